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

A sampler whose stream comes in *draws* of ``d > 1`` positions
(:attr:`~annbatch_torch.Sampler.draw_size`: a perturbed row and its controls,
``sampling/pairing.py``) is dealt in batches of ``batch_size * d`` positions, so a draw is
never split between batches, ranks or workers (every total the deal counts is a multiple
of ``d``: pools, padding, ``drop_last``); each batch is laid out with the draws' first
rows before their other rows (:func:`draw_layout`), so the two parts of a batch are
contiguous runs of its pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import SamplerError
from .plan import EpochDeal, EpochPlan, EvenBatches, pool_rows, rank_batches
from .samplers import Sampler
from .worklist import (
    WorkList,
    merge_ranges,
    pool_order,
    pool_permutation,
    stratified_permutation,
)

__all__ = ["SampleRows", "SamplePlan", "sample_deal", "sample_rank_items",
           "sample_batches_per_rank", "draw_layout"]


def draw_layout(n: int, batch_size: int, draw_size: int) -> np.ndarray:
    """Positions ``0 .. n-1`` of a pool of draws laid out batch by batch as ``[the first
    row of each draw, then the draws' other rows]``, each part in stream order.

    ``n`` and ``batch_size`` are multiples of ``draw_size``. In a batch of ``k`` draws the
    first ``k`` positions are the draws' first rows, and positions ``k + i * (d - 1) ...
    k + (i + 1) * (d - 1) - 1`` are the other rows of draw ``i`` (``d = draw_size``).
    """
    pos = np.arange(n, dtype=np.int64)
    if draw_size == 1:
        return pos
    key = (pos // batch_size) * 2 + (pos % draw_size != 0)
    return np.argsort(key, kind="stable")


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
        self.draw_size = int(sampler.draw_size)
        if self.total % self.draw_size:
            raise SamplerError(f"{sampler!r}: len() = {self.total} is not a multiple of its "
                               f"draw_size {self.draw_size}.")

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
        d = self.draw_size
        if self.shuffled and pool_index >= 0:  # batches of rows from all over the pool
            strata = self.sampler.pool_strata(a, b)
            if d > 1:  # draws permuted whole (each stays a run of d positions)
                draws = pool_permutation((b - a) // d, seed=self.seed, epoch=self.epoch,
                                         pool_index=pool_index, shuffle=True)
                perm = (draws[:, None] * d + np.arange(d)).reshape(-1)
            elif strata is None:
                perm = pool_permutation(b - a, seed=self.seed, epoch=self.epoch,
                                        pool_index=pool_index, shuffle=True)
            else:
                perm = stratified_permutation(strata, seed=self.seed, epoch=self.epoch,
                                              pool_index=pool_index)
            # (a batch's positions sorted: its draws stay runs of d, in ascending order)
            order = order[pool_order(perm, batch_size)]
        if d > 1:  # each batch: the draws' first rows, then their others
            order = order[draw_layout(b - a, batch_size, d)]
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
    stream's batch order with several DataLoader workers. A sampler of draws
    (``draw_size`` ``d > 1``) gives batches of ``batch_size`` draws, ``batch_size * d``
    stream positions (:attr:`positions`), and pools of whole such batches."""

    sampler: Sampler

    @property
    def positions(self) -> int:
        """Stream positions (rows read) per batch: ``batch_size`` draws of ``draw_size``."""
        return self.batch_size * int(self.sampler.draw_size)

    @property
    def pool(self) -> int:
        """Rows per pool: the preload budget in whole batches of :attr:`positions`."""
        return pool_rows(self.positions, self.chunk_size, self.preload_nchunks)

    def deal(self, epoch: int) -> EpochDeal:
        # a sampler of runs has its pools mixed whatever shuffle says (its stream's order
        # is runs of one class: kept, each batch would hold one or two classes)
        return sample_deal(self.sampler, self.positions, self.pool, seed=self.seed,
                           epoch=epoch, drop_last=self.drop_last,
                           even_batches=self.even_batches,
                           in_order=not self.shuffle and not self.sampler.mixes_in_pool)

    def fresh_batches(self, world_size: int) -> int:
        return sample_batches_per_rank(self.sampler, self.positions, self.pool,
                                       world_size=world_size, drop_last=self.drop_last,
                                       even_batches=self.even_batches)

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "sampler": self.sampler.signature}
