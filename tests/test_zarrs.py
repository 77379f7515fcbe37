"""The zarrs codec pipeline for compressed stores: same values, fork-safe, opt-out.

The lz4 collection here uses 1,024-element chunks so that every read spans several
chunks: zarrs decodes a single chunk inline, and only multi-chunk reads reach the rayon
pool that a forked child must not use (a fork-unsafe setup hangs there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp
import torch
import zarr
from conftest import run_python
from torch.utils.data import DataLoader

import annbatch_torch as abt
from annbatch_torch import Collection
from annbatch_torch.convert import batch_dict_converter
from annbatch_torch.store import zarrs as _zarrs
from annbatch_torch.store.collection import open_collection
from annbatch_torch.store.inputs.inplace import InPlaceSource
from annbatch_torch.store.source import Source
from annbatch_torch.write.writer import create_anndata_collection

needs_zarrs = pytest.mark.skipif(not _zarrs.zarrs_available(), reason="zarrs not installed")


@pytest.fixture(scope="module")
def lz4_collection(
    synthetic_h5ads: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    out = tmp_path_factory.mktemp("zarrs") / "lz4"
    create_anndata_collection(
        synthetic_h5ads, out, seed=0, n_obs_per_shard=1024, compressor="lz4",
        zarr_shard_elems=0,  # one file per chunk (tests damage single chunk files)
        zarr_chunk_elems=1024, progress=False,
    )
    return out


@pytest.fixture(autouse=True)
def _restore_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    # set_codec_pipeline writes the variable; monkeypatch puts the old value back
    monkeypatch.setenv(_zarrs.ENV_VAR, "auto")


def _pipeline_name(source: Source, field: str = "X") -> str:
    arr = source.element(0, field).data  # type: ignore[attr-defined]
    arr = getattr(arr, "values", arr)  # in place, values are read through the finite check
    return type(arr._async_array.codec_pipeline).__name__


def _read_all(source: Source) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for field in source.fields:
        for shard, n in enumerate(source.shard_sizes):
            out.setdefault(field, []).append(source.element(shard, field).read(0, n))
    source.close()
    return out


def _assert_same(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> None:
    assert a.keys() == b.keys()
    for field in a:
        for x, y in zip(a[field], b[field], strict=True):
            if sp.issparse(x):
                for attr in ("data", "indices", "indptr"):
                    np.testing.assert_array_equal(getattr(x, attr), getattr(y, attr), field)
            else:
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), field)


@needs_zarrs
def test_values_equal_zarr_python(lz4_collection: Path) -> None:
    abt.set_codec_pipeline("zarr")
    plain = open_collection(lz4_collection)
    assert _pipeline_name(plain) == "BatchedCodecPipeline"
    want = _read_all(plain)

    abt.set_codec_pipeline("zarrs")
    fast = open_collection(lz4_collection)
    assert _pipeline_name(fast) == "ZarrsReadPipeline"
    _assert_same(want, _read_all(fast))
    # the switch is scoped to annbatch_torch's reads: zarr's global config is untouched
    assert zarr.config.get("codec_pipeline.path") == (
        "zarr.core.codec_pipeline.BatchedCodecPipeline"
    )


@needs_zarrs
@pytest.mark.filterwarnings("ignore:Writing zarr v2 data:UserWarning")
def test_inplace_zarr_store_values(synthetic_h5ads: list[Path], tmp_path: Path) -> None:
    store = tmp_path / "in.zarr"
    ad.read_h5ad(synthetic_h5ads[0]).write_zarr(store)
    abt.set_codec_pipeline("zarr")
    want = _read_all(InPlaceSource([store]))
    abt.set_codec_pipeline("zarrs")
    src = InPlaceSource([store])
    assert _pipeline_name(src) == "ZarrsReadPipeline"
    _assert_same(want, _read_all(src))


@needs_zarrs
@pytest.mark.parametrize("where", ["checksum", "middle"])
def test_checksummed_arrays_are_validated_on_every_read(tmp_path: Path, where: str) -> None:
    """zarrs skips crc32c when it decodes part of a chunk: row slices of checksummed arrays
    are read in whole chunks (ChunkAligned: zarrs validates those) and any other part of a
    chunk goes to zarr-python, which validates it."""
    from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec

    root = zarr.open_group(tmp_path / "g.zarr", mode="w")
    for name, codecs in (("crc", [BloscCodec(cname="lz4"), Crc32cCodec()]),
                         ("plain", [BloscCodec(cname="lz4")])):
        arr = root.create_array(name, shape=(1000,), chunks=(100,), dtype="float32",
                                serializer=BytesCodec(), compressors=codecs)
        arr[:] = np.arange(1000, dtype=np.float32)
    abt.set_codec_pipeline("zarrs")
    group = _zarrs.read_group(zarr.open_group(tmp_path / "g.zarr", mode="r"))
    crc = group["crc"]
    assert isinstance(crc, _zarrs.ChunkAligned)
    assert crc._array._async_array.codec_pipeline.impl is not None  # zarrs decodes it
    assert not isinstance(group["plain"], _zarrs.ChunkAligned)
    for lo, hi in ((10, 20), (95, 310), (0, 1000), (990, 1000), (5, 5)):
        np.testing.assert_array_equal(crc[lo:hi], np.arange(lo, hi, dtype=np.float32))
    np.testing.assert_array_equal(crc[...], np.arange(1000, dtype=np.float32))
    assert crc.shape == (1000,)
    chunk = tmp_path / "g.zarr" / "crc" / "c" / "0"
    raw = bytearray(chunk.read_bytes())
    at = len(raw) - 4 if where == "checksum" else len(raw) // 2
    for i in range(4):
        raw[at + i] ^= 0x55
    chunk.write_bytes(bytes(raw))
    with pytest.raises((ValueError, RuntimeError), match="checksum"):
        crc[10:20]  # a part of the damaged chunk, read whole by zarrs
    with pytest.raises(ValueError, match="checksum"):
        crc._array[10:20]  # a part read directly: zarr-python validates it
    np.testing.assert_array_equal(crc[100:200], np.arange(100, 200, dtype=np.float32))


@needs_zarrs
@pytest.mark.parametrize("pipeline", ["zarrs", "zarr"])
def test_a_damaged_lz4_chunk_is_an_error_not_wrong_values(
        lz4_collection: Path, tmp_path: Path, pipeline: str) -> None:
    """The writer follows Blosc with a CRC-32C (Blosc does not verify its payload: flipped
    bytes in the middle of a chunk used to decode to wrong numbers without an error)."""
    import shutil

    from annbatch_torch.errors import ReadError

    store = Path(shutil.copytree(lz4_collection, tmp_path / "lz4"))
    meta = zarr.open_array(store / "shard_00000.zarr" / "X" / "data", mode="r").metadata
    assert [c.to_dict()["name"] for c in meta.codecs][-2:] == ["blosc", "crc32c"]
    chunk = store / "shard_00000.zarr" / "X" / "data" / "c" / "1"
    raw = bytearray(chunk.read_bytes())
    for i in range(4):
        raw[len(raw) // 2 + i] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    abt.set_codec_pipeline(pipeline)
    ds = abt.AnnBatchDataset(store, batch_size=256, chunk_size=64, shuffle=False)
    with pytest.raises(ReadError, match=r"shard_00000\.zarr: failed reading field 'X'.*checksum"):
        for _ in ds:
            pass


def _probe_converter(batch: dict[str, Any]) -> dict[str, Any]:
    out = batch_dict_converter(batch)
    out["zarrs_serial"] = torch.tensor(_zarrs._serial_here())
    out["pid"] = torch.tensor(os.getpid())
    return out


def _dataset(path: Any) -> abt.AnnBatchDataset:
    # small pools (256 rows) so both workers get several
    return abt.AnnBatchDataset(path, batch_size=128, chunk_size=64, preload_nchunks=4,
                               return_index=True, batch_converter=_probe_converter)


def _epoch(ds: abt.AnnBatchDataset, loader: Any) -> tuple[dict[int, float], set[bool], set[int]]:
    sums: dict[int, float] = {}
    serial: set[bool] = set()
    pids: set[int] = set()
    for b in loader:
        x = b["X"].to_dense().double().sum(1).numpy()
        for i, s in zip(b["index"].tolist(), x, strict=True):
            assert i not in sums, f"row {i} delivered twice"
            sums[i] = float(s)
        serial.add(bool(b["zarrs_serial"]))
        pids.add(int(b["pid"]))
    assert sorted(sums) == list(range(ds.source.n_obs)), "rows missing"
    return sums, serial, pids


@needs_zarrs
def test_fork_workers_after_parent_read(lz4_collection: Path) -> None:
    abt.set_codec_pipeline("auto")
    ds = _dataset(lz4_collection)
    want, serial, _ = _epoch(ds, ds)  # the parent reads through zarrs first
    assert serial == {False}
    assert _zarrs._pool_pid == os.getpid()
    assert _pipeline_name(ds.source) == "ZarrsReadPipeline"

    # fork (the Linux default), persistent workers, two epochs; a hang fails by timeout
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork",
                        persistent_workers=True, timeout=30)
    for epoch in range(2):
        ds.set_epoch(epoch)
        got, serial, pids = _epoch(ds, loader)
        assert serial == {True}  # workers forked after zarrs ran: serial decode
        assert len(pids) == 2
        assert os.getpid() not in pids
        assert got == want
    del loader


_CLEAN_PARENT = """
import sys
from annbatch_torch.store import zarrs as _zarrs
from torch.utils.data import DataLoader
sys.path.insert(0, sys.argv[2])
from test_zarrs import _dataset, _epoch

