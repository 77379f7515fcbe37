"""Scattered reads: rows straight into their shuffled places.

* ``RawZarrArray.read_runs`` / ``read_into`` against a numpy reference, on arrays written
  by zarr-python (with and without the ``crc32c`` codec), and its failure modes (absent,
  truncated, oversize and corrupted chunk files);
* ``CSRElement.read_rows_scatter`` for raw arrays and its numpy fallback;
* ``PoolReader.read(ranges, order)`` equals ``PoolReader.read(ranges)[order]`` for a raw
  collection, an lz4 collection, in-place h5ad files and in-memory AnnData;
* ``sampling.pool_order``;
* a damaged column index surfaces as a ``ReadError`` naming the field.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import anndata as ad
import google_crc32c
import numpy as np
import pytest
import scipy.sparse as sp
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from zarr.codecs import BytesCodec, Crc32cCodec

from annbatch_torch import AnnBatchDataset
from annbatch_torch.datasets import write_synthetic_h5ads
from annbatch_torch.errors import ReadError
from annbatch_torch.read.reader import GATHER_PIECES, PoolReader
from annbatch_torch.sampling import pool_order
from annbatch_torch.store import diskio, native, rawzarr
from annbatch_torch.store.checks import bad_column
from annbatch_torch.store.collection import open_collection
from annbatch_torch.store.elements import CSRElement
from annbatch_torch.store.inputs.inplace import InPlaceSource, open_source
from annbatch_torch.store.rawzarr import ChunkError, RawZarrArray, open_raw
from annbatch_torch.write.writer import create_anndata_collection

DTYPES = ("int32", "int64", "float32")


# -- helpers ----------------------------------------------------------------------------
def write_raw(
    path: Path, values: np.ndarray, chunk: int, crc: bool, fill_value: Any = None,
    per_shard: int | None = None,
) -> RawZarrArray:
    """``values`` as a zarr v3 array of raw little-endian chunks (+ CRC-32C if ``crc``);
    ``per_shard``: inside zarr v3 shard files of that many chunks."""
    chunks = (chunk, *values.shape[1:])
    a = zarr.create_array(
        store=str(path),
        shape=values.shape,
        chunks=chunks,
        shards=None if per_shard is None else (chunk * per_shard, *values.shape[1:]),
        dtype=values.dtype,
        compressors=[Crc32cCodec()] if crc else None,
        filters=None,
        serializer=BytesCodec(endian="little"),
        fill_value=fill_value,
    )
    a[...] = values
    raw = open_raw(path)
    assert raw is not None
    assert raw.crc == crc
    assert raw.chunk_rows == chunk
    assert raw.per_shard == (per_shard or 0)
    return raw


def source_values(rng: np.random.Generator, n: int, dtype: str) -> np.ndarray:
    """Distinct-looking, non-zero (never the fill value) and never the sentinel."""
    if dtype == "float32":
        return (rng.random(n) + 1.0).astype(np.float32)
    return rng.integers(1, 2**31 - 1, size=n).astype(dtype)


def sentinel(dtype: str) -> Any:
    return -12345.5 if dtype == "float32" else -7


def reference(src: np.ndarray, starts: np.ndarray, stop: int, dests: np.ndarray,
              out: np.ndarray) -> np.ndarray:
    ref = out.copy()
    ends = np.append(starts[1:], stop)
    for s, e, d in zip(starts.tolist(), ends.tolist(), dests.tolist()):
        ref[d : d + e - s] = src[s:e]
    return ref


def chunk_path(raw: RawZarrArray, c: int) -> Path:
    p = raw.path / "c" / str(c)
    assert p.is_file(), p
    return p


# -- RawZarrArray.read_runs -------------------------------------------------------------
@st.composite
def runs_cases(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 120))
    chunk = draw(st.one_of(st.just(1), st.integers(2, 40), st.integers(n + 1, n + 10)))
    lo = draw(st.integers(0, n))
    stop = draw(st.integers(lo, n))
    cuts = sorted(draw(st.lists(st.integers(lo, stop), max_size=12)))  # repeats: empty runs
    starts = np.array([lo, *cuts], dtype=np.int64)
    lengths = np.diff(np.append(starts, stop))
    k = len(starts)
    perm = draw(st.permutations(range(k)))
    gaps = draw(st.lists(st.integers(0, 3), min_size=k + 1, max_size=k + 1))
    dests = np.empty(k, dtype=np.int64)
    pos = gaps[0]
    for j, r in enumerate(perm):  # runs laid out in ``perm`` order, with gaps between
        dests[r] = pos
        pos += int(lengths[r]) + gaps[j + 1]
    return {
        "n": n, "chunk": chunk, "starts": starts, "stop": stop, "dests": dests,
        "out_len": pos, "dtype": draw(st.sampled_from(DTYPES)), "crc": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**32 - 1)),
        "per_shard": draw(st.one_of(st.none(), st.integers(1, 5))),
    }


@settings(max_examples=100, deadline=None)
@given(runs_cases())
def test_read_runs_matches_numpy_reference(case: dict[str, Any]) -> None:
    rng = np.random.default_rng(case["seed"])
    dtype = case["dtype"]
    src = source_values(rng, case["n"], dtype)
    with tempfile.TemporaryDirectory() as tmp:
        raw = write_raw(Path(tmp) / "a", src, case["chunk"], case["crc"],
                        per_shard=case["per_shard"])
        out = np.full(case["out_len"], sentinel(dtype), dtype=dtype)
        ref = reference(src, case["starts"], case["stop"], case["dests"], out)
        raw.read_runs(case["starts"], case["stop"], case["dests"], out)
    np.testing.assert_array_equal(out, ref)  # untouched parts keep the sentinel


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 80),
    chunk=st.integers(1, 90),
    cols=st.integers(1, 3),
    dtype=st.sampled_from(DTYPES),
    crc=st.booleans(),
    per_shard=st.one_of(st.none(), st.integers(1, 4)),
    data=st.data(),
)
def test_read_into_and_getitem(n: int, chunk: int, cols: int, dtype: str, crc: bool,
                               per_shard: int | None, data: st.DataObject) -> None:
    rng = np.random.default_rng(n * 1000 + chunk)
    src = source_values(rng, n * cols, dtype)
    src = src.reshape(n, cols) if cols > 1 else src
    lo = data.draw(st.integers(0, n), label="lo")
    hi = data.draw(st.integers(lo, n), label="hi")
    with tempfile.TemporaryDirectory() as tmp:
        raw = write_raw(Path(tmp) / "a", src, chunk, crc, per_shard=per_shard)
        out = np.full((hi - lo, *src.shape[1:]), sentinel(dtype), dtype=dtype)
        raw.read_into(lo, hi, out)
        np.testing.assert_array_equal(out, src[lo:hi])
        np.testing.assert_array_equal(raw[lo:hi], src[lo:hi])
        np.testing.assert_array_equal(raw[...], src)


@pytest.mark.parametrize("crc", [False, True])
@pytest.mark.parametrize("n_chunks", [1, 2])
def test_read_runs_more_segments_than_iov_max(tmp_path: Path, crc: bool, n_chunks: int) -> None:
    """3,000 one-element runs, reversed (so nothing merges): > 1,024 buffers per preadv."""
    n = 3000
    src = np.arange(1, n + 1, dtype=np.int32)
    raw = write_raw(tmp_path / "a", src, n // n_chunks, crc)
    # skip element 0 so the chunk has a leading part not requested (scratch with crc)
    starts = np.arange(1, n - 1, dtype=np.int64)
    dests = (n - 3) - np.arange(n - 2, dtype=np.int64)
    out = np.full(n - 2, -1, dtype=np.int32)
    raw.read_runs(starts, n - 1, dests, out)
    np.testing.assert_array_equal(out, src[1 : n - 1][::-1])


def test_preadv_full_splits_at_iov_max(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a tiny IOV_MAX every group boundary is exercised, also a short read mid-way."""
    monkeypatch.setattr(diskio, "IOV_MAX", 3)
    monkeypatch.setattr(rawzarr, "IOV_MAX", 3)
    n = 40
    src = np.arange(1, n + 1, dtype=np.int64)
    raw = write_raw(tmp_path / "a", src, 20, crc=True)
    starts = np.arange(n, dtype=np.int64)
    dests = (n - 1) - starts
    out = np.zeros(n, dtype=np.int64)
    raw.read_runs(starts, n, dests, out)
    np.testing.assert_array_equal(out, src[::-1])
    p = chunk_path(raw, 1)
    p.write_bytes(p.read_bytes()[:-30])
    with pytest.raises(ChunkError):
        raw.read_runs(starts, n, dests, np.zeros(n, dtype=np.int64))


