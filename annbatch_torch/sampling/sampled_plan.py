"""Sampling mode's epoch plan: a sampler's stream cut into pools, ranks and workers.

Pure numpy (no torch, no I/O). The epoch's stream is the bound sampler's row ids for
``(seed, epoch)`` (:mod:`~annbatch_torch.sampling.samplers`). It is dealt exactly as
chunked mode deals its chunks' rows (:func:`~annbatch_torch.sampling.plan.deal_pools`):
positions are cut into pools of ``pool`` rows (a multiple of ``batch_size``), complete
rounds of pools go whole to ranks round-robin, the rest is split by batches so every rank
yields the same number of batches (``even_batches``), and a rank's items go round-robin to
its workers. So the batches of an epoch (their rows, in order) depend on the sampler,
``seed``, ``epoch``, ``batch_size``, the pool size and ``world_size``, never on
``num_workers``.

A pool's rows are read by random access: its distinct rows, sorted and merged into ranges
where they touch, are read once (a row drawn twice is read once) and its positions into
them give the pool in stream order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import SamplerError
from .plan import EpochDeal, EpochPlan, EvenBatches, rank_batches
from .samplers import Sampler
from .worklist import WorkList, merge_ranges, pool_order, pool_permutation

__all__ = ["SampleRows", "SamplePlan", "sample_deal", "sample_rank_items",
           "sample_batches_per_rank"]


class SampleRows:
    """The rows of a sampler's stream for one ``(seed, epoch)``, pool by pool (the
    :class:`~annbatch_torch.sampling.worklist.PoolRows` of sampling mode).

    A pool's batches are runs of the stream, in stream order; with ``mix`` (a sampler whose
    stream is runs of rows, :attr:`~annbatch_torch.Sampler.mixes_in_pool`, in a shuffled
    dataset) the pool's positions are permuted first, as chunked mode permutes a pool's
    rows (``pool_permutation`` of the pool index).
    """

    random_access = True

    def __init__(self, sampler: Sampler, seed: int, epoch: int, mix: bool = False) -> None:
        self.sampler, self.seed, self.epoch = sampler, int(seed), int(epoch)
        self.total = len(sampler)
        self.shuffled = bool(mix)

    def pool(self, pool_index: int, a: int, b: int, batch_size: int
             ) -> tuple[np.ndarray, np.ndarray]:
        rows = np.asarray(self.sampler.rows(self.seed, self.epoch, a, b))
        n_obs = self.sampler.n_obs
        if rows.shape != (b - a,) or (rows.size and rows.dtype.kind not in "iu"):
            raise SamplerError(f"{self.sampler!r}: rows({a}, {b}) gave {rows.dtype} of shape "
                               f"{rows.shape}, expected {b - a} integer row ids.")
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= n_obs):
            raise SamplerError(f"{self.sampler!r}: rows({a}, {b}) holds a row outside "
                               f"[0, {n_obs}) (the source's rows).")
        uniq, inverse = np.unique(rows.astype(np.int64, copy=False), return_inverse=True)
        allowed = self.sampler.allowed  # kept for samplers that do not apply it themselves
        if allowed is not None and len(uniq):
            at = np.minimum(np.searchsorted(allowed, uniq), len(allowed) - 1)
            out = allowed[at] != uniq
            if out.any():
                raise SamplerError(f"{self.sampler!r}: rows({a}, {b}) holds row "
                                   f"{int(uniq[out][0])}, which is not among the rows it may "
                                   "draw (the training split); draw from self.allowed.")
        ranges = merge_ranges(np.stack([uniq, uniq + 1], axis=1))
        ranges.flags.writeable = False
        order = inverse.reshape(-1).astype(np.int64, copy=False)
        if self.shuffled and pool_index >= 0:  # batches of rows from all over the pool
            perm = pool_permutation(b - a, seed=self.seed, epoch=self.epoch,
                                    pool_index=pool_index, shuffle=True)
            order = order[pool_order(perm, batch_size)]
        return ranges, order


def sample_rank_items(sampler: Sampler, batch_size: int, pool: int, *, seed: int, epoch: int,
                      rank: int = 0, world_size: int = 1, drop_last: bool = False,
                      even_batches: EvenBatches = "drop") -> WorkList:
    """A rank's work items of one epoch in sampling mode (deal them to workers with
    :func:`~annbatch_torch.sampling.worker_items`).

    Parameters
    ----------
    sampler
        A bound sampler (:meth:`~annbatch_torch.Sampler.bind`).
    batch_size, pool
        Rows per batch; rows per pool (read together), a multiple of ``batch_size``.
    seed, epoch
        The stream's ``(seed, epoch)``.
    rank, world_size, drop_last, even_batches
        As in :func:`~annbatch_torch.sampling.rank_items`.
    """
    return sample_deal(sampler, batch_size, pool, seed=seed, epoch=epoch, drop_last=drop_last,
                       even_batches=even_batches).fresh(rank, world_size)


def sample_deal(sampler: Sampler, batch_size: int, pool: int, *, seed: int, epoch: int,
                drop_last: bool = False, even_batches: EvenBatches = "drop",
                in_order: bool = False) -> EpochDeal:
    """The :class:`~annbatch_torch.sampling.plan.EpochDeal` of one epoch in sampling mode
    (``in_order``: the stream's batch order is kept with several DataLoader workers; else
    a sampler that :attr:`~annbatch_torch.Sampler.mixes_in_pool` has its pools mixed)."""
    rows = SampleRows(sampler, seed, epoch, mix=sampler.mixes_in_pool and not in_order)
    return EpochDeal(rows, pool, batch_size, drop_last=drop_last,
                     even_batches=even_batches, in_order=in_order)


def sample_batches_per_rank(sampler: Sampler, batch_size: int, pool: int, *,
                            world_size: int = 1, drop_last: bool = False,
                            even_batches: EvenBatches = "drop") -> int:
    """Batches every rank yields per epoch in sampling mode (the dataset's ``len``)."""
    return rank_batches(len(sampler), pool, batch_size, world_size=world_size,
                        drop_last=drop_last, even_batches=even_batches)


@dataclass(frozen=True, kw_only=True, eq=False)
class SamplePlan(EpochPlan):
    """Sampling mode's :class:`~annbatch_torch.sampling.plan.EpochPlan`: ``sampler``'s
    stream (bound, :meth:`~annbatch_torch.Sampler.bind`) cut into pools of
    ``EpochPlan.pool`` rows; ``shuffle=False`` keeps the
    stream's batch order with several DataLoader workers."""

    sampler: Sampler

    def deal(self, epoch: int) -> EpochDeal:
        # a sampler of runs has its pools mixed whatever shuffle says (its stream's order
        # is runs of one class: kept, each batch would hold one or two classes)
        return sample_deal(self.sampler, self.batch_size, self.pool, seed=self.seed,
                           epoch=epoch, drop_last=self.drop_last,
                           even_batches=self.even_batches,
                           in_order=not self.shuffle and not self.sampler.mixes_in_pool)

    def fresh_batches(self, world_size: int) -> int:
        return sample_batches_per_rank(self.sampler, self.batch_size, self.pool,
                                       world_size=world_size, drop_last=self.drop_last,
                                       even_batches=self.even_batches)

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "sampler": self.sampler.signature}
