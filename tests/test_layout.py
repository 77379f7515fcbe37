"""The collection's layout on disk: few files (zarr v3 shard files, large collection shards
written in blocks), the same rows whatever the memory, and old layouts still read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

import annbatch_torch as abt
from annbatch_torch import A, create_anndata_collection, open_collection
from annbatch_torch.write import budget as _writer_budget
from annbatch_torch.write.shardstore import Appender


def _files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


def _shard_arrays(coll: abt.Collection, shard: int) -> dict[str, np.ndarray]:
    """Every array of a shard store, read with zarr (what anndata would read)."""
    g = zarr.open_group(str(coll.shard_path(shard)), mode="r")
    out: dict[str, np.ndarray] = {}

    def walk(node: Any, prefix: str) -> None:
        for name, child in node.members():
            key = f"{prefix}{name}"
            if isinstance(child, zarr.Array):
                out[key] = child[...]
            else:
                walk(child, key + "/")

    walk(g, "")
    return out


def _by_name(coll_path: Path, sources: list[Path]) -> tuple[ad.AnnData, ad.AnnData]:
    """The collection (all shards, anndata's read) and the inputs, in the collection's
    row order."""
    coll = open_collection(coll_path)
    got = ad.concat([ad.read_zarr(coll.shard_path(i)) for i in range(len(coll.shards))])
    ref = ad.concat([ad.read_h5ad(p) for p in sources])
    return got, ref[got.obs_names]


def test_the_default_layout_is_few_files_in_shard_files(synthetic_h5ads: list[Path],
                                                        tmp_path: Path) -> None:
    coll = create_anndata_collection(synthetic_h5ads, tmp_path / "c", progress=False)
    assert len(coll.shards) == 1  # 2,700 cells < the default 2**17 rows per shard
    writer = coll.manifest.extra["writer"]
    assert writer["zarr_shard_elems"] == 2**23
    assert writer["n_obs_per_shard"] == 2700
    meta = json.loads((coll.shard_path(0) / "X" / "data" / "zarr.json").read_text())
    assert meta["codecs"][0]["name"] == "sharding_indexed"
    # one shard file per sharded array (X, layers/counts: data + indices + indptr; obsm)
    for array in ("X/data", "X/indices", "X/indptr", "layers/counts/data", "obsm/X_pca"):
        assert len(_files(coll.shard_path(0) / array / "c")) == 1, array
    unsharded = create_anndata_collection(synthetic_h5ads, tmp_path / "u", progress=False,
                                          zarr_shard_elems=0, zarr_chunk_elems=1024)
    assert unsharded.manifest.extra["writer"]["zarr_shard_elems"] is None
    assert len(_files(tmp_path / "c")) < len(_files(tmp_path / "u")) / 2
    got, ref = _by_name(tmp_path / "c", synthetic_h5ads)
    np.testing.assert_array_equal(got.X.toarray(), ref.X.toarray())
    np.testing.assert_array_equal(got.layers["counts"].toarray(), ref.layers["counts"].toarray())
    np.testing.assert_array_equal(got.obsm["X_pca"], ref.obsm["X_pca"])
    assert (got.obs["cell_type"].astype(str) == ref.obs["cell_type"].astype(str)).all()


def test_same_rows_in_the_same_shards_whatever_the_memory(
        synthetic_h5ads: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pass 2 writes a shard in blocks sized from the memory; the stored arrays are the
    same, byte for byte, with one block per shard or many."""
    kw: dict[str, Any] = {"seed": 3, "n_obs_per_shard": 1000, "zarr_chunk_elems": 512,
                          "zarr_shard_elems": 4096, "progress": False}
    big = create_anndata_collection(synthetic_h5ads, tmp_path / "big", **kw)
    assert big.manifest.extra["writer"]["n_obs_per_block"] == 1000
    monkeypatch.setattr(_writer_budget, "working_memory", lambda max_memory, n_cells: 10**6)
    small = create_anndata_collection(synthetic_h5ads, tmp_path / "small", **kw)
    blocks = small.manifest.extra["writer"]["n_obs_per_block"]
    assert blocks < 1000  # several blocks per shard, not aligned to the zarr shards
    assert small.shard_sizes == big.shard_sizes == [1000, 1000, 700]
    for s in range(3):
        a, b = _shard_arrays(big, s), _shard_arrays(small, s)
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("codec", ["raw", "lz4"])
def test_shard_files_read_like_chunk_files(synthetic_h5ads: list[Path], tmp_path: Path,
                                           codec: str) -> None:
    """The loader yields the same rows and values from both layouts (raw: annbatch_torch's
    direct reader inside shard files; lz4: zarrs or zarr-python)."""
    kw: dict[str, Any] = {"seed": 0, "n_obs_per_shard": 1024, "zarr_chunk_elems": 2048,
                          "compressor": codec, "progress": False}
    sel = {"X": A.X, "counts": A.layers["counts"], "pca": A.obsm["X_pca"],
           "ct": A.obs["cell_type"]}
    out = {}
    for name, elems in (("shards", 1 << 15), ("chunks", 0)):
        create_anndata_collection(synthetic_h5ads, tmp_path / name, zarr_shard_elems=elems,
                                  **kw)
        ds = abt.AnnBatchDataset(tmp_path / name, batch_size=300, chunk_size=64,
                                 preload_nchunks=4, selector=sel, return_index=True, seed=1)
        out[name] = list(ds)
    assert len(out["shards"]) == len(out["chunks"]) > 1
    for x, y in zip(out["shards"], out["chunks"]):
        assert set(x) == set(y)
        for key in x:
            a, b = x[key], y[key]
            if a.layout != torch.strided:
                a, b = a.to_dense(), b.to_dense()
            assert a.equal(b), key
    ref = ad.concat([ad.read_h5ad(p) for p in synthetic_h5ads])
    coll = open_collection(tmp_path / "shards")
    for batch in out["shards"][:2]:
        names = coll.obs_names_at(batch["index"].numpy())
        np.testing.assert_array_equal(batch["X"].to_dense().numpy(),
                                      ref[names].X.toarray())


@settings(max_examples=60, deadline=None)
@given(unit=st.integers(1, 40), pieces=st.lists(st.integers(0, 90), max_size=12),
       width=st.sampled_from([0, 3]))
def test_the_appender_writes_whole_units_once(unit: int, pieces: list[int],
                                              width: int) -> None:
    """Every write but the last starts and ends on a unit boundary; nothing is written
    twice; the array ends up equal to the pieces concatenated."""
    n = sum(pieces)
    shape = (n, width) if width else (n,)
    arr = zarr.create_array(zarr.storage.MemoryStore(), shape=shape, dtype=np.int64,
                            chunks=(max(unit, 1), *shape[1:]) if n else (1, *shape[1:]),
                            fill_value=-1)
    writes: list[tuple[int, int]] = []

    class Recording:
        """The real array, with its writes recorded."""

        shape, dtype = arr.shape, arr.dtype

        def __setitem__(self, key: slice, value: np.ndarray) -> None:
            writes.append((key.start, key.stop))
            arr[key] = value

    app = Appender(Recording(), unit)
    start = 0
    for k in pieces:
        rows = np.arange(start, start + k, dtype=np.int64)
        app.append(rows[:, None].repeat(width, 1) if width else rows)
        start += k
    app.close("test")
    want = np.arange(n, dtype=np.int64)
    np.testing.assert_array_equal(arr[...], want[:, None].repeat(width, 1) if width else want)
    covered = [b for a, b in writes]
    assert [a for a, _ in writes] == [0, *covered[:-1]][:len(writes)]  # in order, no overlap
    for a, b in writes[:-1]:
        assert a % unit == 0
        assert b % unit == 0
    if writes:
        assert writes[-1][0] % unit == 0
        assert writes[-1][1] == n


def test_an_old_layout_collection_still_reads(synthetic_h5ads: list[Path],
                                              tmp_path: Path) -> None:
    """A collection in the first layout (one file per chunk, small shards) opens and reads
    values equal to its inputs; the format version is the same."""
    old = create_anndata_collection(synthetic_h5ads, tmp_path / "old", zarr_shard_elems=None,
                                    n_obs_per_shard=700, progress=False)
    new = create_anndata_collection(synthetic_h5ads, tmp_path / "new", progress=False)
    assert old.manifest.format_version == new.manifest.format_version
    assert len(old.shards) == 4
    ds = abt.AnnBatchDataset(tmp_path / "old", batch_size=512, chunk_size=32,
                             preload_nchunks=8, return_index=True, seed=0)
    ref = ad.concat([ad.read_h5ad(p) for p in synthetic_h5ads])
    rows = []
    for batch in ds:
        idx = batch["index"].numpy()
        rows.append(idx)
        names = old.obs_names_at(idx)
        np.testing.assert_array_equal(batch["X"].to_dense().numpy(), ref[names].X.toarray())
    assert np.sort(np.concatenate(rows)).tolist() == list(range(old.n_obs))
    assert sp.issparse(ad.read_zarr(old.shard_path(0)).X)


OLD_LAYOUT = Path(__file__).parent / "data" / "layout_v1"


def test_a_collection_written_by_the_first_layout_reads(tmp_path: Path) -> None:
    """tests/data/layout_v1: written by the code before shard files (f2a42d2). It opens,
    every row comes once per epoch with the values of its input, in 0 and 2 workers."""
    import shutil

    store = Path(shutil.copytree(OLD_LAYOUT / "collection", tmp_path / "collection"))
    coll = open_collection(store)
    assert coll.manifest.format_version == 1
    assert coll.shard_sizes == [50, 50]
    assert "shards" not in json.loads((coll.shard_path(0) / "X" / "data" / "zarr.json")
                                      .read_text())["codecs"][0].get("configuration", {})
    assert len(_files(coll.shard_path(0) / "X" / "data" / "c")) > 1  # one file per chunk
    ref = ad.read_h5ad(OLD_LAYOUT / "input0.h5ad")
    sel = {"X": A.X, "pca": A.obsm["X_pca"], "ct": A.obs["cell_type"]}
    cats = coll.categories("cell_type")
    for workers in (0, 2):
        ds = abt.AnnBatchDataset(store, batch_size=16, chunk_size=8, preload_nchunks=4,
                                 selector=sel, return_index=True, seed=workers)
        seen = []
        for batch in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers):
            idx = batch["index"].numpy()
            seen.append(idx)
            names = coll.obs_names_at(idx)
            np.testing.assert_array_equal(batch["X"].to_dense().numpy(),
                                          ref[names].X.toarray())
            np.testing.assert_array_equal(batch["pca"].numpy(), ref[names].obsm["X_pca"])
            assert [cats[c] for c in batch["ct"].tolist()] == \
                ref[names].obs["cell_type"].astype(str).tolist()
        assert np.sort(np.concatenate(seen)).tolist() == list(range(100))