def test_contiguous_runs_are_merged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """1-element runs landing one after the other are read as one segment."""
    n = 500
    src = np.arange(1, n + 1, dtype=np.int32)
    raw = write_raw(tmp_path / "a", src, n, crc=False)
    calls: list[int] = []
    real = rawzarr.preadv_full

    def spy(fd: int, bufs: list[Any], *rest: Any) -> int:
        calls.append(len(bufs))
        return real(fd, bufs, *rest)

    monkeypatch.setattr(rawzarr, "preadv_full", spy)
    out = np.zeros(n + 5, dtype=np.int32)
    raw.read_runs(np.arange(n, dtype=np.int64), n, np.arange(n, dtype=np.int64) + 5, out)
    np.testing.assert_array_equal(out[5:], src)
    np.testing.assert_array_equal(out[:5], 0)
    assert calls == [1]


def test_read_runs_nothing_to_read(tmp_path: Path) -> None:
    src = np.arange(1, 11, dtype=np.int32)
    raw = write_raw(tmp_path / "a", src, 4, crc=True)
    out = np.full(5, -1, dtype=np.int32)
    raw.read_runs(np.zeros(0, dtype=np.int64), 0, np.zeros(0, dtype=np.int64), out)
    raw.read_runs(np.array([3, 3, 3]), 3, np.array([0, 1, 2]), out)  # only empty runs
    raw.read_into(4, 4, out)
    np.testing.assert_array_equal(out, -1)


# -- failure modes ----------------------------------------------------------------------
@pytest.mark.parametrize("crc", [False, True])
@pytest.mark.parametrize(("dtype", "fill"), [("int32", -5), ("int64", 0), ("float32", 0.5),
                                             ("float32", float("nan"))])
def test_absent_chunk_reads_fill_value(tmp_path: Path, crc: bool, dtype: str, fill: Any) -> None:
    n, chunk = 30, 8
    src = source_values(np.random.default_rng(0), n, dtype)
    raw = write_raw(tmp_path / "a", src, chunk, crc, fill_value=fill)
    chunk_path(raw, 1).unlink()
    want = src.copy()
    want[8:16] = fill
    # zarr agrees on what an absent chunk means
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "a"), mode="r")[...], want)
    starts = np.array([2, 5, 9, 14, 20], dtype=np.int64)
    stop = 27
    dests = np.array([100, 0, 50, 3, 70], dtype=np.int64)
    out = np.full(120, sentinel(dtype), dtype=dtype)
    ref = reference(want, starts, stop, dests, out)
    raw.read_runs(starts, stop, dests, out)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(raw[...], want)


@pytest.mark.parametrize("crc", [False, True])
@pytest.mark.parametrize("cut", [1, 4, 32, "all"])
def test_truncated_chunk_raises(tmp_path: Path, crc: bool, cut: Any) -> None:
    src = np.arange(1, 25, dtype=np.int32)
    raw = write_raw(tmp_path / "a", src, 8, crc)
    p = chunk_path(raw, 1)
    body = p.read_bytes()
    p.write_bytes(b"" if cut == "all" else body[:-cut])
    with pytest.raises(ChunkError):
        raw[...]
    with pytest.raises(ChunkError):
        raw.read_runs(np.array([6, 10]), 20, np.array([10, 0]), np.zeros(14, dtype=np.int32))
    np.testing.assert_array_equal(raw[:8], src[:8])  # other chunks still read
    np.testing.assert_array_equal(raw[16:], src[16:])


@pytest.mark.parametrize("where", ["requested", "not requested", "crc trailer"])
def test_flipped_byte_fails_checksum(tmp_path: Path, where: str) -> None:
    src = np.arange(1, 41, dtype=np.int64)
    raw = write_raw(tmp_path / "a", src, 10, crc=True)
    p = chunk_path(raw, 2)  # elements [20, 30)
    body = bytearray(p.read_bytes())
    assert len(body) == 10 * 8 + 4
    pos = {"requested": 3 * 8 + 1, "not requested": 9 * 8 + 2, "crc trailer": 81}[where]
    body[pos] ^= 0x10
    p.write_bytes(bytes(body))
    out = np.zeros(4, dtype=np.int64)
    with pytest.raises(ChunkError, match="checksum"):
        raw.read_runs(np.array([22, 24]), 26, np.array([2, 0]), out)  # bytes 16..48
    with pytest.raises(ChunkError, match="checksum"):
        raw.read_into(20, 21, np.zeros(1, dtype=np.int64))
    np.testing.assert_array_equal(raw[:20], src[:20])


def test_oversize_chunk_raises(tmp_path: Path) -> None:
    src = np.arange(1, 41, dtype=np.float32)
    raw = write_raw(tmp_path / "a", src, 10, crc=True)
    p = chunk_path(raw, 3)
    p.write_bytes(p.read_bytes() + b"\x00")
    with pytest.raises(ChunkError):
        raw[...]
    with pytest.raises(ChunkError):
        raw.read_runs(np.array([31]), 32, np.array([0]), np.zeros(1, dtype=np.float32))
    np.testing.assert_array_equal(raw[:30], src[:30])


# -- inside zarr v3 shard files ----------------------------------------------------------
def test_shard_files_hold_the_chunks_and_their_index_is_checked(tmp_path: Path) -> None:
    import pickle

    src = np.arange(1, 101, dtype=np.float32)
    raw = write_raw(tmp_path / "a", src, 10, crc=True, per_shard=4)  # 3 files: 4 + 4 + 2
    assert (raw.nchunks, raw.nchunks_initialized) == (3, 3)
    np.testing.assert_array_equal(raw[...], src)
    again = pickle.loads(pickle.dumps(raw))  # no lock or cached index travels
    np.testing.assert_array_equal(again[35:77], src[35:77])
    # a flipped byte in shard 1's index: its chunks are refused, the others still read
    p = chunk_path(raw, 1)
    body = bytearray(p.read_bytes())
    body[-10] ^= 0x01
    p.write_bytes(bytes(body))
    fresh = open_raw(tmp_path / "a")
    assert fresh is not None
    with pytest.raises(ChunkError, match="shard index checksum mismatch"):
        fresh[40:41]
    np.testing.assert_array_equal(fresh[:40], src[:40])
    np.testing.assert_array_equal(fresh[80:], src[80:])
    # a flipped byte in a chunk of shard 2: its checksum
    p2 = chunk_path(raw, 2)
    body = bytearray(p2.read_bytes())
    body[5] ^= 0x01
    p2.write_bytes(bytes(body))
    with pytest.raises(ChunkError, match="checksum mismatch"):
        open_raw(tmp_path / "a")[80:81]  # type: ignore[index]
    # a truncated shard file: its index no longer fits where it says
    p2.write_bytes(p2.read_bytes()[:30])
    with pytest.raises(ChunkError):
        open_raw(tmp_path / "a")[80:81]  # type: ignore[index]


