"""The replay of what each worker of each rank has consumed of an epoch (pure numpy).

A resumed epoch's deal is the plan: which batches were consumed follows from ``(seed,
epoch)``, the plan and the number of batches the loaders had yielded, so a resume state is
``O(segments)``.

* :func:`dataloader_order` is the order torch's ``DataLoader`` takes batches from its
  workers (round-robin, skipping exhausted ones), and :func:`consumed_per_worker` what each
  worker had yielded when the loader had yielded ``n``. That is how a state saved on one
  rank resumes another: ranks yield the same number of batches but their workers need not,
  and Lightning checkpoints rank 0 only.
* Elastic resume: a :class:`Segment` is a part of an epoch run under one topology
  (``world_size`` ranks of ``num_workers`` workers) until every rank's loader had yielded
  ``steps`` batches. :func:`remaining_batches` replays an epoch's segments, every rank and
  worker of each, and gives the epoch's batches not yet yielded; :func:`rank_items_after`
  deals them to a new topology (:meth:`~annbatch_torch.sampling.EpochDeal.rest`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .worklist import WorkItem, WorkList, total_batches

__all__ = [
    "Deal",
    "Segment",
    "dataloader_order",
    "consumed_per_worker",
    "remaining_batches",
    "rank_items_after",
]


class Deal(Protocol):
    """How an epoch is dealt to ranks and workers, as the replay uses it (an
    :class:`~annbatch_torch.sampling.EpochDeal`)."""

    @property
    def n_batches(self) -> int: ...

    def fresh(self, rank: int, world_size: int) -> WorkList: ...

    def rest(self, batches: np.ndarray, rank: int, world_size: int) -> WorkList: ...

    def workers(self, items: WorkList, num_workers: int) -> list[Sequence[WorkItem]]: ...


@dataclass(frozen=True)
class Segment:
    """A part of an epoch run on ``world_size`` ranks of ``num_workers`` DataLoader workers
    each (0 workers count as 1), until every rank's loader had yielded ``steps`` batches."""

    world_size: int
    num_workers: int
    steps: int


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


def _first_batch_ids(items: WorkList, n: int) -> np.ndarray:
    """Epoch batch ids of the first ``n`` batches of a worker's items (padding left out)."""
    counts = items.batch_counts
    pool = np.repeat(items.pool_index, counts)[:n]
    first = np.repeat(items.batch_start - np.cumsum(counts) + counts, counts)[:n]
    batch = np.arange(len(pool), dtype=np.int64) + first
    return (pool * (items.pool_size // items.batch_size) + batch)[pool >= 0]


def remaining_batches(deal: Deal, segments: Sequence[Segment]) -> np.ndarray:
    """The epoch batch ids (sorted int64; see :func:`~annbatch_torch.sampling.epoch_batches`)
    not yielded in ``segments``, run one after the other: the first dealt as a fresh epoch,
    each later one the batches left by those before it. Every rank of a segment yielded
    its ``steps`` batches, its workers round-robin (:func:`consumed_per_worker`).

    Raises ``ValueError`` when a segment's steps exceed what its ranks had to yield (a
    state of another plan).
    """
    left = np.arange(deal.n_batches, dtype=np.int64)
    for k, seg in enumerate(segments):
        if seg.steps == 0:  # nothing yielded (whatever its ranks, which are not dealt)
            continue
        done = []
        for rank in range(seg.world_size):
            items = (deal.fresh(rank, seg.world_size) if k == 0
                     else deal.rest(left, rank, seg.world_size))
            per_worker = deal.workers(items, seg.num_workers)
            counts = [total_batches(w) for w in per_worker]
            if seg.steps > sum(counts):
                raise ValueError(
                    f"load_state_dict: the state says {seg.steps} batches were yielded on "
                    f"{seg.world_size} ranks x {seg.num_workers} workers, but a rank had only "
                    f"{sum(counts)} to yield; pass a state saved by this dataset's loader.")
            for wl, n in zip(per_worker, consumed_per_worker(counts, seg.steps)):
                done.append(_first_batch_ids(wl, n))  # type: ignore[arg-type]
        consumed = np.sort(np.concatenate(done)) if done else np.zeros(0, np.int64)
        assert len(np.unique(consumed)) == len(consumed), "a batch consumed twice"
        left = np.setdiff1d(left, consumed, assume_unique=True)
    return left


def rank_items_after(deal: Deal, segments: Sequence[Segment], rank: int,
                     world_size: int) -> WorkList:
    """Rank ``rank``'s items of what an epoch still owes after ``segments`` (none: the
    fresh epoch)."""
    if not segments:
        return deal.fresh(rank, world_size)
    return deal.rest(remaining_batches(deal, segments), rank, world_size)
