"""The epoch plan: which rows each rank and worker yields, in which batches.

Pure functions over integers (numpy only: no torch, no I/O). Rules, in order:

1. Chunk ``c`` covers global rows ``[c * chunk_size, min((c + 1) * chunk_size, n_obs))``. The
   epoch's chunk stream is ``chunk_ids`` (default: all chunks) sorted, then permuted with
   ``default_rng([seed, epoch, TAG_CHUNKS])`` when ``shuffle``.
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
   rank does not depend on ``num_workers``, only their interleaving does. Without shuffling
   and with several workers, a rank's items are first cut into one item per batch
   (:meth:`WorkList.per_batch`), so the loader's round-robin yields them in stream order.
6. A resumed epoch (:meth:`EpochDeal.rest`): batch ``g`` of the epoch is batch
   ``g % per_pool`` of pool ``g // per_pool``; the batches not yet yielded, in ``g`` order,
   are split into ``world_size`` contiguous runs of equal length (``even_batches`` as in
   rule 4: the remainder dropped, or one padding item for the short ranks), each run cut
   into items at pool boundaries and gaps.

Work lists are lazy (:class:`WorkList`): planning costs ``O(n_chunks)`` numpy work, and a
pool's ranges are only computed when its :class:`WorkItem` is taken from the list.

A dataset asks its :class:`EpochPlan` (here :class:`ChunkPlan`; sampling mode's is
:class:`~annbatch_torch.sampling.sampled_plan.SamplePlan`) instead of planning: the deal of
an epoch, its batches per rank, the items of one worker of a rank (fresh, or resumed after
segments run elsewhere: :mod:`~annbatch_torch.sampling.replay`) and the fingerprint a
resume state records.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import numpy as np

from ..errors import check_int
from .replay import Segment, rank_items_after
from .worklist import (
    ChunkRows,
    PoolRows,
    RowOrder,
    Stream,
    WorkItem,
    WorkList,
    global_rows,
    total_batches,
)

__all__ = [
    "EvenBatches",
    "MAX_ROWS",
    "TAG_CHUNKS",
    "TAG_SPLIT",
    "validate_params",
    "n_chunks",
    "chunk_rows",
    "pool_rows",
    "chunk_order",
    "chunk_stream",
    "epoch_pools",
    "rank_items",
    "worker_items",
    "batches_per_rank",
    "deal_pools",
    "rank_batches",
    "batch_positions",
    "split_chunks",
    "split_chunks3",
    "EpochDeal",
    "EpochPlan",
    "ChunkPlan",
    "chunk_deal",
    "deal_batches",
    "epoch_batches",
]

EvenBatches = Literal["drop", "pad"]
#: The most rows one size of a plan may count (a batch, a chunk, a pool's preload budget):
#: the plan's row positions are int64, and a position plus a size must not overflow.
MAX_ROWS = 2**62
#: Why a size is bounded, as the messages say it.
_ROWS_NOTE = " (the plan's row positions are int64)"
#: Seed tag of an epoch's chunk order: ``default_rng([seed, epoch, TAG_CHUNKS])``.
TAG_CHUNKS = 0x43484E4B  # "CHNK"
#: Seed tag of the train/validation chunk split: ``default_rng([seed, TAG_SPLIT])``.
TAG_SPLIT = 0x53504C54  # "SPLT"


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
    check_int("n_obs", n_obs, 0)
    for name, value in (
        ("chunk_size", chunk_size),
        ("preload_nchunks", preload_nchunks),
        ("batch_size", batch_size),
    ):
        check_int(name, value, 1, maximum=MAX_ROWS, maximum_text="2**62" + _ROWS_NOTE)
    check_int("world_size", world_size, 1)
    if chunk_size * preload_nchunks > MAX_ROWS:
        raise ValueError(
            f"chunk_size * preload_nchunks (the rows of a pool) must be <= 2**62{_ROWS_NOTE}, "
            f"got {chunk_size} * {preload_nchunks}; lower preload_nchunks or chunk_size.")
    check_int("seed", seed, 0)
    check_int("epoch", epoch, 0)
    if not 0 <= check_int("rank", rank, 0) < world_size:
        raise ValueError(
            f"rank must be an integer with 0 <= rank < world_size (= {world_size}), got {rank!r}"
        )
    nw = max(1, check_int("num_workers", num_workers, 0))
    if not 0 <= check_int("worker", worker, 0) < nw:
        raise ValueError(
            f"worker must be an integer with 0 <= worker < num_workers (= {nw}), got {worker!r}"
        )
    if even_batches not in ("drop", "pad"):
        raise ValueError(f"even_batches must be 'drop' or 'pad', got {even_batches!r}")


def n_chunks(n_obs: int, chunk_size: int) -> int:
    """Number of chunks covering ``n_obs`` rows (the last one may be short)."""
    return -(-n_obs // chunk_size)


def chunk_rows(n_obs: int, chunk_size: int, chunk_ids: np.ndarray) -> int:
    """Rows held by the chunks ``chunk_ids`` of ``n_obs`` rows (the last chunk may be
    short), e.g. the rows of a split."""
    ids = np.asarray(chunk_ids, dtype=np.int64)
    return int(np.minimum(chunk_size, n_obs - ids * chunk_size).sum())


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
    bad = ids[(ids < 0) | (ids >= n)]
    if bad.size:
        raise ValueError(
            f"chunk_ids must lie in [0, {n}) (the chunks of n_obs={n_obs} rows in chunks of "
            f"chunk_size={chunk_size}), got {_some(bad)} ({bad.size} of {ids.size} ids "
            "outside); pass chunk ids of this source and chunk_size (e.g. from "
            "sampling.split_chunks(n_obs, chunk_size, ...))"
        )
    twice = np.unique(ids[1:][ids[1:] == ids[:-1]])
    if twice.size:
        raise ValueError(f"chunk_ids must not contain duplicates, got {_some(twice)} more "
                         "than once; pass each chunk id once")
    return ids


def _some(ids: np.ndarray, k: int = 5) -> str:
    """The first ``k`` of ``ids`` for a message (``"3, 7, ..."``)."""
    head = ", ".join(str(int(i)) for i in ids[:k])
    return head + (", ..." if len(ids) > k else "")


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
    return np.random.default_rng([seed, epoch, TAG_CHUNKS]).permutation(ids) if shuffle else ids


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
    n_full = total // pool
    per_pool = pool // batch_size
    head = (n_full // world_size) * world_size
    return per_pool, head, n_full, epoch_batches(total, pool, batch_size, drop_last) - (
        head * per_pool)


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
    return rank_batches(total, pool, batch_size, world_size=world_size, drop_last=drop_last,
                        even_batches=even_batches)


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
    return chunk_deal(n_obs, chunk_size, preload_nchunks, batch_size, shuffle=shuffle,
                      seed=seed, epoch=epoch, drop_last=drop_last, even_batches=even_batches,
                      chunk_ids=chunk_ids).fresh(rank, world_size)


def chunk_deal(
    n_obs: int,
    chunk_size: int,
    preload_nchunks: int,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    drop_last: bool = False,
    even_batches: EvenBatches = "drop",
    chunk_ids: np.ndarray | None = None,
) -> EpochDeal:
    """The :class:`EpochDeal` of one epoch in chunked mode (rules 1-3: chunk stream, pools,
    row order)."""
    stream = Stream(
        chunk_stream(
            n_obs, chunk_size, shuffle=shuffle, seed=seed, epoch=epoch, chunk_ids=chunk_ids
        )
    )
    return EpochDeal(ChunkRows(stream, RowOrder(seed, epoch, shuffle)),
                     pool_rows(batch_size, chunk_size, preload_nchunks), batch_size,
                     drop_last=drop_last, even_batches=even_batches, in_order=not shuffle)


def deal_pools(source: PoolRows, pool: int, batch_size: int, *, rank: int, world_size: int,
               drop_last: bool, even_batches: EvenBatches) -> WorkList:
    """Rank ``rank``'s pools of a stream of ``source.total`` positions cut into pools of
    ``pool`` rows (rule 4 of this module), then its padding items if any."""
    per_pool, head, _, tail = _deal(source.total, pool, batch_size, world_size, drop_last)
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
        source,
        pool,
        batch_size,
        np.concatenate([pool_ids, np.full(n_pad, -1, dtype=np.int64)]),
        np.concatenate([b0, np.zeros(n_pad, dtype=np.int64)]),
        np.concatenate([b1, np.ones(n_pad, dtype=np.int64)]),
    )


def rank_batches(total: int, pool: int, batch_size: int, *, world_size: int, drop_last: bool,
                 even_batches: EvenBatches) -> int:
    """Batches every rank yields from a stream of ``total`` positions in pools of ``pool``
    rows (what :func:`deal_pools` gives each rank)."""
    per_pool, head, _, tail = _deal(total, pool, batch_size, world_size, drop_last)
    return _rank_target(head, per_pool, tail, world_size, even_batches)


def epoch_batches(total: int, pool: int, batch_size: int, drop_last: bool) -> int:
    """Batches of an epoch of ``total`` positions in pools of ``pool`` rows, before ranks are
    made equal: batch ``g`` is batch ``g % (pool // batch_size)`` of pool
    ``g // (pool // batch_size)``."""
    n_full, rest = divmod(total, pool)
    last = rest // batch_size if drop_last else -(-rest // batch_size)
    return n_full * (pool // batch_size) + last


def deal_batches(source: PoolRows, pool: int, batch_size: int, batches: np.ndarray, *,
                 rank: int, world_size: int, even_batches: EvenBatches) -> WorkList:
    """Rank ``rank``'s share of the epoch batches ``batches`` (sorted global batch ids, rule
    6): a contiguous run of them, cut into items at pool boundaries and gaps, then one
    padding item under ``"pad"`` for a rank one batch short."""
    ids = np.asarray(batches, dtype=np.int64)
    base, extra = divmod(len(ids), world_size)
    if even_batches == "pad":
        t0, t1 = rank * base + min(rank, extra), (rank + 1) * base + min(rank + 1, extra)
        target = base + (1 if extra else 0)
    else:
        t0, t1, target = rank * base, (rank + 1) * base, base
    per_pool = pool // batch_size
    g = ids[t0:t1]
    pools = g // per_pool
    cut = np.flatnonzero((np.diff(g) != 1) | (np.diff(pools) != 0)) + 1
    first = np.concatenate([[0], cut]).astype(np.int64) if len(g) else np.zeros(0, np.int64)
    last = np.concatenate([cut - 1, [len(g) - 1]]).astype(np.int64) if len(g) else first
    pool_ids = pools[first]
    b0, b1 = g[first] - pool_ids * per_pool, g[last] + 1 - pool_ids * per_pool
    n_pad = target - len(g)
    return WorkList(
        source, pool, batch_size,
        np.concatenate([pool_ids, np.full(n_pad, -1, dtype=np.int64)]),
        np.concatenate([b0, np.zeros(n_pad, dtype=np.int64)]),
        np.concatenate([b1, np.ones(n_pad, dtype=np.int64)]),
    )


@dataclass(frozen=True)
class EpochDeal:
    """How one epoch's stream is dealt to ranks and workers (rules 4-6), whichever mode
    made the stream: ``source`` gives a pool's rows, ``pool`` rows per pool (a multiple of
    ``batch_size``); ``in_order``: not shuffled, so a rank's batches go to its workers one
    by one (rule 5)."""

    source: PoolRows
    pool: int
    batch_size: int
    drop_last: bool = False
    even_batches: EvenBatches = "drop"
    in_order: bool = False

    @property
    def n_batches(self) -> int:
        """Batches of the epoch before ranks are made equal (:func:`epoch_batches`)."""
        return epoch_batches(self.source.total, self.pool, self.batch_size, self.drop_last)

    @property
    def per_pool(self) -> int:
        """Batches of a full pool."""
        return self.pool // self.batch_size

    def fresh(self, rank: int, world_size: int) -> WorkList:
        """Rank ``rank``'s items of the whole epoch (rule 4)."""
        return deal_pools(self.source, self.pool, self.batch_size, rank=rank,
                          world_size=world_size, drop_last=self.drop_last,
                          even_batches=self.even_batches)

    def rest(self, batches: np.ndarray, rank: int, world_size: int) -> WorkList:
        """Rank ``rank``'s items of the epoch batches ``batches`` (rule 6)."""
        return deal_batches(self.source, self.pool, self.batch_size, batches, rank=rank,
                            world_size=world_size, even_batches=self.even_batches)

    def workers(self, items: WorkList, num_workers: int) -> list[Sequence[WorkItem]]:
        """A rank's items per DataLoader worker (rule 5; 0 workers count as 1)."""
        nw = max(1, num_workers)
        if self.in_order and nw > 1:
            items = items.per_batch()
        return [worker_items(items, w, nw) for w in range(nw)]


@dataclass(frozen=True, kw_only=True, eq=False)
class EpochPlan(ABC):
    """The epochs of a dataset's settings, whichever mode: the answers to the dataset's
    planning questions (an epoch's :class:`EpochDeal`, its batches per rank, the items of
    one worker of a rank, the fingerprint a resume state records). An epoch resumed after
    ``segments`` run under other topologies is dealt what it still owes
    (``sampling.replay.rank_items_after``). :class:`ChunkPlan` and
    :class:`~annbatch_torch.sampling.sampled_plan.SamplePlan` make the deal.

    Parameters
    ----------
    n_obs, chunk_size, preload_nchunks, batch_size
        Rows of the source, rows per chunk, chunks per preload budget, rows per batch.
    shuffle, seed
        Shuffle with generators seeded by ``(seed, epoch, ...)``.
    drop_last, even_batches
        As in :func:`rank_items`.
    source_id
        What identifies the source's rows (a collection's manifest digest; ``None``: not
        known), recorded by the fingerprint: a state of another collection of as many rows
        would skip other rows.
    source_name
        What the source is called in messages (a path or URL), not part of the
        fingerprint.
    """

    n_obs: int
    chunk_size: int
    preload_nchunks: int
    batch_size: int
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    even_batches: EvenBatches = "drop"
    source_id: str | None = None
    source_name: str = ""

    @property
    def pool(self) -> int:
        """Rows per pool (:func:`pool_rows`)."""
        return pool_rows(self.batch_size, self.chunk_size, self.preload_nchunks)

    @abstractmethod
    def deal(self, epoch: int) -> EpochDeal:
        """How ``epoch``'s stream is dealt to ranks and workers."""

    @abstractmethod
    def fresh_batches(self, world_size: int) -> int:
        """Batches every rank of ``world_size`` yields of a whole epoch."""

    def batches_per_rank(self, epoch: int, world_size: int,
                         segments: Sequence[Segment] = ()) -> int:
        """Batches every rank yields of ``epoch`` (the dataset's ``len``): after
        ``segments``, those every rank yielded in them plus those it still owes."""
        if not segments:
            return self.fresh_batches(world_size)
        return sum(seg.steps for seg in segments) + rank_items_after(
            self.deal(epoch), segments, 0, world_size).n_batches

    def items(self, epoch: int, *, rank: int, world_size: int, worker: int = 0,
              num_workers: int = 1, segments: Sequence[Segment] = ()) -> Sequence[WorkItem]:
        """The work items of ``worker`` of ``num_workers`` (0 count as 1) on ``rank`` of
        ``world_size`` in ``epoch``, after ``segments`` (none: the fresh epoch)."""
        deal = self.deal(epoch)
        return deal.workers(rank_items_after(deal, segments, rank, world_size),
                            num_workers)[worker]

    def worker_batches(self, epoch: int, *, rank: int, world_size: int, num_workers: int,
                       segments: Sequence[Segment] = ()) -> list[int]:
        """Batches each of ``num_workers`` workers of ``rank`` yields of ``epoch`` after
        ``segments``."""
        deal = self.deal(epoch)
        items = rank_items_after(deal, segments, rank, world_size)
        return [total_batches(w) for w in deal.workers(items, num_workers)]

    def fingerprint(self) -> dict[str, Any]:
        """What the epoch's batches depend on besides seed, epoch and world size (JSON
        scalars; ``source``: ``source_id``): a state saved under other values would
        skip other batches."""
        return {
            "n_obs": int(self.n_obs), "batch_size": self.batch_size,
            "chunk_size": self.chunk_size, "preload_nchunks": self.preload_nchunks,
            "shuffle": self.shuffle, "drop_last": self.drop_last,
            "even_batches": self.even_batches, "chunk_ids": None, "sampler": None,
            "source": self.source_id,
        }


@dataclass(frozen=True, kw_only=True, eq=False)
class ChunkPlan(EpochPlan):
    """Chunked mode's :class:`EpochPlan` (rules 1-6 of this module).

    Parameters
    ----------
    chunk_ids
        The chunks the plan uses (e.g. a training split); default all.
    """

    chunk_ids: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.chunk_ids is not None:  # refused here, not when an epoch is first dealt
            _chunk_ids(self.n_obs, self.chunk_size, self.chunk_ids)

    @cached_property
    def chunk_ids_crc(self) -> int | None:
        """crc32 of the sorted ``chunk_ids`` (what a resume state records of them; computed
        once: the state is taken at every batch)."""
        if self.chunk_ids is None:
            return None
        return zlib.crc32(np.sort(np.asarray(self.chunk_ids, dtype=np.int64)).tobytes())

    def deal(self, epoch: int) -> EpochDeal:
        return chunk_deal(self.n_obs, self.chunk_size, self.preload_nchunks, self.batch_size,
                          shuffle=self.shuffle, seed=self.seed, epoch=epoch,
                          drop_last=self.drop_last, even_batches=self.even_batches,
                          chunk_ids=self.chunk_ids)

    def fresh_batches(self, world_size: int) -> int:
        return batches_per_rank(self.n_obs, self.chunk_size, self.preload_nchunks,
                                self.batch_size, world_size=world_size,
                                drop_last=self.drop_last, even_batches=self.even_batches,
                                chunk_ids=self.chunk_ids)

    def rows(self) -> np.ndarray:
        """The global row ids of the plan's chunks, in row order (int64)."""
        return global_rows(chunk_stream(self.n_obs, self.chunk_size, shuffle=False,
                                        seed=self.seed, epoch=0, chunk_ids=self.chunk_ids))

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "chunk_ids": self.chunk_ids_crc}


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
    nw = max(1, check_int("num_workers", num_workers, 0))
    if not 0 <= check_int("worker", worker, 0) < nw:
        raise ValueError(
            f"worker must be an integer with 0 <= worker < num_workers (= {nw}), got {worker!r}"
        )
    return items[worker::nw]


def batch_positions(item: WorkItem, batch: int, batch_size: int, perm: np.ndarray) -> np.ndarray:
    """Canonical positions (into ``global_rows(item.ranges)``) of batch ``batch`` of the pool."""
    if not item.batch_start <= batch < item.batch_stop:
        raise ValueError(f"batch must lie in [{item.batch_start}, {item.batch_stop}), got {batch}")
    return perm[batch * batch_size : (batch + 1) * batch_size]


def split_chunks(
    n_obs: int, chunk_size: int, val_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split whole chunks into sorted, disjoint ``(train_ids, val_ids)`` covering all chunks.

    Validation gets ``round(val_fraction * n_chunks)`` chunks, at least one when
    ``val_fraction > 0`` and ``n_chunks >= 2``, and never all of them (train keeps >= 1).
    The same as the first two parts of :func:`split_chunks3` with ``test_fraction=0``.
    """
    train, val, _ = split_chunks3(n_obs, chunk_size, val_fraction, 0.0, seed)
    return train, val


def _apportion(counts: np.ndarray) -> np.ndarray:
    """A sequence of ``counts.sum()`` stratum numbers, stratum ``k`` ``counts[k]`` times,
    whose every prefix of length ``i`` holds each stratum's share ``i * counts[k] / n`` to
    within one: each place goes to the stratum furthest behind its share (exact integer
    arithmetic; ties to the lower number)."""
    counts = np.asarray(counts, dtype=np.int64)
    n = int(counts.sum())
    taken = np.zeros(counts.size, dtype=np.int64)
    done = np.iinfo(np.int64).min
    seq = np.empty(n, dtype=np.int64)
    for i in range(1, n + 1):
        k = int(np.argmax(np.where(taken < counts, i * counts - n * taken, done)))
        taken[k] += 1
        seq[i - 1] = k
    return seq


def split_chunks3(
    n_obs: int, chunk_size: int, val_fraction: float, test_fraction: float, seed: int,
    strata: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split whole chunks into sorted, disjoint ``(train_ids, val_ids, test_ids)``.

    Validation gets ``round(val_fraction * n_chunks)`` chunks and test
    ``round(test_fraction * n_chunks)``, each at least one when its fraction is > 0 and
    there are chunks to spare; training always keeps at least one chunk (held-out parts
    are cut down to leave it, validation first served). The validation part is the one
    :func:`split_chunks` gives for the same ``val_fraction`` and ``seed``, so adding a test
    split moves chunks out of training only.

    ``strata`` (one label per chunk; a collection grouped by a class column, whose chunks
    are mostly of one class): the chunks are taken stratum by stratum in proportion (the
    chunks in a random order, each stratum's interleaved by its share), so the validation
    part holds each stratum's share of the chunks to within one, the test part to within
    two. ``None``: the chunks in a random order.
    """
    check_int("n_obs", n_obs, 0)
    check_int("chunk_size", chunk_size, 1)
    check_int("seed", seed, 0)
    for name, frac in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= frac < 1.0:
            raise ValueError(f"{name} must be a number in [0, 1), got {frac!r}")
    if val_fraction + test_fraction >= 1.0:
        raise ValueError(f"val_fraction + test_fraction must be < 1 (training keeps the rest), "
                         f"got {val_fraction!r} + {test_fraction!r}")
    n = n_chunks(n_obs, chunk_size)
    spare = max(n - 1, 0)  # training keeps one chunk
    n_val = min(round(val_fraction * n), spare)
    if val_fraction > 0 and spare > 0:
        n_val = max(n_val, 1)
    n_test = min(round(test_fraction * n), spare - n_val)
    if test_fraction > 0 and spare - n_val > 0:
        n_test = max(n_test, 1)
    perm = np.random.default_rng([seed, TAG_SPLIT]).permutation(n)
    if strata is not None:
        labels = np.asarray(strata)
        if labels.shape != (n,):
            raise ValueError(f"strata must hold one label per chunk ({n}), got shape "
                             f"{labels.shape}")
        _, inv, counts = np.unique(labels[perm], return_inverse=True, return_counts=True)
        grouped = perm[np.argsort(inv.reshape(-1), kind="stable")]  # by stratum, random order
        seq = _apportion(counts)  # which stratum each place of the order takes
        nth = np.empty(n, dtype=np.int64)  # the how-manieth of its stratum each place is
        nth[np.argsort(seq, kind="stable")] = np.arange(n) - np.repeat(
            np.cumsum(counts) - counts, counts)
        perm = grouped[(np.cumsum(counts) - counts)[seq] + nth]
    held = n_val + n_test
    return np.sort(perm[held:]), np.sort(perm[:n_val]), np.sort(perm[n_val:held])


