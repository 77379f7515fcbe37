"""``group_by``: each shard's rows sorted by a class column (the writer, append, the parallel
writer), and ``ClassBalancedSampler`` drawing runs of rows of one class from such a
collection, read as runs and mixed in the pools."""

from __future__ import annotations

import json
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from conftest import IMBALANCED
from hypothesis import example, given, settings
from hypothesis import strategies as st

import annbatch_torch as abt
from annbatch_torch import A
from annbatch_torch.sampling.samplers import AUTO_RUN

N_OBS, N_VARS, N_CLASSES = IMBALANCED


@pytest.fixture(scope="module")
def adata(imbalanced_h5ad: Path) -> ad.AnnData:
    return ad.read_h5ad(imbalanced_h5ad)


def _codes(coll: abt.Collection) -> np.ndarray:
    return np.asarray(coll.obs_at(np.arange(coll.n_obs), "cell_type")["cell_type"].cat.codes)


def _assert_grouped(coll: abt.Collection, column: str = "cell_type") -> None:
    codes = np.asarray(coll.obs_at(np.arange(coll.n_obs), column)[column].cat.codes,
                       dtype=np.int64)
    codes[codes < 0] = 1 << 30  # missing values last
    for a, b in zip(coll.shard_offsets[:-1], coll.shard_offsets[1:]):
        assert (np.diff(codes[a:b]) >= 0).all(), f"shard rows [{a}, {b}) not grouped"


def test_grouped_shards_hold_the_same_cells_sorted_by_class(
        grouped_collection: abt.Collection, imbalanced_collection: abt.Collection,
        adata: ad.AnnData) -> None:
    g, plain = grouped_collection, imbalanced_collection
    assert g.group_by == "cell_type"
    assert plain.group_by is None
    assert g.shard_sizes == plain.shard_sizes
    _assert_grouped(g)
    names, plain_names = g.obs_names, plain.obs_names
    for a, b in zip(g.shard_offsets[:-1], g.shard_offsets[1:]):
        assert set(names[a:b]) == set(plain_names[a:b])  # the shuffle is the same
    assert not np.array_equal(names, plain_names)
    # every cell's values are its input's
    rows = adata.obs_names.get_indexer(names)
    x = abt.AnnBatchDataset(g, selector={"x": A.X}, batch_size=N_OBS, shuffle=False,
                            chunk_size=N_OBS, preload_nchunks=1)
    got = next(iter(x))["x"]
    dense = got.to_dense().numpy() if got.layout != __import__("torch").strided else got.numpy()
    np.testing.assert_array_equal(dense, adata.X[rows].toarray())
    assert list(g.obs_at(np.arange(N_OBS), "cell_type")["cell_type"].astype(str)) == list(
        adata.obs["cell_type"].iloc[rows].astype(str))
    # a shard is still an AnnData zarr store, read by anndata itself
    shard = ad.read_zarr(g.shard_path(0))
    assert list(shard.obs_names) == list(names[: g.shard_sizes[0]])
    manifest = json.loads((g.path / "manifest.json").read_text())
    assert manifest["extra"]["writer"]["group_by"] == "cell_type"


def _tiny(folder: Path, n: int = 300, seed: int = 0, prefix: str = "c",
          with_type: bool = True) -> Path:
    rng = np.random.default_rng(seed)
    obs = {"score": rng.random(n)}
    if with_type:
        obs["cell_type"] = pd.Categorical.from_codes(rng.integers(-1, 4, n),
                                                     ["a", "b", "c", "d"])
    a = ad.AnnData(sp.random(n, 6, density=0.5, format="csr", dtype=np.float32,
                             random_state=seed),
                   obs=pd.DataFrame(obs, index=[f"{prefix}{i}" for i in range(n)]))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{prefix}.h5ad"
    a.write_h5ad(path)
    return path


def test_missing_values_go_last_and_bad_columns_are_refused(tmp_path: Path) -> None:
    path = _tiny(tmp_path / "in")
    coll = abt.create_anndata_collection([path], tmp_path / "s", group_by="cell_type",
                                         n_obs_per_shard=128, progress=False)
    _assert_grouped(coll)
    for column, what in (("score", "a numeric column"),
                         ("nothere", "not carried into the collection")):
        out = tmp_path / f"bad_{column}"
        with pytest.raises(abt.InputError, match=rf"group_by='{column}': the obs column is "
                           rf"{what}; .*carried: \['cell_type'\]"):
            abt.create_anndata_collection([path], out, group_by=column, progress=False)
        assert not out.exists()  # refused before anything was written
    with pytest.raises(abt.InputError, match="group_by must be an obs column name"):
        abt.create_anndata_collection([path], tmp_path / "x", group_by=3, progress=False)


