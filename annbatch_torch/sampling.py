"""The epoch plan: which rows each rank and worker yields, in which batches.

Pure functions over integers (numpy only: no torch, no I/O). Rules, in order:

1. Chunk ``c`` covers global rows ``[c * chunk_size, min((c + 1) * chunk_size, n_obs))``. The
   epoch's chunk stream is ``chunk_ids`` (default: all chunks) sorted, then permuted with
   ``default_rng([seed, epoch, _TAG_CHUNKS])`` when ``shuffle``.
2. The chunks' rows, concatenated in stream order, are cut into pools of
   :func:`pool_rows` rows (a multiple of ``batch_size``); only the last pool may be shorter.
   A pool's ``ranges`` are ``(k, 2)`` int64 ``[start, stop)`` global row ranges in stream order
   (the pool's *canonical* row order); pieces that touch (``stop == next start``) are merged.
3. Batch ``b`` of a pool holds canonical positions ``perm[b * batch_size:(b + 1) * batch_size]``
   with ``perm = pool_permutation(...)``, seeded by ``(seed, epoch, pool_index)``.
   ``drop_last`` drops the one partial batch of the epoch (the last pool's last batch).
4. Complete rounds of full pools are dealt whole, pool ``i`` to rank ``i % world_size``. The
   rest (fewer than ``world_size`` full pools plus the partial last pool) is split by
   batches into ``world_size`` contiguous runs, one per rank, so every rank gets work even
   with fewer pools than ranks. Every rank then yields the same number of batches:
   ``even_batches="drop"`` gives each rank ``tail // world_size`` tail batches (fewer than
   ``world_size`` batches are dropped in all), ``"pad"`` gives the first ``tail %
   world_size`` ranks one more and appends one padding item (a batch of the first
   ``min(batch_size, n_rows_in_stream)`` rows of the stream, all marked padding) to the
   others.
5. Item ``j`` of a rank's list goes to worker ``j % num_workers``; so the set of batches of a
   rank does not depend on ``num_workers``, only their interleaving does.

Work lists are lazy (:class:`WorkList`): planning costs ``O(n_chunks)`` numpy work, and a
pool's ranges are only computed when its :class:`WorkItem` is taken from the list.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal, overload

import numpy as np

__all__ = [
    "EvenBatches",
    "WorkItem",
    "WorkList",
    "validate_params",
    "n_chunks",
    "pool_rows",
    "chunk_order",
    "chunk_stream",
    "epoch_pools",
    "pool_permutation",
    "item_permutation",
    "batch_positions",
    "rank_items",
    "worker_items",
    "batches_per_rank",
    "dataloader_order",
    "consumed_per_worker",
    "remaining_items",
    "split_chunks",
    "global_rows",
]

EvenBatches = Literal["drop", "pad"]
_TAG_CHUNKS = 0x43484E4B  # "CHNK": chunk order of an epoch
_TAG_ROWS = 0x524F5753  # "ROWS": row order inside a pool
_TAG_SPLIT = 0x53504C54  # "SPLT": train/val chunk split


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


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool | np.bool_):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    try:
        out = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if out < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return out


def validate_params(
    *,
    n_obs: int,
    chunk_size: int,
    preload_nchunks: int,
    batch_size: int,
    seed: int = 0,
    epoch: int = 0,
    rank: int = 0,
    world_size: int = 1,
    worker: int = 0,
    num_workers: int = 1,
    even_batches: str = "drop",
) -> None:
    """Raise :class:`ValueError` naming the first bad argument and its valid range.

    ``num_workers=0`` (DataLoader in the main process) counts as one worker.
    """
    _check_int("n_obs", n_obs, 0)
    for name, value in (
        ("chunk_size", chunk_size),
        ("preload_nchunks", preload_nchunks),
        ("batch_size", batch_size),
        ("world_size", world_size),
    ):
        _check_int(name, value, 1)
    _check_int("seed", seed, 0)
    _check_int("epoch", epoch, 0)
    if not 0 <= _check_int("rank", rank, 0) < world_size:
        raise ValueError(
            f"rank must be an integer with 0 <= rank < world_size (= {world_size}), got {rank!r}"
        )
    nw = max(1, _check_int("num_workers", num_workers, 0))
    if not 0 <= _check_int("worker", worker, 0) < nw:
        raise ValueError(
            f"worker must be an integer with 0 <= worker < num_workers (= {nw}), got {worker!r}"
        )
    if even_batches not in ("drop", "pad"):
        raise ValueError(f"even_batches must be 'drop' or 'pad', got {even_batches!r}")


def n_chunks(n_obs: int, chunk_size: int) -> int:
    """Number of chunks covering ``n_obs`` rows (the last one may be short)."""
    return -(-n_obs // chunk_size)


def pool_rows(batch_size: int, chunk_size: int, preload_nchunks: int) -> int:
    """Rows per pool: the largest multiple of ``batch_size`` within the preload budget
    ``chunk_size * preload_nchunks``, but at least ``batch_size``."""
    return max(1, (chunk_size * preload_nchunks) // batch_size) * batch_size


def _chunk_ids(n_obs: int, chunk_size: int, chunk_ids: np.ndarray | None) -> np.ndarray:
    n = n_chunks(n_obs, chunk_size)
    if chunk_ids is None:
        return np.arange(n, dtype=np.int64)
    ids = np.asarray(chunk_ids)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(
            f"chunk_ids must be a 1-D integer array, got shape {ids.shape} and dtype {ids.dtype}"
        )
    ids = np.sort(ids.astype(np.int64))
    if ids.size and (ids[0] < 0 or ids[-1] >= n):
        raise ValueError(
            f"chunk_ids must lie in [0, {n}) (n_chunks for n_obs={n_obs}, "
            f"chunk_size={chunk_size}), got values in [{ids[0]}, {ids[-1]}]"
        )
    if ids.size > 1 and not np.all(ids[1:] != ids[:-1]):
        raise ValueError("chunk_ids must not contain duplicates")
    return ids


def chunk_order(
    n_obs: int,
    chunk_size: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    chunk_ids: np.ndarray | None = None,
) -> np.ndarray:
    """Chunk indices in the epoch's stream order (int64)."""
    ids = _chunk_ids(n_obs, chunk_size, chunk_ids)
    return np.random.default_rng([seed, epoch, _TAG_CHUNKS]).permutation(ids) if shuffle else ids


