"""PairedSampler through the loader (issue 34): batches of a perturbed row and its matched
controls under ``control_`` keys, with values equal to the source, workers, 2 gloo ranks x
2 workers (fork and spawn), sets, resume, the DataModule and the converter."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.multiprocessing as tmp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from annbatch_torch import (
    A,
    AnnBatchDataLoader,
    AnnBatchDataset,
    Collection,
    PairedSampler,
    SamplerError,
    batch_dict_converter,
    sampling,
)
from annbatch_torch.lightning import AnnBatchDataModule
from annbatch_torch.sampling.samplers import ObsColumn

sys.path.insert(0, str(Path(__file__).parent))
import pairing_ddp
from test_ddp import free_port

CONTROL = "non-targeting"
MATCH = ("cell_line", "gem_group")


@pytest.fixture(scope="module")
def screen(screen_h5ad: Path) -> ad.AnnData:
    return ad.read_h5ad(screen_h5ad)


def _paired(n_controls: int = 1, **kw: Any) -> PairedSampler:
    return PairedSampler("target_gene", CONTROL, match=MATCH, n_controls=n_controls, **kw)


def _src(coll: Collection, screen: ad.AnnData, index: np.ndarray) -> np.ndarray:
    """Rows of the source AnnData that rows ``index`` of the collection are."""
    return screen.obs_names.get_indexer(coll.obs_names_at(np.asarray(index)))


def _perturbed_rows(coll: Collection, screen: ad.AnnData) -> np.ndarray:
    """The collection's perturbed rows (sorted)."""
    rows = np.arange(coll.n_obs)
    return rows[(screen.obs["target_gene"].to_numpy()[_src(coll, screen, rows)] != CONTROL)]


def _check_pairs(coll: Collection, screen: ad.AnnData, pert: np.ndarray, ctrl: np.ndarray,
                 n_controls: int) -> None:
    """Each perturbed row's ``n_controls`` controls are controls of its match group."""
    obs = screen.obs
    p, c = _src(coll, screen, pert), _src(coll, screen, ctrl).reshape(len(pert), n_controls)
    assert (obs["target_gene"].to_numpy()[p] != CONTROL).all()
    assert (obs["target_gene"].to_numpy()[c] == CONTROL).all()
    for m in MATCH:
        col = obs[m].to_numpy()
        assert (col[c] == col[p][:, None]).all(), m


@pytest.mark.parametrize(("loader", "num_workers", "densify", "n_controls", "runs"),
                         [(DataLoader, 0, False, 1, None), (DataLoader, 2, True, 2, None),
                          (DataLoader, 2, False, 3, None), (AnnBatchDataLoader, 2, True, 1, None),
                          (DataLoader, 2, True, 1, 32), (AnnBatchDataLoader, 0, False, 2, 7)])
def test_batches_pair_each_perturbed_row_once_with_values_of_the_source(
        screen_collection: Collection, screen: ad.AnnData, loader: Any, num_workers: int,
        densify: bool, n_controls: int, runs: int | None) -> None:
    coll = screen_collection
    ds = AnnBatchDataset(coll, selector={"X": A.X, "t": A.obs["target_gene"]}, batch_size=50,
                         sampler=_paired(n_controls, chunk_size=runs), return_index=True,
                         densify=densify, chunk_size=64, preload_nchunks=4)
    kw = {"batch_size": None} if loader is DataLoader else {}
    batches = list(loader(ds, num_workers=num_workers, **kw))
    assert len(batches) == len(ds)
    x = screen.X.toarray()
    cats = np.asarray(coll.categories("target_gene"), dtype=object)
    for b in batches:
        k = len(b["index"])
        assert set(b) == {"X", "t", "index", "control_X", "control_t", "control_index"}
        assert len(b["control_index"]) == k * n_controls
        _check_pairs(coll, screen, b["index"].numpy(), b["control_index"].numpy(), n_controls)
        for key, rows in (("X", b["index"]), ("control_X", b["control_index"])):
            assert (b[key].layout == torch.strided) == densify
            got = b[key].to_dense() if b[key].layout == torch.sparse_csr else b[key]
            np.testing.assert_array_equal(got.numpy(), x[_src(coll, screen, rows.numpy())])
        src = _src(coll, screen, b["control_index"].numpy())
        assert (cats[b["control_t"].numpy()] == screen.obs["target_gene"].to_numpy()[src]).all()
    pert = np.concatenate([b["index"].numpy() for b in batches])
    np.testing.assert_array_equal(np.sort(pert), _perturbed_rows(coll, screen))  # once each