def test_the_parallel_writer_groups_alike(imbalanced_h5ad: Path,
                                          grouped_collection: abt.Collection,
                                          tmp_path: Path) -> None:
    par = abt.create_anndata_collection([imbalanced_h5ad], tmp_path / "p", seed=0,
                                        n_obs_per_shard=2048, group_by="cell_type",
                                        scheduler="threads", n_workers=2, progress=False)
    assert list(par.obs_names) == list(grouped_collection.obs_names)


def test_append_groups_its_new_shards(tmp_path: Path) -> None:
    first = _tiny(tmp_path / "in", seed=1, prefix="a")
    coll = abt.create_anndata_collection([first], tmp_path / "s", group_by="cell_type",
                                         n_obs_per_shard=128, progress=False)
    before = (coll.path / "manifest.json").read_text()
    lacking = _tiny(tmp_path / "in", seed=2, prefix="b", with_type=False)
    with pytest.raises(abt.InputError, match=r"b.h5ad: has no obs column 'cell_type'"):
        abt.append_to_collection(coll.path, [lacking], progress=False)
    assert (coll.path / "manifest.json").read_text() == before  # nothing published
    more = _tiny(tmp_path / "in", n=400, seed=3, prefix="c")
    coll = abt.append_to_collection(coll.path, [more], progress=False)
    assert coll.n_obs == 700
    assert coll.group_by == "cell_type"
    _assert_grouped(coll)


def test_balanced_sampler_draws_runs_on_a_grouped_collection(
        grouped_collection: abt.Collection, imbalanced_collection: abt.Collection) -> None:
    ds = abt.AnnBatchDataset(grouped_collection, batch_size=512,
                             sampler=abt.ClassBalancedSampler("cell_type"))
    assert ds.sampler.run == AUTO_RUN
    assert ds.sampler.mixes_in_pool
    plain = abt.AnnBatchDataset(imbalanced_collection, batch_size=512,
                                sampler=abt.ClassBalancedSampler("cell_type"))
    assert plain.sampler.run == 1
    assert not plain.sampler.mixes_in_pool
    item = ds.epoch_plan.items(0, rank=0, world_size=1)[0]
    single = plain.epoch_plan.items(0, rank=0, world_size=1)[0]
    # a pool is a few runs (split at shard ends), not a range per row
    assert len(item.ranges) <= 3 * item.n_rows // AUTO_RUN < len(single.ranges) // 4
    # runs are mixed in the pool: batches are as mixed as random ones
    report = abt.diversity_report(ds, "cell_type", None).loc["cell_type"]
    assert report["entropy_ratio"] > 0.9
    assert abs(report["share_error"]) < 0.05
    classes = abt.diversity_report(ds, "cell_type", None, per="class").loc["cell_type"]
    np.testing.assert_allclose(classes["batch_share"], 1 / N_CLASSES, rtol=0.2)
    # shuffle=False does not leave the runs in stream order (a batch of one class or two):
    # a sampler of runs always has its pools mixed
    ordered = abt.AnnBatchDataset(grouped_collection, batch_size=512, shuffle=False,
                                  sampler=abt.ClassBalancedSampler("cell_type"))
    mixed = abt.diversity_report(ordered, "cell_type", None).loc["cell_type"]
    assert mixed["entropy_ratio"] > 0.9


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_run_row_equals_its_source_cell(grouped_collection: abt.Collection,
                                              adata: ad.AnnData, num_workers: int) -> None:
    coll = grouped_collection
    sampler = abt.ClassBalancedSampler("cell_type", num_samples=3000)
    ds = abt.AnnBatchDataset(coll, selector={"x": A.X, "y": A.obs["cell_type"]},
                             batch_size=256, densify=True, return_index=True, seed=5,
                             sampler=sampler)
    cats = np.asarray(coll.categories("cell_type"), dtype=object)
    seen = []
    for batch in abt.AnnBatchDataLoader(ds, num_workers=num_workers):
        index = batch["index"].numpy()
        rows = adata.obs_names.get_indexer(coll.obs_names_at(index))
        np.testing.assert_array_equal(batch["x"].numpy(), adata.X[rows].toarray())
        assert list(cats[batch["y"].numpy()]) == list(adata.obs["cell_type"].iloc[rows]
                                                      .astype(str))
        seen.append(index)
    got = np.concatenate(seen)
    assert len(got) == 3000  # the epoch's draws, every one yielded
    from annbatch_torch.diversity import report_batches

    want = np.concatenate(report_batches(ds, None, 0))
    assert sorted(got.tolist()) == sorted(want.tolist())
    if num_workers == 0:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_with_runs_yields_exactly_the_rest(grouped_collection: abt.Collection,
                                                  num_workers: int) -> None:
    def make() -> abt.AnnBatchDataset:
        ds = abt.AnnBatchDataset(grouped_collection, selector={"y": A.obs["cell_type"]},
                                 batch_size=100, chunk_size=100, preload_nchunks=3,
                                 return_index=True, seed=4,
                                 sampler=abt.ClassBalancedSampler("cell_type",
                                                                  num_samples=2345))
        ds.set_epoch(1)
        return ds

    full = [b["index"].numpy().copy() for b in abt.AnnBatchDataLoader(
        make(), num_workers=num_workers)]
    loader = abt.AnnBatchDataLoader(make(), num_workers=num_workers)
    it = iter(loader)
    k = len(full) // 2 + 1
    head = [next(it)["index"].numpy().copy() for _ in range(k)]
    state = loader.state_dict()
    del it, loader
    resumed = abt.AnnBatchDataLoader(make(), num_workers=num_workers)
    resumed.load_state_dict(state)
    tail = [b["index"].numpy().copy() for b in resumed]
    assert len(head) + len(tail) == len(full)
    for a, b in zip(head + tail, full):
        np.testing.assert_array_equal(a, b)


