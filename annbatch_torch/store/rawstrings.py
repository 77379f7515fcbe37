"""Direct reads of a few items of a zarr v3 string array: a collection's obs_names.

A zarr v3 ``string`` array whose codecs are ``vlen-utf8`` optionally followed by
``crc32c`` (what the writer stores as a shard's obs index) holds each chunk as a 4-byte item
count, then per item a 4-byte length and its UTF-8 bytes (all little endian), then the
CRC-32C. zarr-python decodes a whole chunk into Python str objects (then casts them to
numpy's string dtype and back to objects), so naming 10^4 random cells of a 10^7-cell
collection decoded every name of every shard. :class:`RawStringArray` reads a chunk's bytes
once, verifies them, finds each item's place by one compiled scan of the lengths and keeps
those bytes and places (about 8 bytes per item beyond the text itself: its stored length and
its place); an item becomes a str only when it is asked for, on every call (no str is kept).

The chunk files are local: a collection on an object store has its obs arrays copied into
its mirror at open (:mod:`annbatch_torch.store.remote.mirror`). Anything else (other codecs,
sharded or v2 arrays) is left to zarr: :func:`open_raw_strings` returns ``None``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numba
import numpy as np

from .native import compiled, load_now
from .rawzarr import ChunkError, chunk_key_layout

__all__ = ["RawStringArray", "open_raw_strings"]

#: a chunk's items decoded all at once (numcodecs) rather than one by one when at least
#: this share of them is asked for: about as fast, and no scan of its items' places
_WHOLE_SHARE = 0.5
#: chunks this process decodes whole before it pays numba's start for the scan (~0.3 s
#: where no compiled loop ran yet; a whole chunk of 65,536 names decodes in ~10 ms): a few
#: names of a small collection never load it, many of a large one load it soon (at once
#: where another compiled loop ran: see native.load_now)
_SCAN_FROM_CHUNKS = 16
_unscanned = 0  # chunks decoded whole so far for want of the scan (this process)


def _vlen_bounds_py(buf, n, bounds):  # type: ignore[no-untyped-def]  # pragma: no cover
    # bounds[i]: where item i's 4-byte length starts; bounds[n]: where the items end.
    # Returns that end, or -1 - i when item i runs past the buffer (damage).
    pos = np.int64(4)
    size = buf.size
    for i in range(n):
        if pos + 4 > size:
            return -1 - i
        bounds[i] = pos
        length = (np.int64(buf[pos]) | (np.int64(buf[pos + 1]) << 8)
                  | (np.int64(buf[pos + 2]) << 16) | (np.int64(buf[pos + 3]) << 24))
        pos += 4 + length
        if pos > size:
            return -1 - i
    bounds[n] = pos
    return pos


_vlen_bounds = compiled(_vlen_bounds_py)


class _Chunk:
    """One chunk's verified bytes: ``raw[:size]`` holds its ``n`` items (the CRC after
    them); ``bounds`` the places of its items (:func:`_vlen_bounds`), found when first
    needed."""

    __slots__ = ("bounds", "n", "raw", "size")

    def __init__(self, raw: bytes, size: int, n: int) -> None:
        self.raw, self.size, self.n = raw, size, n
        self.bounds: np.ndarray | None = None


class RawStringArray:
    """A 1-D zarr v3 ``string`` array of ``vlen-utf8`` (+ ``crc32c``) chunks whose items are
    read by position: ``array[positions]`` gives an object array of str.

    Chunks are read on first use and kept (their bytes and item places, not str objects).
    An absent chunk is the fill value (``""``) unless :attr:`require_chunks` is set, then it
    is damage (:class:`~annbatch_torch.store.rawzarr.ChunkError`), as for
    :class:`~annbatch_torch.store.rawzarr.RawZarrArray`.
    """

    #: an absent chunk is damage, not the fill value (set by readers of stores whose writer
    #: wrote every chunk)
    require_chunks = False

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.shape = (int(meta["shape"][0]),)
        self.chunk_rows = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
        self.crc = any(c.get("name") == "crc32c" for c in meta["codecs"])
        fill = meta.get("fill_value", "")
        self.fill_value = fill if isinstance(fill, str) else ""
        layout = chunk_key_layout(meta)
        if layout is None:
            raise ValueError(f"{path}: chunk_key_encoding {meta.get('chunk_key_encoding')!r} "
                             "is neither zarr v3's default nor v2")
        self._prefix = str(path) + os.sep + layout[0]
        self.attrs: dict[str, Any] = meta.get("attributes", {})
        # chunk -> its bytes and places (None: absent); filled without a lock (two threads
        # may read a chunk twice, one copy kept), so a fork never inherits one held
        self._chunks: dict[int, _Chunk | None] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_chunks"] = {}  # read again where it is used
        return state

    @property
    def ndim(self) -> int:
        return 1

    @property
    def nchunks(self) -> int:
        """Number of chunk files of the array's grid (as ``zarr.Array.nchunks``)."""
        return -(-self.shape[0] // self.chunk_rows) if self.shape[0] else 0

    @property
    def nchunks_initialized(self) -> int:
        """Number of chunk files present (as ``zarr.Array.nchunks_initialized``)."""
        return sum(Path(self._file_name(c)).is_file() for c in range(self.nchunks))

    @property
    def cached_nbytes(self) -> int:
        """Bytes held by the chunks read so far (their text and item places)."""
        return sum(len(ch.raw) + (0 if ch.bounds is None else ch.bounds.nbytes)
                   for ch in self._chunks.values() if ch)

    def _file_name(self, c: int) -> str:
        return f"{self._prefix}{c}"

    def __getitem__(self, positions: Any) -> np.ndarray:
        """Items at ``positions`` (integers in ``[0, shape[0])``, any order, repeats
        allowed) as an object array of str; ``...`` or ``slice(None)``: every item."""
        if positions is Ellipsis or (isinstance(positions, slice)
                                     and positions == slice(None)):
            positions = np.arange(self.shape[0])
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        out = np.empty(pos.size, dtype=object)
        if not pos.size:
            return out
        if int(pos.min()) < 0 or int(pos.max()) >= self.shape[0]:
            raise IndexError(f"{self.path}: positions outside [0, {self.shape[0]})")
        chunk_of = pos // self.chunk_rows
        order = np.argsort(chunk_of, kind="stable")
        cuts = np.flatnonzero(np.diff(chunk_of[order])) + 1
        for part in np.split(order, cuts):
            c = int(chunk_of[part[0]])
            out[part] = self._take(c, pos[part] - c * self.chunk_rows)
        return out

    def _take(self, c: int, items: np.ndarray) -> np.ndarray:
        global _unscanned
        chunk = self._chunk(c)
        out = np.empty(items.size, dtype=object)
        if chunk is None:
            out[...] = self.fill_value
            return out
        # the chunk's items checked (both ways agree), unless it is decoded whole at once
        # for want of the scan (see _SCAN_FROM_CHUNKS)
        scan = chunk.bounds is not None or load_now(_vlen_bounds, _unscanned, _SCAN_FROM_CHUNKS)
        bounds = self._bounds(c, chunk) if scan else None
        if bounds is None:
            _unscanned += 1
        try:
            if items.size >= _WHOLE_SHARE * chunk.n or bounds is None:
                from numcodecs.vlen import VLenUTF8  # one decode of the whole chunk

                out[...] = VLenUTF8().decode(memoryview(chunk.raw)[:chunk.size])[items]
            else:
                raw = chunk.raw
                starts = (bounds[items] + 4).tolist()
                ends = bounds[items + 1].tolist()
                out[...] = [raw[a:b].decode() for a, b in zip(starts, ends, strict=True)]
        except (UnicodeDecodeError, ValueError) as e:
            raise ChunkError(f"{self._file_name(c)}: the chunk does not decode ({e}); the "
                             "file is corrupted") from None
        return out

    def _bounds(self, c: int, chunk: _Chunk) -> np.ndarray | None:
        """Where each item of ``chunk`` lies: ``bounds[i] + 4`` to ``bounds[i + 1]``
        (``None`` where numba's JIT is disabled: the scan would run in Python, the whole
        chunk is decoded instead); a chunk whose items run past its end is damage."""
        if chunk.bounds is None and not numba.config.DISABLE_JIT:
            bounds = np.empty(chunk.n + 1, dtype=np.int64)
            data = np.frombuffer(chunk.raw, dtype=np.uint8)[:chunk.size]
            end = int(_vlen_bounds(data, chunk.n, bounds))
            if end < 0:  # bytes past the items are left alone, as zarr does
                raise ChunkError(f"{self._file_name(c)}: item {-1 - end} of {chunk.n} runs "
                                 "past the chunk's end (the file is corrupted)")
            chunk.bounds = bounds.astype(np.uint32) if end < 2**32 else bounds
        return chunk.bounds

    def _chunk(self, c: int) -> _Chunk | None:
        chunk = self._chunks.get(c, False)
        if chunk is False:
            chunk = self._chunks.setdefault(c, self._read_chunk(c))
        return chunk  # type: ignore[return-value]

    def _read_chunk(self, c: int) -> _Chunk | None:
        name = self._file_name(c)
        try:
            with open(name, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            if self.require_chunks:
                raise ChunkError(f"{name}: chunk {c} is missing (the writer wrote every "
                                 "chunk: files were deleted or not copied)") from None
            return None
        size = len(raw)
        if self.crc:
            import google_crc32c

            size -= 4
            if size < 0 or google_crc32c.value(np.frombuffer(raw, np.uint8)[:size]) != (
                    int.from_bytes(raw[size:], "little")):
                raise ChunkError(f"{name}: chunk checksum mismatch (the file is corrupted)")
        if size < 4:
            raise ChunkError(f"{name}: the chunk holds {size} bytes, too few for its item "
                             "count (the file is corrupted)")
        n = int.from_bytes(raw[:4], "little")
        if n != self.chunk_rows:
            raise ChunkError(f"{name}: the chunk holds {n} items, expected {self.chunk_rows} "
                             "(the file is corrupted)")
        return _Chunk(raw, size, n)


def open_raw_strings(path: str | os.PathLike[str]) -> RawStringArray | None:
    """A :class:`RawStringArray` for the zarr v3 array at ``path`` (on the local file
    system), or ``None`` when it is not a 1-D ``string`` array of unsharded ``vlen-utf8``
    (+ ``crc32c``) chunks on a regular grid, or its metadata is not what zarr writes (zarr
    then reads it, or says what is wrong)."""
    p = Path(path)
    try:
        with open(p / "zarr.json", "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError):
        return None
    try:
        if (meta.get("zarr_format") != 3 or meta.get("node_type") != "array"
                or meta.get("data_type") != "string" or meta.get("storage_transformers")):
            return None
        codecs = meta.get("codecs", [])
        if (not codecs or len(codecs) > 2 or codecs[0].get("name") != "vlen-utf8"
                or any(c.get("name") != "crc32c" for c in codecs[1:])):
            return None
        grid = meta.get("chunk_grid", {})
        shape = [int(s) for s in meta["shape"]]
        chunks = [int(s) for s in grid["configuration"]["chunk_shape"]]
        if (grid.get("name") != "regular" or len(shape) != 1 or len(chunks) != 1
                or chunks[0] < 1 or chunk_key_layout(meta) is None):
            return None
        return RawStringArray(p, meta)
    except (AttributeError, KeyError, TypeError, ValueError):  # not zarr's metadata
        return None