def test_a_missing_shard_or_inner_chunk_is_damage_where_every_chunk_was_written(
        tmp_path: Path) -> None:
    src = np.arange(1, 41, dtype=np.int32)
    raw = write_raw(tmp_path / "a", src, 10, crc=True, per_shard=2)
    chunk_path(raw, 1).unlink()
    fresh = open_raw(tmp_path / "a")
    assert fresh is not None
    assert fresh.nchunks_initialized == 1
    np.testing.assert_array_equal(fresh[20:], np.zeros(20, np.int32))  # zarr: fill value
    fresh.require_chunks = True  # a collection's writer wrote every chunk
    with pytest.raises(ChunkError, match="is missing"):
        fresh[25:26]
    np.testing.assert_array_equal(fresh[:20], src[:20])


@pytest.mark.parametrize("shard_elems", [None, 1 << 12])
def test_a_sharded_collection_reads_the_same_through_the_fast_path(
        synthetic_h5ads: list[Path], tmp_path: Path, shard_elems: int | None) -> None:
    coll = create_anndata_collection(synthetic_h5ads, tmp_path / "s", seed=0, progress=False,
                                     n_obs_per_shard=1024, zarr_chunk_elems=1 << 10,
                                     zarr_shard_elems=shard_elems)
    el = coll.element(0, "X")
    assert el.can_scatter  # raw chunks read by rawzarr, sharded or not
    assert el.data.per_shard == (0 if shard_elems is None else 4)
    ref = create_anndata_collection(synthetic_h5ads, tmp_path / "ref", seed=0, progress=False,
                                    n_obs_per_shard=1024, compressor="lz4")
    kw: dict[str, Any] = dict(batch_size=128, seed=5, return_index=True, densify=True)
    for a, b in zip(AnnBatchDataset(coll, **kw), AnnBatchDataset(ref, **kw)):
        np.testing.assert_array_equal(a["index"].numpy(), b["index"].numpy())
        np.testing.assert_array_equal(a["X"].numpy(), b["X"].numpy())


# -- CSRElement.read_rows_scatter ---------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    n_rows=st.integers(1, 50),
    chunk=st.integers(1, 60),
    crc=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_csr_read_rows_scatter(n_rows: int, chunk: int, crc: bool, seed: int,
                               data: st.DataObject) -> None:
    rng = np.random.default_rng(seed)
    n_cols = 17
    m = sp.random(n_rows, n_cols, density=data.draw(st.sampled_from([0.0, 0.1, 0.5])),
                  format="csr", dtype=np.float32, random_state=rng)
    m.data += 1.0  # never 0 (the fill value)
    start = data.draw(st.integers(0, n_rows), label="start")
    stop = data.draw(st.integers(start, n_rows), label="stop")
    order = rng.permutation(stop - start)  # output row i is row start + order[i]
    lengths = np.diff(m.indptr[start : stop + 1])
    out_indptr = np.concatenate([[0], np.cumsum(lengths[order])])
    dests = np.empty(stop - start, dtype=np.int64)
    dests[order] = out_indptr[:-1]
    want = m[start:stop][order]
    nnz = int(lengths.sum())
    with tempfile.TemporaryDirectory() as tmp:
        # zarr refuses 0-length arrays' chunk shape 0: keep one element beyond nnz
        d = write_raw(Path(tmp) / "data", np.append(m.data, 9).astype(np.float32), chunk, crc)
        i = write_raw(Path(tmp) / "indices", np.append(m.indices, 0).astype(np.int32),
                      chunk, crc)
        elements = [
            CSRElement(d, i, m.indptr, m.shape),
            CSRElement(m.data, m.indices.astype(np.int32), m.indptr, m.shape),
        ]
        assert [el.can_scatter for el in elements] == [True, False]
        for el in elements:
            data_out = np.full(nnz, -1.0, dtype=np.float32)
            indices_out = np.full(nnz, -1, dtype=np.int32)
            el.read_rows_scatter(start, stop, data_out, indices_out, dests)
            np.testing.assert_array_equal(data_out, want.data)
            np.testing.assert_array_equal(indices_out, want.indices)
            np.testing.assert_array_equal(out_indptr, want.indptr)


# -- PoolReader.read(ranges, order) -------------------------------------------------------
FIELDS = ["X", "layers/counts", "obsm/X_pca", "obs/cell_type", "obs/n_counts"]
SOURCE_KINDS = ["raw", "lz4", "h5ad", "memory"]


