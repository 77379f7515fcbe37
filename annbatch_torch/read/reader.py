"""Reading a pool: global row ranges -> one in-memory block per selected field.

A pool is a list of global ``[start, stop)`` row ranges (a
:class:`~annbatch_torch.sampling.WorkItem`'s ``ranges``) and optionally the order its rows
are to be laid out in (``order``). The reader splits the ranges at shard boundaries,
coalesces pieces that touch inside a shard, and reads every (field, piece) concurrently in
a small thread pool (zarr / h5py / numcodecs release the GIL while decoding):

* CSR fields -> one ``scipy.sparse.csr_matrix`` already in ``order``: where the chunks are
  raw (:mod:`annbatch_torch.store.rawzarr`), each row is read straight into its place
  (``indptr`` comes from the shard's cached ``indptr``); other CSR fields are read in
  canonical order and permuted once;
* dense fields and obs columns -> one numpy array in ``order`` (categorical obs as global
  codes).

Any failure is re-raised as :class:`~annbatch_torch.errors.ReadError` naming the shard,
the field and the row range.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import scipy.sparse as sp

from ..errors import AnnBatchError, CollectionError, InputError, ReadError
from ..store.checks import bad_column
from ..store.diskio import CpuSlots, io_gate
from ..store.elements import CSCElement, CSRElement
from ..store.inputs.inplace import NonFiniteValues
from ..store.source import Source
from .buffers import BufferCache
from .csr import csr_view
from .scatter import densifies, scatter_rows, scatter_rows_range, scratch

__all__ = ["Piece", "Pieces", "split_ranges", "piece_arrays", "describe_ranges", "PoolReader",
           "read_column",
           "default_read_threads",
           "read_fused", "IO_DEPTH", "GATHER_PIECES", "GATHER_GAP_BYTES", "SCRATCH_ELEMS",
           "FUSED_SCATTER"]


#: ``(shard, start, stop, out_start)`` of a pool's pieces as int64 arrays
PieceArrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class Piece(NamedTuple):
    """A contiguous run of rows inside one shard, landing at ``out_start`` in the pool."""

    shard: int
    start: int  # local row in shard
    stop: int
    out_start: int


class Pieces(Sequence[Piece]):
    """A pool's pieces as four int64 arrays (:attr:`arrays`: shard, start, stop and
    out_start), read as a sequence of :class:`Piece` made on demand: a pool of drawn rows
    holds thousands of pieces, computed with per piece, not iterated, on the way."""

    __slots__ = ("arrays",)

    def __init__(self, shard: np.ndarray, start: np.ndarray, stop: np.ndarray,
                 out_start: np.ndarray) -> None:
        self.arrays: PieceArrays = (shard, start, stop, out_start)

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return Pieces(*(a[i] for a in self.arrays))
        return Piece(*(int(a[i]) for a in self.arrays))

    def __iter__(self) -> Iterator[Piece]:
        return itertools.starmap(Piece, zip(*(a.tolist() for a in self.arrays)))

    def first_of_each_shard(self) -> list[Piece]:
        """The first piece of every shard the pieces touch, in shard order."""
        _, first = np.unique(self.arrays[0], return_index=True)
        return [self[int(i)] for i in first]


def split_ranges(ranges: np.ndarray, offsets: np.ndarray) -> Pieces:
    """Split global row ranges at shard boundaries and merge pieces that touch.

    Parameters
    ----------
    ranges
        ``(k, 2)`` global ``[start, stop)`` ranges in canonical (output) order.
    offsets
        Shard start rows plus the total at the end (``Source.shard_offsets``).
    """
    ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    ranges = ranges[ranges[:, 1] > ranges[:, 0]]
    if not len(ranges):
        empty = np.zeros(0, dtype=np.int64)
        return Pieces(empty, empty, empty, empty)
    offsets = np.asarray(offsets, dtype=np.int64)
    s0 = np.searchsorted(offsets, ranges[:, 0], side="right") - 1
    s1 = np.searchsorted(offsets, ranges[:, 1] - 1, side="right") - 1
    n = s1 - s0 + 1  # shards each range touches
    run = np.repeat(np.arange(len(ranges)), n)
    shard = s0[run] + np.arange(len(run)) - np.repeat(np.cumsum(n) - n, n)
    lo = np.maximum(ranges[run, 0], offsets[shard]) - offsets[shard]
    hi = np.minimum(ranges[run, 1], offsets[shard + 1]) - offsets[shard]
    keep = hi > lo  # empty shards in between
    shard, lo, hi = shard[keep], lo[keep], hi[keep]
    new = np.concatenate([[True], (shard[1:] != shard[:-1]) | (lo[1:] != hi[:-1])])
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(shard) - 1)
    shard, lo, hi = shard[first], lo[first], hi[last]
    out = np.cumsum(hi - lo) - (hi - lo)
    return Pieces(shard, lo, hi, out)


def piece_arrays(pieces: Sequence[Piece]) -> PieceArrays:
    """``(shard, start, stop, out_start)`` of ``pieces`` as int64 arrays (what
    :func:`_groups`, the gathers and the categorical assembly compute with)."""
    if isinstance(pieces, Pieces):
        return pieces.arrays
    n = len(pieces)
    shard, start, stop, out = (np.fromiter((p[i] for p in pieces), np.int64, n)
                               for i in range(4))
    return shard, start, stop, out


def _groups(pieces: Sequence[Piece], parts: int, gap: int | None = None,
            arrays: PieceArrays | None = None) -> list[tuple[int, int]]:
    """``[i0, i1)`` runs of consecutive pieces of one shard in ascending row order, cut
    into about ``parts`` runs in all (so threads share the work); with ``gap``, a run also
    ends where the next piece starts ``gap`` rows or more after the previous one.
    ``arrays``: :func:`piece_arrays` of ``pieces``, when made already."""
    shard, start, stop, _ = piece_arrays(pieces) if arrays is None else arrays
    cut = (shard[1:] != shard[:-1]) | (start[1:] < stop[:-1])
    if gap is not None:
        cut |= start[1:] - stop[:-1] >= gap
    bounds = [0, *(np.flatnonzero(cut) + 1).tolist(), len(pieces)]
    out = []
    step = max(1, -(-len(pieces) // max(1, parts)))
    for a, b in itertools.pairwise(bounds):
        out += [(i, min(i + step, b)) for i in range(a, b, step)]
    return out


def _row_lengths(pieces: Sequence[Piece], els: list[Any], arrays: PieceArrays | None = None
                 ) -> np.ndarray:
    """Non-zeros of each row of ``pieces`` (CSR elements ``els``), in canonical order."""
    if not pieces:
        return np.zeros(0, np.int64)
    if len(pieces) < GATHER_PIECES:
        return np.concatenate([el.indptr.lengths(p.start, p.stop)
                               for p, el in zip(pieces, els)])
    arrays = piece_arrays(pieces) if arrays is None else arrays
    lengths = np.empty(int((arrays[2] - arrays[1]).sum()), dtype=np.int64)
    for a, b in _groups(pieces, 1, arrays=arrays):
        rows, canon = _piece_rows(arrays, a, b)
        indptr = els[a].indptr
        lengths[canon] = indptr[rows + 1] - indptr[rows]
    return lengths


def first_places(order: np.ndarray, n_rows: int) -> np.ndarray:
    """Where each of ``n_rows`` canonical rows first appears in ``order`` (every one must)."""
    uniq, first = np.unique(order, return_index=True)
    if len(uniq) != n_rows:
        raise ValueError(f"order must hold each of the {n_rows} rows at least once, "
                         f"it holds {len(uniq)} of them")
    return first


def repeat_rows(data: np.ndarray, indices: np.ndarray, indptr: np.ndarray,
                order: np.ndarray) -> None:
    """Fill the rows of a CSR pool laid out in ``order`` whose canonical row appeared
    before (read once, at its first place): copy them from there."""
    first = first_places(order, int(order.max()) + 1 if order.size else 0)
    dup = np.flatnonzero(first[order] != np.arange(len(order)))
    if not dup.size:
        return
    src = indptr[first[order[dup]]]
    n = indptr[dup + 1] - indptr[dup]
    for arr in (data, indices):  # compiled row copies (no index array per element)
        scatter_rows(arr, src, n, arr, indptr[dup])


def _piece_rows(arrays: PieceArrays, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """The local rows of pieces ``[a, b)`` (:func:`piece_arrays`) and their canonical
    positions, concatenated."""
    start, stop, out = arrays[1][a:b], arrays[2][a:b], arrays[3][a:b]
    n = stop - start
    offset = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    return np.repeat(start, n) + offset, np.repeat(out, n) + offset


def describe_ranges(source: Source, ranges: np.ndarray, limit: int = 4) -> str:
    """Global row ranges as ``"<shard path> rows [a, b)"`` pieces, for error messages."""
    pieces = split_ranges(np.asarray(ranges, dtype=np.int64).reshape(-1, 2),
                          source.shard_offsets)
    text = "; ".join(
        f"{source.shard_name(p.shard)} rows [{p.start}, {p.stop})" for p in pieces[:limit]
    )
    return text + (f"; and {len(pieces) - limit} more ranges" if len(pieces) > limit else "")


#: elements of values and of indices a read thread puts in its scratch at a time: a pool's
#: piece of 512 rows of ~2,000 non-zeros at once (a chunk the block's end cuts is read again
#: by the next block); 8 MiB per thread for float32 + int32, kept while the reader lives
SCRATCH_ELEMS = 1 << 20
#: read rows of shards storing the pool's own dtypes through the scratch too (one ``preadv``
#: and one CRC-32C per chunk, then the compiled scatter) rather than straight into place
#: (a ``preadv`` buffer and a CRC-32C update per row)
FUSED_SCATTER = True


def _row_blocks(lens: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """``[a, b)`` runs of consecutive rows of at most ``limit`` elements (a longer row
    alone)."""
    ends = np.cumsum(lens, dtype=np.int64)
    out, a, base = [], 0, 0
    while a < len(lens):
        b = max(a + 1, int(np.searchsorted(ends, base + limit, side="right")))
        out.append((a, b))
        base, a = int(ends[b - 1]), b
    return out


def _prefetch(el: CSRElement, starts: np.ndarray, ends: np.ndarray) -> None:
    """On an object store, fetch every chunk of the element ranges ``[starts, ends)`` of
    ``el``'s data and indices at once (the blocks of :func:`read_fused` would otherwise
    wait on the store one after the other)."""
    for arr in (el.data, el.indices):
        if getattr(arr, "remote", None) is None:
            continue
        keep = ends > starts
        size = arr.chunk_rows
        first, last = starts[keep] // size, (ends[keep] - 1) // size
        n = last - first + 1
        ids = np.repeat(first, n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
        arr.prefetch(np.unique(ids).tolist())


def read_fused(el: CSRElement, rows: np.ndarray, data: np.ndarray, indices: np.ndarray,
               dests: np.ndarray, trust_verified: bool = False) -> dict[int, int] | None:
    """Rows ``rows`` (ascending, distinct) of ``el`` put at ``data[dests[i]:]`` and
    ``indices[dests[i]:]``, cast to their dtypes: read in stored order, a block of at most
    :data:`SCRATCH_ELEMS` at a time, into the thread's scratch (one ``preadv`` and one
    CRC-32C per chunk), then scattered by the compiled loop (:func:`~.scatter.scatter_rows`).
    The column indices are checked inside ``[0, n_cols)`` by that loop, while in the
    cache: returns ``{}`` (the delivered indices were checked already) or, when one is
    outside, ``None`` (the caller's check of the pool then finds it and names it).
    ``trust_verified``: rows a sampler drew (see :meth:`CSRElement.read_rows_gather`)."""
    rows = np.asarray(rows, dtype=np.int64)
    if not rows.size:
        return {}
    # drawn rows of chunks verified before: cast on the way from the page cache, no scratch
    # pass, the column indices checked on the way (nothing left for the caller to check)
    if trust_verified and hasattr(el, "read_rows_cast") and el.read_rows_cast(
            rows, data, indices, dests):
        return {}
    # drawn rows read from chunks verified before stay on read_rows_gather (trust_verified)
    first = int(rows[0])
    contiguous = (not trust_verified) and int(rows[-1]) - first + 1 == len(rows)
    offsets: Any = None
    if contiguous:
        offsets = el.indptr[first : first + len(rows) + 1]
        at, lens = offsets[:-1], np.diff(offsets)
    else:
        at = el.indptr[rows]
        lens = el.indptr[rows + 1] - at
    _prefetch(el, at, at + lens)
    inside = True
    for a, b in _row_blocks(lens, SCRATCH_ELEMS):
        part = lens[a:b]
        starts = np.zeros(b - a, dtype=np.int64)
        np.cumsum(part[:-1], out=starts[1:])
        n = int(starts[-1] + part[-1])
        values, columns = scratch(n, el.data.dtype, 0), scratch(n, el.indices.dtype, 1)
        if contiguous:
            el.read_rows_scatter(int(rows[a]), int(rows[b - 1]) + 1, values, columns, starts,
                                 offsets=offsets[a : b + 1])
        else:
            el.read_rows_gather(rows[a:b], values, columns, starts,
                                trust_verified=trust_verified)
        scatter_rows(values, starts, part, data, dests[a:b])
        span = scatter_rows_range(columns, starts, part, indices, dests[a:b])
        if span is not None and not 0 <= span[0] <= span[1] < el.n_cols:
            inside = False
    return {} if inside else None


#: reads in flight per process (each a thread; only ``threads`` of them use a CPU at once)
IO_DEPTH = 16
#: a pool of this many pieces or more (rows a sampler drew) is read in a few calls per
#: shard (:meth:`CSRElement.read_rows_gather`; other fields by covering ranges)
GATHER_PIECES = 64
#: rows per piece, on average, from which drawn rows are read by all the read threads
#: (runs of rows drawn from a grouped collection) rather than by one
RUN_ROWS = 8
#: bytes between pieces up to which a non-sparse field's covering read spans both (in rows:
#: 8,192 of an int64 obs column, 327 of 50 float32 obsm columns, 0 of a wide dense matrix)
GATHER_GAP_BYTES = 1 << 16


def default_read_threads() -> int:
    """Concurrent pool reads per process: the usable CPUs, at most 4.

    Measured on 2 CPUs (benchmarks, 3 interleaved rounds): 2 threads read 1.15-1.2x faster
    than 4 (less contention with the consumer), 1 thread 0.6-0.75x.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


class PoolReader:
    """Read pools of rows of selected fields from a
    :class:`~annbatch_torch.store.source.Source`.

    Parameters
    ----------
    source
        Where rows come from.
    fields
        Field strings to read (``"X"``, ``"layers/counts"``, ``"obs/cell_type"``...).
    threads
        Reads that may copy and check bytes at once (CPU slots).
    io_depth
        Reads in flight at once when the data comes from the disk (default
        :data:`IO_DEPTH`, at least ``threads``): a read of raw chunks that must wait for
        the disk gives its slot back while it waits
        (:func:`~annbatch_torch.store.diskio.io_gate`), so many requests queue at the
        disk while at most ``threads`` copy and check bytes. A pool is read this way when
        5% or more of the previous pool's reads waited for the disk (and the first pool);
        when they came from the page cache, the next pool is read by ``threads`` threads
        (extra threads cost warm loaders about 20%, measured).
    values_dtype
        The dtype of sparse fields' values in pools (``AnnBatchDataset(out_dtype=...)``:
        the caller checked that it holds every stored value); ``None``: each field's
        dtype.
    stored_dtypes
        Sparse fields' pools keep the narrower dtypes collection shards store (integer
        counts, 16-bit column indices) rather than widening them to ``values_dtype`` and
        int32: for pools that are only densified (into ``values_dtype``, casting then),
        which then take less memory (and less of it fresh in a DataLoader worker's first
        pools).
    """

    def __init__(self, source: Source, fields: list[str], threads: int = 4,
                 io_depth: int | None = None, values_dtype: np.dtype | None = None,
                 stored_dtypes: bool = False) -> None:
        self.source = source
        self.values_dtype = None if values_dtype is None else np.dtype(values_dtype)
        self.stored_dtypes = bool(stored_dtypes)
        self.fields = list(dict.fromkeys(fields))
        self.threads = max(1, int(threads))
        self.io_depth = max(self.threads, int(io_depth or IO_DEPTH))
        self._pool: ThreadPoolExecutor | None = None  # threads workers: warm pools
        self._deep: ThreadPoolExecutor | None = None  # io_depth workers: pools from disk
        self._pool_pid: int | None = None
        self._slots: CpuSlots | None = None
        self._from_disk = True  # the first pool: no reads seen yet
        # 3 pools (a CSR field's data and indices share a buffer): the one read ahead, the
        # current one and the previous one while the caller still holds its last batch;
        # room for twice that
        self.buffers = BufferCache(keep=6 * len(self.fields))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = state["_deep"] = None
        state["_pool_pid"] = None
        state["_slots"] = None
        state["_from_disk"] = True
        return state

    def _executor(self) -> ThreadPoolExecutor:
        """The executor for the next pool: deep when the last pool waited for the disk."""
        if self._pool is None or self._pool_pid != os.getpid():
            # fresh in a forked child: a semaphore copied while a read held it stays taken
            self._slots = CpuSlots(self.threads)
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="annbatch-read")
            self._deep = None
            self._pool_pid = os.getpid()
            self._from_disk = True
        assert self._slots is not None
        reads, waits = self._slots.take_counts()
        if reads:  # 5% of the last pool's reads or more waited for the disk
            self._from_disk = waits * 20 >= reads
        if not self._from_disk or self.io_depth <= self.threads:
            # pools from the page cache: the deep executor is let go of; its threads exit
            # once it is garbage and its queue is empty (a read still using it, e.g. a
            # dropped read-ahead, finishes first), and their read scratch goes with them.
            # Pools switching between the disk and the cache make it anew each time: 16
            # threads and their scratch, little beside a pool that waits for the disk
            self._deep = None
            return self._pool
        if self._deep is None:
            self._deep = ThreadPoolExecutor(self.io_depth, thread_name_prefix="annbatch-read")
        return self._deep

    def _gated(self, fn: Any, *args: Any) -> Any:
        """Run one read task holding a CPU slot (given back while it waits for the disk)."""
        assert self._slots is not None
        with io_gate(self._slots):
            return fn(*args)

    def close(self) -> None:
        self.buffers.clear()
        for ex in (self._pool, self._deep):
            if ex is not None:
                ex.shutdown(wait=False, cancel_futures=True)
        self._pool = self._deep = None

    # -- reading -----------------------------------------------------------------
    def _wrap(self, exc: BaseException, piece: Piece, field: str) -> ReadError | InputError:
        """``exc`` met reading ``field`` of ``piece``, with where it was met: a
        :class:`ReadError`, or an :class:`InputError` for NaN or inf in an input read in
        place (which the writer refuses as an InputError too: no damage, no store
        failure)."""
        where = self.source.shard_name(piece.shard)
        msg = str(exc) if isinstance(exc, AnnBatchError) else f"{type(exc).__name__}: {exc}"
        # a message that says what to do already (an input's damaged_reason) gets no other
        fix = "" if "Fix:" in msg else " " + self.source.DAMAGE_FIX
        what = self.source.PART
        kind = InputError if isinstance(exc, NonFiniteValues) else ReadError
        return kind(
            f"{where}: failed reading field {field!r}, {what} rows [{piece.start}, "
            f"{piece.stop}) ({what} {piece.shard}): {msg.rstrip('.')}.{fix}"
        )

    def _element(self, piece: Piece, field: str) -> Any:
        el = self.source.element(piece.shard, field)
        if isinstance(el, CSCElement):
            el = el.as_csr_element()
        return el

    def read(self, ranges: np.ndarray, order: np.ndarray | None = None, *,
             random_access: bool = False) -> dict[str, Any]:
        """Read ``ranges`` for every field (see :meth:`_read` for the parameters), from the
        collection as it was when it was opened: the source is checked before and after
        (``Source.check_current``), so a pool that another process's rewrite of the
        collection reached raises :class:`~annbatch_torch.CollectionError` instead of
        mixing the two (a failure during the read is reported as that, when it is)."""
        self.source.check_current()
        try:
            out = self._read(ranges, order, random_access=random_access)
        except Exception as e:
            try:
                self.source.check_current()
            except CollectionError as changed:
                raise changed from e
            raise
        self.source.check_current()
        return out

    def _read(self, ranges: np.ndarray, order: np.ndarray | None = None, *,
              random_access: bool = False) -> dict[str, Any]:
        """Read ``ranges`` for every field.

        Parameters
        ----------
        ranges
            ``(k, 2)`` global ``[start, stop)`` row ranges; their concatenation is the
            pool's *canonical* row order.
        order
            Optional canonical positions: output row ``i`` is canonical row ``order[i]``,
            a permutation or any other list of positions (they repeat where a sampler drew
            a row twice; each row is read once). CSR fields of raw stores are read straight
            into their places (no gather afterwards; a repeated row is copied within the
            pool); other fields are gathered after reading.
        random_access
            The rows were drawn by a sampler: many small ranges across the source. CSR
            fields of raw stores are read in a few gather calls per shard, reading each
            inner chunk whole (and verifying it) only the first time this process touches
            it (``RawZarrArray.read_runs``'s ``trust_verified``; column indices are checked
            on every pool then, by the compiled loop as they are read where it reads them);
            other fields by covering reads.
        """
        ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        n_rows = int((ranges[:, 1] - ranges[:, 0]).sum())
        if order is not None:
            order = np.asarray(order, dtype=np.int64)
            if order.ndim != 1 or (order.size and (order.min() < 0 or order.max() >= n_rows)):
                raise ValueError(f"order must hold positions in [0, {n_rows}), got "
                                 f"{order.shape}")
        pieces = split_ranges(ranges, self.source.shard_offsets)
        ex = self._executor()
        jobs: dict[str, list[tuple[Piece, Future[Any]]]] = {}
        job_els: dict[str, list[Any]] = {}  # CSR fields: the element each job reads
        covered: set[str] = set()  # fields read by covering reads (a list per job)
        csr_buffers: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        permute_after: set[str] = set()
        # drawn rows: the pieces as arrays, made once for every field
        arrays = (piece_arrays(pieces) if random_access and len(pieces) >= GATHER_PIECES
                  else None)
        for field in self.fields:
            # open elements in this thread first: errors surface with context, and
            # element caches are not populated concurrently
            by_shard: dict[int, Any] = {}
            for p in pieces.first_of_each_shard():
                try:
                    by_shard[p.shard] = self._element(p, field)
                except Exception as e:
                    raise self._wrap(e, p, field) from e
            els = [by_shard[k] for k in pieces.arrays[0].tolist()]
            if els and isinstance(els[0], CSRElement):
                raw = all(el.can_scatter for el in by_shard.values())
                dtypes = self._pool_dtypes(field, list(by_shard.values()))
                narrow = any((el.data.dtype, el.indices.dtype) != dtypes
                             for el in by_shard.values())
                scatter = order is not None and raw
                fused = raw and (narrow or (scatter and FUSED_SCATTER))
                jobs[field], job_els[field] = self._submit_csr(
                    ex, field, pieces, els, csr_buffers, order if scatter else None,
                    random_access, dtypes, fused, arrays)
                if order is not None and not scatter:
                    permute_after.add(field)
            elif random_access and len(pieces) >= GATHER_PIECES:  # covering reads
                covered.add(field)
                jobs[field] = [
                    (pieces[a], ex.submit(self._gated, self._read_cover, els[a], pieces[a:b]))
                    for a, b in _groups(pieces, 2 * self.threads, self._gap_rows(field),
                                        arrays)
                ]
                if order is not None:
                    permute_after.add(field)
            else:
                jobs[field] = [
                    (p, ex.submit(self._gated, self._read_piece, el, p))
                    for p, el in zip(pieces, els)
                ]
                if order is not None:
                    permute_after.add(field)
        out: dict[str, Any] = {}
        for field, futs in jobs.items():
            parts = []
            for p, f in futs:
                try:
                    parts.append(f.result())
                except Exception as e:
                    for _, other in futs:
                        other.cancel()
                    raise self._wrap(e, p, field) from e
            if field in covered:
                parts = [part for group in parts for part in group]
            elif (field in csr_buffers and field not in permute_after and order is not None
                  and len(order) != n_rows):  # read into place: fill the repeats
                data, indices, indptr = csr_buffers[field]
                repeat_rows(data, indices, indptr, order)
            try:
                if field in csr_buffers:
                    value = self._assemble_csr(field, pieces, job_els[field],
                                               csr_buffers[field], n_rows, parts)
                else:
                    value = self._assemble(field, pieces, parts, n_rows, arrays)
            except ReadError:
                raise
            except Exception as e:  # e.g. shards disagreeing on a dense field's width
                ranges_txt = ", ".join(
                    f"shard {p.shard} rows [{p.start}, {p.stop})" for p in pieces[:4]
                ) + (", ..." if len(pieces) > 4 else "")
                raise ReadError(
                    f"{self.source.describe()}: failed assembling field {field!r} from "
                    f"{ranges_txt} ({type(e).__name__}: {e}). {self.source.DAMAGE_FIX}"
                ) from e
            out[field] = value[order] if field in permute_after else value
        return out

    def _submit_csr(
        self,
        ex: ThreadPoolExecutor,
        field: str,
        pieces: Sequence[Piece],
        els: list[Any],
        buffers: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
        order: np.ndarray | None,
        random_access: bool,
        dtypes: tuple[np.dtype, np.dtype],
        fused: bool,
        arrays: PieceArrays | None = None,
    ) -> tuple[list[tuple[Piece, Future[Any]]], list[Any]]:
        """Allocate the pool's data/indices once (``dtypes``); every row is read into its
        final place (canonical order, or ``order`` when given). Returns the jobs and the
        element each reads: one job per piece, or for many pieces of drawn rows
        (``random_access``) a few per shard that read all their rows at once
        (:meth:`CSRElement.read_rows_gather`). ``fused``: rows are read in stored order
        into a thread's scratch and put in place by :func:`~.scatter.scatter_rows`, cast
        to the pool's dtypes (the way for shards storing narrower dtypes); else straight
        into place by ``preadv``."""
        if arrays is None and random_access and len(pieces) >= GATHER_PIECES:
            arrays = piece_arrays(pieces)
        canon = _row_lengths(pieces, els, arrays)
        out_len = canon if order is None else canon[order]
        indptr = np.zeros(len(out_len) + 1, dtype=np.int64)
        np.cumsum(out_len, out=indptr[1:])
        # each row goes where it first appears (repeats are copied once it is read)
        dests = indptr[:-1] if order is None else indptr[first_places(order, len(canon))]
        nnz = int(indptr[-1])
        data, indices = self.buffers.take_pair(nnz, dtypes[0], dtypes[1])
        buffers[field] = (data, indices, indptr)
        # a read thread keeps its task's arguments until it gets to drop the task, which may
        # be well after the result is seen (a busy machine preempts it in between); handed
        # over in a list the task empties, the pool's buffers are not held by it past its
        # return, so a dropped pool's buffers are free for the next pool at once
        distinct = list({id(el): el for el in els}.values())
        if random_access and len(pieces) >= GATHER_PIECES and all(
                el.can_scatter and hasattr(el, "read_rows_gather") for el in distinct):
            jobs, job_els = [], []
            # from the disk: many reads in flight; from the page cache: the read threads
            # for runs of rows (a collection grouped for the sampler: the copies, not the
            # Python steps, are the work) and for single rows read by the compiled loop
            # (store/native.py: no GIL held per row), else one call per shard (a Python
            # step per row holds the GIL: two threads were 0.75x as fast as one)
            runs = len(out_len) >= RUN_ROWS * len(pieces)
            compiled = all(el.reads_compiled for el in distinct)
            spread = self.io_depth if self._from_disk else (
                self.threads if runs or compiled else 1)
            assert arrays is not None
            for a, b in _groups(pieces, spread, arrays=arrays):
                rows, canon = _piece_rows(arrays, a, b)
                # errors name the job's span of shard rows (its pieces are of one shard)
                span = Piece(int(arrays[0][a]), int(arrays[1][a]), int(arrays[2][b - 1]),
                             int(arrays[3][a]))
                jobs.append((span, ex.submit(self._gated, self._read_csr_gather, els[a],
                                             [rows, data, indices, dests[canon]], fused)))
                job_els.append(els[a])
            return jobs, job_els
        return [
            (p, ex.submit(self._gated, self._read_csr_piece, el, p,
                          [data, indices, dests[p.out_start : p.out_start + (p.stop - p.start)]],
                          fused))
            for p, el in zip(pieces, els)
        ], list(els)

    @staticmethod
    def _read_csr_gather(el: CSRElement, arrays: list[np.ndarray], fused: bool
                         ) -> dict[int, int] | None:
        """Read rows of one shard into the pool (``arrays``: rows, data, indices and row
        destinations, taken out of the list as in :meth:`_read_csr_piece`)."""
        rows, data, indices, dests = arrays
        arrays.clear()
        if fused:
            return read_fused(el, rows, data, indices, dests, trust_verified=True)
        return el.read_rows_gather(rows, data, indices, dests, trust_verified=True)

    @staticmethod
    def _read_csr_piece(el: CSRElement, p: Piece, arrays: list[np.ndarray], fused: bool
                        ) -> dict[int, int] | None:
        """Read one piece into the pool (``arrays``: data, indices and row destinations,
        taken out of the list); returns its indices chunks' CRCs (see
        :meth:`CSRElement.read_rows_scatter`) or ``None`` when they are unknown."""
        data, indices, dests = arrays
        arrays.clear()
        # a narrow stored dtype read by a scatter-capable element beside elements that
        # cannot scatter (a mixture of a collection and inputs read in place): cast too
        if fused or (el.can_scatter and (el.data.dtype, el.indices.dtype)
                     != (data.dtype, indices.dtype)):
            return read_fused(el, np.arange(p.start, p.stop), data, indices, dests)
        if el.can_scatter:
            return el.read_rows_scatter(p.start, p.stop, data, indices, dests)
        lo, hi = el.nnz_range(p.start, p.stop)  # canonical order: one contiguous block
        a = int(dests[0]) if len(dests) else 0
        el.read_into(p.start, p.stop, data[a : a + hi - lo], indices[a : a + hi - lo])
        return None

    def _pool_dtypes(self, field: str, els: list[Any]) -> tuple[np.dtype, np.dtype]:
        """The (data, indices) dtypes of field ``field``'s pools: :attr:`values_dtype`, else
        the field's dtype (what readers deliver, whatever a shard stores), and int32 (int64
        where a shard's indices are wider, or the matrix too wide). With
        :attr:`stored_dtypes` (pools only densified, into ``values_dtype`` or float32):
        what the shards store where it is no wider, values that densifying casts as
        reading would (``scatter.densifies``) and 8- or 16-bit column indices, else that
        dtype and int32."""
        info = self.source.fields.get(field)
        index = np.result_type(np.int32, *{el.indices.dtype for el in els})
        n_cols = max(el.n_cols for el in els)
        if index.kind == "u" or n_cols >= np.iinfo(np.int32).max:
            index = np.dtype(np.int64)
        if not self.stored_dtypes:
            data = (self.values_dtype if self.values_dtype is not None
                    else np.dtype(info.dtype) if info is not None else els[0].dtype)
        else:  # densified into values_dtype (float32 by default)
            data = np.dtype(np.float32 if self.values_dtype is None else self.values_dtype)
            if all(el.can_scatter for el in els):
                stored = np.result_type(*{el.data.dtype for el in els})
                if stored.itemsize <= data.itemsize and densifies(stored, data):
                    data = stored
                narrow = np.result_type(*{el.indices.dtype for el in els})
                if (narrow.kind == "u" and narrow.itemsize < 4
                        and n_cols <= np.iinfo(narrow).max):
                    index = narrow
        return np.dtype(data), np.dtype(index)

    def _assemble_csr(
        self,
        field: str,
        pieces: Sequence[Piece],
        els: list[Any],
        buffers: tuple[np.ndarray, np.ndarray, np.ndarray],
        n_rows: int,
        crcs: list[dict[int, int] | None],
    ) -> sp.csr_matrix:
        data, indices, indptr = buffers
        # the widest element's (a mixture's members differ: MemberGenes maps each row)
        n_cols = max(el.n_cols for el in els) if els else self._element(pieces[0], field).n_cols
        # column indices are checked once per chunk content: a pool whose indices chunks
        # all have the CRC of chunks checked before needs no scan (~10% of a pool's read)
        if all(el.all_checked(c) for el, c in zip(els, crcs)):
            bad = None
        else:
            bad = bad_column(indices, n_cols)
            if bad is None:
                for el, c in zip(els, crcs):
                    el.mark_checked(c)
        if bad is not None:
            row = int(np.searchsorted(indptr, bad, side="right")) - 1
            raise ReadError(
                f"{self.source.describe()}: field {field!r} holds column index "
                f"{int(indices[bad])} outside [0, {n_cols}) (pool row {row}, read from "
                f"{describe_ranges(self.source, self._ranges_of(pieces))}). "
                f"{self.source.DAMAGE_FIX}"
            )
        if indptr[-1] < np.iinfo(np.int32).max:
            indptr = indptr.astype(np.int32)  # scipy would otherwise copy indices to int64
        return csr_view(data, indices, indptr, (len(indptr) - 1, n_cols))

    def _ranges_of(self, pieces: Sequence[Piece]) -> np.ndarray:
        offsets = np.asarray(self.source.shard_offsets, dtype=np.int64)
        shard, start, stop, _ = piece_arrays(pieces)
        return np.stack([offsets[shard] + start, offsets[shard] + stop], axis=1)

    def _gap_rows(self, field: str) -> int:
        """Rows of ``field`` worth :data:`GATHER_GAP_BYTES` (at least 1)."""
        info = self.source.fields.get(field)
        if info is None:
            return 1
        width = int(np.prod([s for s in info.shape[1:] if s is not None], dtype=np.int64))
        try:
            size = np.dtype(info.dtype).itemsize or 8  # strings: a pointer's worth at least
        except TypeError:
            size = 8
        return max(1, GATHER_GAP_BYTES // (max(1, width) * size))

    def _read_cover(self, el: Any, pieces: Sequence[Piece]) -> list[Any]:
        """Pieces of one shard read by one covering read (rows between them are read and
        dropped): their values in piece order, one array for all of them where the
        field reads as a numpy array, else one value per piece."""
        _, start, stop, _ = piece_arrays(pieces)
        lo, hi = int(start[0]), int(stop.max())
        value = el.read(lo, hi)
        if len(value) != hi - lo:
            raise ReadError(f"expected {hi - lo} rows, got {len(value)}")
        if len(pieces) > 1 and isinstance(value, np.ndarray):  # the rows of every piece at once
            n = stop - start
            take = np.repeat(start - lo, n) + (np.arange(int(n.sum()))
                                              - np.repeat(np.cumsum(n) - n, n))
            return [value[take]]
        return [value[a - lo : b - lo] for a, b in zip(start.tolist(), stop.tolist())]

    def _read_piece(self, el: Any, p: Piece) -> Any:
        # CSR fields never come here: _submit_csr reads them into the pool's buffers
        value = el.read(p.start, p.stop)
        if len(value) != p.stop - p.start:
            raise ReadError(f"expected {p.stop - p.start} rows, got {len(value)}")
        return value

    def _assemble(self, field: str, pieces: Sequence[Piece], parts: list[Any], n_rows: int,
                  arrays: PieceArrays | None = None) -> Any:
        if not pieces:
            info = self.source.fields[field]
            if info.kind == "csr":
                return sp.csr_matrix((0, int(info.shape[1] or 0)), dtype=np.dtype(info.dtype))
            return np.zeros((0, *[int(s) for s in info.shape[1:]]), dtype=np.dtype(info.dtype))
        values = np.concatenate(parts) if len(parts) > 1 else parts[0]
        info = self.source.fields.get(field)
        if info is None:
            return values
        if info.kind != "categorical":  # one dtype for every pool, whatever the shard
            return np.asarray(values).astype(np.dtype(info.dtype), copy=False)
        # pieces land one after the other (split_ranges): checked and mapped piece by
        # piece, never with an array per row beside the codes (a whole column of 10^7 rows
        # read to bind a sampler: such arrays took ~27 bytes a row)
        shard, start, stop, _ = piece_arrays(pieces) if arrays is None else arrays
        lens = stop - start
        offsets = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        shards = np.unique(shard)
        tables = {int(k): self.source.code_map(int(k), field) for k in shards}
        n_global = len(info.categories or ())
        limits = np.array([n_global if tables[int(k)] is None else len(tables[int(k)]) - 1
                           for k in shards], dtype=np.int64)
        limit = limits[np.searchsorted(shards, shard)]  # of each piece
        values = np.asarray(values)
        # codes index the categories (-1 is a missing value); anything else would turn into
        # a wrong label, or a device-side assert far away in the loss function
        some = lens > 0
        if some.any():
            at = offsets[some]
            lo = np.minimum.reduceat(values, at)
            hi = np.maximum.reduceat(values, at)
            bad = np.flatnonzero((lo < -1) | (hi >= limit[some]))
            if bad.size:
                i = int(np.flatnonzero(some)[bad[0]])
                part = values[offsets[i] : offsets[i] + lens[i]]
                r = int(np.flatnonzero((part < -1) | (part >= limit[i]))[0])
                raise ReadError(
                    f"{self.source.shard_name(int(shard[i]))}: field {field!r} holds category "
                    f"code {int(part[r])} at shard row {int(start[i]) + r} (shard "
                    f"{int(shard[i])}), outside [-1, {int(limit[i])}); the categorical is "
                    "damaged, rewrite the store."
                )
        # shards appended with more categories store wider codes than the older ones: one
        # dtype for every pool (after the check above, which sees the codes as stored)
        dtype = np.dtype(info.dtype)
        if all(t is None for t in tables.values()):
            return values.astype(dtype, copy=False)
        values = values.astype(dtype, copy=True)  # never write into a source's buffer
        for k, table in tables.items():
            if table is None:
                continue
            mine = np.flatnonzero(shard == k)
            # many pieces (drawn rows): one gather over their rows rather than a Python
            # step each; few (whole shards of a column): in place, no array of their rows
            if len(mine) > 64:
                rows = np.repeat(offsets[mine] - np.cumsum(lens[mine]) + lens[mine],
                                 lens[mine]) + np.arange(int(lens[mine].sum()))
                values[rows] = table[values[rows]]
            else:
                for i in mine.tolist():
                    part = values[offsets[i] : offsets[i] + lens[i]]
                    part[...] = table[part]
        return values


def read_column(source: Source, field: str) -> np.ndarray:
    """Every row of one field of ``source`` (an obs column: a categorical's global codes),
    read once by a one-thread :class:`PoolReader`."""
    reader = PoolReader(source, [field], threads=1)
    try:
        return np.asarray(reader.read(np.array([[0, source.n_obs]], dtype=np.int64))[field])
    finally:
        reader.close()
