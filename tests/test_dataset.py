"""AnnBatchDataset end to end: values, coverage across workers and start methods, epochs,
pickling, and in-place sources. Real DataLoader worker processes throughout."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from torch.utils.data import DataLoader

import annbatch_torch as abt
from annbatch_torch import A, AnnBatchDataset
from annbatch_torch.world import EPOCH_ROWS, SharedEpoch

SEL = {
    "x": A.X,
    "counts": A.layers["counts"],
    "pca": A.obsm["X_pca"],
    "ct": A.obs["cell_type"],
}


def _truth(adatas: list[ad.AnnData]) -> ad.AnnData:
    return ad.concat(adatas, merge="same")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], ad.AnnData]:
    """Three small h5ad files (grouped by cell type) and their concatenation."""
    d = tmp_path_factory.mktemp("inplace")
    rng = np.random.default_rng(42)
    cats = ["B", "NK", "T", "mono"]
    paths, adatas = [], []
    for i, n in enumerate([700, 450, 333]):
        x = sp.random(n, 40, density=0.2, format="csr", dtype=np.float32, random_state=rng)
        x.data = np.round(x.data * 10) + 1
        ct = np.sort(rng.choice(cats[i % 2 : i % 2 + 3], n))  # grouped, per-file categories
        obs = pd.DataFrame(
            {"cell_type": pd.Categorical(ct), "score": rng.normal(size=n).astype(np.float32)},
            index=[f"f{i}_c{j}" for j in range(n)],
        )
        a = ad.AnnData(x, obs=obs, var=pd.DataFrame(index=[f"g{k}" for k in range(40)]))
        a.layers["counts"] = x.copy() * 2
        a.obsm["X_pca"] = rng.normal(size=(n, 5)).astype(np.float32)
        p = d / f"in{i}.h5ad"
        a.write_h5ad(p)
        paths.append(p)
        adatas.append(a)
    return paths, _truth(adatas)


def _collect(loader: Any, key: str = "index") -> list[np.ndarray]:
    return [b[key].numpy().copy() for b in loader]


def _check_values(ds: AnnBatchDataset, truth: ad.AnnData, batches: list[dict[str, Any]]) -> None:
    cats = ds.source.categories("cell_type")
    truth_codes = pd.Categorical(truth.obs["cell_type"].astype(str), categories=cats).codes
    for b in batches:
        idx = b["index"].numpy()
        x = b["x"].to_dense().numpy() if b["x"].layout == torch.sparse_csr else b["x"].numpy()
        np.testing.assert_array_equal(x, truth.X[idx].toarray())
        c = b["counts"]
        c = c.to_dense().numpy() if c.layout == torch.sparse_csr else c.numpy()
        np.testing.assert_array_equal(c, truth.layers["counts"][idx].toarray())
        np.testing.assert_array_equal(b["pca"].numpy(), truth.obsm["X_pca"][idx])
        assert b["ct"].dtype == torch.int64
        np.testing.assert_array_equal(b["ct"].numpy(), truth_codes[idx])


def test_inplace_values_and_exact_coverage(inputs: tuple[list[Path], ad.AnnData]) -> None:
    paths, truth = inputs
    ds = AnnBatchDataset(paths, selector=SEL, batch_size=64, chunk_size=16, preload_nchunks=4,
                         return_index=True)
    batches = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert len(batches) == len(ds)
    _check_values(ds, truth, batches)
    rows = np.concatenate([b["index"].numpy() for b in batches])
    assert sorted(rows.tolist()) == list(range(truth.n_obs))
    assert all(len(b["index"]) == 64 for b in batches[:-1])


def test_densify_outputs_dense_float32(inputs: tuple[list[Path], ad.AnnData]) -> None:
    paths, truth = inputs
    ds = AnnBatchDataset(paths, selector=SEL, batch_size=100, densify=True, return_index=True)
    batches = list(ds)
    assert batches[0]["x"].layout == torch.strided
    assert batches[0]["x"].dtype == torch.float32
    _check_values(ds, truth, batches)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_coverage_and_batch_sets_independent_of_workers(
    inputs: tuple[list[Path], ad.AnnData], method: str
) -> None:
    paths, truth = inputs
    ds = AnnBatchDataset(paths, selector={"x": A.X}, batch_size=50, chunk_size=16,
                         preload_nchunks=5, return_index=True, seed=3)
    ds.set_epoch(1)
    list(ds)  # the main process touched every handle before workers start
    sets = {}
    # the split among 1, 2 and 3 workers is the same code under both start methods (the
    # worker's id and count from get_worker_info): fork checks each count; spawn adds the
    # dataset pickled and its handles reopened in fresh interpreters, checked with 3
    # workers (ids 0-2, an uneven split) against none, without paying 3 more interpreter
    # starts (torch + annbatch_torch imported in each) for 1 and 2 workers
    worker_counts = [0, 1, 2, 3] if method == "fork" else [0, 3]
    for nw in worker_counts:
        ctx = mp.get_context(method) if nw else None
        loader = DataLoader(ds, batch_size=None, num_workers=nw, multiprocessing_context=ctx)
        batches = _collect(loader)
        rows = np.concatenate(batches)
        assert sorted(rows.tolist()) == list(range(truth.n_obs)), nw
        sets[nw] = Counter(frozenset(b.tolist()) for b in batches)
        assert len(batches) == len(ds)
    first = sets[0]
    assert all(s == first for s in sets.values())


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_epochs_differ_and_match_fresh_loader_with_persistent_workers(
    inputs: tuple[list[Path], ad.AnnData], context: str,
) -> None:
    """set_epoch in the main process reaches persistent workers, forked or spawned (these
    receive the dataset's row of shared epochs through multiprocessing's pickler)."""
    paths, _ = inputs
    kw = dict(selector={"x": A.X}, batch_size=40, chunk_size=8, preload_nchunks=4,
              return_index=True, seed=11)
    ds = AnnBatchDataset(paths, **kw)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context=context)
    epochs = []
    for e in range(3):
        ds.set_epoch(e)
        epochs.append(_collect(loader))
    orders = [np.concatenate(b) for b in epochs]
    assert not np.array_equal(orders[0], orders[1])
    assert not np.array_equal(orders[1], orders[2])
    for e in range(3):
        fresh = AnnBatchDataset(paths, **kw)
        fresh.set_epoch(e)
        got = _collect(DataLoader(fresh, batch_size=None, num_workers=2))
        assert len(got) == len(epochs[e])
        for a, b in zip(got, epochs[e]):
            np.testing.assert_array_equal(a, b)


def _repeat_warnings(caplog: pytest.LogCaptureFixture) -> int:
    n = sum("is iterated again with the same order" in r.getMessage() for r in caplog.records)
    caplog.clear()
    return n


def test_an_epoch_run_to_its_end_and_iterated_again_warns_a_look_at_it_does_not(
    inputs: tuple[list[Path], ad.AnnData], caplog: pytest.LogCaptureFixture,
) -> None:
    """A forgotten ``set_epoch`` (an epoch run to its end, then iterated again) warns; a
    look at an epoch's first batch (``next(iter(...))``) or a loop broken off, then the
    epoch's loop, does not. With DataLoader workers worker 0 records the end in the
    dataset's shared state (seen here), the same rule then applies."""
    paths, _ = inputs
    ds = AnnBatchDataset(paths, selector={"x": A.X}, batch_size=40, chunk_size=8,
                         preload_nchunks=4)
    with caplog.at_level("WARNING", logger="annbatch_torch"):
        next(iter(ds))  # a look
        assert len(list(ds)) > 1
        assert _repeat_warnings(caplog) == 0
        list(ds)  # the same epoch again, run to its end before
        assert _repeat_warnings(caplog) == 1
        ds.set_epoch(1)
        for i, _ in enumerate(ds):  # broken off
            if i == 1:
                break
        list(ds)
        assert _repeat_warnings(caplog) == 0
        list(ds)
        assert _repeat_warnings(caplog) == 1
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    ds.set_epoch(2)
    next(iter(loader))
    assert int(ds._epoch._t[1]) == 2
    assert int(ds._epoch._t[2]) == 0  # not run to its end: a later loop does not warn
    assert len(list(loader)) > 1
    assert int(ds._epoch._t[2]) == 1  # worker 0's share ran to its end: a repeat warns