@pytest.fixture(scope="module")
def pool_sources(
    synthetic_h5ads: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Each source with its whole content read in canonical order (the truth)."""
    folder = tmp_path_factory.mktemp("scatter_sources")
    opts = {"seed": 3, "n_obs_per_shard": 300, "zarr_chunk_elems": 1500, "progress": False}
    sources = {
        "raw": create_anndata_collection(synthetic_h5ads, folder / "raw", **opts),
        "lz4": create_anndata_collection(
            synthetic_h5ads, folder / "lz4", compressor="lz4", **opts
        ),
        "h5ad": open_source(list(synthetic_h5ads)),
        "memory": InPlaceSource([ad.read_h5ad(p) for p in synthetic_h5ads]),
    }
    out = {}
    for kind, src in sources.items():
        reader = PoolReader(src, FIELDS, threads=2)
        out[kind] = (src, reader.read(np.array([[0, src.n_obs]])))
        reader.close()
    return out


def test_pool_sources_scatter_where_expected(
    pool_sources: dict[str, tuple[Any, dict[str, Any]]],
) -> None:
    for kind, (src, _) in pool_sources.items():
        n_shards = len(src.shard_offsets) - 1
        assert n_shards >= 3
        can = [src.element(s, "X").can_scatter for s in range(n_shards)]
        # raw chunks, and Blosc-compressed ones in zarr shard files (read and decoded by
        # the raw reader): every shard scatters; zarr-python / h5py / memory: none
        assert all(can) if kind in ("raw", "lz4") else not any(can), kind
    # the raw and lz4 stores hold the same rows in the same order
    raw, lz4 = pool_sources["raw"][1], pool_sources["lz4"][1]
    for f in FIELDS:
        if sp.issparse(raw[f]):
            assert (raw[f] != lz4[f]).nnz == 0
        else:
            np.testing.assert_array_equal(raw[f], lz4[f])


def assert_same(got: Any, want: Any, field: str) -> None:
    assert type(got) is type(want) or (sp.issparse(got) and sp.issparse(want)), field
    assert got.shape == want.shape, field
    assert got.dtype == want.dtype, field
    if sp.issparse(want):
        got, want = got.tocsr(copy=True), want.tocsr(copy=True)
        got.sort_indices()
        want.sort_indices()
        np.testing.assert_array_equal(got.indptr, want.indptr, err_msg=field)
        np.testing.assert_array_equal(got.indices, want.indices, err_msg=field)
        np.testing.assert_array_equal(got.data, want.data, err_msg=field)
    else:
        np.testing.assert_array_equal(got, want, err_msg=field)


@st.composite
def pools(draw: st.DrawFn, n_obs: int) -> tuple[np.ndarray, np.ndarray]:
    ranges = []
    for _ in range(draw(st.integers(0, 5))):
        a = draw(st.integers(0, n_obs - 1))
        b = draw(st.integers(a, min(n_obs, a + 700)))  # may be empty, overlap, cross shards
        ranges.append((a, b))
    ranges_a = np.array(ranges, dtype=np.int64).reshape(-1, 2)
    n = int((ranges_a[:, 1] - ranges_a[:, 0]).sum())
    perm = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(n)
    if draw(st.booleans()):  # as the dataset lays pools out: batch after batch
        perm = pool_order(perm, draw(st.integers(1, 64)))
    return ranges_a, perm


@pytest.mark.parametrize("kind", SOURCE_KINDS)
def test_pool_read_with_order(
    pool_sources: dict[str, tuple[Any, dict[str, Any]]], kind: str
) -> None:
    src, full = pool_sources[kind]
    reader = PoolReader(src, FIELDS, threads=2)

    @settings(max_examples=25, deadline=None)
    @given(pools(src.n_obs))
    def check(case: tuple[np.ndarray, np.ndarray]) -> None:
        ranges, order = case
        rows = np.concatenate(
            [np.arange(a, b) for a, b in ranges] or [np.zeros(0, dtype=np.int64)]
        )
        canonical = reader.read(ranges)
        got = reader.read(ranges, order)
        assert set(got) == set(FIELDS)
        for f in FIELDS:
            assert_same(got[f], canonical[f][order], f)
            assert_same(got[f], full[f][rows[order]], f)

    try:
        check()
    finally:
        reader.close()


@pytest.mark.parametrize("kind", SOURCE_KINDS)
def test_pool_read_order_across_every_shard(
    pool_sources: dict[str, tuple[Any, dict[str, Any]]], kind: str
) -> None:
    """A whole-source pool, reversed, and ranges cut exactly at shard boundaries."""
    src, full = pool_sources[kind]
    offsets = src.shard_offsets
    ranges = np.stack([offsets[:-1], offsets[1:]], axis=1)[::-1].copy()
    rows = np.concatenate([np.arange(a, b) for a, b in ranges])
    order = np.arange(len(rows))[::-1].copy()
    reader = PoolReader(src, FIELDS, threads=3)
    try:
        got = reader.read(ranges, order)
    finally:
        reader.close()
    for f in FIELDS:
        assert_same(got[f], full[f][rows[order]], f)


def test_pool_read_order_validation(pool_sources: dict[str, tuple[Any, dict[str, Any]]]) -> None:
    src, _ = pool_sources["raw"]
    reader = PoolReader(src, ["X"])
    try:
        with pytest.raises(ValueError, match="order"):
            reader.read(np.array([[0, 10]]), np.arange(9))
        empty = reader.read(np.zeros((0, 2), dtype=np.int64), np.zeros(0, dtype=np.int64))
        assert empty["X"].shape == (0, src.n_vars)
    finally:
        reader.close()


# -- sampling.pool_order ----------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 300), batch_size=st.integers(1, 70), seed=st.integers(0, 2**32 - 1))
def test_pool_order(n: int, batch_size: int, seed: int) -> None:
    perm = np.random.default_rng(seed).permutation(n)
    out = pool_order(perm, batch_size)
    assert out.shape == perm.shape
    np.testing.assert_array_equal(np.sort(out), np.arange(n))  # a permutation of perm
    for b in range(0, n, batch_size):
        block = out[b : b + batch_size]
        assert (np.diff(block) > 0).all()  # sorted
        np.testing.assert_array_equal(block, np.sort(perm[b : b + batch_size]))


# -- damaged stores through the pool reader ------------------------------------------------
@pytest.fixture(scope="module")
def pristine_tiny_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_raw_store")
    paths = write_synthetic_h5ads(folder / "in", 2, [70, 50], 30, seed=5)
    out = folder / "store"
    create_anndata_collection(paths, out, n_obs_per_shard=40, zarr_chunk_elems=64,
                              zarr_shard_elems=0,  # one file per chunk: damage one chunk
                              progress=False)
    return out


@pytest.fixture
def tiny_raw_store(pristine_tiny_store: Path, tmp_path: Path) -> Path:
    """A private copy of a small raw collection (3 shards of 40 rows), free to damage."""
    return Path(shutil.copytree(pristine_tiny_store, tmp_path / "store"))


@pytest.mark.parametrize("bad", [30, 1000, -1])
@pytest.mark.parametrize("ordered", [False, True])
def test_damaged_column_index_raises_read_error(tiny_raw_store: Path, bad: int,
                                                ordered: bool) -> None:
    c = open_collection(tiny_raw_store)
    assert c.n_vars == 30
    indices = c.element(1, "X").indices
    assert isinstance(indices, RawZarrArray)
    assert indices.crc
    p = chunk_path(indices, 0)
    values = np.frombuffer(p.read_bytes()[:-4], dtype=indices.dtype).copy()
    values[5] = _stored(bad, indices.dtype)
    payload = values.tobytes()
    p.write_bytes(payload + google_crc32c.value(payload).to_bytes(4, "little"))
    c = open_collection(tiny_raw_store)
    n = c.n_obs
    order = np.random.default_rng(0).permutation(n) if ordered else None
    with pytest.raises(ReadError, match=r"field 'X'.*column index"):
        PoolReader(c, ["X", "obs/cell_type"]).read(np.array([[0, n]]), order)
    # rows outside the damaged chunk still read
    ok = PoolReader(c, ["X"]).read(np.array([[0, 40]]), np.arange(40)[::-1].copy())
    assert ok["X"].shape == (40, 30)


def test_corrupted_chunk_raises_read_error(tiny_raw_store: Path) -> None:
    c = open_collection(tiny_raw_store)
    data = c.element(0, "X").data
    assert isinstance(data, RawZarrArray)
    p = chunk_path(data, 0)
    body = bytearray(p.read_bytes())
    body[0] ^= 0xFF
    p.write_bytes(bytes(body))
    c = open_collection(tiny_raw_store)
    order = np.arange(c.n_obs)[::-1].copy()
    with pytest.raises(ReadError, match=r"'X'.*checksum"):
        PoolReader(c, ["X"]).read(np.array([[0, c.n_obs]]), order)


def _stored(value: int, dtype: np.dtype) -> Any:
    """``value`` as an array of ``dtype`` stores its bits (-1 in uint16 indices: 65535)."""
    return np.array(value, dtype=np.int64).astype(dtype)


def _damage_index(indices: RawZarrArray, pos: int, bad: int) -> None:
    """Set element ``pos`` of a raw indices array to ``bad``, with a valid CRC."""
    c, off = divmod(pos, indices.chunk_rows)
    p = chunk_path(indices, c)
    values = np.frombuffer(p.read_bytes()[:-4], dtype=indices.dtype).copy()
    values[off] = _stored(bad, indices.dtype)
    payload = values.tobytes()
    p.write_bytes(payload + google_crc32c.value(payload).to_bytes(4, "little"))


@pytest.fixture
def tiny_wide_store(pristine_tiny_store: Path, tmp_path: Path) -> Path:
    """The tiny collection's inputs written in the wide layout (float32 values, int32
    column indices: what pools hold, so rows may be read straight into place)."""
    out = tmp_path / "wide"
    create_anndata_collection(sorted((pristine_tiny_store.parent / "in").glob("*.h5ad")), out,
                              n_obs_per_shard=40, zarr_chunk_elems=64, zarr_shard_elems=0,
                              data_dtype="float32", index_dtype="int32", progress=False)
    return out


@pytest.mark.parametrize("fused", [True, False])
def test_column_indices_are_scanned_once_per_chunk_content(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, fused: bool
) -> None:
    """Read through the scratch and the compiled copy (``fused``), a pool's column indices
    are checked as they are copied: the pool is never scanned, unless one is outside (the
    scan then names it). Read straight into place, a pool whose indices chunks were all
    checked before (same CRC-32C) skips the scan; a chunk rewritten since (another CRC) is
    scanned again. Damage is caught either way."""
    import annbatch_torch.read.reader as reader_mod

    scans: list[int] = []

    def counting(indices: np.ndarray, n_cols: int) -> int | None:
        scans.append(len(indices))
        return bad_column(indices, n_cols)

    monkeypatch.setattr(reader_mod, "bad_column", counting)
    monkeypatch.setattr(reader_mod, "FUSED_SCATTER", fused)
    store = request.getfixturevalue("tiny_raw_store" if fused else "tiny_wide_store")
    c = open_collection(store)
    n = c.n_obs
    reader = PoolReader(c, ["X"])
    order = np.random.default_rng(1).permutation(n)
    first = reader.read(np.array([[0, n]]), order)["X"].toarray()
    stored = sp.vstack([ad.read_zarr(c.shard_path(k)).X for k in range(len(c.shard_sizes))])
    np.testing.assert_array_equal(first[np.argsort(order)], stored.toarray())
    assert len(scans) == (0 if fused else 1)
    again = reader.read(np.array([[0, n]]), order)["X"].toarray()
    np.testing.assert_array_equal(again, first)
    part = reader.read(np.array([[10, 75]]))["X"].toarray()  # chunks checked above
    np.testing.assert_array_equal(part, first[np.argsort(order)][10:75])
    assert len(scans) == (0 if fused else 1)
    indices = c.element(1, "X").indices
    _damage_index(indices, 3, 1000)  # same open collection: the chunk's CRC changes
    with pytest.raises(ReadError, match=r"column index 1000 outside \[0, 30\)"):
        reader.read(np.array([[0, n]]), order)
    assert len(scans) == (1 if fused else 2)


def test_damage_in_the_unread_part_of_a_chunk_is_caught(tiny_raw_store: Path) -> None:
    """Chunks are read (and checksummed) whole: the parts before and after the rows asked
    for are range-checked too, so a chunk recorded as checked really is."""
    c = open_collection(tiny_raw_store)
    el = c.element(1, "X")
    size = el.indices.chunk_rows
    r = next(r for r in range(1, el.n_rows) if el.indptr[r] % size
             and el.indptr[r] // size == el.indptr[r - 1] // size)
    end = int(el.indptr[r])  # rows [0, r) end inside a chunk
    _damage_index(el.indices, end, -7)  # the first value after them, same chunk
    c = open_collection(tiny_raw_store)
    off = int(c.shard_offsets[1])
    with pytest.raises(ReadError, match=rf"chunk holds {_stored(-7, el.indices.dtype)}, outside "
                       r"\[0, 30\) \(a column "
                       r"index out of range"):
        PoolReader(c, ["X"]).read(np.array([[off, off + r]]), np.arange(r)[::-1].copy())
    PoolReader(c, ["X"]).read(np.array([[0, off]]))  # other shards read fine


# -- disjoint runs (rows a sampler drew) and chunks verified once ------------------------
@st.composite
def disjoint_cases(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 150))
    chunk = draw(st.one_of(st.just(1), st.integers(2, 40), st.integers(n + 1, n + 10)))
    bounds = sorted(set(draw(st.lists(st.integers(0, n), min_size=2, max_size=24))))
    starts = np.array(bounds[:-1:2], dtype=np.int64)  # every other stretch is a gap
    ends = np.array(bounds[1::2], dtype=np.int64)
    k = min(len(starts), len(ends))
    starts, ends = starts[:k], ends[:k]
    perm = draw(st.permutations(range(k)))
    dests = np.empty(k, dtype=np.int64)
    pos = draw(st.integers(0, 3))
    for r in perm:
        dests[r] = pos
        pos += int(ends[r] - starts[r]) + draw(st.integers(0, 2))
    return {"n": n, "chunk": chunk, "starts": starts, "ends": ends, "dests": dests,
            "out_len": pos, "dtype": draw(st.sampled_from(DTYPES)), "crc": draw(st.booleans()),
            "seed": draw(st.integers(0, 2**32 - 1)),
            "per_shard": draw(st.one_of(st.none(), st.integers(1, 5)))}


@settings(max_examples=100, deadline=None)
@given(disjoint_cases())
def test_read_runs_of_disjoint_runs_matches_numpy_reference(case: dict[str, Any]) -> None:
    """The first read verifies whole chunks; the second reads the runs only: both equal
    numpy's, and nothing outside the destinations is written."""
    rng = np.random.default_rng(case["seed"])
    dtype = case["dtype"]
    src = source_values(rng, case["n"], dtype)
    ref = np.full(case["out_len"], sentinel(dtype), dtype=dtype)
    for s, e, d in zip(case["starts"].tolist(), case["ends"].tolist(), case["dests"].tolist()):
        ref[d : d + e - s] = src[s:e]
    with tempfile.TemporaryDirectory() as tmp:
        raw = write_raw(Path(tmp) / "a", src, case["chunk"], case["crc"],
                        per_shard=case["per_shard"])
        for trust in (False, True, True):
            out = np.full(case["out_len"], sentinel(dtype), dtype=dtype)
            raw.read_runs(case["starts"], 0, case["dests"], out, ends=case["ends"],
                          trust_verified=trust)
            np.testing.assert_array_equal(out, ref)
        if case["crc"] and case["per_shard"] and len(case["starts"]):
            assert raw._verified  # sharded chunks are remembered as verified