def test_chunk_size_is_checked_and_explicit_runs_work_anywhere(
        imbalanced_collection: abt.Collection) -> None:
    with pytest.raises(abt.SamplerError, match="chunk_size must be an integer >= 1"):
        abt.ClassBalancedSampler("cell_type", chunk_size=0)
    ds = abt.AnnBatchDataset(imbalanced_collection, batch_size=256,
                             sampler=abt.ClassBalancedSampler("cell_type", chunk_size=16))
    assert ds.sampler.run == 16
    assert "runs of 16 rows" in ds.sampler.signature
    rows = ds.epoch_plan.sampler.rows(0, 0, 0, 64)
    codes = _codes(imbalanced_collection)
    assert len(set(codes[rows[:16]].tolist())) == 1  # a run is one class


def test_obs_prefix_and_per_shard_record(imbalanced_h5ad: Path, tmp_path: Path) -> None:
    """group_by="obs/cell_type" is recorded as the column's name; a shard that does not
    record it (appended by a version that did not group) turns the collection's grouping
    off, and an append then writes ungrouped shards instead of claiming a grouping."""
    coll = abt.create_anndata_collection([imbalanced_h5ad], tmp_path / "s", seed=0,
                                         n_obs_per_shard=2048, group_by="obs/cell_type",
                                         progress=False)
    assert coll.group_by == "cell_type"
    ds = abt.AnnBatchDataset(coll, batch_size=256, sampler=abt.ClassBalancedSampler(
        "cell_type"))
    assert ds.sampler.run == AUTO_RUN
    path = coll.path / "manifest.json"
    manifest = json.loads(path.read_text())
    assert [sh["grouped_by"] for sh in manifest["shards"]] == ["cell_type"] * 3
    del manifest["shards"][1]["grouped_by"]  # what an older appender leaves
    path.write_text(json.dumps(manifest))
    old = abt.open_collection(coll.path)
    assert old.group_by is None
    ds = abt.AnnBatchDataset(old, batch_size=256, sampler=abt.ClassBalancedSampler(
        "cell_type"))
    assert ds.sampler.run == 1  # single rows: correct, as fast as an ungrouped collection


def test_prepare_rewrites_when_group_by_changes(imbalanced_h5ad: Path, tmp_path: Path) -> None:
    store = tmp_path / "s"
    assert abt.prepare_collection([imbalanced_h5ad], store, progress=False)
    assert not abt.prepare_collection([imbalanced_h5ad], store, progress=False)
    assert abt.prepare_collection([imbalanced_h5ad], store, group_by="cell_type",
                                  progress=False)
    assert abt.open_collection(store).group_by == "cell_type"
    assert not abt.prepare_collection([imbalanced_h5ad], store, group_by="cell_type",
                                      progress=False)
    assert abt.prepare_collection([imbalanced_h5ad], store, group_by=None, progress=False)
    assert abt.open_collection(store).group_by is None


