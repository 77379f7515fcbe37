"""Work items of the epoch plan: a pool's rows, their order, its batches.

A :class:`WorkItem` is complete: one pool's global row ranges, the pool's row order laid
out batch after batch (:func:`pool_order` of :func:`pool_permutation`), and the batches of
it a worker yields; everything reading and batch assembly need, so nothing downstream calls
back into the plan. A :class:`WorkList` computes an item (ranges and order) only when it is
indexed; :func:`remaining_items` is what is left of a list after a number of batches. Pure
numpy, no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple, Protocol, overload

import numpy as np

__all__ = [
    "WorkItem",
    "WorkList",
    "RowOrder",
    "PoolRows",
    "ChunkRows",
    "Stream",
    "merge_ranges",
    "remaining_items",
    "total_batches",
    "pool_permutation",
    "stratified_permutation",
    "item_permutation",
    "pool_order",
    "global_rows",
    "TAG_ROWS",
]

#: Seed tag of the row order inside a pool: ``default_rng([seed, epoch, pool, TAG_ROWS])``.
TAG_ROWS = 0x524F5753  # "ROWS"


@dataclass(frozen=True, eq=False)
class WorkItem:
    """One unit of a worker's work: batches ``[batch_start, batch_stop)`` of one pool.

    ``pool_index`` is the global pool index in the epoch (``-1`` for a padding item);
    ``ranges`` the ``(k, 2)`` int64 global row ranges in canonical order; ``n_rows`` the
    pool's rows. A padding item has one batch (``[0, 1)``) holding all its ``n_rows`` rows.
    Items of a plan (taken from a :class:`WorkList`) also carry ``order``, the pool's
    canonical positions laid out batch after batch (batch ``b`` is positions
    ``order[lo:hi]`` with ``(lo, hi) = bounds(b)``), and ``batch_size``. In chunked mode
    ``order`` is a permutation and the ranges hold ``n_rows`` rows; in sampling mode the
    ranges hold the pool's distinct rows, fewer than ``n_rows`` when a row was drawn twice,
    and ``order`` repeats its position.
    """

    pool_index: int
    ranges: np.ndarray
    n_rows: int
    batch_start: int
    batch_stop: int
    padding: bool = False
    order: np.ndarray | None = None
    batch_size: int = 0
    #: rows drawn by a sampler (read by random access, not as chunks)
    random_access: bool = False

    def bounds(self, batch: int) -> tuple[int, int]:
        """Positions ``[lo, hi)`` of batch ``batch`` in the pool laid out in ``order``."""
        if self.padding:
            return 0, self.n_rows
        lo = batch * self.batch_size
        return lo, min(lo + self.batch_size, self.n_rows)

    @cached_property
    def rows(self) -> np.ndarray:
        """Global row ids of the pool in ``order`` (``rows[lo:hi]`` are a batch's rows)."""
        if self.order is None:
            raise ValueError("this WorkItem carries no row order (take items from a WorkList)")
        return global_rows(self.ranges)[self.order]

    @property
    def n_batches(self) -> int:
        """Number of batches this item yields."""
        return self.batch_stop - self.batch_start

    def key(self) -> tuple:
        """A hashable description (for comparisons in tests and logs)."""
        return (
            self.pool_index,
            self.n_rows,
            self.batch_start,
            self.batch_stop,
            self.padding,
            self.ranges.tobytes(),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkItem) and self.key() == other.key()

    __hash__ = None  # type: ignore[assignment]


def merge_ranges(ranges: np.ndarray) -> np.ndarray:
    """Merge consecutive ranges that touch (``stop == next start``); order is kept."""
    if len(ranges) < 2:
        return ranges
    cut = np.flatnonzero(ranges[1:, 0] != ranges[:-1, 1])
    if len(cut) == len(ranges) - 1:
        return ranges
    first = np.concatenate([[0], cut + 1])
    last = np.concatenate([cut, [len(ranges) - 1]])
    return np.stack([ranges[first, 0], ranges[last, 1]], axis=1)


class Stream:
    """Stream ranges with cumulative row offsets; slices stream positions into row ranges."""

    def __init__(self, ranges: np.ndarray) -> None:
        self.ranges = ranges
        lengths = ranges[:, 1] - ranges[:, 0]
        self.ends = np.cumsum(lengths)
        self.starts = self.ends - lengths
        self.total = int(self.ends[-1]) if len(lengths) else 0

    def rows(self, a: int, b: int) -> np.ndarray:
        if b <= a:
            return np.empty((0, 2), dtype=np.int64)
        j0 = int(np.searchsorted(self.ends, a, side="right"))
        j1 = int(np.searchsorted(self.starts, b, side="left"))
        out = self.ranges[j0:j1].copy()
        out[0, 0] += a - self.starts[j0]
        out[-1, 1] -= self.ends[j1 - 1] - b
        out = merge_ranges(out)
        out.flags.writeable = False
        return out


class RowOrder(NamedTuple):
    """What a pool's row order depends on besides the pool: ``(seed, epoch, shuffle)``."""

    seed: int
    epoch: int
    shuffle: bool


class PoolRows(Protocol):
    """Where a :class:`WorkList` gets a pool's rows: positions ``[a, b)`` of the epoch's
    stream as ``(ranges, order)``, the distinct global rows as sorted or stream-ordered
    ranges and the pool's positions into them laid out batch after batch (``None``: the
    ranges' own order)."""

    #: positions in the epoch's stream
    total: int
    #: whether a pool's batches are not runs of the stream (:meth:`WorkList.per_batch`
    #: then refuses)
    shuffled: bool
    #: whether pools are drawn rows (read by random access)
    random_access: bool

    def pool(self, pool_index: int, a: int, b: int, batch_size: int
             ) -> tuple[np.ndarray, np.ndarray | None]: ...


class ChunkRows:
    """Chunked mode: the stream is the epoch's chunks' rows; a pool's rows are permuted by
    :func:`pool_permutation` of ``row_order`` (seeded by the pool index)."""

    def __init__(self, stream: Stream, row_order: RowOrder | None) -> None:
        self.stream, self.row_order = stream, row_order
        self.total = stream.total
        self.shuffled = row_order is not None and row_order.shuffle
        self.random_access = False

    def pool(self, pool_index: int, a: int, b: int, batch_size: int
             ) -> tuple[np.ndarray, np.ndarray | None]:
        ranges = self.stream.rows(a, b)
        if self.row_order is None:
            return ranges, None
        seed, epoch, shuffle = self.row_order
        perm = pool_permutation(b - a, seed=seed, epoch=epoch, pool_index=pool_index,
                                shuffle=shuffle and pool_index >= 0)
        return ranges, pool_order(perm, batch_size)


class WorkList(Sequence[WorkItem]):
    """A lazy list of :class:`WorkItem`: a pool's rows are computed when it is indexed.

    Pool ``p`` is positions ``[p * pool_size, (p + 1) * pool_size)`` of the epoch's stream,
    whose rows ``source`` gives. Slicing returns a :class:`WorkList`; ``pool_index``,
    ``batch_start`` and ``batch_stop`` are int64 arrays (pool index ``-1`` marks a padding
    item: the stream's first ``batch_size`` positions, one batch).
    """

    def __init__(
        self,
        source: PoolRows,
        pool_size: int,
        batch_size: int,
        pool_index: np.ndarray,
        batch_start: np.ndarray,
        batch_stop: np.ndarray,
    ) -> None:
        self.source, self.pool_size, self.batch_size = source, pool_size, batch_size
        self.pool_index, self.batch_start, self.batch_stop = pool_index, batch_start, batch_stop

    def __len__(self) -> int:
        return len(self.pool_index)

    @overload
    def __getitem__(self, i: int) -> WorkItem: ...
    @overload
    def __getitem__(self, i: slice) -> WorkList: ...
    def __getitem__(self, i: int | slice) -> WorkItem | WorkList:
        if isinstance(i, slice):
            return WorkList(
                self.source,
                self.pool_size,
                self.batch_size,
                self.pool_index[i],
                self.batch_start[i],
                self.batch_stop[i],
            )
        p = int(self.pool_index[i])
        total = self.source.total
        a, b = (
            (0, min(self.batch_size, total))
            if p < 0
            else (p * self.pool_size, min((p + 1) * self.pool_size, total))
        )
        ranges, order = self.source.pool(p, a, b, self.batch_size)
        return WorkItem(
            p,
            ranges,
            b - a,
            int(self.batch_start[i]),
            int(self.batch_stop[i]),
            padding=p < 0,
            order=order,
            batch_size=self.batch_size,
            random_access=self.source.random_access,
        )

    def __iter__(self) -> Iterator[WorkItem]:
        return (self[i] for i in range(len(self)))

    def per_batch(self) -> WorkList:
        """The same batches, one item per batch, in the same order (unshuffled lists only).

        Without shuffling a batch is a contiguous run of its pool's rows, so each batch can
        be read on its own: dealt round-robin to DataLoader workers, which the loader reads
        round-robin too, the batches then arrive in this list's order (pools dealt whole
        would interleave their batches).
        """
        if self.source.shuffled:
            raise ValueError("per_batch: a shuffled pool's batches are not contiguous runs")
        per_pool = self.pool_size // self.batch_size
        counts = self.batch_counts
        pool = np.repeat(self.pool_index, counts)
        first = np.repeat(self.batch_start - np.cumsum(counts) + counts, counts)
        batch = np.arange(len(pool), dtype=np.int64) + first
        index = np.where(pool < 0, -1, pool * per_pool + batch)
        ones = np.ones(len(index), dtype=np.int64)
        return WorkList(self.source, self.batch_size, self.batch_size, index,
                        np.zeros(len(index), dtype=np.int64), ones)

    @property
    def batch_counts(self) -> np.ndarray:
        """Batches per item (int64 array)."""
        return self.batch_stop - self.batch_start

    @property
    def n_batches(self) -> int:
        """Total number of batches of all items."""
        return int(self.batch_counts.sum())


def total_batches(items: Sequence[WorkItem]) -> int:
    """Batches in ``items`` (one worker's plan of an epoch)."""
    if isinstance(items, WorkList):
        return int(items.batch_counts.sum())
    return int(sum(it.n_batches for it in items))


def remaining_items(items: Sequence[WorkItem], consumed: int) -> Sequence[WorkItem]:
    """The work left after a worker yielded ``consumed`` batches of ``items``: fully consumed
    items are skipped and the first partly consumed one starts at its next batch."""
    counts = (
        items.batch_counts
        if isinstance(items, WorkList)
        else np.array([it.n_batches for it in items], dtype=np.int64)
    )
    if not 0 <= consumed <= int(counts.sum()):
        raise ValueError(f"consumed must lie in [0, {int(counts.sum())}], got {consumed}")
    skip = int(np.searchsorted(np.cumsum(counts), consumed, side="right"))
    offset = consumed - int(counts[:skip].sum())
    if isinstance(items, WorkList):
        rest = items[skip:]
        rest.batch_start = rest.batch_start.copy()
        if offset:
            rest.batch_start[0] += offset
        return rest
    rest_list = list(items[skip:])
    if offset:
        rest_list[0] = replace(rest_list[0], batch_start=rest_list[0].batch_start + offset)
    return rest_list


def pool_permutation(
    n_rows: int, *, seed: int, epoch: int, pool_index: int, shuffle: bool
) -> np.ndarray:
    """Order of a pool's canonical row positions (int64); identity when not ``shuffle``."""
    if not shuffle:
        return np.arange(n_rows, dtype=np.int64)
    return np.random.default_rng([seed, epoch, pool_index, TAG_ROWS]).permutation(n_rows)


def stratified_permutation(strata: np.ndarray, *, seed: int, epoch: int, pool_index: int
                           ) -> np.ndarray:
    """A random permutation ``perm`` of a pool's positions with ``strata[perm[i]] ==
    strata[i]`` (each label's positions permuted among themselves), seeded as
    :func:`pool_permutation` is."""
    strata = np.asarray(strata)
    noise = np.random.default_rng([seed, epoch, pool_index, TAG_ROWS]).random(len(strata))
    by_label = np.argsort(strata, kind="stable")  # each label's positions, in order
    shuffled = np.lexsort((noise, strata))  # each label's positions, in a random order
    perm = np.empty(len(strata), dtype=np.int64)
    perm[by_label] = shuffled
    return perm


def item_permutation(item: WorkItem, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """:func:`pool_permutation` of an item's pool (identity for a padding item)."""
    return pool_permutation(
        item.n_rows,
        seed=seed,
        epoch=epoch,
        pool_index=item.pool_index,
        shuffle=shuffle and not item.padding,
    )


def pool_order(perm: np.ndarray, batch_size: int) -> np.ndarray:
    """The pool laid out batch after batch: ``perm`` with each ``batch_size`` block sorted.

    Batch ``b`` is then the contiguous slice ``[b * batch_size, (b + 1) * batch_size)``
    and holds the same rows, in the same (ascending) order, as
    ``np.sort(batch_positions(item, b, batch_size, perm))``.
    """
    perm = np.asarray(perm, dtype=np.int64)
    n_full = len(perm) // batch_size * batch_size
    out = np.empty_like(perm)
    if n_full:  # (a shape of one batch_size row, not -1: batch_size may exceed memory)
        out[:n_full] = np.sort(perm[:n_full].reshape(n_full // batch_size, batch_size),
                               axis=1).reshape(-1)
    out[n_full:] = np.sort(perm[n_full:])
    return out


def global_rows(ranges: np.ndarray) -> np.ndarray:
    """Expand ``(k, 2)`` ``[start, stop)`` ranges into row ids (int64), in range order."""
    ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    lengths = ranges[:, 1] - ranges[:, 0]
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(ranges[:, 0] - offsets, lengths) + np.arange(int(lengths.sum()))