@settings(max_examples=60, deadline=None)
@given(disjoint_cases(), st.sampled_from(["uint8", "uint16", "int32"]))
def test_runs_cast_on_the_way_equal_the_runs_read_then_cast(case: dict[str, Any],
                                                             stored: str) -> None:
    """``plan_cast`` + ``read_cast`` (drawn rows of verified chunks, cast from the stored
    dtype by the compiled loop): the runs equal numpy's cast of them, nothing else is
    written; a chunk never verified gives no plan (it must be read whole and checked)."""
    if not native.pread_available():
        pytest.skip("no preadv2 here")
    rng = np.random.default_rng(case["seed"])
    # never 0, the fill value: zarr leaves chunks of fill values unwritten (absent chunks
    # are the per-chunk path's, which fills them; the writer writes every chunk)
    src = rng.integers(1, np.iinfo(stored).max, case["n"], endpoint=True).astype(stored)
    starts, ends, dests = case["starts"], case["ends"], case["dests"]
    for wide in ("float32", "int64"):
        ref = np.full(case["out_len"], -7, dtype=wide)
        for s, e, d in zip(starts.tolist(), ends.tolist(), dests.tolist()):
            ref[d : d + e - s] = src[s:e]
        with tempfile.TemporaryDirectory() as tmp:
            raw = write_raw(Path(tmp) / "a", src, case["chunk"], case["crc"],
                            per_shard=case["per_shard"] or 2)
            plan = raw.plan_cast(starts, ends, dests)
            if case["crc"] and len(starts):
                assert plan is None  # nothing verified yet
                raw.read_runs(starts, 0, dests, np.zeros(case["out_len"], stored), ends=ends,
                              trust_verified=True)
                plan = raw.plan_cast(starts, ends, dests)
            assert plan is not None
            out = np.full(case["out_len"], -7, dtype=wide)
            raw.read_cast(plan, out)
            np.testing.assert_array_equal(out, ref)


def test_a_cast_read_refused_at_every_segment_still_delivers_every_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not native.pread_available():
        pytest.skip("no preadv2 here")
    src = np.arange(1, 401, dtype=np.uint16)
    raw = write_raw(tmp_path / "a", src, 20, False, per_shard=5)
    starts, ends, dests = np.array([1, 15, 45, 100]), np.array([3, 17, 46, 130]), \
        np.array([0, 2, 4, 5])
    monkeypatch.setattr(rawzarr, "fast_flags", lambda _dev: 1 << 20)  # a flag every call refuses
    plan = raw.plan_cast(starts, ends, dests)
    assert plan is not None
    out = np.zeros(35, dtype=np.float32)
    raw.read_cast(plan, out)
    np.testing.assert_array_equal(out, np.concatenate([src[s:e] for s, e in zip(starts, ends)]))


