"""mix(): several collections read as one, in chosen proportions (issue 34 part 2): per-batch
quotas, epoch shares, genes aligned to a reference list (values equal to the sources), one
code space per categorical column, the source key, workers, ranks, resume, the DataModule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import annbatch_torch as abt
from annbatch_torch import A, AnnBatchDataLoader, SamplerError, SchemaError
from annbatch_torch.datasets import synthetic
from annbatch_torch.lightning import AnnBatchDataModule
from annbatch_torch.sampling.mixing import MixSampler, batch_quotas

GENES = [f"gene_{i}" for i in range(48)]  # "a" has 0..49, "b" 0..39 reversed, "c" 4..51
SIZES = {"a": 1400, "b": 600, "c": 500}


def _member(name: str, n: int, seed: int) -> ad.AnnData:
    a = synthetic(n, 52, seed=seed, density=0.3)
    if name == "a":
        a = a[:, :50].copy()
    elif name == "b":
        a = a[:, :40][:, ::-1].copy()
        a.obs["cell_type"] = a.obs["cell_type"].cat.rename_categories(lambda c: f"b_{c}")
    else:
        a = a[:, 4:].copy()
    a.obs_names = [f"{name}{i}" for i in range(n)]
    return a


@pytest.fixture(scope="module")
def members(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[ad.AnnData, Any]]:
    out = {}
    root = tmp_path_factory.mktemp("mixing")
    for seed, (name, n) in enumerate(SIZES.items()):
        adata = _member(name, n, seed)
        adata.write_h5ad(root / f"{name}.h5ad")
        coll = abt.create_anndata_collection([root / f"{name}.h5ad"], root / name, seed=seed,
                                             n_obs_per_shard=512, progress=False)
        out[name] = (adata, coll)
    return out


def _mix(members: dict[str, tuple[ad.AnnData, Any]], weights: dict[str, float] | None,
         **kw: Any) -> abt.Mixture:
    return abt.mix({n: c for n, (_, c) in members.items()}, weights, var_names=GENES, **kw)


def _expected(members: dict[str, tuple[ad.AnnData, Any]], mixture: abt.Mixture,
              index: np.ndarray) -> np.ndarray:
    """The rows ``index`` of the mixture as dense values over GENES, from the AnnData."""
    out = np.zeros((len(index), len(GENES)), dtype=np.float32)
    member = mixture.member_of(index)
    for i, name in enumerate(mixture.names):
        at = np.flatnonzero(member == i)
        adata, coll = members[name]
        names = coll.obs_names_at(index[at] - mixture.member_offsets[i])
        x = adata[np.asarray(names)].to_df()
        cols = [g for g in GENES if g in x.columns]
        out[np.ix_(at, [GENES.index(g) for g in cols])] = x[cols].to_numpy()
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_hold_the_quotas_with_values_and_labels_of_the_sources(
        members: dict[str, tuple[ad.AnnData, Any]], num_workers: int) -> None:
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    mixture = _mix(members, weights)
    assert mixture.missing_genes == {"b": GENES[40:], "c": GENES[:4]}
    ds = AnnBatchDataLoader(abt.AnnBatchDataset(
        mixture, selector={"X": A.X, "ct": A.obs["cell_type"]}, batch_size=100, chunk_size=50,
        preload_nchunks=4, densify=True, return_index=True), num_workers=num_workers)
    cats = np.asarray(mixture.categories("cell_type"), dtype=object)
    assert mixture.categories("source") == ["a", "b", "c"]
    seen = np.zeros(3, dtype=np.int64)
    for b in ds:
        counts = np.bincount(b["source"].numpy(), minlength=3)
        assert counts.tolist() == [50, 30, 20]
        index = b["index"].numpy()
        np.testing.assert_array_equal(b["source"].numpy(), mixture.member_of(index))
        np.testing.assert_array_equal(b["X"].numpy(), _expected(members, mixture, index))
        for i, name in enumerate(mixture.names):  # one code space: labels as stored
            at = b["source"].numpy() == i
            adata, coll = members[name]
            names = coll.obs_names_at(index[at] - mixture.member_offsets[i])
            want = adata.obs.loc[np.asarray(names), "cell_type"].astype(str).to_numpy()
            assert (cats[b["ct"].numpy()[at]] == want).all()
        seen += counts
    assert seen.sum() == sum(SIZES.values())
    np.testing.assert_allclose(seen / seen.sum(), [0.5, 0.3, 0.2], atol=0.01)


def test_without_weights_each_row_once_per_epoch(
        members: dict[str, tuple[ad.AnnData, Any]]) -> None:
    # shares of one full pass each (sizes 1400/600/500 in batches of 100: 56/24/20 a batch)
    mixture = _mix(members, None)
    ds = abt.AnnBatchDataset(mixture, selector={"X": A.X}, batch_size=100, chunk_size=64,
                             return_index=True)
    index = np.concatenate([b["index"].numpy() for b in DataLoader(ds, batch_size=None,
                                                                   num_workers=2)])
    assert sorted(index.tolist()) == list(range(mixture.n_obs))
    ds.set_epoch(1)
    again = np.concatenate([b["index"].numpy() for b in ds])
    assert sorted(again.tolist()) == list(range(mixture.n_obs))
    assert not np.array_equal(index, again)


def test_a_small_collection_repeats_and_a_large_one_is_subsampled_anew(
        members: dict[str, tuple[ad.AnnData, Any]]) -> None:
    mixture = _mix({k: members[k] for k in ("a", "c")}, {"a": 0.2, "c": 0.8},
                   num_samples=1000)
    ds = abt.AnnBatchDataset(mixture, selector={"X": A.X}, batch_size=100, chunk_size=50,
                             return_index=True)
    per_epoch = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        index = np.concatenate([b["index"].numpy() for b in ds])
        member = mixture.member_of(index)
        assert np.bincount(member).tolist() == [200, 800]
        c = index[member == 1]
        assert len(set(c.tolist())) == 500  # 800 draws of 500 rows: every row, 300 twice
        per_epoch.append(set(index[member == 0].tolist()))
        assert len(per_epoch[-1]) == 200  # a subsample of whole runs, no repeat
    assert per_epoch[0] != per_epoch[1]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=4),
       st.lists(st.floats(0.0, 5.0), min_size=4, max_size=4), st.integers(1, 64),
       st.integers(1, 40), st.one_of(st.none(), st.integers(1, 2000)), st.integers(0, 99))
def test_the_stream_keeps_quotas_runs_and_shares(sizes: list[int], raw: list[float],
                                                 batch: int, chunk: int,
                                                 num_samples: int | None, seed: int) -> None:
    w = np.asarray(raw[:len(sizes)])
    if w.sum() == 0:
        w[0] = 1.0
    w = w / w.sum()
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    s = MixSampler(offsets, w, batch_size=batch, chunk_size=chunk,
                   num_samples=num_samples).bind(int(offsets[-1]), {})
    n = len(s)
    rows = np.asarray(s.rows(seed, 1, 0, n))
    np.testing.assert_array_equal(rows, s.rows(seed, 1, 0, n))  # pure
    member = np.searchsorted(offsets, rows, side="right") - 1
    np.testing.assert_array_equal(member, s.pool_strata(0, n))
    for lo in range(0, n, batch):  # every batch: floor(L * w) or one more of each member
        counts = np.bincount(member[lo:lo + batch], minlength=len(sizes))
        exact = min(batch, n - lo) * w
        assert (counts >= np.floor(exact) - 1e-9).all()
        assert (counts <= np.floor(exact) + 1).all()
    total = np.bincount(member, minlength=len(sizes))
    assert (np.abs(total - n * w) < 1 + 1e-9).all()  # the epoch's shares
    whole = np.isclose(n * w, np.round(n * w), atol=1e-9)
    assert (total[whole] == np.round(n * w[whole])).all()  # exact where n * w is whole
    for m in range(len(sizes)):  # rows of a member: whole passes of runs, then a part
        got = rows[member == m] - offsets[m]
        full, part = divmod(len(got), sizes[m])
        for p in range(full):
            assert sorted(got[p * sizes[m]:(p + 1) * sizes[m]].tolist()) == list(
                range(sizes[m]))
        tail = got[full * sizes[m]:]
        assert len(set(tail.tolist())) == part
        starts = tail[(tail % chunk == 0)]  # a part is whole runs, but for the last
        assert len(tail) == 0 or len(starts) >= len(tail) // chunk


def test_batch_quotas_are_largest_remainders() -> None:
    assert batch_quotas(10, np.array([0.55, 0.25, 0.2])).tolist() == [6, 2, 2]
    assert batch_quotas(7, np.array([0.5, 0.5])).tolist() == [4, 3]


def test_ranks_workers_and_resume(members: dict[str, tuple[ad.AnnData, Any]]) -> None:
    def ds(rank: int, world: int) -> abt.AnnBatchDataset:
        return abt.AnnBatchDataset(_mix(members, {"a": 0.6, "b": 0.4}), batch_size=50,
                                   selector={"X": A.X}, chunk_size=40, preload_nchunks=3,
                                   return_index=True, rank=rank, world_size=world, seed=3)

    got = [[b["index"].numpy() for b in AnnBatchDataLoader(ds(r, 2), num_workers=2)]
           for r in range(2)]
    assert len(got[0]) == len(got[1]) == len(ds(0, 2))
    for batches in got:
        for b in batches:
            member = _mix(members, None).member_of(b)
            assert np.bincount(member, minlength=3)[:2].tolist() == [30, 20]
    # two ranks read the one-rank epoch's batches (but fewer than two dropped)
    single = {tuple(b["index"].tolist()) for b in ds(0, 1)}
    both = {tuple(b.tolist()) for g in got for b in g}
    assert both <= single
    assert len(single) - len(both) < 2
    full = [b["index"].tolist() for b in AnnBatchDataLoader(ds(0, 1), num_workers=2)]
    loader = AnnBatchDataLoader(ds(0, 1), num_workers=2)
    it = iter(loader)
    head = [next(it)["index"].tolist() for _ in range(len(full) // 2)]
    state = loader.state_dict()
    del it, loader
    resumed = AnnBatchDataLoader(ds(0, 1), num_workers=2)
    resumed.load_state_dict(state)
    assert head + [b["index"].tolist() for b in resumed] == full
    other = abt.AnnBatchDataset(_mix(members, {"a": 0.5, "b": 0.5}), batch_size=50,
                                selector={"X": A.X}, chunk_size=40, preload_nchunks=3, seed=3)
    with pytest.raises(ValueError, match=r"a=.* x 0\.6.* this dataset reads .*a=.* x 0\.5"):
        other.load_state_dict(ds(0, 1).state_dict() | {"batches": 1})


def test_the_datamodule_mixes_training_and_reads_held_out_rows_once(
        members: dict[str, tuple[ad.AnnData, Any]]) -> None:
    mixture = _mix(members, {"a": 0.5, "b": 0.5})
    dm = AnnBatchDataModule(None, mixture, batch_size=40, chunk_size=50, val_fraction=0.2,
                            selector={"X": A.X}, dataset_kwargs={"return_index": True})
    dm.setup("fit")
    n, cs = mixture.n_obs, dm.split_chunk_size
    val = {r for c in dm.val_chunks for r in range(c * cs, min(n, (c + 1) * cs))}
    train = [b for b in dm.train_dataloader()]
    for b in train:
        want = batch_quotas(len(b["index"]), np.array([0.5, 0.5, 0.0])).tolist()
        assert np.bincount(b["source"].numpy(), minlength=3).tolist() == want
        assert not set(b["index"].tolist()) & val
    held = [i for b in dm.val_dataloader() for i, m in zip(b["index"].tolist(),
                                                            b["mask"].tolist()) if m]
    assert sorted(held) == sorted(val)


def test_bad_mixtures_name_the_fix(members: dict[str, tuple[ad.AnnData, Any]],
                                   tmp_path: Path) -> None:
    colls = {n: c for n, (_, c) in members.items()}
    with pytest.raises(SchemaError, match="pass var_names="):
        abt.mix(colls, {"a": 1.0})
    with pytest.raises(SchemaError, match=r"weights name \['z'\]"):
        abt.mix(colls, {"z": 1.0}, var_names=GENES)
    with pytest.raises(SchemaError, match="'b' must be a finite number >= 0"):
        abt.mix(colls, {"a": 1.0, "b": -1.0}, var_names=GENES)
    with pytest.raises(SchemaError, match="every weight is 0"):
        abt.mix(colls, {"a": 0.0}, var_names=GENES)
    with pytest.raises(SchemaError, match="none of the 2 var_names is a gene of 'a'"):
        abt.mix(colls, None, var_names=["ENSG1", "ENSG2"])
    with pytest.raises(SchemaError, match="none of the 4 var_names is a gene of 'b'"):
        abt.mix(colls, None, var_names=GENES[44:48])  # b has gene_0 .. gene_39
    with pytest.raises(TypeError, match="weights must be a"):
        abt.mix(colls, [0.5, 0.5], var_names=GENES)  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match="give weights= too"):
        abt.mix(colls, None, var_names=GENES, num_samples=10)
    with pytest.raises(SamplerError, match="draws its rows by its weights"):
        abt.AnnBatchDataset(_mix(members, {"a": 1.0}),
                            sampler=abt.ClassBalancedSampler("cell_type"))
    with pytest.raises(SchemaError, match=r"member\(s\) \['a'\] of the mixture do not offer"):
        abt.AnnBatchDataset(abt.mix({"a": colls["a"], "p": _pca(tmp_path)}, None,
                                    var_names=GENES), selector={"pca": A.obsm["X_pca"]})


def _pca(tmp_path: Path) -> Path:
    """An h5ad with obsm X_pca (read in place as a member)."""
    a = synthetic(200, 20, seed=9, obsm_pca=4)
    a.obs_names = [f"p{i}" for i in range(200)]
    a.write_h5ad(tmp_path / "p.h5ad")
    return tmp_path / "p.h5ad"


def test_an_unweighted_mixture_takes_a_sampler(members: dict[str, tuple[ad.AnnData, Any]]
                                               ) -> None:
    mixture = _mix(members, None).without_weights()
    ds = abt.AnnBatchDataset(mixture, selector={"ct": A.obs["cell_type"]}, batch_size=200,
                             sampler=abt.ClassBalancedSampler("cell_type", num_samples=2000))
    codes = np.concatenate([b["ct"].numpy() for b in ds])
    counts = np.bincount(codes, minlength=len(mixture.categories("cell_type")))
    assert len(mixture.categories("cell_type")) == 16  # a's/c's 8 and b's 8 renamed
    np.testing.assert_allclose(counts / counts.sum(), 1 / 16, atol=0.03)
    assert torch.is_tensor(next(iter(ds))["source"])


def test_a_member_draws_with_a_sampler_of_its_own(
        members: dict[str, tuple[ad.AnnData, Any]]) -> None:
    mixture = _mix({k: members[k] for k in ("a", "b")}, {"a": 0.5, "b": 0.5},
                   samplers={"a": abt.ClassBalancedSampler("cell_type")})
    ds = abt.AnnBatchDataset(mixture, selector={"ct": A.obs["cell_type"]}, batch_size=100,
                             chunk_size=50, return_index=True)
    assert "samplers={'a': ClassBalancedSampler" in repr(ds.sampler)
    cats = np.asarray(mixture.categories("cell_type"), dtype=object)
    a_types, b_rows = [], []
    for b in DataLoader(ds, batch_size=None, num_workers=2):
        src = b["source"].numpy()
        assert np.bincount(src, minlength=2).tolist() == [50, 50]
        a_types.append(cats[b["ct"].numpy()[src == 0]])
        b_rows.append(b["index"].numpy()[src == 1])
    a_types = np.concatenate(a_types)
    share = pd.Series(a_types).value_counts(normalize=True)
    assert len(share) == 8  # a's own types only, each about 1/8 (the stored shares differ)
    assert all(not t.startswith("b_") for t in share.index)
    np.testing.assert_allclose(share.to_numpy(), 1 / 8, atol=0.04)
    stored = members["a"][0].obs["cell_type"].value_counts(normalize=True)
    assert stored.max() > 0.2  # so balancing changed the shares
    rows_b = np.concatenate(b_rows)  # b: runs of its rows, every row once (its share: 1000)
    assert len(rows_b) == 1000
    assert len(set(rows_b.tolist())) == SIZES["b"]
    with pytest.raises(SchemaError, match=r"samplers name \['z'\]"):
        _mix(members, {"a": 1.0}, samplers={"z": abt.ClassBalancedSampler("cell_type")})
    with pytest.raises(SamplerError, match="drawing single rows"):
        abt.AnnBatchDataset(_mix(members, {"a": 1.0}, samplers={"a": abt.PairedSampler(
            "cell_type", "T cell")}))


def test_numpy_weights_in_place_members_and_a_source_column_of_their_own(
        members: dict[str, tuple[ad.AnnData, Any]], tmp_path: Path) -> None:
    adata_c, _ = members["c"]
    own = adata_c.copy()
    own.obs["source"] = "lab"  # the mixture's source column replaces it
    own.write_h5ad(tmp_path / "c.h5ad")
    adata_a, coll_a = members["a"]
    # a collection (narrow stored dtypes) beside an h5ad read in place, in one pool
    mixture = abt.mix({"a": coll_a, "c": tmp_path / "c.h5ad"},
                      {"a": np.float32(0.5), "c": np.int64(1)}, var_names=GENES)
    assert mixture.weights == pytest.approx([1 / 3, 2 / 3])
    assert mixture.categories("source") == ["a", "c"]
    ds = abt.AnnBatchDataset(mixture, selector={"X": A.X}, batch_size=60, densify=True,
                             return_index=True, chunk_size=32)
    for b in DataLoader(ds, batch_size=None, num_workers=2):
        index = b["index"].numpy()
        counts = np.bincount(b["source"].numpy(), minlength=2)
        assert (np.abs(counts - len(index) * np.array([1 / 3, 2 / 3])) < 1).all()
        want = np.zeros((len(index), len(GENES)), dtype=np.float32)
        member = mixture.member_of(index)
        for i, adata in enumerate((adata_a, adata_c)):
            at = np.flatnonzero(member == i)
            local = index[at] - mixture.member_offsets[i]
            names = (coll_a.obs_names_at(local) if i == 0 else adata.obs_names[local])
            x = adata[np.asarray(names)].to_df()
            cols = [g for g in GENES if g in x.columns]
            want[np.ix_(at, [GENES.index(g) for g in cols])] = x[cols].to_numpy()
        np.testing.assert_array_equal(b["X"].numpy(), want)


def test_members_with_the_same_genes_are_not_remapped(
        members: dict[str, tuple[ad.AnnData, Any]]) -> None:
    from annbatch_torch.read.genes import MemberGenes

    coll = members["a"][1]
    mixture = abt.mix({"x": coll, "y": coll}, {"x": 1, "y": 1})
    genes = MemberGenes.of(mixture.member_offsets, mixture.gene_map("X"), None,
                           mixture.n_vars)
    assert genes.identity
    moved = MemberGenes.of(mixture.member_offsets, _mix(members, None).gene_map("X")[:2],
                           None, len(GENES))
    assert not moved.identity


def test_a_resume_state_knows_each_member_collection(
        members: dict[str, tuple[ad.AnnData, Any]], tmp_path: Path) -> None:
    adata, coll = members["a"]
    adata.write_h5ad(tmp_path / "a.h5ad")  # the same cells shuffled with another seed
    other = abt.create_anndata_collection([tmp_path / "a.h5ad"], tmp_path / "a", seed=99,
                                          progress=False)
    assert other.n_obs == coll.n_obs
    assert abt.mix({"a": coll}, {"a": 1}).identity() != abt.mix(
        {"a": other}, {"a": 1}).identity()
