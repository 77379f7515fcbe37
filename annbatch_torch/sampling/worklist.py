"""Work items and lazy work lists of the epoch plan, and resuming a worker's list.

Split out of :mod:`annbatch_torch.sampling` (which re-exports everything here): a
:class:`WorkItem` is one pool's batch range for a worker, a :class:`WorkList` computes a
pool's row ranges only when indexed, and :func:`remaining_items` /
:func:`consumed_per_worker` / :func:`dataloader_order` describe what is left after a
number of batches. Pure numpy, no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, overload

import numpy as np

__all__ = [
    "WorkItem",
    "WorkList",
    "Stream",
    "merge_ranges",
    "dataloader_order",
    "consumed_per_worker",
    "remaining_items",
    "total_batches",
    "state_ints",
]


@dataclass(frozen=True, eq=False)
class WorkItem:
    """One unit of a worker's work: batches ``[batch_start, batch_stop)`` of one pool.

    ``pool_index`` is the global pool index in the epoch (``-1`` for a padding item);
    ``ranges`` the ``(k, 2)`` int64 global row ranges in canonical order; ``n_rows`` their
    total. A padding item has one batch (``[0, 1)``) holding all its ``n_rows`` rows.
    """

    pool_index: int
    ranges: np.ndarray
    n_rows: int
    batch_start: int
    batch_stop: int
    padding: bool = False

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


class WorkList(Sequence[WorkItem]):
    """A lazy list of :class:`WorkItem`: a pool's ranges are computed when it is indexed.

    Slicing returns a :class:`WorkList`; ``pool_index``, ``batch_start`` and ``batch_stop``
    are int64 arrays (pool index ``-1`` marks a padding item).
    """

    def __init__(
        self,
        stream: Stream,
        pool_size: int,
        batch_size: int,
        pool_index: np.ndarray,
        batch_start: np.ndarray,
        batch_stop: np.ndarray,
    ) -> None:
        self._stream, self.pool_size, self.batch_size = stream, pool_size, batch_size
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
                self._stream,
                self.pool_size,
                self.batch_size,
                self.pool_index[i],
                self.batch_start[i],
                self.batch_stop[i],
            )
        p = int(self.pool_index[i])
        total = self._stream.total
        a, b = (
            (0, min(self.batch_size, total))
            if p < 0
            else (p * self.pool_size, min((p + 1) * self.pool_size, total))
        )
        return WorkItem(
            p,
            self._stream.rows(a, b),
            b - a,
            int(self.batch_start[i]),
            int(self.batch_stop[i]),
            padding=p < 0,
        )

    def __iter__(self) -> Iterator[WorkItem]:
        return (self[i] for i in range(len(self)))

    @property
    def batch_counts(self) -> np.ndarray:
        """Batches per item (int64 array)."""
        return self.batch_stop - self.batch_start

    @property
    def n_batches(self) -> int:
        """Total number of batches of all items."""
        return int(self.batch_counts.sum())


def dataloader_order(per_worker_counts: Sequence[int]) -> list[tuple[int, int]]:
    """``(worker, local batch index)`` in the order torch's DataLoader yields them: one batch
    per worker in turn, skipping exhausted workers."""
    return [
        (w, j)
        for j in range(max(per_worker_counts, default=0))
        for w, c in enumerate(per_worker_counts)
        if j < c
    ]


def consumed_per_worker(per_worker_counts: Sequence[int], n_consumed: int) -> list[int]:
    """Batches each worker had yielded when the DataLoader had yielded ``n_consumed``."""
    counts = [int(c) for c in per_worker_counts]
    if not 0 <= n_consumed <= sum(counts):
        raise ValueError(f"n_consumed must lie in [0, {sum(counts)}], got {n_consumed}")
    done = [0] * len(counts)
    left = n_consumed
    while left:
        active = [w for w, c in enumerate(counts) if c > done[w]]
        rounds = min(min(counts[w] - done[w] for w in active), left // len(active))
        if rounds == 0:  # a partial round: the first `left` active workers yield one more
            for w in active[:left]:
                done[w] += 1
            break
        for w in active:
            done[w] += rounds
        left -= rounds * len(active)
    return done


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


def state_ints(state: Mapping[str, Any], keys: Sequence[str], saved_by: str) -> dict[str, int]:
    """``{key: int(state[key])}`` of a saved resume state, or a ``ValueError`` naming what is
    missing and where a valid state comes from (``saved_by``)."""
    try:
        return {k: int(state[k]) for k in keys}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"load_state_dict: state {dict(state)!r} lacks {e}; pass a state saved by "
            f"{saved_by}."
        ) from e