def test_runs_of_perturbed_rows_are_mixed_across_the_pool(
        screen_collection: Collection) -> None:
    # runs of 16 rows hold ~12 perturbed rows: a batch of 20 would span ~2 runs unmixed
    ds = AnnBatchDataset(screen_collection, selector={"t": A.obs["target_gene"]},
                         batch_size=20, chunk_size=64, preload_nchunks=16, return_index=True,
                         sampler=_paired(chunk_size=16))
    spans = [len(np.unique(b["index"].numpy() // 16)) for b in ds]
    assert np.median(spans) >= 12
    s = _paired(chunk_size=16)
    assert s.mixes_in_pool
    assert not _paired(chunk_size=None).mixes_in_pool
    assert _paired().chunk_size == 256  # "auto": runs
    assert _paired(set_size=4).chunk_size is None  # sets: single rows


def test_sets_come_whole_in_batches(screen_collection: Collection, screen: ad.AnnData) -> None:
    coll = screen_collection
    ds = AnnBatchDataset(coll, selector={"t": A.obs["target_gene"]}, batch_size=12,
                         sampler=_paired(set_size=4), return_index=True)
    obs = screen.obs
    seen = []
    for b in DataLoader(ds, batch_size=None, num_workers=2):
        rows = _src(coll, screen, b["index"].numpy()).reshape(-1, 4)
        for col in ("target_gene", *MATCH):
            v = obs[col].to_numpy()[rows]
            assert (v == v[:, :1]).all(), col
        seen.append(b["index"].numpy())
    # every perturbed row at least once (sets filled up with rows of the same group)
    assert set(np.concatenate(seen)) == set(_perturbed_rows(coll, screen).tolist())


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_two_gloo_ranks_with_two_workers_each_pair_every_perturbed_row_once(
        screen_collection: Collection, screen: ad.AnnData, context: str,
        tmp_path: Path) -> None:
    coll, world = screen_collection, 2
    tmp.spawn(pairing_ddp.entry, args=(world, free_port(), str(coll.path), str(tmp_path),
                                       context), nprocs=world, join=True)
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(world)]
    pert, n = [], pairing_ddp.N_CONTROLS
    for res in ranks:
        assert res["counts"].tolist() == [int(res["n_batches"])] * world == [int(res["len"])] * 2
        real = res["mask"]
        assert res["control_mask"].tolist() == np.repeat(real, n).tolist()
        _check_pairs(coll, screen, res["index"], res["control_index"], n)
        pert.append(res["index"][real])
    both = np.concatenate(pert)
    np.testing.assert_array_equal(np.sort(both), _perturbed_rows(coll, screen))


def _resume_ds(coll: Collection) -> AnnBatchDataset:
    return AnnBatchDataset(coll, selector={"t": A.obs["target_gene"]}, batch_size=40,
                           chunk_size=40, preload_nchunks=3, return_index=True, seed=4,
                           sampler=_paired(2))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_equals_the_uninterrupted_run(screen_collection: Collection,
                                                      num_workers: int) -> None:
    def rows(b: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
        return b["index"].tolist(), b["control_index"].tolist()

    ds = _resume_ds(screen_collection)
    ds.set_epoch(1)
    full = [rows(b) for b in AnnBatchDataLoader(ds, num_workers=num_workers)]
    ds = _resume_ds(screen_collection)
    ds.set_epoch(1)
    loader = AnnBatchDataLoader(ds, num_workers=num_workers)
    it = iter(loader)
    head = [rows(next(it)) for _ in range(len(full) // 2)]
    state = loader.state_dict()
    del it, loader
    resumed = AnnBatchDataLoader(_resume_ds(screen_collection), num_workers=num_workers)
    resumed.load_state_dict(state)
    assert head + [rows(b) for b in resumed] == full
    other = AnnBatchDataset(screen_collection, selector={"t": A.obs["target_gene"]},
                            batch_size=40, chunk_size=40, preload_nchunks=3, seed=4,
                            sampler=_paired(1))
    with pytest.raises(ValueError, match="n_controls=1"):  # another pairing: refused
        other.load_state_dict(ds.state_dict() | {"batches": 1})


@settings(max_examples=60, deadline=None)
@given(st.integers(30, 300), st.integers(0, 2**16), st.integers(1, 3), st.integers(1, 9),
       st.integers(1, 4), st.integers(1, 3), st.booleans(), st.sampled_from(["drop", "pad"]),
       st.one_of(st.none(), st.integers(1, 20)), st.booleans())
def test_the_plan_deals_whole_draws_laid_out_perturbed_first(
        n: int, seed: int, n_controls: int, batch_size: int, preload: int, world: int,
        drop_last: bool, even: str, runs: int | None, shuffle: bool) -> None:
    rng = np.random.default_rng(seed)
    target = rng.integers(0, 3, n)
    target[0] = 0
    cols = {"target_gene": ObsColumn(target, (CONTROL, "a", "b"))}
    if (target != 0).sum() == 0:
        target[1] = 1
    s = PairedSampler("target_gene", CONTROL, n_controls=n_controls,
                      chunk_size=runs).bind(n, cols)
    plan = sampling.SamplePlan(n_obs=n, chunk_size=7, preload_nchunks=preload,
                               batch_size=batch_size, seed=seed, sampler=s,
                               drop_last=drop_last, even_batches=even, shuffle=shuffle)
    d = n_controls + 1
    assert plan.pool % (batch_size * d) == 0
    seen = []
    counts = set()
    for rank in range(world):
        got = 0
        for w in range(2):
            for it in plan.items(0, rank=rank, world_size=world, worker=w, num_workers=2):
                for b in range(it.batch_start, it.batch_stop):
                    lo, hi = it.bounds(b)
                    rows = it.rows[lo:hi]
                    assert len(rows) % d == 0
                    assert 0 < len(rows) <= batch_size * d
                    k = len(rows) // d
                    assert (target[rows[:k]] != 0).all()
                    assert (target[rows[k:]] == 0).all()
                    if not it.padding:
                        seen.append(rows[:k])
                    got += 1
        counts.add(got)
    assert counts == {plan.fresh_batches(world)}
    perturbed = np.flatnonzero(target != 0)
    pert = np.concatenate(seen) if seen else np.zeros(0, dtype=np.int64)
    assert len(set(pert.tolist())) == len(pert)  # never twice
    assert set(pert.tolist()) <= set(perturbed.tolist())
    if world == 1 and not drop_last:
        assert sorted(pert.tolist()) == perturbed.tolist()


def test_bad_settings_name_the_fix(screen_collection: Collection) -> None:
    with pytest.raises(SamplerError, match=r"batch_size=10 must be a multiple of .*set_size=4"):
        AnnBatchDataset(screen_collection, batch_size=10, sampler=_paired(set_size=4))
    with pytest.raises(ValueError, match="control_X"):
        AnnBatchDataset(screen_collection, selector={"X": A.X, "control_X": A.X},
                        sampler=_paired())
    with pytest.raises(ValueError, match="control_index"):
        AnnBatchDataset(screen_collection, selector={"control_index": A.obs["cell_line"]},
                        return_index=True, sampler=_paired())


def _converter(batch: dict[str, Any]) -> dict[str, Any]:
    out = batch_dict_converter(batch)
    out["keys"] = sorted(batch)
    out["sparse"] = [k for k, v in batch.items() if sp.issparse(v)]
    return out


def test_the_converter_and_transforms_see_the_control_keys(
        screen_collection: Collection) -> None:
    ds = AnnBatchDataset(screen_collection, batch_size=30, sampler=_paired(),
                         selector={"X": A.X, "lib": A.X.with_transform(_row_sums)},
                         batch_converter=_converter)
    b = next(iter(DataLoader(ds, batch_size=None, num_workers=1)))
    assert b["keys"] == ["X", "control_X", "control_lib", "lib"]
    assert sorted(b["sparse"]) == ["X", "control_X"]
    assert b["control_lib"].shape == (30,)
    np.testing.assert_allclose(b["control_lib"].numpy(),
                               b["control_X"].to_dense().sum(1).numpy(), rtol=1e-6)


def _row_sums(x: Any) -> np.ndarray:
    return np.asarray(x.sum(axis=1)).ravel()


def test_the_datamodule_pairs_training_and_validation_each_within_its_split(
        screen_collection: Collection, screen: ad.AnnData) -> None:
    dm = AnnBatchDataModule(None, screen_collection.path, batch_size=32, chunk_size=64,
                            val_fraction=0.25, sampler=_paired(),
                            selector={"t": A.obs["target_gene"]},
                            dataset_kwargs={"return_index": True}, num_workers=0)
    dm.setup("fit")
    n, cs = screen_collection.n_obs, dm.split_chunk_size
    val_rows, train_rows = ({r for c in chunks for r in range(c * cs, min(n, (c + 1) * cs))}
                            for chunks in (dm.val_chunks, dm.train_chunks))
    assert val_rows
    assert not val_rows & train_rows
    for loader, allowed in ((dm.train_dataloader(), train_rows),
                            (dm.val_dataloader(), val_rows)):
        batches = list(loader)
        assert batches
        for b in batches:
            assert "control_t" in b
            used = set(b["index"].tolist()) | set(b["control_index"].tolist())
            assert used <= allowed
            _check_pairs(screen_collection, screen, b["index"].numpy(),
                         b["control_index"].numpy(), 1)


def test_held_out_splits_pair_each_row_once_with_the_same_pairs_every_epoch(
        screen_collection: Collection, screen: ad.AnnData) -> None:
    dm = AnnBatchDataModule(None, screen_collection.path, batch_size=32, chunk_size=64,
                            val_fraction=0.25, sampler=_paired(num_samples=300),
                            selector={"t": A.obs["target_gene"]},
                            dataset_kwargs={"return_index": True})
    dm.setup(None)
    assert len(list(dm.train_dataloader())) == -(-300 // 32)  # training: num_samples
    n, cs = screen_collection.n_obs, dm.split_chunk_size
    val = np.array(sorted(r for c in dm.val_chunks for r in range(c * cs, min(n, (c + 1) * cs))))
    want = np.intersect1d(val, _perturbed_rows(screen_collection, screen))

    def pairs(loader: Any) -> list[tuple[int, int]]:
        return [(i, c) for b in loader for i, c, m in zip(
            b["index"].tolist(), b["control_index"].tolist(), b["mask"].tolist()) if m]

    first = pairs(dm.val_dataloader())
    assert sorted(i for i, _ in first) == want.tolist()  # each held-out perturbed row once
    dm.val_dataset.set_epoch(3)  # (Lightning moves the validation loader's epoch too)
    assert sorted(pairs(dm.val_dataloader())) == sorted(first)  # (pools mix anew)
    pred = sorted(i for i, _ in pairs(dm.predict_dataloader()))
    assert pred == _perturbed_rows(screen_collection, screen).tolist()
    assert "evaluation" in repr(dm.val_dataset.sampler)


def test_a_held_out_split_without_controls_is_named_with_the_fix(
        screen_collection: Collection) -> None:
    dm = AnnBatchDataModule(None, screen_collection.path, batch_size=32, chunk_size=16,
                            val_fraction=0.01, sampler=_paired(),
                            selector={"t": A.obs["target_gene"]})
    with pytest.raises(SamplerError, match=r"the validation split's pairs .* no control .*"
                                           r"raise its fraction"):
        dm.setup("fit")


def test_the_report_counts_the_perturbed_rows(screen_collection: Collection) -> None:
    from annbatch_torch import diversity_report

    ds = AnnBatchDataset(screen_collection, batch_size=100, sampler=_paired(3))
    shares = diversity_report(ds, "target_gene", per="class")
    row = shares.loc[("target_gene", "non-targeting")]
    assert row["batch_share"] == row["epoch_share"] == 0  # controls are not counted
    assert row["collection_share"] > 0.2


def test_scvi_refuses_pairs(screen_collection: Collection) -> None:
    from annbatch_torch.integrations.scvi import SCVIDataModule

    with pytest.raises(SamplerError, match="control_ keys"):
        SCVIDataModule(screen_collection, batch_key="gem_group", sampler=_paired(),
                       check_counts=False)
