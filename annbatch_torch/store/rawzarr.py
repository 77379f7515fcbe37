"""Direct reads of zarr v3 arrays of raw (or Blosc-compressed, in shard files) chunks: the
collection's fast path.

A zarr v3 array whose codecs are ``bytes`` (little endian) optionally followed by
``crc32c`` stores every chunk as the raw array bytes (plus a 4-byte CRC-32C). Reading such
a chunk needs no decoding at all, so :class:`RawZarrArray` reads chunk files with plain
``preadv`` calls (which release the GIL) straight into the caller's buffers, skipping
zarr-python's per-call async machinery (measured ~5-10x faster for the 100k-1M element
slices a pool needs). With ``crc32c`` every chunk is verified before use: a truncated or
overwritten chunk raises instead of yielding wrong numbers.

The same holds inside zarr v3 shard files (codec ``sharding_indexed`` whose inner codecs
are ``bytes`` + optional ``crc32c``): an inner chunk is the same raw bytes at the offset the
shard's index gives. The index (at the end or the start of the shard file, checked by its
own CRC-32C) is read once per shard and kept; an atlas then is thousands of files, not
millions, and each read is still one ``preadv`` into the pool.

Inner chunks compressed by Blosc and followed by a CRC-32C (``bytes`` + ``blosc`` +
``crc32c``: the writer's ``compressor="lz4"`` / ``"zstd"`` in zarr v3 shard files) are read
the same way, their stored size taken from the shard index: each is read whole, verified,
decoded by numcodecs straight into the caller's buffer when it asks for the whole chunk,
else into the thread's scratch and copied.

Anything else (other codecs, unsharded compressed chunks, big-endian, v2) is left to zarr:
:func:`open_raw` returns ``None`` and callers fall back to ``zarr.open_array``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, NoReturn, Protocol

import numpy as np

from .checks import bad_column
from .diskio import IOV_MAX, OpenFile, count_warm, fast_flags, preadv_full, split_at
from .native import OutOfRange, pread_available, pread_segments, pread_widen

__all__ = ["CastPlan", "ChunkError", "ChunkSource", "IndexOutOfRange", "RawZarrArray",
           "open_raw"]


class ChunkError(OSError):
    """A chunk file is missing bytes or fails its checksum."""


class IndexOutOfRange(ChunkError):
    """A column index read by :meth:`RawZarrArray.read_cast` outside ``[0, below)``:
    ``value`` at byte ``byte`` of shard file ``path``, delivered at item ``item`` of the
    output (in shard row ``row`` where the caller knows it: :meth:`in_row`)."""

    def __init__(self, path: str, value: int, below: int, byte: int, item: int,
                 row: int | None = None) -> None:
        where = "" if row is None else f" in row {row} of this shard"
        super().__init__(f"{path}: column index {value} outside [0, {below}){where} at byte "
                         f"{byte} (the store is damaged)")
        self.path, self.value, self.below, self.byte, self.item = path, value, below, byte, item

    def in_row(self, row: int) -> IndexOutOfRange:
        """The same error, naming the shard row that holds the index."""
        return IndexOutOfRange(self.path, self.value, self.below, self.byte, self.item, row)


class CastPlan(NamedTuple):
    """Segments of disjoint runs read by :meth:`RawZarrArray.read_cast`: each one's shard
    file, byte offset in it, items, and the item of the output it lands at."""

    files: np.ndarray
    offsets: np.ndarray
    counts: np.ndarray
    dests: np.ndarray
    #: items are checked inside ``[0, below)`` as they are read (column indices); ``None``: not
    below: int | None = None
    #: ``{shard file: identity}`` the chunks were verified under (checksummed arrays)
    idents: dict[int, tuple[int, int, int]] = {}  # noqa: RUF012


class ChunkSource(Protocol):
    """Where a raw array's chunk files come from when they are not on the local disk (a
    collection on an object store: :class:`~annbatch_torch.store.remote.mirror.RemoteChunks`).

    ``path`` is always the name of a chunk or shard file under the array's local folder
    (which holds the array's metadata, not its chunks); the bytes are read from the local
    files :meth:`local` returns.
    """

    def present(self, path: str) -> bool:
        """Whether the object behind ``path`` exists."""

    def identity(self, path: str) -> tuple[int, int, int] | None:
        """A fingerprint of the object (changes when it is replaced), ``None`` if absent."""

    def size(self, path: str) -> int | None:
        """The object's size in bytes, ``None`` if absent."""

    def local(self, path: str, start: int, stop: int) -> str | None:
        """A local file holding bytes ``[start, stop)`` of the object (fetched now if
        needed), ``None`` if absent."""

    def fetch(self, wanted: list[tuple[str, int, int]]) -> None:
        """Make the byte ranges ``(path, start, stop)`` local, concurrently."""

    def drop(self, local: str) -> None:
        """Forget a local copy (a damaged one): the next :meth:`local` fetches it again."""

    def url_of(self, path: str) -> str:
        """Where the object is, for messages."""


_local = threading.local()


def _scratch(nbytes: int, name: str = "buf") -> np.ndarray:
    """A thread's reusable byte buffer ``name`` of at least ``nbytes`` (grown, never
    shrunk; ``"zbuf"`` / ``"dbuf"``: a Blosc chunk's stored and decoded bytes)."""
    buf = getattr(_local, name, None)
    if buf is None or len(buf) < nbytes:
        buf = np.empty(nbytes, dtype=np.uint8)
        setattr(_local, name, buf)
    return buf


class RawZarrArray:
    """A 1-D or 2-D zarr v3 array with raw little-endian chunks (or Blosc + CRC-32C inner
    chunks of shard files: :attr:`blosc`), read by row slices.

    Only the first axis may be chunked in more than one piece (``chunks[1:] == shape[1:]``).
    """

    #: an absent chunk is damage (:class:`ChunkError`), not the fill value: set by readers
    #: of stores whose writer wrote every chunk
    require_chunks = False

    def __init__(self, path: Path, meta: dict[str, Any], remote: ChunkSource | None = None
                 ) -> None:
        self.path = path
        #: where the chunk objects are when they are on an object store (``None``: files
        #: under ``path``); chunks then arrive in the chunk cache, read from there
        self.remote = remote
        self._dev: int | None = None  # the device of path's file system (see _device)
        self.shape = tuple(int(s) for s in meta["shape"])
        self.dtype = np.dtype(meta["data_type"]).newbyteorder("<")
        outer = tuple(int(c) for c in meta["chunk_grid"]["configuration"]["chunk_shape"])
        sharding = _sharding(meta)
        codecs = meta["codecs"] if sharding is None else sharding["codecs"]
        self.chunks = outer if sharding is None else tuple(
            int(c) for c in sharding["chunk_shape"])
        self.crc = any(c["name"] == "crc32c" for c in codecs)
        #: inner chunks are Blosc-compressed (then a CRC-32C of the compressed bytes):
        #: each is read whole, verified and decoded (:meth:`_read_blosc_chunk`)
        self.blosc = any(c["name"] == "blosc" for c in codecs)
        #: inner chunks per shard file (0: not sharded, one file per chunk)
        self.per_shard = 0 if sharding is None else outer[0] // self.chunks[0]
        if sharding is not None:
            self._index_at_end = sharding.get("index_location", "end") == "end"
            self._index_crc = any(c["name"] == "crc32c" for c in sharding["index_codecs"])
            self._indexes: dict[int, np.ndarray | None] = {}
            self._index_lock = threading.Lock()
        self.fill_value = meta.get("fill_value", 0)
        layout = chunk_key_layout(meta)
        if layout is None:
            raise ValueError(f"{path}: chunk_key_encoding {meta.get('chunk_key_encoding')!r} "
                             "is neither zarr v3's default nor v2")
        key_prefix, self._sep = layout
        self.row_items = int(np.prod(self.shape[1:], dtype=np.int64))
        self.chunk_rows = self.chunks[0]
        self.chunk_nbytes = self.chunk_rows * self.row_items * self.dtype.itemsize
        self.attrs: dict[str, Any] = meta.get("attributes", {})
        #: inner chunks of shard files this process verified whole (CRC-32C, and ``below``
        #: when asked): ``{chunk: (below, identity of its shard file then)}``; see
        #: :meth:`read_runs`'s ``trust_verified``
        self._verified: dict[int, tuple[int | None, tuple[int, int, int]]] = {}
        self._seen_ids: dict[int, tuple[int, int, int]] = {}
        # chunk file names: f"{prefix}{c}{suffix}" (built once: this is on the hot path)
        rest = self._sep.join(["0"] * (len(self.shape) - 1))
        self._suffix = self._sep + rest if rest else ""
        self._prefix = str(path) + os.sep + key_prefix

    @property
    def reads_compiled(self) -> bool:
        """Whether runs of chunks verified before are read by the compiled loop
        (:func:`~annbatch_torch.store.native.pread_segments`: local, uncompressed shard
        files, where the loop runs)."""
        return (self.remote is None and bool(self.per_shard) and not self.blosc
                and self.dtype.isnative and pread_available())

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nchunks(self) -> int:
        """Number of chunk files of the array's grid (shard files when sharded, as
        ``zarr.Array.nchunks``)."""
        n = -(-self.shape[0] // self.chunk_rows) if self.shape[0] else 0
        return -(-n // self.per_shard) if self.per_shard else n

    @property
    def nchunks_initialized(self) -> int:
        """Number of chunk (or shard) files present (as ``zarr.Array.nchunks_initialized``)."""
        if self.remote is not None:
            return sum(self.remote.present(self._file_name(k)) for k in range(self.nchunks))
        return sum(Path(self._file_name(k)).is_file() for k in range(self.nchunks))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_verified"], state["_seen_ids"] = {}, {}  # verified again where it is read
        state["_dev"] = None
        if self.per_shard:  # indexes are read again where needed; locks do not pickle
            state["_indexes"], state["_index_lock"] = {}, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.per_shard:
            self._index_lock = threading.Lock()

    def _device(self) -> int | None:
        """The ``st_dev`` of the array's folder (``None`` on a store): a file system that
        refused ``RWF_NOWAIT`` is remembered by its device (:func:`~.diskio.fast_flags`)."""
        if self._dev is None and self.remote is None:
            with contextlib.suppress(OSError):
                self._dev = os.stat(self.path).st_dev
        return self._dev

    def _file_name(self, k: int) -> str:
        """Chunk file ``k`` (a shard file when sharded)."""
        return f"{self._prefix}{k}{self._suffix}"

    def _chunk_name(self, c: int) -> str:
        return self._file_name(c // self.per_shard if self.per_shard else c)

    def _index(self, k: int) -> np.ndarray | None:
        """Shard file ``k``'s index: ``(per_shard, 2)`` uint64 (offset, nbytes), all ones for
        an absent chunk; ``None`` when the shard file is absent. Read once, CRC checked (on
        a store, a cached copy that fails is dropped and fetched once more)."""
        if self.remote is None:
            return self._index_once(k)
        try:
            return self._index_once(k)
        except (ChunkError, FileNotFoundError):
            path = self._file_name(k)
            where = self._index_range(path)
            if where is None:
                raise
            local = self.remote.local(path, *where)
            if local is not None:
                self.remote.drop(local)
            return self._index_once(k)

    def _index_once(self, k: int) -> np.ndarray | None:
        with self._index_lock:
            if k in self._indexes:
                return self._indexes[k]
        path = self._file_name(k)
        n_index = self.per_shard * 16
        size = self._index_nbytes
        got = self._read_index(path, size)
        if got is None:
            index = None
        else:
            raw, end = got
            if len(raw) != size:
                raise ChunkError(f"{path}: shard index is truncated")
            if self._index_crc:
                import google_crc32c

                if google_crc32c.value(raw[:n_index]) != int.from_bytes(raw[n_index:], "little"):
                    raise ChunkError(f"{path}: shard index checksum mismatch (the file is "
                                     "corrupted)")
            index = np.frombuffer(raw[:n_index], dtype="<u8").reshape(self.per_shard, 2)
            if self._index_at_end and np.any((index[:, 0] != _ABSENT) & (
                    index[:, 0] + index[:, 1] > end - size)):
                raise ChunkError(f"{path}: shard index points past the chunk data (the file is "
                                 "truncated or corrupted)")
        with self._index_lock:
            self._indexes[k] = index
        return index

    def _read_index(self, path: str, size: int) -> tuple[bytes, int] | None:
        """The ``size`` index bytes of shard file ``path`` and the file's size (``None``
        when it is absent)."""
        if self.remote is not None:
            if (end := self.remote.size(path)) is None:
                return None
            if end < size:
                raise ChunkError(f"{path}: shard object has {end} bytes, less than its "
                                 f"{size}-byte index")
            local = self.remote.local(path, *self._index_range(path))  # type: ignore[misc]
            if local is None:
                return None
            with open(local, "rb") as f:
                return f.read(), end
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            end = os.fstat(fd).st_size
            if end < size:
                raise ChunkError(f"{path}: shard file has {end} bytes, less than its "
                                 f"{size}-byte index")
            return os.pread(fd, size, end - size if self._index_at_end else 0), end
        finally:
            os.close(fd)

    @property
    def _index_nbytes(self) -> int:
        """Bytes of a shard file's index (with its CRC-32C)."""
        return self.per_shard * 16 + (4 if self._index_crc else 0)

    def _index_range(self, path: str) -> tuple[int, int] | None:
        """Where the index lies in the shard object ``path`` on a store (``None``: the
        object is absent or smaller than an index)."""
        assert self.remote is not None
        end, n = self.remote.size(path), self._index_nbytes
        if end is None or end < n:
            return None
        start = end - n if self._index_at_end else 0
        return start, start + n

    def _fetch_range(self, where: tuple[str, int, int]) -> tuple[str, int, int]:
        """The object and byte range to fetch on a store for a chunk at ``where`` (an
        :meth:`_object_range`): a whole chunk object with one byte more, so a longer
        object is noticed as it is locally."""
        path, off, want = where
        return path, off, off + want + (0 if self.per_shard else 1)

    def _locate(self, c: int) -> tuple[str, int, int] | None:
        """Chunk ``c``'s file, byte offset and stored size; ``None`` when it is absent.
        For an array on a store the file is the chunk's entry in the chunk cache."""
        where = self._object_range(c)
        if where is None or self.remote is None:
            return where
        local = self.remote.local(*self._fetch_range(where))
        return None if local is None else (local, 0, where[2])

    def prefetch(self, chunks: list[int]) -> None:
        """Fetch the chunks ``chunks`` of an array on a store into the chunk cache, all at
        once (their shard indexes first); nothing for local arrays."""
        if self.remote is None or not chunks:
            return
        if self.per_shard:
            need = []
            for k in sorted({c // self.per_shard for c in chunks}):
                with self._index_lock:
                    if k in self._indexes:
                        continue
                path = self._file_name(k)
                if (where := self._index_range(path)) is not None:
                    need.append((path, *where))
            self.remote.fetch(need)
        self.remote.fetch([self._fetch_range(w) for c in chunks
                           if (w := self._object_range(c)) is not None])

    def _object_range(self, c: int) -> tuple[str, int, int] | None:
        """Chunk ``c``'s chunk or shard file, byte offset and stored size; ``None`` when it
        is absent."""
        want = self.chunk_nbytes + (4 if self.crc else 0)
        if not self.per_shard:
            return self._chunk_name(c), 0, want
        k, i = divmod(c, self.per_shard)
        index = self._index(k)
        if index is None or int(index[i, 0]) == _ABSENT:
            return None
        path = self._file_name(k)
        if self.blosc:  # compressed: any size from a CRC to Blosc's worst case
            got = int(index[i, 1])
            if not 4 < got <= want + _BLOSC_MAX_OVERHEAD:
                raise ChunkError(f"{path}: inner chunk {i} holds {got} bytes, not a "
                                 f"compressed chunk of at most {want + _BLOSC_MAX_OVERHEAD}")
            return path, int(index[i, 0]), got
        if int(index[i, 1]) != want:
            raise ChunkError(f"{path}: inner chunk {i} holds {int(index[i, 1])} bytes, "
                             f"expected {want}")
        return path, int(index[i, 0]), want

    def __getitem__(self, sl: Any) -> np.ndarray:
        if sl is Ellipsis:
            sl = slice(None)
        if not isinstance(sl, slice) or sl.step not in (None, 1):
            raise TypeError("RawZarrArray supports contiguous row slices only.")
        lo, hi, _ = sl.indices(self.shape[0])
        hi = max(lo, hi)
        out = np.empty((hi - lo, *self.shape[1:]), dtype=self.dtype)
        self.read_into(lo, hi, out)
        return out

    def read_into(self, lo: int, hi: int, out: np.ndarray) -> None:
        """Copy rows ``[lo, hi)`` into ``out`` (shape ``(hi - lo, *shape[1:])``), cast to
        ``out``'s dtype when it is not the stored one (a narrow shard read into a wider
        buffer)."""
        if hi <= lo:
            return
        if out.dtype != self.dtype:
            stored = np.empty(out.shape, dtype=self.dtype)
            self.read_into(lo, hi, stored)
            out[...] = stored
            return
        if self.ndim == 1:
            self.read_runs(np.array([lo], dtype=np.int64), hi, np.zeros(1, np.int64), out)
            return
        flat = out.reshape(-1).view(np.uint8)
        row_bytes = self.row_items * self.dtype.itemsize
        if self.remote is not None:
            self.prefetch(list(range(lo // self.chunk_rows, (hi - 1) // self.chunk_rows + 1)))
        for c in range(lo // self.chunk_rows, (hi - 1) // self.chunk_rows + 1):
            c0 = c * self.chunk_rows
            a, b = max(lo, c0), min(hi, c0 + self.chunk_rows)
            dst = flat[(a - lo) * row_bytes : (b - lo) * row_bytes]
            self._read_chunk_part(c, (a - c0) * row_bytes, dst)

    def read_runs(
        self, starts: np.ndarray, stop: int, dests: np.ndarray, out: np.ndarray,
        below: int | None = None, ends: np.ndarray | None = None,
        trust_verified: bool = False,
    ) -> dict[int, int] | None:
        """Scatter elements ``[starts[0], stop)`` of this 1-D array into ``out``.

        The run ``[starts[i], starts[i + 1])`` (the last one ends at ``stop``) lands at
        ``out[dests[i]:]``; with ``ends`` (ascending, disjoint runs) the run is
        ``[starts[i], ends[i])`` and the elements between runs are not delivered. Each raw
        chunk is read with one ``preadv`` call straight into the destinations (no
        intermediate copy) and, with ``crc32c``, verified in place; a Blosc chunk is read
        whole, verified and decoded, then copied to the destinations.

        ``trust_verified`` (with ``ends``; random access to drawn rows): an inner chunk of
        a shard file that this process verified whole before, while the file kept its
        inode, size and mtime, is read only where the runs fall, without its checksum
        (reading and checking all of it for each drawn row costs ~30x the bytes); the call
        then returns ``None`` instead of the CRCs: the caller must check what was
        delivered itself (a damaged value is not caught there; see ``docs/format.md``).
        Blosc chunks are always read whole, verified and decoded (no trusted part reads).

        Returns the CRC-32C of every chunk read (``{chunk: crc}``; empty without the
        ``crc32c`` codec): a chunk read again with the same CRC holds the same values.
        With ``below``, the parts of those chunks read but *not* delivered (before the
        first and after the last element asked for) must hold values ``< below`` (compared
        unsigned, so negatives fail too), else :class:`ChunkError`: together with a check
        of what was delivered, every value of each returned chunk has been checked.
        """
        if self.ndim != 1:
            raise TypeError("read_runs needs a 1-D array")
        if out.dtype != self.dtype or not out.flags.c_contiguous:
            raise TypeError(f"{self.path}: read_runs needs a contiguous {self.dtype} buffer, "
                            f"got {out.dtype}")
        starts = np.asarray(starts, dtype=np.int64)
        dests = np.asarray(dests, dtype=np.int64)
        if ends is not None:
            return self._read_disjoint(starts, np.asarray(ends, dtype=np.int64), dests, out,
                                       below, trust_verified)
        if starts.size == 0 or stop <= int(starts[0]):
            return {}
        ends = np.append(starts[1:], stop)
        if int((dests + (ends - starts)).max()) > out.size or int(dests.min()) < 0:
            raise ValueError(f"{self.path}: read_runs destinations fall outside the buffer "
                             f"of {out.size} items")
        lo = int(starts[0])
        keep = ends > starts
        starts, ends, dests = starts[keep], ends[keep], dests[keep]
        if starts.size > 1:  # merge runs that continue each other in the destination too
            cont = dests[1:] == dests[:-1] + (ends[:-1] - starts[:-1])
            new = np.flatnonzero(np.concatenate([[True], ~cont]))
            starts, dests = starts[new], dests[new]
        size = self.chunk_rows
        bounds = np.arange(lo // size + 1, (stop - 1) // size + 1, dtype=np.int64) * size
        if bounds.size:  # split runs at chunk boundaries
            r = np.searchsorted(starts, bounds, side="right") - 1
            seg_starts, first = np.unique(np.concatenate([starts, bounds]), return_index=True)
            seg_dests = np.concatenate([dests, dests[r] + (bounds - starts[r])])[first]
        else:
            seg_starts, seg_dests = starts, dests
        seg_ends = np.append(seg_starts[1:], stop)
        chunk_of = seg_starts // size
        cuts = np.flatnonzero(np.diff(chunk_of)) + 1
        if self.remote is not None:
            self.prefetch(np.unique(chunk_of).tolist())
        item = self.dtype.itemsize
        flat = out.reshape(-1).view(np.uint8)
        lo_b = (seg_starts * item).tolist()
        hi_b = (seg_ends * item).tolist()
        d_b = (seg_dests * item).tolist()
        begin = [0, *cuts.tolist()]
        finish = [*cuts.tolist(), len(lo_b)]
        crcs: dict[int, int] = {}
        for i0, i1 in zip(begin, finish):
            c = lo_b[i0] // (size * item)
            segs = [flat[d : d + (e - s)] for s, e, d in zip(lo_b[i0:i1], hi_b[i0:i1],
                                                             d_b[i0:i1])]
            crc = self._read_chunk_segments(c, lo_b[i0] - c * size * item,
                                            hi_b[i1 - 1] - c * size * item, segs, below)
            if crc is not None:
                crcs[c] = crc
        return crcs

    def _read_disjoint(self, starts: np.ndarray, ends: np.ndarray, dests: np.ndarray,
                       out: np.ndarray, below: int | None, trust: bool
                       ) -> dict[int, int] | None:
        """:meth:`read_runs` of disjoint runs ``[starts[i], ends[i])``.

        A chunk with ``crc32c`` is read whole (the bytes between runs into scratch) and
        verified, those bytes checked ``< below`` too; with ``trust``, a chunk verified so
        before under the shard file's current identity is read where the runs fall only:
        one ``preadv`` per stretch of touching runs, the chunks of one shard file through
        one descriptor (local shard files: all their trusted reads in one compiled loop,
        :func:`~annbatch_torch.store.native.pread_segments`).
        """
        keep = ends > starts
        starts, ends, dests = starts[keep], ends[keep], dests[keep]
        if not starts.size:
            return {}
        if int((dests + (ends - starts)).max()) > out.size or int(dests.min()) < 0:
            raise ValueError(f"{self.path}: read_runs destinations fall outside the buffer "
                             f"of {out.size} items")
        size, item = self.chunk_rows, self.dtype.itemsize
        chunk, seg_lo, seg_hi, seg_dest = self._split_runs(starts, ends, dests)
        lo_b = (seg_lo - chunk * size) * item  # bytes, from the chunk's start
        hi_b = (seg_hi - chunk * size) * item
        d_b = seg_dest * item
        if self.remote is not None:
            self.prefetch(np.unique(chunk).tolist())
        idents = (self._identities(np.unique(chunk // self.per_shard).tolist())
                  if self.crc and self.per_shard else {})
        new_chunk = np.concatenate([[True], chunk[1:] != chunk[:-1]])
        flat = out.reshape(-1).view(np.uint8)
        chunk_at = [*np.flatnonzero(new_chunk).tolist(), len(chunk)]
        # preadv flags of a read that must not wait (None: gated reads)
        fast = fast_flags(self._device())
        done = self._read_trusted_compiled(chunk, lo_b, hi_b, d_b, new_chunk, flat, below,
                                           trust, idents, fast)
        if done is not None and done.all():
            return None
        # a stretch: touching segments of one chunk, read by one preadv
        new_stretch = new_chunk | np.concatenate([[True], lo_b[1:] != hi_b[:-1]])
        views = [flat[d : d + n] for d, n in zip(d_b.tolist(), (hi_b - lo_b).tolist())]
        stretch_at = [*np.flatnonzero(new_stretch).tolist(), len(chunk)]
        lo_l, hi_l, chunks = lo_b.tolist(), hi_b.tolist(), chunk.tolist()
        crcs: dict[int, int] = {}
        trusted = done is not None and bool(done.any())  # a chunk read without its checksum
        skip = [False] * (len(chunk_at) - 1) if done is None else done.tolist()
        files = OpenFile()
        k = 0  # the next stretch
        try:
            for j, (i0, i1) in enumerate(itertools.pairwise(chunk_at)):
                if skip[j]:
                    continue
                c = chunks[i0]
                while stretch_at[k] < i0:
                    k += 1
                ident = idents.get(c // self.per_shard) if self.per_shard else None
                known = self._verified.get(c) if trust and ident is not None else None
                if self.crc and (self.blosc or known is None or known != (below, ident)):
                    crc = self._verify_chunk(c, lo_l[i0:i1], views[i0:i1], below, ident)
                elif (where := self._locate(c)) is None:  # absent: fill value (or error)
                    crc = self._read_chunk_segments(c, 0, 0, views[i0:i1], below)
                else:
                    path, base, _ = where
                    fd = files.open(path)
                    while stretch_at[k] < i1:
                        s0, s1 = stretch_at[k], stretch_at[k + 1]
                        k += 1
                        self._read_stretch(fd, path, base + lo_l[s0], hi_l[s1 - 1] - lo_l[s0],
                                           views[s0:s1], fast)
                    crc, trusted = None, True  # not checked now: the caller checks its part
                if crc is not None:
                    crcs[c] = crc
        finally:
            files.close()
        return None if trusted else crcs

    @staticmethod
    def _read_stretch(fd: int, path: str, off: int, want: int, bufs: list[np.ndarray],
                      fast: int | None) -> None:
        """Read ``want`` bytes at ``off`` of file ``fd`` into ``bufs``: first what the
        page cache holds (``fast``: the flags of that try; ``None``: no such try), the rest
        by a gated read."""
        got = 0
        if fast is not None and len(bufs) <= IOV_MAX:
            try:
                got = os.preadv(fd, bufs, off, fast)
            except OSError:  # not cached, or the flag refused here (the gated read below
                got = 0  # notes a refusal)
        if got < want:
            rest = split_at(bufs, got)[1]
            got += preadv_full(fd, rest, off + got, want - got)
            if got != want:
                raise ChunkError(f"{path}: chunk file is truncated")
        else:
            count_warm()

    def _read_trusted_compiled(self, chunk: np.ndarray, lo_b: np.ndarray, hi_b: np.ndarray,
                               d_b: np.ndarray, new_chunk: np.ndarray, flat: np.ndarray,
                               below: int | None, trust: bool,
                               idents: dict[int, tuple[int, int, int]], fast: int | None
                               ) -> np.ndarray | None:
        """Read the segments of :meth:`_read_disjoint` that fall in chunks read without
        their checksum (verified before under the shard file's identity, with ``trust``;
        every present chunk without ``crc32c``) of local, uncompressed shard files, by one
        compiled loop per shard file. Returns which chunks (one flag per chunk of
        ``new_chunk``) were read so; ``None`` when the loop does not apply here (on a
        store, unsharded, Blosc, no ``preadv2`` or no first try from the page cache)."""
        if fast is None or not self.reads_compiled:
            return None
        if self.crc and not trust:
            return None
        uniq = chunk[new_chunk]
        shard_of = uniq // self.per_shard
        ok, base = self._chunk_bases(uniq, below, idents)
        if not ok.any():
            return ok
        seg_chunk = np.cumsum(new_chunk) - 1  # each segment's place in uniq
        seg_ok = ok[seg_chunk]
        seg_file = shard_of[seg_chunk]
        offsets = base[seg_chunk] + lo_b
        lengths = hi_b - lo_b
        for k in np.unique(seg_file[seg_ok]).tolist():
            at = np.flatnonzero(seg_ok & (seg_file == k))
            offs, lens, dsts = offsets[at], lengths[at], d_b[at]
            loop = functools.partial(pread_segments, offsets=offs, lengths=lens, out=flat,
                                     dests=dsts, flags=fast)
            for fd, path, j in self._refused_segments(k, len(at), idents.get(k), loop):
                d, m = int(dsts[j]), int(lens[j])
                self._read_stretch(fd, path, int(offs[j]), m, [flat[d : d + m]], None)
        return ok

    def _refused_segments(self, k: int, n: int, ident: tuple[int, int, int] | None,
                          loop: Callable[..., int]) -> Iterator[tuple[int, str, int]]:
        """Read segments ``0 .. n-1`` of shard file ``k`` by the compiled ``loop(fd,
        first=i)`` (it returns the first segment it did not read in full: the page cache
        did not hold it, or the file is short); yield ``(fd, path, j)`` of each such
        segment for the caller to read waiting for the disk, the loop going on after it.
        ``ident``: the identity the chunks were verified under; a file found replaced once
        opened is a :class:`ChunkError` (what the loop would read was never verified)."""
        path = self._file_name(k)
        fd = os.open(path, os.O_RDONLY)
        try:
            if ident is not None:
                st = os.fstat(fd)
                if (st.st_ino, st.st_size, st.st_mtime_ns) != ident:
                    raise ChunkError(f"{path}: shard file replaced while it was read "
                                     "(another process rewrote the collection?)")
            i = 0
            while i < n:
                j = loop(fd, first=i)
                count_warm(j - i)
                if j < n:
                    yield fd, path, j
                i = j + 1
        finally:
            os.close(fd)

    def _split_runs(self, starts: np.ndarray, ends: np.ndarray, dests: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Disjoint runs ``[starts[i], ends[i])`` (items) split at chunk boundaries: each
        segment's chunk, first and end item, and the item of the output it lands at."""
        size = self.chunk_rows
        first, last = starts // size, (ends - 1) // size  # run i: chunks first .. last
        n_parts = last - first + 1
        run = np.repeat(np.arange(len(starts)), n_parts)
        chunk = first[run] + np.arange(len(run)) - np.repeat(np.cumsum(n_parts) - n_parts,
                                                             n_parts)
        seg_lo = np.maximum(starts[run], chunk * size)
        seg_hi = np.minimum(ends[run], (chunk + 1) * size)
        return chunk, seg_lo, seg_hi, dests[run] + (seg_lo - starts[run])

    def _chunk_bases(self, uniq: np.ndarray, below: int | None,
                     idents: dict[int, tuple[int, int, int]]
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Which of the chunks ``uniq`` (ascending) may be read without their checksum
        from local shard files (verified before under the file's identity ``idents``,
        with ``below``; every present chunk without ``crc32c``), and their byte offsets in
        their shard files. Absent chunks and wrong sizes are left to the per-chunk path,
        which says what is wrong."""
        shard_of = uniq // self.per_shard
        if self.crc:
            ok = np.fromiter(
                ((ident := idents.get(k)) is not None and self._verified.get(c) == (below, ident)
                 for c, k in zip(uniq.tolist(), shard_of.tolist())), bool, len(uniq))
        else:
            ok = np.ones(len(uniq), dtype=bool)
        want = self.chunk_nbytes + (4 if self.crc else 0)
        base = np.zeros(len(uniq), dtype=np.int64)
        for k in np.unique(shard_of[ok]).tolist():
            at = np.flatnonzero(ok & (shard_of == k))
            index = self._index(k)
            if index is None:  # absent shard file
                ok[at] = False
                continue
            entry = index[uniq[at] % self.per_shard]
            good = (entry[:, 0] != _ABSENT) & (entry[:, 1] == want)
            ok[at[~good]] = False
            base[at[good]] = entry[good, 0].astype(np.int64)
        return ok, base

    def plan_cast(self, starts: np.ndarray, ends: np.ndarray, dests: np.ndarray,
                  below: int | None = None) -> CastPlan | None:
        """How :meth:`read_cast` reads the disjoint runs ``[starts[i], ends[i])`` into
        ``out[dests[i]:]`` in another dtype: when every chunk they touch is in a local,
        uncompressed shard file and was verified before (as ``read_runs(ends=,
        trust_verified=True)`` would read it without its checksum), and the compiled loop
        runs here; ``None`` otherwise (read with :meth:`read_runs` then). The runs are
        those of rows a sampler drew, read without their chunks' checksums; ``below``
        (column indices): every item is checked inside ``[0, below)`` as it is read."""
        if self.ndim != 1 or not self.reads_compiled or fast_flags(self._device()) is None:
            return None
        starts = np.asarray(starts, dtype=np.int64)
        ends = np.asarray(ends, dtype=np.int64)
        dests = np.asarray(dests, dtype=np.int64)
        keep = ends > starts
        starts, ends, dests = starts[keep], ends[keep], dests[keep]
        if not starts.size:
            empty = np.zeros(0, dtype=np.int64)
            return CastPlan(empty, empty, empty, empty, below)
        chunk, seg_lo, seg_hi, seg_dest = self._split_runs(starts, ends, dests)
        new_chunk = np.concatenate([[True], chunk[1:] != chunk[:-1]])
        uniq = chunk[new_chunk]
        idents = (self._identities(np.unique(uniq // self.per_shard).tolist())
                  if self.crc else {})
        ok, base = self._chunk_bases(uniq, below, idents)
        if not ok.all():
            return None
        seg_chunk = np.cumsum(new_chunk) - 1
        offsets = base[seg_chunk] + (seg_lo - chunk * self.chunk_rows) * self.dtype.itemsize
        return CastPlan(chunk // self.per_shard, offsets, seg_hi - seg_lo, seg_dest, below,
                        idents)

    def read_cast(self, plan: CastPlan, out: np.ndarray) -> None:
        """Read a :meth:`plan_cast` into ``out`` (cast to its dtype; the caller makes sure
        it holds every value): one compiled loop per shard file, through a scratch of the
        longest segment; a segment the page cache does not hold stops the loop, is read by
        the gated read and copied, and the loop goes on after it. With the plan's
        ``below``, every item read is checked inside ``[0, below)`` on the way.

        Raises
        ------
        IndexOutOfRange
            If an item is outside ``[0, below)`` (the store is damaged).
        ChunkError
            If a shard file was replaced since its chunks were verified, or is short."""
        if not len(plan.counts):
            return
        nbytes = int(plan.counts.max()) * self.dtype.itemsize
        scratch = _scratch(nbytes, "cast")[:nbytes].view(self.dtype)
        fast = fast_flags(self._device())
        flags = 0 if fast is None else fast
        below = plan.below
        for k in np.unique(plan.files).tolist():
            at = np.flatnonzero(plan.files == k)
            offs, counts, dsts = plan.offsets[at], plan.counts[at], plan.dests[at]
            loop = functools.partial(pread_widen, offsets=offs, counts=counts, out=out,
                                     dests=dsts, scratch=scratch, flags=flags, below=below)
            try:
                for fd, path, j in self._refused_segments(k, len(at), plan.idents.get(k),
                                                          loop):
                    m = int(counts[j])
                    part = scratch[:m]
                    self._read_stretch(fd, path, int(offs[j]), m * self.dtype.itemsize,
                                       [part.view(np.uint8)], None)
                    if below is not None and bad_column(part, below) is not None:
                        self._out_of_range(path, int(offs[j]), part, below, int(dsts[j]))
                    out[int(dsts[j]) : int(dsts[j]) + m] = part
            except OutOfRange as e:
                self._out_of_range(self._file_name(k), int(offs[e.segment]),
                                   scratch[: int(counts[e.segment])], e.below,
                                   int(dsts[e.segment]))

    def _out_of_range(self, path: str, offset: int, values: np.ndarray, below: int,
                      dest: int) -> NoReturn:
        """Raise the :class:`IndexOutOfRange` of ``values`` (read at byte ``offset`` of
        shard file ``path``, delivered at item ``dest`` of the output) holding an item
        outside ``[0, below)``."""
        pos = bad_column(values, below) or 0
        raise IndexOutOfRange(path, int(values[pos]), below,
                              offset + pos * self.dtype.itemsize, dest + pos)

    def _identities(self, files: list[int]) -> dict[int, tuple[int, int, int]]:
        """``{shard file: (inode, size, mtime)}`` of those that exist now."""
        out = {}
        for k in files:
            if self.remote is not None:
                if (got := self.remote.identity(self._file_name(k))) is None:
                    continue
                out[k] = ident = got
            else:
                try:
                    st = os.stat(self._file_name(k))
                except FileNotFoundError:
                    continue  # the read reports it
                out[k] = ident = (st.st_ino, st.st_size, st.st_mtime_ns)
            if self._seen_ids.setdefault(k, ident) != ident:  # replaced or rewritten
                self._seen_ids[k] = ident
                with self._index_lock:  # its index is read again
                    self._indexes.pop(k, None)
        return out

    def _verify_chunk(self, c: int, offsets: list[int], dsts: list[np.ndarray],
                      below: int | None, ident: tuple[int, int, int] | None) -> int | None:
        """Read all of chunk ``c``, the pieces at ``offsets`` (bytes, ascending, disjoint)
        into ``dsts`` and the rest into scratch; verify its CRC-32C and the scratch bytes'
        values ``< below``; remember it as verified. Returns its CRC (``None`` if absent)."""
        gaps: list[np.ndarray] = []
        # gaps go past what _read_chunk_segments uses of the same scratch (its head, tail
        # and checksum lie in the first chunk_nbytes + 5 bytes)
        base = self.chunk_nbytes + 8
        scratch = _scratch(base + self.chunk_nbytes)
        pieces: list[np.ndarray] = []
        at = 0
        for off, dst in zip(offsets, dsts):
            if off > at:
                gaps.append(scratch[base + at : base + off])
                pieces.append(gaps[-1])
            pieces.append(dst)
            at = off + len(dst)
        crc = self._read_chunk_segments(c, 0, at, pieces, below)
        if crc is not None:
            if below is not None:
                for gap in gaps:
                    self._check_below(self._chunk_name(c), below, gap)
            if ident is not None:  # verified under this identity of its shard file
                self._verified[c] = (below, ident)
        return crc

    def _read_chunk_segments(self, c: int, first: int, last: int, segs: list[np.ndarray],
                             below: int | None = None) -> int | None:
        """Read bytes ``[first, last)`` of chunk ``c`` into ``segs`` (consecutive pieces);
        returns the chunk's CRC-32C (``None`` without the codec or for an absent chunk).

        On a store, a cached copy that fails its checks (or vanished) is dropped and the
        chunk fetched once more: only a second failure blames the object on the store."""
        if self.remote is None:
            return self._read_chunk_file(c, first, last, segs, below)
        try:
            return self._read_chunk_file(c, first, last, segs, below, vanished_ok=False)
        except (ChunkError, FileNotFoundError):
            where = self._locate(c)
            if where is not None:
                self.remote.drop(where[0])
        try:
            return self._read_chunk_file(c, first, last, segs, below, vanished_ok=False)
        except (ChunkError, FileNotFoundError) as e:
            obj = self._object_range(c)
            what = (f"{self.remote.url_of(obj[0])} bytes [{obj[1]}, {obj[1] + obj[2]})"
                    if obj is not None else self._chunk_name(c))
            raise ChunkError(f"{what}: {e} (fetched twice: the object on the store is "
                             "damaged)") from None

    def _read_chunk_file(self, c: int, first: int, last: int, segs: list[np.ndarray],
                         below: int | None = None, vanished_ok: bool = True) -> int | None:
        """:meth:`_read_chunk_segments` from the chunk's file (a cache entry on a store;
        ``vanished_ok=False``: a file that went away is an error, not an absent chunk)."""
        where = self._locate(c)
        fd = -1
        if where is not None:
            path, base, want = where
            if vanished_ok:
                with contextlib.suppress(FileNotFoundError):
                    fd = os.open(path, os.O_RDONLY)
            else:
                fd = os.open(path, os.O_RDONLY)
        if fd < 0:
            if self.require_chunks:
                raise ChunkError(f"{self._chunk_name(c)}: chunk {c} is missing (the writer "
                                 "wrote every chunk: files were deleted or not copied)")
            for seg in segs:  # absent chunk: fill value (zarr spec)
                seg.view(self.dtype)[...] = self.fill_value
            return None
        try:
            if self.blosc:
                return self._read_blosc_chunk(fd, path, c, base, want, first, last, segs, below)
            if not self.crc:
                n = preadv_full(fd, segs, base + first, last - first)
                if n != last - first:
                    raise ChunkError(f"{path}: chunk file is truncated ({first + n} of "
                                     f"{last} bytes)")
                return None
            import google_crc32c

            scratch = _scratch(self.chunk_nbytes + 5)
            tail = scratch[first : first + self.chunk_nbytes - last]
            # the CRC, plus one byte past it in a chunk file: a longer file is damage too
            extra = 0 if self.per_shard else 1
            check = scratch[self.chunk_nbytes : self.chunk_nbytes + 4 + extra]
            bufs = ([scratch[:first]] if first else []) + segs + ([tail] if len(tail) else [])
            n = preadv_full(fd, [*bufs, check], base, want + extra, need=want)
            if n != want:
                what = f"inner chunk {c % self.per_shard}" if self.per_shard else "chunk file"
                raise ChunkError(f"{path}: {what} has {n} bytes, expected {want}")
            crc = 0
            for b in bufs:
                crc = google_crc32c.extend(crc, b)
            if crc != int.from_bytes(check[:4].tobytes(), "little"):
                raise ChunkError(f"{path}: chunk checksum mismatch (the file is corrupted)")
            if below is not None:
                self._check_below(path, below, scratch[:first], tail)
            return crc
        finally:
            os.close(fd)

    def _read_blosc_chunk(self, fd: int, path: str, c: int, base: int, want: int, first: int,
                          last: int, segs: list[np.ndarray], below: int | None) -> int:
        """:meth:`_read_chunk_file` of a Blosc-compressed inner chunk: its ``want`` stored
        bytes read whole, their CRC-32C checked, decoded (into the only segment when it is
        the whole chunk, else into the thread's scratch and copied) and the bytes
        ``[first, last)`` delivered; the decoded bytes not delivered checked ``< below``."""
        import google_crc32c
        from numcodecs import blosc

        packed = _scratch(want, "zbuf")[:want]
        n = preadv_full(fd, [packed], base, want)
        if n != want:
            raise ChunkError(f"{path}: inner chunk {c % self.per_shard} has {n} bytes, "
                             f"expected {want}")
        crc = google_crc32c.value(packed[:-4])
        if crc != int.from_bytes(packed[-4:].tobytes(), "little"):
            raise ChunkError(f"{path}: chunk checksum mismatch (the file is corrupted)")
        size = self.chunk_nbytes
        whole = first == 0 and last == size and len(segs) == 1 and segs[0].nbytes == size
        out = segs[0] if whole else _scratch(size, "dbuf")[:size]
        what = f"{path}: inner chunk {c % self.per_shard}"
        # Blosc's 16-byte header: uncompressed bytes at 4, compressed bytes at 12 (little
        # endian); a chunk that decodes to fewer bytes would leave the rest unwritten
        head = packed[:16].tobytes()
        decoded, stored = int.from_bytes(head[4:8], "little"), int.from_bytes(head[12:16],
                                                                               "little")
        if want < 20 or decoded != size or stored != want - 4:
            raise ChunkError(f"{what}: its Blosc header says {decoded} bytes in {stored}, "
                             f"expected {size} in {want - 4} (the file is corrupted)")
        try:
            blosc.decompress(packed[:-4], out)
        except (RuntimeError, ValueError) as e:
            if "-5" in str(e):  # Blosc: the compressor named in the header is not built in
                raise ChunkError(f"{what} needs a Blosc compressor this numcodecs lacks ({e}); "
                                 "install a numcodecs built with it") from None
            raise ChunkError(f"{what} does not decode ({e}; the file is corrupted)") from None
        if not whole:
            at = first
            for seg in segs:
                seg[...] = out[at : at + seg.nbytes]
                at += seg.nbytes
        if below is not None:
            self._check_below(path, below, out[:first], out[last:size])
        return crc

    def _check_below(self, path: str, below: int, *parts: np.ndarray) -> None:
        for part in parts:
            values = part.view(self.dtype)
            pos = bad_column(values, below)
            if pos is not None:
                raise ChunkError(f"{path}: chunk holds {int(values[pos])}, outside [0, {below}) "
                                 "(a column index out of range: the store is damaged)")

    def _read_chunk_part(self, c: int, offset: int, dst: np.ndarray) -> None:
        self._read_chunk_segments(c, offset, offset + dst.nbytes, [dst.reshape(-1).view(np.uint8)])


#: the index entry of an absent inner chunk (offset and size all ones)
_ABSENT = 2**64 - 1
#: bytes Blosc may add to a chunk it cannot compress (its header)
_BLOSC_MAX_OVERHEAD = 16


def _sharding(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The ``sharding_indexed`` configuration of an array's codecs, or ``None``."""
    codecs = meta.get("codecs", [])
    if len(codecs) == 1 and codecs[0].get("name") == "sharding_indexed":
        return dict(codecs[0].get("configuration", {}))
    return None


def _raw_codecs(codecs: list[dict[str, Any]]) -> bool:
    """Whether ``codecs`` are ``bytes`` (little endian) and at most a ``crc32c``."""
    if not codecs or codecs[0].get("name") != "bytes" or len(codecs) > 2:
        return False
    if codecs[0].get("configuration", {}).get("endian", "little") != "little":
        return False
    return all(c.get("name") == "crc32c" for c in codecs[1:])


def _blosc_codecs(codecs: list[dict[str, Any]]) -> bool:
    """Whether ``codecs`` are ``bytes`` (little endian), ``blosc``, ``crc32c``: what the
    writer's ``compressor="lz4"`` / ``"zstd"`` store inside zarr v3 shard files."""
    return (len(codecs) == 3 and _raw_codecs([codecs[0]])
            and codecs[1].get("name") == "blosc" and codecs[2].get("name") == "crc32c")


def chunk_key_layout(meta: dict[str, Any]) -> tuple[str, str] | None:
    """How the zarr v3 array metadata ``meta`` names its chunk files: ``(prefix, sep)``,
    a chunk's key being ``prefix + sep.join(its grid coordinates)`` (the default encoding:
    ``"c" + sep``, ``sep`` "/" unless configured; v2 keys: no prefix, "." unless
    configured). ``None`` for an encoding other than those two."""
    enc = meta.get("chunk_key_encoding") or {"name": "default"}
    if not isinstance(enc, dict) or enc.get("name") not in ("default", "v2"):
        return None
    default = enc["name"] == "default"
    conf = enc.get("configuration") or {}
    sep = conf.get("separator", "/" if default else ".") if isinstance(conf, dict) else None
    if sep not in ("/", "."):
        return None
    return ("c" + sep if default else ""), sep


def open_raw(path: str | os.PathLike[str], remote: ChunkSource | None = None
             ) -> RawZarrArray | None:
    """A :class:`RawZarrArray` for the zarr v3 array at ``path``, or ``None`` when the
    array is not raw (compressed outside shard files, v2, big-endian, chunked along
    columns; sharded with inner codecs other than raw or Blosc + CRC-32C, or inner chunks
    that do not divide the shard). ``remote``: ``path``
    holds the array's metadata only, its chunk objects come from there (a collection on an
    object store, see :mod:`annbatch_torch.store.remote.mirror`)."""
    p = Path(path)
    try:
        with open(p / "zarr.json") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        return None
    sharding = _sharding(meta)
    if sharding is None:
        if not _raw_codecs(meta.get("codecs", [])):
            return None
    elif (not (_raw_codecs(sharding.get("codecs", []))
               or _blosc_codecs(sharding.get("codecs", [])))
          or not _raw_codecs(sharding.get("index_codecs", []))
          or sharding.get("index_location", "end") not in ("end", "start")):
        return None
    if meta.get("chunk_grid", {}).get("name") != "regular" or meta.get("storage_transformers"):
        return None
    if chunk_key_layout(meta) is None:
        return None
    try:
        dtype = np.dtype(meta["data_type"])
    except TypeError:
        return None
    if dtype.kind not in "biuf":
        return None
    shape = meta["shape"]
    chunks = meta["chunk_grid"]["configuration"]["chunk_shape"]
    if len(shape) not in (1, 2) or list(chunks[1:]) != list(shape[1:]):
        return None
    if sharding is not None:
        inner = sharding.get("chunk_shape", [])
        if (len(inner) != len(shape) or list(inner[1:]) != list(shape[1:])
                or int(inner[0]) < 1 or int(chunks[0]) % int(inner[0])):
            return None
    return RawZarrArray(p, meta, remote)