def test_pickles_after_iteration_without_open_handles(
    inputs: tuple[list[Path], ad.AnnData],
) -> None:
    paths, _ = inputs
    ds = AnnBatchDataset(paths, selector=SEL, batch_size=64, return_index=True)
    first = [b["index"].numpy() for b in ds]
    assert ds.source.has_open_handles
    clone = pickle.loads(pickle.dumps(ds))
    assert not clone.source.has_open_handles
    assert clone._stream is None
    again = [b["index"].numpy() for b in clone]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


def test_transform_and_converter_run_in_workers(inputs: tuple[list[Path], ad.AnnData]) -> None:
    paths, truth = inputs
    ds = AnnBatchDataset(
        paths,
        selector={"x": A.X.with_transform(np.log1p), "pca": "obsm/X_pca"},
        batch_size=128, densify=True, return_index=True, batch_converter=_pid_converter,
    )
    main_pid = os.getpid()
    for b in DataLoader(ds, batch_size=None, num_workers=2):
        assert b["pid"] != main_pid
        idx = b["index"].numpy()
        np.testing.assert_allclose(b["x"].numpy(), np.log1p(truth.X[idx].toarray()), rtol=1e-6)


def _pid_converter(batch: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = abt.batch_dict_converter(batch)
    out["pid"] = os.getpid()
    return out


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
        ({"chunk_size": -1}, "chunk_size must be an integer >= 1"),
        ({"preload_nchunks": 0}, "preload_nchunks must be an integer >= 1"),
        ({"rank": 2, "world_size": 2}, r"rank must be in \[0, world_size=2\)"),
        ({"world_size": 0}, "world_size must be an integer >= 1"),
        ({"even_batches": "odd"}, "even_batches must be 'drop' or 'pad'"),
        ({"selector": {"x": A.obsm["nope"]}}, "'obsm/nope'.*Available fields"),
        ({"selector": {"x": "layers/missing"}}, "selector key 'x'.*'layers/missing'"),
    ],
)
def test_bad_arguments(inputs: tuple[list[Path], ad.AnnData], kwargs: dict, match: str) -> None:
    paths, _ = inputs
    with pytest.raises((ValueError, KeyError), match=match):
        AnnBatchDataset(paths, **kwargs)