def chunk_stream(
    n_obs: int,
    chunk_size: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    chunk_ids: np.ndarray | None = None,
) -> np.ndarray:
    """The epoch's chunks as ``(n, 2)`` int64 ``[start, stop)`` row ranges in stream order."""
    starts = (
        chunk_order(n_obs, chunk_size, shuffle=shuffle, seed=seed, epoch=epoch, chunk_ids=chunk_ids)
        * chunk_size
    )
    return np.stack([starts, np.minimum(starts + chunk_size, n_obs)], axis=1)


def _merge(ranges: np.ndarray) -> np.ndarray:
    """Merge consecutive ranges that touch (``stop == next start``); order is kept."""
    if len(ranges) < 2:
        return ranges
    cut = np.flatnonzero(ranges[1:, 0] != ranges[:-1, 1])
    if len(cut) == len(ranges) - 1:
        return ranges
    first = np.concatenate([[0], cut + 1])
    last = np.concatenate([cut, [len(ranges) - 1]])
    return np.stack([ranges[first, 0], ranges[last, 1]], axis=1)


class _Stream:
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
        out = _merge(out)
        out.flags.writeable = False
        return out


class WorkList(Sequence[WorkItem]):
    """A lazy list of :class:`WorkItem`: a pool's ranges are computed when it is indexed.

    Slicing returns a :class:`WorkList`; ``pool_index``, ``batch_start`` and ``batch_stop``
    are int64 arrays (pool index ``-1`` marks a padding item).
    """

    def __init__(
        self,
        stream: _Stream,
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


def _deal(
    total: int, pool: int, batch_size: int, world_size: int, drop_last: bool
) -> tuple[int, int, int, int]:
    """How an epoch's pools are dealt to ranks.

    Returns ``(per_pool, head, n_full, tail)``: batches per full pool; ``head``, the pools
    dealt whole and round-robin (complete rounds of full pools only); the number of full
    pools; and ``tail``, the batches of the remaining pools (fewer than ``world_size`` full
    pools plus the partial last pool), which are split into equal contiguous runs, one per
    rank, so no rank is starved when there are fewer pools than ranks.
    """
    n_full, rest = divmod(total, pool)
    per_pool = pool // batch_size
    last = rest // batch_size if drop_last else -(-rest // batch_size)
    head = (n_full // world_size) * world_size
    return per_pool, head, n_full, (n_full - head) * per_pool + last


def _rank_target(head: int, per_pool: int, tail: int, world_size: int, even: str) -> int:
    base, extra = divmod(tail, world_size)
    return head // world_size * per_pool + base + (1 if even == "pad" and extra else 0)


def _stream_total(n_obs: int, chunk_size: int, ids: np.ndarray) -> int:
    """Rows in the chunks ``ids`` (sorted); only the very last chunk of the source is short."""
    short = n_chunks(n_obs, chunk_size) * chunk_size - n_obs
    return len(ids) * chunk_size - (
        short if len(ids) and ids[-1] == n_chunks(n_obs, chunk_size) - 1 else 0
    )


def batches_per_rank(
    n_obs: int,
    chunk_size: int,
    preload_nchunks: int,
    batch_size: int,
    *,
    world_size: int = 1,
    drop_last: bool = False,
    even_batches: EvenBatches = "drop",
    chunk_ids: np.ndarray | None = None,
) -> int:
    """Batches every rank yields in an epoch (its ``len``); ``O(world_size)`` after ids check."""
    validate_params(
        n_obs=n_obs,
        chunk_size=chunk_size,
        preload_nchunks=preload_nchunks,
        batch_size=batch_size,
        world_size=world_size,
        even_batches=even_batches,
    )
    total = _stream_total(n_obs, chunk_size, _chunk_ids(n_obs, chunk_size, chunk_ids))
    pool = pool_rows(batch_size, chunk_size, preload_nchunks)
    per_pool, head, _, tail = _deal(total, pool, batch_size, world_size, drop_last)
    return _rank_target(head, per_pool, tail, world_size, even_batches)


def rank_items(
    n_obs: int,
    chunk_size: int,
    preload_nchunks: int,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
    even_batches: EvenBatches = "drop",
    chunk_ids: np.ndarray | None = None,
) -> WorkList:
    """A rank's work items for one epoch: its pools in order, then padding items if any.

    Parameters
    ----------
    n_obs, chunk_size, preload_nchunks, batch_size
        Rows of the source, rows per chunk, chunks per preload budget, rows per batch.
    shuffle, seed, epoch
        Shuffle chunks and rows within pools with generators seeded by ``(seed, epoch, ...)``.
    rank, world_size
        Pool ``i`` belongs to rank ``i % world_size``.
    drop_last
        Drop the one partial batch of the epoch.
    even_batches
        ``"drop"``: every rank yields the minimum count; ``"pad"``: the maximum, short ranks
        append padding items.
    chunk_ids
        The chunks this plan uses (e.g. a train split); default all.

    Returns
    -------
    WorkList
        Lazy list of :class:`WorkItem`; items with no batch left (a truncated pool, a last
        pool emptied by ``drop_last``) are left out. It yields exactly
        :func:`batches_per_rank` batches. Deal it to workers with :func:`worker_items`.
    """
    validate_params(
        n_obs=n_obs,
        chunk_size=chunk_size,
        preload_nchunks=preload_nchunks,
        batch_size=batch_size,
        seed=seed,
        epoch=epoch,
        rank=rank,
        world_size=world_size,
        even_batches=even_batches,
    )
    stream = _Stream(
        chunk_stream(
            n_obs, chunk_size, shuffle=shuffle, seed=seed, epoch=epoch, chunk_ids=chunk_ids
        )
    )
    pool = pool_rows(batch_size, chunk_size, preload_nchunks)
    per_pool, head, _, tail = _deal(stream.total, pool, batch_size, world_size, drop_last)
    target = _rank_target(head, per_pool, tail, world_size, even_batches)
    # whole pools of the complete rounds, round-robin
    pools = [np.arange(rank, head, world_size, dtype=np.int64)]
    starts = [np.zeros(len(pools[0]), dtype=np.int64)]
    stops = [np.full(len(pools[0]), per_pool, dtype=np.int64)]
    # the tail's batches: rank r takes the r-th contiguous run (runs of equal length under
    # "drop", the remainder being dropped; the first `extra` runs one longer under "pad")
    base, extra = divmod(tail, world_size)
    if even_batches == "pad":
        t0, t1 = rank * base + min(rank, extra), (rank + 1) * base + min(rank + 1, extra)
    else:
        t0, t1 = rank * base, (rank + 1) * base
    if t1 > t0:
        first, stop_pool = t0 // per_pool, (t1 - 1) // per_pool + 1
        idx = np.arange(first, stop_pool, dtype=np.int64)
        pools.append(head + idx)
        starts.append(np.maximum(t0 - idx * per_pool, 0))
        stops.append(np.minimum(t1 - idx * per_pool, per_pool))
    pool_ids, b0, b1 = (np.concatenate(x) for x in (pools, starts, stops))
    n_pad = target - int((b1 - b0).sum())
    assert n_pad >= 0
    return WorkList(
        stream,
        pool,
        batch_size,
        np.concatenate([pool_ids, np.full(n_pad, -1, dtype=np.int64)]),
        np.concatenate([b0, np.zeros(n_pad, dtype=np.int64)]),
        np.concatenate([b1, np.ones(n_pad, dtype=np.int64)]),
    )


def epoch_pools(
    n_obs: int,
    chunk_size: int,
    preload_nchunks: int,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    drop_last: bool = False,
    chunk_ids: np.ndarray | None = None,
) -> WorkList:
    """All pools of the epoch in stream order, each with its full batch range."""
    return rank_items(
        n_obs,
        chunk_size,
        preload_nchunks,
        batch_size,
        shuffle=shuffle,
        seed=seed,
        epoch=epoch,
        drop_last=drop_last,
        chunk_ids=chunk_ids,
    )


def worker_items(items: Sequence[WorkItem], worker: int, num_workers: int) -> Sequence[WorkItem]:
    """Item ``j`` of a rank's list goes to worker ``j % num_workers`` (0 workers count as 1)."""
    nw = max(1, _check_int("num_workers", num_workers, 0))
    if not 0 <= _check_int("worker", worker, 0) < nw:
        raise ValueError(
            f"worker must be an integer with 0 <= worker < num_workers (= {nw}), got {worker!r}"
        )
    return items[worker::nw]


def pool_permutation(
    n_rows: int, *, seed: int, epoch: int, pool_index: int, shuffle: bool
) -> np.ndarray:
    """Order of a pool's canonical row positions (int64); identity when not ``shuffle``."""
    if not shuffle:
        return np.arange(n_rows, dtype=np.int64)
    return np.random.default_rng([seed, epoch, pool_index, _TAG_ROWS]).permutation(n_rows)


def item_permutation(item: WorkItem, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """:func:`pool_permutation` of an item's pool (identity for a padding item)."""
    return pool_permutation(
        item.n_rows,
        seed=seed,
        epoch=epoch,
        pool_index=item.pool_index,
        shuffle=shuffle and not item.padding,
    )


def batch_positions(item: WorkItem, batch: int, batch_size: int, perm: np.ndarray) -> np.ndarray:
    """Canonical positions (into ``global_rows(item.ranges)``) of batch ``batch`` of the pool."""
    if not item.batch_start <= batch < item.batch_stop:
        raise ValueError(f"batch must lie in [{item.batch_start}, {item.batch_stop}), got {batch}")
    return perm[batch * batch_size : (batch + 1) * batch_size]


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


def split_chunks(
    n_obs: int, chunk_size: int, val_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split whole chunks into sorted, disjoint ``(train_ids, val_ids)`` covering all chunks.

    Validation gets ``round(val_fraction * n_chunks)`` chunks, at least one when
    ``val_fraction > 0`` and ``n_chunks >= 2``, and never all of them (train keeps >= 1).
    """
    _check_int("n_obs", n_obs, 0)
    _check_int("chunk_size", chunk_size, 1)
    _check_int("seed", seed, 0)
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be a number in [0, 1), got {val_fraction!r}")
    n = n_chunks(n_obs, chunk_size)
    n_val = min(round(val_fraction * n), max(n - 1, 0))
    if val_fraction > 0 and n >= 2:
        n_val = max(n_val, 1)
    perm = np.random.default_rng([seed, _TAG_SPLIT]).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def global_rows(ranges: np.ndarray) -> np.ndarray:
    """Expand ``(k, 2)`` ``[start, stop)`` ranges into row ids (int64), in range order."""
    ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    lengths = ranges[:, 1] - ranges[:, 0]
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(ranges[:, 0] - offsets, lengths) + np.arange(int(lengths.sum()))