def test_only_a_file_system_that_refused_rwf_nowait_loses_the_compiled_cast_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled cast read needs the page-cache first try: a refusal by another file
    system (a remote collection's cache in ``/dev/shm``) keeps it; one by the array's own
    file system gives the plain reads (the same values)."""
    if not native.pread_available():
        pytest.skip("no preadv2 here")
    src = np.arange(1, 401, dtype=np.uint16)
    raw = write_raw(tmp_path / "a", src, 20, False, per_shard=5)
    starts, ends, dests = np.array([1, 45]), np.array([3, 50]), np.array([0, 2])
    dev = os.stat(tmp_path / "a").st_dev
    with diskio.io_gate(diskio.CpuSlots(1)):
        monkeypatch.setattr(diskio, "_REFUSED_DEVICES", {dev + 1})
        assert raw.plan_cast(starts, ends, dests) is not None
        monkeypatch.setattr(diskio, "_REFUSED_DEVICES", {dev})
        assert raw.plan_cast(starts, ends, dests) is None
        out = np.zeros(7, dtype=src.dtype)
        raw.read_runs(starts, 0, dests, out, ends=ends)
    np.testing.assert_array_equal(out, np.concatenate([src[1:3], src[45:50]]))


@pytest.mark.parametrize("refused", [False, True])
@pytest.mark.parametrize("stored", ["uint16", "int32"])
def test_a_cast_read_checks_every_item_against_below(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: bool, stored: str) -> None:
    """Column indices read by the compiled cast loop are checked inside ``[0, below)`` on
    the way (so the pool needs no scan afterwards): one item out of range in the third
    run is a ChunkError naming the shard file, whether the loop read it or the gated read
    after a refusal; without it every run is delivered."""
    if not native.pread_available():
        pytest.skip("no preadv2 here")
    src = np.arange(1, 401).astype(stored)
    starts, ends, dests = np.array([1, 15, 45, 100]), np.array([3, 17, 50, 130]), \
        np.array([0, 2, 4, 9])
    if refused:
        monkeypatch.setattr(rawzarr, "fast_flags", lambda _dev: 1 << 20)  # every call refuses
    raw = write_raw(tmp_path / "ok", src, 20, False, per_shard=5)
    plan = raw.plan_cast(starts, ends, dests, below=400)
    assert plan is not None
    out = np.zeros(39, dtype=np.int32)
    raw.read_cast(plan, out)
    np.testing.assert_array_equal(out, np.concatenate([src[s:e] for s, e in zip(starts, ends)]))
    for bad in (400, -3) if stored == "int32" else (400, 65535):
        damaged = src.copy()
        damaged[47] = bad
        raw = write_raw(tmp_path / f"bad{bad}", damaged, 20, False, per_shard=5)
        plan = raw.plan_cast(starts, ends, dests, below=400)
        assert plan is not None
        at = 47 * np.dtype(stored).itemsize  # shard file c/0 holds chunks 0-4 in order
        with pytest.raises(ChunkError, match=rf"c/0: column index {bad} outside \[0, 400\) "
                                             rf"at byte {at} "):
            raw.read_cast(plan, np.zeros(39, dtype=np.int32))


def test_pread_widen_names_the_segment_holding_an_item_out_of_range(tmp_path: Path) -> None:
    """``pread_widen(below=)``: the segments before the bad one are copied and checked, the
    bad one is named; ``below`` is refused for items that are not integers."""
    if not native.pread_available():
        pytest.skip("no preadv2 here")
    values = np.array([5, 6, 7, 8, 9, 1, 2], dtype=np.uint16)
    path = tmp_path / "f"
    path.write_bytes(values.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        offsets, counts, dests = np.array([0, 10, 4]), np.array([2, 2, 3]), np.array([0, 2, 4])
        out = np.zeros(7, dtype=np.int32)
        scratch = np.zeros(3, dtype=np.uint16)
        assert native.pread_widen(fd, offsets, counts, out, dests, scratch, below=10) == 3
        np.testing.assert_array_equal(out, [5, 6, 1, 2, 7, 8, 9])
        out[:] = 0
        with pytest.raises(native.OutOfRange) as got:
            native.pread_widen(fd, offsets, counts, out, dests, scratch, below=9)
        assert got.value.segment == 2
        assert got.value.below == 9
        np.testing.assert_array_equal(out[:4], [5, 6, 1, 2])
        with pytest.raises(ValueError, match="integer items"):
            native.pread_widen(fd, offsets, counts, out.astype(np.float32), dests,
                               scratch.astype(np.float32), below=9)
    finally:
        os.close(fd)


def _sharded(tmp_path: Path, crc: bool = True) -> tuple[RawZarrArray, np.ndarray]:
    src = np.arange(1, 401, dtype=np.int32)
    return write_raw(tmp_path / "a", src, 20, crc, per_shard=5), src


def _flip_in_shard(raw: RawZarrArray, c: int, byte: int) -> None:
    """Flip byte ``byte`` of inner chunk ``c`` in its shard file (rewritten in place)."""
    path, base, _ = raw._locate(c)
    body = bytearray(Path(path).read_bytes())
    body[base + byte] ^= 0xFF
    Path(path).write_bytes(bytes(body))


def test_damage_between_the_runs_of_a_first_read_is_caught(tmp_path: Path) -> None:
    raw, _ = _sharded(tmp_path)
    _flip_in_shard(raw, 0, 4 * 10)  # element 10: between the runs asked for
    out = np.zeros(4, dtype=np.int32)
    with pytest.raises(ChunkError, match="checksum mismatch"):
        raw.read_runs(np.array([1, 15]), 0, np.array([0, 2]), out, ends=np.array([3, 17]),
                      trust_verified=True)


def test_a_shard_file_rewritten_after_its_chunks_were_verified_is_verified_again(
        tmp_path: Path) -> None:
    raw, src = _sharded(tmp_path)
    out = np.zeros(4, dtype=np.int32)
    kw = {"ends": np.array([3, 17]), "trust_verified": True}
    raw.read_runs(np.array([1, 15]), 0, np.array([0, 2]), out, **kw)
    np.testing.assert_array_equal(out, src[[1, 2, 15, 16]])
    assert 0 in raw._verified
    _flip_in_shard(raw, 0, 4 * 10)  # same process, same open array: the file changed
    with pytest.raises(ChunkError, match="checksum mismatch"):
        raw.read_runs(np.array([1, 15]), 0, np.array([0, 2]), out, **kw)


@pytest.mark.parametrize("how", ["read_runs", "read_cast"])
def test_a_shard_file_replaced_between_its_stat_and_its_read_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Verified chunks are trusted under their shard file's identity (inode, size, mtime);
    a file replaced after that identity was taken and before the compiled loop reads it
    (another process rewriting the collection) is a ChunkError, never unverified bytes."""
    if not native.pread_available():
        pytest.skip("no preadv2 here")
    raw, _ = _sharded(tmp_path)
    starts, ends, dests = np.array([1, 15]), np.array([3, 17]), np.array([0, 2])
    out = np.zeros(4, dtype=np.int32)
    raw.read_runs(starts, 0, dests, out, ends=ends, trust_verified=True)  # verified now
    path = Path(raw._locate(0)[0])
    real = rawzarr.RawZarrArray._identities

    def then_replaced(self: Any, files: list[int]) -> dict[int, tuple[int, int, int]]:
        idents = real(self, files)
        body = bytearray(path.read_bytes())
        body[4 * 1] ^= 0xFF  # element 1, read by the runs
        (path.parent / "new").write_bytes(bytes(body))
        os.replace(path.parent / "new", path)
        return idents

    if how == "read_cast":
        plan = raw.plan_cast(starts, ends, dests)
        assert plan is not None
        then_replaced(raw, [])
        with pytest.raises(ChunkError, match="replaced while it was read"):
            raw.read_cast(plan, np.zeros(4, dtype=np.int64))
    else:
        monkeypatch.setattr(rawzarr.RawZarrArray, "_identities", then_replaced)
        with pytest.raises(ChunkError, match="replaced while it was read"):
            raw.read_runs(starts, 0, dests, out, ends=ends, trust_verified=True)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-loop", "os.preadv"])
def test_verified_chunks_are_read_where_the_runs_fall_only(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           compiled: bool) -> None:
    """Once verified, a chunk is read where the runs fall: by the compiled loop of
    ``preadv2`` calls (store/native.py) where it runs, else by ``os.preadv``."""
    if compiled and not native.pread_available():
        pytest.skip("no preadv2 here (not Linux, or numba's JIT disabled)")
    if not compiled:
        monkeypatch.setattr(rawzarr, "pread_available", lambda: False)
    raw, src = _sharded(tmp_path)
    starts, ends = np.array([1, 15, 45]), np.array([3, 17, 46])
    out = np.zeros(5, dtype=np.int32)
    got = raw.read_runs(starts, 0, np.array([0, 2, 4]), out, ends=ends, trust_verified=True)
    assert sorted(got) == [0, 2]  # chunks 0 and 2 read whole and verified: their CRCs
    sizes: list[int] = []
    real, real_loop = os.preadv, rawzarr.pread_segments

    def counting(fd: int, bufs: list[Any], offset: int, *flags: int) -> int:
        sizes.append(sum(len(b) for b in bufs))
        return real(fd, bufs, offset, *flags)

    def counting_loop(fd: int, offsets: np.ndarray, lengths: np.ndarray, out: np.ndarray,
                      dests: np.ndarray, flags: int = 0, first: int = 0) -> int:
        done = real_loop(fd, offsets, lengths, out, dests, flags, first)
        sizes.extend(np.asarray(lengths)[first:done].tolist())
        return done

    monkeypatch.setattr(os, "preadv", counting)
    monkeypatch.setattr(rawzarr, "pread_segments", counting_loop)
    out[:] = 0
    got = raw.read_runs(starts, 0, np.array([0, 2, 4]), out, ends=ends, trust_verified=True)
    np.testing.assert_array_equal(out, src[[1, 2, 15, 16, 45]])
    assert sorted(sizes) == [4, 8, 8]  # the runs' bytes, no whole chunks
    assert got is None  # read without their checksum: the caller must check the values
    sizes.clear()
    raw.read_runs(starts, 0, np.array([0, 2, 4]), out, ends=ends)  # not trusted: whole again
    assert sorted(sizes) == [84, 84]  # each chunk whole, with its 4-byte CRC


@pytest.mark.skipif(not native.pread_available(), reason="no preadv2 here")
def test_pread_segments_reads_each_segment_and_stops_at_a_short_one(tmp_path: Path) -> None:
    body = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8)
    (tmp_path / "f").write_bytes(body.tobytes())
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        out = np.zeros(64, dtype=np.uint8)
        offsets, lengths = np.array([990, 0, 500]), np.array([10, 7, 20])
        dests = np.array([0, 40, 10])
        assert native.pread_segments(fd, offsets, lengths, out, dests) == 3
        for o, n, d in zip(offsets, lengths, dests):
            np.testing.assert_array_equal(out[d : d + n], body[o : o + n])
        assert not out[30:40].any()  # nothing else written
        assert not out[47:].any()
        # the second segment runs past the end of the file: the loop stops there
        assert native.pread_segments(fd, np.array([0, 995, 10]), np.array([4, 10, 4]), out,
                                     np.array([0, 4, 20])) == 1
        assert native.pread_segments(fd, np.array([0, 995, 10]), np.array([4, 10, 4]), out,
                                     np.array([0, 4, 20]), first=2) == 3
        np.testing.assert_array_equal(out[20:24], body[10:14])
        with pytest.raises(ValueError, match="outside the buffer"):
            native.pread_segments(fd, np.array([0]), np.array([8]), out, np.array([60]))
    finally:
        os.close(fd)