@pytest.mark.parametrize("batch_size", [1, 7, 1000, 5000])
def test_any_batch_size_works_with_defaults(
    inputs: tuple[list[Path], ad.AnnData], batch_size: int
) -> None:
    paths, truth = inputs
    ds = AnnBatchDataset(paths, batch_size=batch_size, return_index=True)
    sizes = [len(b["index"]) for b in ds]
    assert sum(sizes) == truth.n_obs
    assert all(s == batch_size for s in sizes[:-1])
    assert len(sizes) == len(ds)


def test_pad_policy_adds_mask(inputs: tuple[list[Path], ad.AnnData]) -> None:
    paths, truth = inputs
    per_rank = []
    for rank in range(3):
        ds = AnnBatchDataset(paths, batch_size=64, chunk_size=16, preload_nchunks=8,
                             even_batches="pad", rank=rank, world_size=3, return_index=True)
        per_rank.append(list(ds))
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1
    real = np.concatenate([b["index"].numpy()[b["mask"].numpy()] for r in per_rank for b in r])
    assert sorted(real.tolist()) == list(range(truth.n_obs))


def test_source_may_be_in_memory_anndata(inputs: tuple[list[Path], ad.AnnData]) -> None:
    _, truth = inputs
    mem = truth.copy()
    mem.obs["cell_type"] = mem.obs["cell_type"].astype("category")
    ds = AnnBatchDataset(mem, selector=SEL, batch_size=99, return_index=True)
    _check_values(ds, truth, list(DataLoader(ds, batch_size=None, num_workers=2)))


def _epochs_in_a_forked_child(conn: Any) -> None:
    made = [SharedEpoch() for _ in range(3)]  # rows of the child's own block
    for e in made:
        e.set(99)
    conn.send(True)


def test_epochs_share_a_descriptor_per_block_pickle_small_and_stay_apart_after_fork(
) -> None:
    """Each dataset's epoch is a row of one block of shared memory per process: a process
    making more datasets than a block holds opens one file descriptor per block (not one
    per dataset: thousands of datasets ran out of descriptors); the rows are independent;
    a plain pickle carries the three numbers, not the block; a forked child takes a
    block of its own (rows handed out there never alias the parent's next ones)."""
    fds = len(os.listdir("/proc/self/fd"))
    made = [SharedEpoch() for _ in range(EPOCH_ROWS + 10)]
    # one or two blocks (the first may be this process's, partly used): a few descriptors,
    # with room for files other threads of the test session open meanwhile; 1,034 before
    assert len(os.listdir("/proc/self/fd")) - fds < 20
    made[3].set(5)
    assert [e.value for e in made[2:5]] == [0, 5, 0]
    blob = pickle.dumps(made[3])
    assert len(blob) < 1000
    back = pickle.loads(blob)
    assert back.value == 5
    back.set(6)
    assert made[3].value == 5  # a plain copy: not shared
    parent, child = mp.get_context("fork").Pipe()
    p = mp.get_context("fork").Process(target=_epochs_in_a_forked_child,
                                                      args=(child,))
    p.start()
    assert parent.recv()
    p.join(30)
    assert [SharedEpoch().value for _ in range(3)] == [0, 0, 0]
