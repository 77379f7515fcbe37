"""Where an iteration runs: rank, world size, DataLoader worker; and the shared epoch.

:class:`World` is resolved once per ``__iter__`` (:meth:`World.current`): the rank and
world size come from the dataset (resolved where the process group lives: the main
process, before workers are made), the worker and worker count from
``torch.utils.data.get_worker_info``. Everything downstream (the plan, the pool stream,
resume) takes it as a value and never asks torch again.

:class:`SharedEpoch` holds the epoch in shared memory, so that ``set_epoch`` in the main
process reaches persistent workers (forked workers inherit it, spawned workers receive it
through torch's multiprocessing pickler). The epochs of a process's datasets are rows of
one shared block (:data:`EPOCH_ROWS` a block): shared memory costs an open file
descriptor per block, and a process making thousands of datasets (a sweep, a test suite)
would otherwise run out of them.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

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


#: datasets' epochs per block of shared memory (one open file descriptor a block)
EPOCH_ROWS = 1024


class _Block:
    """This process's block of epochs: its pid, the shared tensor, the rows handed out."""

    pid = -1
    rows: torch.Tensor | None = None
    used = EPOCH_ROWS
    lock = threading.Lock()


def _lock_after_fork() -> None:
    _Block.lock = threading.Lock()  # (one held by another thread at the fork stays held)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_lock_after_fork)


def _epoch_row() -> torch.Tensor:
    """A fresh row of 3 int64 in this process's block of shared memory (a forked child
    takes a block of its own: rows handed out after the fork would otherwise be handed
    out twice, once in each process)."""
    with _Block.lock:
        if _Block.rows is None or _Block.pid != os.getpid() or _Block.used == EPOCH_ROWS:
            _Block.rows = torch.zeros((EPOCH_ROWS, 3), dtype=torch.int64).share_memory_()
            _Block.pid, _Block.used = os.getpid(), 0
        _Block.used += 1
        return _Block.rows[_Block.used - 1]


class SharedEpoch:
    """The epoch a dataset iterates next, the last epoch that started iterating and
    whether that iteration ran to its end, in shared memory (3 int64, a row of this
    process's block)."""

    def __init__(self) -> None:
        self._t = _epoch_row()
        self._t[1] = -1

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled plainly (pickle.dumps, deepcopy): the three numbers, into a row of the
        # receiver's block (not the whole block the row lies in); a DataLoader worker made
        # by spawn receives the shared row itself (_reduce_shared)
        return (_epoch_of, (self._t.tolist(),))

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


def _epoch_of(values: list[int]) -> SharedEpoch:
    """A :class:`SharedEpoch` holding ``values``, in a row of this process's block."""
    out = SharedEpoch()
    out._t[:] = torch.tensor(values, dtype=torch.int64)
    return out


def _shared_epoch(t: torch.Tensor) -> SharedEpoch:
    """A :class:`SharedEpoch` on the row ``t`` another process shares with this one."""
    out = object.__new__(SharedEpoch)
    out._t = t
    return out


def _reduce_shared(epoch: SharedEpoch) -> tuple[Any, ...]:
    """Pickling by multiprocessing's pickler (a spawned worker's dataset copy): the row of
    shared memory itself, which torch's reduction of tensors shares."""
    return (_shared_epoch, (epoch._t,))


ForkingPickler.register(SharedEpoch, _reduce_shared)
