"""Readers while another process rewrites the collection, and two iterators of one dataset.

X encodes each cell and the write it came from (column 0: cell number + 1, column 1: the
generation), so a batch mixing two collections, or rows of another one, shows in its values.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest

import annbatch_torch as abt
from annbatch_torch import A, AnnBatchDataLoader, AnnBatchDataset, CollectionError

N_OBS = 3000


def _input(path: Path, generation: int) -> Path:
    x = np.zeros((N_OBS, 4), dtype=np.float32)
    x[:, 0] = np.arange(N_OBS) + 1
    x[:, 1] = generation
    obs = pd.DataFrame(index=[f"c{i}" for i in range(N_OBS)])
    ad.AnnData(x, obs=obs, var=pd.DataFrame(index=[f"g{i}" for i in range(4)])).write_h5ad(path)
    return path


@pytest.fixture
def store(tmp_path: Path) -> Path:
    out = tmp_path / "store"
    abt.create_anndata_collection([_input(tmp_path / "a.h5ad", 1)], out, seed=0,
                                  progress=False)
    _input(tmp_path / "b.h5ad", 2)
    return out


def _rewrite(store: Path, times: int = 1, background: bool = False) -> subprocess.Popen | None:
    """Another process overwrites the collection with generation 2 (``times`` times)."""
    code = textwrap.dedent(f"""
        import annbatch_torch as abt
        for seed in range({times}):
            abt.create_anndata_collection([{str(store.parent / 'b.h5ad')!r}], {str(store)!r},
                                          seed=seed + 1, overwrite=True, progress=False)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code])
    if background:
        return proc
    assert proc.wait(timeout=120) == 0
    return None


def _dataset(store: Path, **kwargs) -> AnnBatchDataset:
    return AnnBatchDataset(store, selector={"x": A.X}, batch_size=50, chunk_size=50,
                           preload_nchunks=4, return_index=True, seed=3, densify=True,
                           **kwargs)


def _check(batch: dict, coll: abt.Collection) -> None:
    """A batch of the collection as it was opened: generation 1, the rows it names."""
    x, idx = batch["x"].numpy(), batch["index"].numpy()
    assert (x[:, 1] == 1).all(), "rows of another write"
    names = coll.obs_names_at(idx)
    assert list(names) == [f"c{int(v) - 1}" for v in x[:, 0]], "rows of another position"


def _drain(it, coll: abt.Collection) -> None:
    for batch in it:
        _check(batch, coll)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_rewrite_fails_the_next_pool_and_never_mixes(store: Path, num_workers: int) -> None:
    coll = abt.open_collection(store)
    ds = _dataset(coll, prefetch=False)
    loader = AnnBatchDataLoader(ds, num_workers=num_workers)
    it = iter(loader)
    for _ in range(2):  # the first pools are read
        _check(next(it), coll)
    _rewrite(store)
    with pytest.raises(CollectionError,
                       match=r"was rewritten \(.*in this process or another\).*Open it again"):
        _drain(it, coll)  # what was read before the rewrite is the old collection's
    # opened again: the new collection, whole
    new = abt.open_collection(store)
    rows = [b["x"].numpy() for b in AnnBatchDataLoader(_dataset(new), num_workers=0)]
    assert (np.concatenate(rows)[:, 1] == 2).all()


def test_rewrites_while_reading_never_mix_generations(store: Path) -> None:
    """Rewrites racing the reads (any moment, also between the writer's two renames): every
    batch yielded is the old collection's, until a CollectionError."""
    coll = abt.open_collection(store)
    proc = _rewrite(store, times=3, background=True)
    assert proc is not None
    n = 0
    try:
        for _ in range(200):
            ds = _dataset(coll, prefetch=True)
            for batch in ds:
                _check(batch, coll)
                n += 1
    except CollectionError:
        pass
    else:
        pytest.fail("200 epochs ran beside three rewrites without noticing them")
    finally:
        assert proc.wait(timeout=300) == 0
    assert n > 0


def test_shards_added_keep_readers_of_the_old_ones_going(store: Path) -> None:
    """Only added to (an append: the old shards as they were): readers carry on."""
    import json

    coll = abt.open_collection(store)
    ds = _dataset(coll, prefetch=False)
    it = iter(ds)
    _check(next(it), coll)
    mpath = store / "manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["created_by"] += " (edited)"  # a new manifest over the very same shards
    tmp = store / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest))
    tmp.replace(mpath)
    for batch in it:
        _check(batch, coll)
    manifest["shards"][0]["generation"] = "another"  # a shard replaced: refused
    tmp.write_text(json.dumps(manifest))
    tmp.replace(mpath)
    with pytest.raises(CollectionError, match="rewritten"):
        list(_dataset(coll))


def test_two_iterators_of_one_dataset(store: Path) -> None:
    """The newest iterator owns the epoch and its resume progress; the older one stops with
    a clear error at its next batch, and counts nothing into the newer one's progress. A
    deep copy iterates independently."""
    import copy

    coll = abt.open_collection(store)
    ds = _dataset(coll)
    first = iter(ds)
    next(first)
    second = iter(ds)
    got = [next(second) for _ in range(3)]
    with pytest.raises(RuntimeError, match="superseded by a newer iter"):
        next(first)
    assert ds.state_dict()["batches"] == 3
    rest = list(second)
    assert len(got) + len(rest) == len(ds)
    other = copy.deepcopy(ds)
    a, b = iter(ds), iter(other)
    for x, y in zip(a, b):  # interleaved, independent, the same epoch
        np.testing.assert_array_equal(x["index"], y["index"])
    assert ds.state_dict()["batches"] == other.state_dict()["batches"] == len(ds)


def test_metadata_readers_refuse_a_rewritten_collection(store: Path) -> None:
    """obs_names_at maps batch["index"] back to cells: after a rewrite it must not answer
    with the new write's names."""
    coll = abt.open_collection(store)
    names = coll.obs_names_at([0, 1, 2])
    _rewrite(store)
    with pytest.raises(CollectionError, match="rewritten"):
        coll.obs_names_at([0, 1, 2])
    assert list(abt.open_collection(store).obs_names_at([0])) != []
    assert len(names) == 3
