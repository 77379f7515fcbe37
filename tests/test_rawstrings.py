"""Names read by position from a zarr v3 string array's raw vlen-utf8 chunks
(``store/rawstrings.py``): what a collection's ``obs_names_at`` reads.

The items must equal zarr's own reading of the array (any text, empty strings, an edge
chunk, with and without a CRC-32C), a damaged chunk must raise naming the file, and the
names kept between calls must be the chunks' bytes, not a str object per cell.
"""

from __future__ import annotations

import json
import re
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from zarr.codecs import Crc32cCodec

from annbatch_torch.errors import CollectionError
from annbatch_torch.store.collection import Collection, open_collection
from annbatch_torch.store.rawstrings import RawStringArray, open_raw_strings
from annbatch_torch.store.rawzarr import ChunkError


def _write(path: Path, names: list[str], chunk: int, crc: bool = True) -> RawStringArray:
    arr = zarr.create_array(str(path), shape=(len(names),), chunks=(chunk,), dtype=str,
                            compressors=[Crc32cCodec()] if crc else None, overwrite=True)
    arr[:] = np.array(names, dtype=object)
    raw = open_raw_strings(path)
    assert raw is not None
    return raw


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)


@settings(max_examples=40, deadline=None)
@given(names=st.lists(_text, min_size=1, max_size=60), chunk=st.integers(1, 17),
       crc=st.booleans(), data=st.data())
def test_items_equal_zarrs_reading(tmp_path_factory: pytest.TempPathFactory,
                                   names: list[str], chunk: int, crc: bool,
                                   data: st.DataObject) -> None:
    path = tmp_path_factory.mktemp("s") / "a.zarr"
    raw = _write(path, names, chunk, crc)
    expected = np.asarray(zarr.open_array(str(path), mode="r")[:], dtype=object)
    assert list(expected) == names
    positions = data.draw(st.lists(st.integers(0, len(names) - 1), max_size=80))
    got = raw[np.array(positions, dtype=np.int64)]
    assert got.dtype == object
    assert list(got) == [names[p] for p in positions]
    assert list(raw[...]) == names  # every item: whole chunks decoded at once