def test_no_compiled_loop_where_the_c_library_has_no_preadv2(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Calling the loop without ``preadv2`` would jump to a null address: the probe must
    say no before it ever calls it (macOS, old glibc)."""
    called: list[bool] = []
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_libc_has_preadv2", lambda: False)
    monkeypatch.setattr(native, "_pread_loop", lambda *a: called.append(True))
    assert native.pread_available() is False
    assert not called


@pytest.mark.parametrize("crc", [True, False])
def test_a_compiled_loop_refused_at_every_read_still_delivers_every_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crc: bool) -> None:
    """Each segment the loop does not read in full (``RWF_NOWAIT`` refused: not in the
    page cache) is read by the gated read, and the loop goes on after it."""
    raw, src = _sharded(tmp_path, crc=crc)
    starts, ends = np.array([1, 15, 45, 100]), np.array([3, 17, 46, 130])
    dests = np.array([0, 2, 4, 5])
    out = np.zeros(35, dtype=np.int32)
    raw.read_runs(starts, 0, dests, out, ends=ends, trust_verified=True)  # verified now
    monkeypatch.setattr(rawzarr, "fast_flags", lambda _dev: 1 << 20)  # a flag every call refuses
    out[:] = 0
    raw.read_runs(starts, 0, dests, out, ends=ends, trust_verified=True)
    np.testing.assert_array_equal(out, np.concatenate([src[s:e] for s, e in zip(starts, ends)]))


@pytest.mark.parametrize("kind", SOURCE_KINDS)
def test_pool_read_of_many_drawn_rows_with_repeats(
    pool_sources: dict[str, tuple[Any, dict[str, Any]]], kind: str
) -> None:
    """Rows as a sampler draws them: hundreds of single-row ranges (read by gather) and
    positions that repeat; read twice (the second time from verified chunks)."""
    src, full = pool_sources[kind]
    reader = PoolReader(src, FIELDS, threads=2)
    rng = np.random.default_rng(8)
    try:
        for _ in range(2):
            drawn = rng.integers(0, src.n_obs, 900)
            uniq, order = np.unique(drawn, return_inverse=True)
            assert len(uniq) >= GATHER_PIECES
            ranges = np.stack([uniq, uniq + 1], axis=1)
            got = reader.read(ranges, order, random_access=True)
            for f in FIELDS:
                assert_same(got[f], full[f][drawn], f)
    finally:
        reader.close()


def _damage_keeping_identity(raw: RawZarrArray, c: int, element: int, value: int) -> None:
    """Set element ``element`` of inner chunk ``c`` to ``value`` in place (its CRC now
    wrong), with the shard file's inode, size and mtime as they were: what silent damage on
    the medium looks like to a reader that verified the chunk before."""
    path, base, _ = raw._locate(c)
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(base + element * raw.dtype.itemsize)
        f.write(np.array([_stored(value, raw.dtype)], dtype=raw.dtype).tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns


@pytest.fixture
def sharded_store(synthetic_h5ads: list[Path], tmp_path: Path) -> Path:
    """A small raw collection in zarr v3 shard files of several inner chunks each."""
    store = tmp_path / "store"
    create_anndata_collection(synthetic_h5ads, store, seed=1, n_obs_per_shard=900,
                              zarr_chunk_elems=1 << 12, zarr_shard_elems=1 << 14,
                              progress=False)
    return store


@pytest.mark.parametrize("densify", [False, True])
def test_damage_after_verification_never_becomes_an_out_of_range_index(
        sharded_store: Path, densify: bool) -> None:
    """Drawn rows of a chunk verified before are read without its checksum, but their
    column indices are still checked: a damaged index is a ReadError (not a crash, not a
    value written into another row)."""
    import annbatch_torch as abt

    coll = open_collection(sharded_store)
    n = coll.n_obs
    ds = AnnBatchDataset(coll, batch_size=64, chunk_size=64, preload_nchunks=4,
                         densify=densify, sampler=abt.SubsetSampler(np.arange(n)))
    assert sum(len(b["X"]) for b in ds) == n  # every chunk verified in this process
    el = ds._stream.reader.source.element(0, "X")
    indices = el.indices
    assert indices._verified
    # the pool read ahead for the next epoch must not be reading while the file is damaged:
    # it would meet the write's passing mtime, and a file changed under a reader is never
    # trusted again (its chunks verified anew: a checksum error, not this index check)
    ds._stream.drop_read_ahead(wait=True)
    _damage_keeping_identity(indices, 1, 5, 10**6)
    row = int(np.searchsorted(el.indptr, indices.chunk_rows + 5, side="right")) - 1
    ds.set_epoch(1)
    with pytest.raises(ReadError, match=rf"column index {_stored(10**6, indices.dtype)} "
                                        r"outside \[0, 200\)") as got:
        for _ in ds:
            pass
    # the rows it names hold the damaged index (the job's span, the row itself)
    span = re.search(r"shard rows \[(\d+), (\d+)\) \(shard 0\)", str(got.value))
    assert span is not None, got.value
    assert int(span[1]) <= row < int(span[2])
    if native.pread_available():  # the compiled loop's check (else the pool's scan)
        assert f"in row {row} of this shard" in str(got.value)


def test_chunked_pools_of_many_pieces_still_verify_every_chunk(sharded_store: Path) -> None:
    """Chunked mode reads whole chunks and checks their CRC on every read, whatever the
    number of pieces in a pool (here 135 chunks of 4 rows)."""
    coll = open_collection(sharded_store)
    ds = AnnBatchDataset(coll, batch_size=540, chunk_size=4, preload_nchunks=135)
    for _ in ds:
        pass
    data = ds._stream.reader.source.element(0, "X").data
    ds._stream.drop_read_ahead(wait=True)  # (a pool read before the damage: see above)
    _damage_keeping_identity(data, 0, 3, 7)
    ds.set_epoch(1)
    with pytest.raises(ReadError, match="checksum mismatch"):
        for _ in ds:
            pass


def test_covering_reads_of_drawn_rows_span_a_bounded_number_of_bytes(
        pool_sources: dict[str, tuple[Any, dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drawn rows of a dense field are read by covering reads that bridge gaps of at most
    GATHER_GAP_BYTES: few rows of a wide field, many of a narrow obs column."""
    import annbatch_torch.read.reader as reader_mod

    src, full = pool_sources["raw"]
    spans: dict[str, list[int]] = {"obsm/X_pca": [], "obs/n_counts": []}
    real = reader_mod.PoolReader._read_cover

    def recording(self: Any, el: Any, pieces: list[Any]) -> list[Any]:
        spans[el.name].append(max(p.stop for p in pieces) - pieces[0].start)
        return real(self, el, pieces)

    width = full["obsm/X_pca"].shape[1] * full["obsm/X_pca"].dtype.itemsize
    monkeypatch.setattr(reader_mod.PoolReader, "_read_cover", recording)
    monkeypatch.setattr(reader_mod, "GATHER_GAP_BYTES", 5 * width)  # 5 rows of X_pca
    rows = np.arange(0, src.n_obs, 10)  # a drawn row every 10 rows
    reader = PoolReader(src, list(spans), threads=1)
    try:
        got = reader.read(np.stack([rows, rows + 1], axis=1), random_access=True)
    finally:
        reader.close()
    for f in spans:
        assert_same(got[f], full[f][rows], f)
    assert max(spans["obsm/X_pca"]) == 1  # gaps of 9 rows of X_pca exceed the budget
    assert max(spans["obs/n_counts"]) > 10  # a narrow column's gaps are bridged


@pytest.mark.parametrize("encoding", [("default", "/"), ("default", "."), ("v2", "."),
                                      ("v2", "/")])
def test_chunk_key_encodings_name_the_files_zarr_wrote(tmp_path: Path,
                                                       encoding: tuple[str, str]) -> None:
    """Every chunk key encoding zarr v3 writes (default or v2 keys, either separator) is
    read at the files zarr wrote: a raw array's values, a raw string array's items and a
    group's chunk file count (chunks absent would read as fill values, or count short)."""
    from annbatch_torch.store.groups import open_fast_group
    from annbatch_torch.store.rawstrings import open_raw_strings

    name, sep = encoding
    enc = {"name": name, "separator": sep}
    root = zarr.open_group(str(tmp_path / "g"), mode="w", zarr_format=3)
    values = np.arange(50, dtype=np.float32).reshape(25, 2) + 1
    root.create_array("m", shape=values.shape, chunks=(4, 2), dtype=np.float32,
                      compressors=[Crc32cCodec()], chunk_key_encoding=enc, fill_value=0)[:] = values
    names = [f"cell{i}" for i in range(11)]
    root.create_array("s", shape=(11,), chunks=(3,), dtype=str, compressors=[Crc32cCodec()],
                      chunk_key_encoding=enc)[:] = np.array(names, dtype=object)
    root.create_array("z", shape=(9,), chunks=(2,), dtype=np.int64, chunk_key_encoding=enc,
                      compressors=[zarr.codecs.ZstdCodec()])[:] = np.arange(9) + 1
    raw = open_raw(tmp_path / "g" / "m")
    assert raw is not None
    np.testing.assert_array_equal(raw[...], values)
    strings = open_raw_strings(tmp_path / "g" / "s")
    assert strings is not None
    assert [str(x) for x in strings[np.arange(11)]] == names
    assert open_fast_group(tmp_path / "g").chunk_files("z") == (5, 5)


def test_an_unknown_chunk_key_encoding_is_left_to_zarr(tmp_path: Path) -> None:
    raw = write_raw(tmp_path / "a", np.arange(10, dtype=np.float32), 4, True)
    meta_path = tmp_path / "a" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    assert raw is not None
    assert rawzarr.chunk_key_layout(meta) == ("c/", "/")
    for enc in ({"name": "future"}, {"name": "default", "configuration": {"separator": "-"}},
                "default"):
        meta["chunk_key_encoding"] = enc
        meta_path.write_text(json.dumps(meta))
        assert open_raw(tmp_path / "a") is None, enc


def test_loops_without_a_cache_folder_are_compiled_and_said_so_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Where numba finds no writable cache folder (a read-only install, no home), a loop
    is compiled in each process instead, works, is known as uncached, and an INFO line
    (importing prints nothing) says so once with the fix (NUMBA_CACHE_DIR)."""
    import numba

    from annbatch_torch.store import native

    real = numba.njit

    def njit(*args: Any, **kw: Any) -> Any:
        if kw.get("cache"):
            raise RuntimeError("cannot cache function: no locator available")
        return real(*args, **kw)

    monkeypatch.setattr(numba, "njit", njit)
    monkeypatch.setattr(native, "_UNCACHED", [])
    caplog.set_level("INFO", logger="annbatch_torch")

    def twice(x):  # type: ignore[no-untyped-def]
        return 2 * x

    def thrice(x):  # type: ignore[no-untyped-def]
        return 3 * x

    a, b = native.compiled(twice), native.compiled(thrice)
    assert (a(4), b(4)) == (8, 12)
    assert not native.is_cached(a)
    said = [r.getMessage() for r in caplog.records if "NUMBA_CACHE_DIR" in r.getMessage()]
    assert len(said) == 1
    assert all(r.levelname == "INFO" for r in caplog.records)