def test_the_datamodule_split_is_stratified_on_a_grouped_collection(
        grouped_collection: abt.Collection, imbalanced_collection: abt.Collection) -> None:
    """Chunks of a grouped collection are mostly one class: the held-out chunks are taken
    class by class in proportion, so every class keeps its share in validation."""
    from annbatch_torch.lightning import AnnBatchDataModule

    dm = AnnBatchDataModule(None, grouped_collection, batch_size=64, chunk_size=32,
                            val_fraction=0.2, seed=1)
    dm.setup("fit")
    size = dm.split_chunk_size
    rows = abt.sampling.global_rows(np.stack(
        [dm.val_chunks * size, np.minimum((dm.val_chunks + 1) * size, N_OBS)], axis=1))
    codes = _codes(grouped_collection)
    held, cells = (np.bincount(c, minlength=N_CLASSES) for c in (codes[rows], codes))
    # each class's share to within a chunk per shard (a chunk's class is its first row's)
    slack = size * (len(grouped_collection.shards) + 1)
    assert (np.abs(held - 0.2 * cells) <= slack).all(), (held, cells)
    # the split is split_chunks3's with each chunk's first row's class as its stratum
    want = abt.sampling.split_chunks3(N_OBS, size, 0.2, 0.0, 1, codes[::size])[1]
    np.testing.assert_array_equal(dm.val_chunks, want)
    assert not np.array_equal(want, abt.sampling.split_chunks3(N_OBS, size, 0.2, 0.0, 1)[1])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=2, max_size=80), st.floats(0.05, 0.45),
       st.integers(0, 2**31))
# a tie of Webster keys ((rank + 0.5) / count) gave the largest stratum one chunk too many
@example([0, 0, 4, 0, 1, 2, 4, 4, 4, 4, 4, 4], 0.4375, 4)
def test_stratified_chunks_take_each_stratum_in_proportion(labels: list[int], frac: float,
                                                           seed: int) -> None:
    strata = np.array(labels)
    n = len(strata)
    train, val, test = abt.sampling.split_chunks3(n, 1, frac, 0.0, seed, strata)
    plain = abt.sampling.split_chunks3(n, 1, frac, 0.0, seed)
    assert len(val) == len(plain[1])  # as many chunks as without strata
    assert sorted([*train, *val, *test]) == list(range(n))
    for k in np.unique(strata):
        want = np.count_nonzero(strata == k) * len(val) / n
        assert abs(np.count_nonzero(strata[val] == k) - want) <= 1


def test_weighted_from_column_draws_runs_in_proportion(grouped_collection: abt.Collection,
                                                       adata: ad.AnnData) -> None:
    """Per-category weights on a grouped collection: runs of one category, each category
    drawn with its weight x cells share (to within a run per block), rows equal to their
    source cells."""
    weights = {f"t{i}": float(i + 1) for i in range(N_CLASSES)}
    sampler = abt.WeightedSampler.from_column("cell_type", weights, num_samples=12_000)
    ds = abt.AnnBatchDataset(grouped_collection, selector={"x": A.X}, batch_size=500,
                             densify=True, return_index=True, sampler=sampler)
    assert ds.sampler.run == AUTO_RUN
    assert ds.sampler.mixes_in_pool
    cats = list(grouped_collection.categories("cell_type"))
    cells = np.bincount(_codes(grouped_collection), minlength=N_CLASSES)
    mass = np.array([weights[c] for c in cats]) * cells
    classes = abt.diversity_report(ds, "cell_type", None, per="class").loc["cell_type"]
    np.testing.assert_allclose(classes["epoch_share"], mass / mass.sum(), atol=0.01)
    assert abt.diversity_report(ds, "cell_type", None).loc["cell_type", "entropy_ratio"] > 0.9
    for batch in abt.AnnBatchDataLoader(ds, num_workers=2):
        rows = adata.obs_names.get_indexer(grouped_collection.obs_names_at(batch["index"]))
        np.testing.assert_array_equal(batch["x"].numpy(), adata.X[rows].toarray())
    per_row = abt.WeightedSampler.from_column("cell_type", weights, replacement=False)
    plain = abt.AnnBatchDataset(grouped_collection, batch_size=500, sampler=per_row)
    assert plain.sampler.run == 1  # without replacement: single rows
    assert "runs" not in plain.sampler.signature
    with pytest.raises(abt.SamplerError, match="runs of rows are drawn with replacement"):
        abt.WeightedSampler.from_column("cell_type", weights, replacement=False, chunk_size=8)


def test_too_few_runs_for_the_classes_is_warned(grouped_collection: abt.Collection) -> None:
    with pytest.warns(UserWarning, match=r"holds 2 runs of 64 rows, fewer than its 8 classes"):
        abt.AnnBatchDataset(grouped_collection, batch_size=64, sampler=abt.ClassBalancedSampler(
            "cell_type", num_samples=128))
    assert "group_by='cell_type'" in repr(grouped_collection)


def test_the_automatic_run_lets_a_default_pool_hold_every_class() -> None:
    from annbatch_torch.sampling.samplers import AUTO_MIN_RUN, AUTO_POOL, auto_run

    assert [auto_run(k) for k in (1, 8, 256, 257, 500, 1000, 10_000)] == [
        64, 64, 64, 32, 32, 16, 8]
    for k in range(1, 3000, 7):
        run = auto_run(k)
        assert run & (run - 1) == 0  # a power of two
        assert AUTO_POOL // run >= k or run == AUTO_MIN_RUN  # a pool holds a run of each
