"""Where an iteration runs: rank, world size, DataLoader worker; and the shared epoch.

:class:`World` is resolved once per ``__iter__`` (:meth:`World.current`): the rank and
world size come from the dataset (resolved where the process group lives: the main
process, before workers are made), the worker and worker count from
``torch.utils.data.get_worker_info``. Everything downstream (the plan, the pool stream,
resume) takes it as a value and never asks torch again.

:class:`SharedEpoch` holds the epoch in shared memory, so that ``set_epoch`` in the main
process reaches persistent workers (forked workers inherit it, spawned workers receive it
through torch's multiprocessing pickler).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.utils.data import get_worker_info

__all__ = ["World", "SharedEpoch", "distributed_rank_world"]

logger = logging.getLogger(__name__)


def distributed_rank_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` of the initialised default process group, else ``None``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None


@dataclass(frozen=True)
class World:
    """The position of one dataset copy: rank of world size, worker of num_workers.

    ``in_worker`` is whether this copy runs in a DataLoader worker process
    (``num_workers`` counts the workers; 1 without any).
    """

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1
    in_worker: bool = False

    @classmethod
    def current(cls, rank: int, world_size: int) -> World:
        """This process's world, for a dataset copy on ``rank`` of ``world_size``."""
        info = get_worker_info()
        if info is None:
            return cls(rank, world_size)
        return cls(rank, world_size, info.id, info.num_workers, True)


class SharedEpoch:
    """The epoch a dataset iterates next, the last epoch that started iterating and
    whether that iteration ran to its end, in shared memory (3 int64)."""

    def __init__(self) -> None:
        self._t = torch.zeros(3, dtype=torch.int64).share_memory_()
        self._t[1] = -1

    @property
    def value(self) -> int:
        return int(self._t[0])

    def set(self, epoch: int) -> None:
        self._t[0] = epoch

    def start(self, epoch: int, *, warn_repeat: bool) -> None:
        """Record that ``epoch`` starts iterating (called by worker 0 of a rank); with
        ``warn_repeat``, warn when it is the epoch whose iteration last started and ran to
        its end (a forgotten ``set_epoch``: the same order again; not after a look at its
        first batches, ``next(iter(loader))``, nor a loop broken off)."""
        if warn_repeat and int(self._t[1]) == epoch and int(self._t[2]):
            logger.warning(
                "AnnBatchDataset: epoch %d is iterated again with the same order; call "
                "dataset.set_epoch(epoch) before each epoch.", epoch
            )
        self._t[1] = epoch
        self._t[2] = 0

    def finish(self, epoch: int) -> None:
        """The iteration of ``epoch`` that started last ran to its end (worker 0 of a
        rank)."""
        if int(self._t[1]) == epoch:
            self._t[2] = 1

    def forget_start(self) -> None:
        """Iterating the current epoch again is intended (a resumed epoch)."""
        self._t[1] = -1