ds = _dataset(sys.argv[1])
loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork",
                    timeout=30)
_, serial, _ = _epoch(ds, loader)
assert _zarrs._pool_pid is None, "the parent built a zarrs pipeline"
assert serial == {False}, serial
print("ok")
"""


@needs_zarrs
def test_fork_workers_of_clean_parent_run_parallel(lz4_collection: Path) -> None:
    # a parent that never built a zarrs pipeline (a fresh interpreter: this one has):
    # its fork workers own their rayon pools and decode in parallel
    res = subprocess.run(
        [sys.executable, "-c", _CLEAN_PARENT, str(lz4_collection), str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, _zarrs.ENV_VAR: "auto"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")


def test_opt_out(lz4_collection: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("0", "false", "off"):
        monkeypatch.setenv(_zarrs.ENV_VAR, value)
        assert _zarrs.ensure_codec_pipeline() is None
    coll = open_collection(lz4_collection)
    assert _pipeline_name(coll) == "BatchedCodecPipeline"
    abt.set_codec_pipeline("zarr")
    assert os.environ[_zarrs.ENV_VAR] == "0"
    assert _zarrs.ensure_codec_pipeline() is None
    with pytest.raises(ValueError, match="'auto', 'zarrs' or 'zarr'"):
        abt.set_codec_pipeline("rust")  # type: ignore[arg-type]
    if _zarrs.zarrs_available():
        abt.set_codec_pipeline("auto")
        assert _zarrs.ensure_codec_pipeline() == _zarrs.PIPELINE_PATH
        monkeypatch.setenv(_zarrs.ENV_VAR, "1")
        assert _zarrs.ensure_codec_pipeline() == _zarrs.PIPELINE_PATH
    else:
        with pytest.raises(ImportError):
            abt.set_codec_pipeline("zarrs")
        abt.set_codec_pipeline("auto")
        assert _zarrs.ensure_codec_pipeline() is None


@needs_zarrs  # without it, the code before this change imported neither either
def test_reading_a_raw_collection_imports_neither_zarr_nor_zarrs(
        small_collection: Collection, tmp_path: Path) -> None:
    """Raw arrays are read without zarr: the read pipeline is chosen only when zarr opens
    an array, so a process (a DataLoader worker) reading a raw collection never imports
    zarr or zarrs. In a fresh process: this one has imported both."""
    out = run_python(f"""
import sys
import annbatch_torch as abt
ds = abt.AnnBatchDataset({str(small_collection.path)!r}, batch_size=256, return_index=True,
                         selector={{"x": "X", "y": "obs/cell_type", "c": "layers/counts"}})
rows = sorted(i for b in ds for i in b["index"].tolist())
print(rows == list(range({small_collection.n_obs})), "zarr" in sys.modules,
      "zarrs" in sys.modules)
""", tmp_path)
    assert out.split() == ["True", "False", "False"], out