def test_few_and_many_items_of_a_chunk_agree(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A few items are decoded one by one from the scanned places, most of a chunk at once:
    both give the same names (one chunk of 1000, names of 1 to 30 bytes, some non-ASCII)."""
    from annbatch_torch.store import rawstrings

    monkeypatch.setattr(rawstrings, "_SCAN_FROM_CHUNKS", 0)  # the scan, whatever ran before
    rng = np.random.default_rng(0)
    names = ["é" * int(k) + f"c{i}" for i, k in enumerate(rng.integers(0, 14, 1000))]
    raw = _write(tmp_path / "a.zarr", names, 1000)
    few = rng.choice(1000, 7, replace=False)
    assert list(raw[few]) == [names[i] for i in few]
    many = rng.permutation(1000)[:900]
    assert list(raw[many]) == [names[i] for i in many]


def test_positions_outside_the_array_are_refused(tmp_path: Path) -> None:
    raw = _write(tmp_path / "a.zarr", ["a", "b"], 1)
    with pytest.raises(IndexError, match=r"outside \[0, 2\)"):
        raw[np.array([2])]


def test_other_codecs_are_left_to_zarr(tmp_path: Path) -> None:
    arr = zarr.create_array(str(tmp_path / "z.zarr"), shape=(3,), chunks=(2,), dtype=str)
    arr[:] = np.array(["a", "b", "c"], dtype=object)  # zarr's default: zstd
    assert open_raw_strings(tmp_path / "z.zarr") is None
    num = zarr.create_array(str(tmp_path / "n.zarr"), shape=(3,), chunks=(2,), dtype="i4")
    num[:] = 1
    assert open_raw_strings(tmp_path / "n.zarr") is None
    assert open_raw_strings(tmp_path / "absent.zarr") is None


@pytest.mark.parametrize("where", ["text", "crc"])
def test_a_corrupted_chunk_raises_naming_the_file(tmp_path: Path, where: str) -> None:
    raw = _write(tmp_path / "a.zarr", [f"cell{i}" for i in range(10)], 4)
    chunk = tmp_path / "a.zarr" / "c" / "1"
    body = bytearray(chunk.read_bytes())
    body[-1 if where == "crc" else 10] ^= 0xFF
    chunk.write_bytes(bytes(body))
    with pytest.raises(ChunkError, match=re.escape(str(chunk)) + ".*checksum mismatch"):
        raw[np.array([5])]
    assert list(raw[np.array([0, 9])]) == ["cell0", "cell9"]  # the other chunks are intact


@pytest.mark.parametrize("scan", [True, False])
def test_a_length_running_past_the_chunk_raises(tmp_path: Path, scan: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a CRC, a damaged item length is found by the scan of the items' places, or
    by numcodecs where the chunk is decoded whole (before numba's start, few chunks)."""
    from annbatch_torch.store import rawstrings

    monkeypatch.setattr(rawstrings, "_SCAN_FROM_CHUNKS", 0 if scan else 10**9)
    monkeypatch.setattr(rawstrings, "_unscanned", 0)
    if not scan:
        monkeypatch.setattr(rawstrings, "_vlen_bounds", rawstrings._vlen_bounds_py)
    raw = _write(tmp_path / "a.zarr", [f"cell{i}" for i in range(8)], 8, crc=False)
    chunk = tmp_path / "a.zarr" / "c" / "0"
    body = bytearray(chunk.read_bytes())
    body[4 + 4 + 5 + 2] = 0xFF  # item 1's length: now far past the chunk's end
    chunk.write_bytes(bytes(body))
    what = "item 1 of 8 runs past" if scan else "does not decode"
    with pytest.raises(ChunkError, match=re.escape(str(chunk)) + f".*{what}"):
        raw[np.array([0])]


def test_numbas_start_is_paid_only_for_many_chunks(tmp_path: Path) -> None:
    """In a fresh process, names from a few chunks are decoded whole (no compiled scan:
    numba's start costs more than decoding them); after 16 chunks so decoded, in one call or
    over several, the scan is loaded."""
    from conftest import run_python

    names = [f"c{i}" for i in range(400)]
    _write(tmp_path / "a.zarr", names, 10)
    code = (
        "import numpy as np\n"
        "from annbatch_torch.store import rawstrings as r\n"
        f"a = r.open_raw_strings({str(tmp_path / 'a.zarr')!r})\n"
        "print(list(a[np.array([1, 25, 12])]), bool(r._vlen_bounds.overloads))\n"
        "print(list(a[np.arange(0, 400, 10)])[-1], bool(r._vlen_bounds.overloads))\n"
    )
    few, many = run_python(code, tmp_path).strip().splitlines()
    assert few == "['c1', 'c25', 'c12'] False"
    assert many == "c390 True"


def test_bytes_after_the_items_are_left_alone_as_zarr_does(tmp_path: Path) -> None:
    """Few items asked or most of the chunk: the same answer, zarr's."""
    names = [f"cell{i}" for i in range(8)]
    raw = _write(tmp_path / "a.zarr", names, 8, crc=False)
    chunk = tmp_path / "a.zarr" / "c" / "0"
    chunk.write_bytes(chunk.read_bytes() + b"\x00" * 8)
    assert list(zarr.open_array(str(tmp_path / "a.zarr"), mode="r")[:]) == names
    assert list(raw[np.array([3])]) == ["cell3"]
    assert list(raw[...]) == names


@pytest.mark.parametrize(("count", "what"), [(5, "holds 5 items, expected 8"),
                                             (None, "holds 2 bytes, too few")])
def test_a_chunk_of_the_wrong_size_is_refused(tmp_path: Path, count: int | None,
                                              what: str) -> None:
    """An item count other than the chunk's (zarr writes edge chunks whole) or a chunk too
    short to hold one."""
    raw = _write(tmp_path / "a.zarr", [f"cell{i}" for i in range(10)], 8, crc=False)
    chunk = tmp_path / "a.zarr" / "c" / "1"
    body = chunk.read_bytes()
    chunk.write_bytes(body[:2] if count is None else count.to_bytes(4, "little") + body[4:])
    with pytest.raises(ChunkError, match=re.escape(str(chunk)) + f".*{what}"):
        raw[np.array([9])]


def test_without_numbas_jit_whole_chunks_are_decoded(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan of items' places would run in Python: a whole chunk is decoded instead."""
    import numba

    names = [f"cell{i}" for i in range(100)]
    raw = _write(tmp_path / "a.zarr", names, 50)
    monkeypatch.setattr(numba.config, "DISABLE_JIT", True)
    assert list(raw[np.array([7, 93, 7])]) == ["cell7", "cell93", "cell7"]
    assert all(ch is None or ch.bounds is None for ch in raw._chunks.values())


def test_metadata_zarr_does_not_write_is_left_to_zarr(tmp_path: Path) -> None:
    _write(tmp_path / "a.zarr", ["a"], 1)
    meta = json.loads((tmp_path / "a.zarr" / "zarr.json").read_text())
    for bad in ({"codecs": ["vlen-utf8"]}, {"chunk_key_encoding": 3},
                {"chunk_grid": {"name": "regular"}}, {"shape": "x"}):
        (tmp_path / "a.zarr" / "zarr.json").write_text(json.dumps({**meta, **bad}))
        assert open_raw_strings(tmp_path / "a.zarr") is None, bad


def test_a_missing_chunk_is_the_fill_value_unless_required(tmp_path: Path) -> None:
    raw = _write(tmp_path / "a.zarr", [f"cell{i}" for i in range(8)], 4)
    (tmp_path / "a.zarr" / "c" / "1").unlink()
    assert list(raw[np.array([0, 5])]) == ["cell0", ""]
    required = open_raw_strings(tmp_path / "a.zarr")
    assert required is not None
    required.require_chunks = True
    with pytest.raises(ChunkError, match="chunk 1 is missing"):
        required[np.array([5])]


def test_a_collections_names_at_random_rows_equal_the_source(
        small_collection: Collection) -> None:
    coll = open_collection(small_collection.path)
    expected = np.concatenate([np.asarray(zarr.open_group(
        str(coll.shard_path(s)), mode="r")["obs/_index"][:], dtype=object)
        for s in range(len(coll.shards))])
    rows = np.random.default_rng(1).integers(0, coll.n_obs, 500)
    assert list(coll.obs_names_at(rows)) == list(expected[rows])
    assert list(coll.obs_names) == list(expected)


def test_a_corrupted_obs_index_chunk_is_a_collection_error(
        small_collection: Collection, tmp_path: Path) -> None:
    shutil.copytree(small_collection.path, tmp_path / "c")
    coll = open_collection(tmp_path / "c")
    chunk = coll.shard_path(1) / "obs/_index/c/0"
    body = bytearray(chunk.read_bytes())
    body[20] ^= 0xFF
    chunk.write_bytes(bytes(body))
    first = coll.shard_sizes[0]
    with pytest.raises(CollectionError, match=re.escape(str(chunk)) + ".*checksum mismatch"
                       ".*create_anndata_collection"):
        coll.obs_names_at([first + 1])


def test_names_kept_between_calls_are_bytes_not_a_str_per_cell(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Naming 50 cells of a 200,000-cell shard keeps its chunks' bytes (the names' ~12
    bytes + 4 + the places' 4 a cell), not 200,000 str objects (~60 bytes each)."""
    from annbatch_torch.store.metadata import shard_obs_names

    n = 200_000
    group = zarr.open_group(str(tmp_path / "shard.zarr"), mode="w")
    obs = group.create_group("obs", attributes={"_index": "_index"})
    idx = obs.create_array("_index", shape=(n,), chunks=(65536,), dtype=str,
                           compressors=[Crc32cCodec()])
    idx[:] = np.array([f"cell_{i:07d}" for i in range(n)], dtype=object)
    from annbatch_torch.store.groups import open_fast_group

    rows = np.random.default_rng(0).integers(0, n, 50)
    from annbatch_torch.store import rawstrings

    # the scan's path (bytes and places kept), numba's start paid before the tracing
    monkeypatch.setattr(rawstrings, "_SCAN_FROM_CHUNKS", 0)
    _write(tmp_path / "warm.zarr", ["a", "b", "c"], 3)[np.array([0])]
    tracemalloc.start()
    try:
        names = shard_obs_names(open_fast_group(tmp_path / "shard.zarr"), n, "shard",
                                by_position=True)
        got = names[rows]
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert list(got) == [f"cell_{i:07d}" for i in rows]
    assert kept < 30 * n, f"{kept / n:.1f} bytes kept a cell"

