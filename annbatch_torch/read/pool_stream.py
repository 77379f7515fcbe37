"""Reading the next epoch's first pool ahead, while an epoch's last pool is consumed.

Without it every epoch starts with a read nothing overlaps (one pool in six at 100k cells
with the defaults). :class:`ReadAheadMixin` is part of
:class:`~annbatch_torch.AnnBatchDataset`: the pool read ahead is kept in ``self._ahead``
(key, future, executor) and used only by an ``__iter__`` asking for the same process,
epoch, worker and first pool; anything else drops it.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .. import sampling
    from .reader import PoolReader

__all__ = ["ReadAheadMixin"]


class ReadAheadMixin:
    """The read-ahead half of :class:`~annbatch_torch.AnnBatchDataset` (in-process only)."""

    shuffle: bool
    _ahead: tuple[tuple[Any, ...], Future[Any], ThreadPoolExecutor] | None

    def plan(self, epoch: int | None = None, worker: int = 0,
             num_workers: int = 1) -> Sequence[sampling.WorkItem]:  # pragma: no cover
        raise NotImplementedError

    def _read_pool(self, reader: PoolReader, item: sampling.WorkItem,
                   epoch: int) -> Any:  # pragma: no cover
        raise NotImplementedError

    def _ahead_key(self, epoch: int, worker: int, num_workers: int,
                   first: sampling.WorkItem) -> tuple[Any, ...]:
        # without shuffling the order does not depend on the epoch
        return (os.getpid(), epoch if self.shuffle else None, worker, num_workers, first.key())

    def _read_ahead(self, bg: ThreadPoolExecutor, reader: PoolReader, epoch: int, worker: int,
                    num_workers: int) -> bool:
        """While the last pool of an epoch is consumed, read the first pool of ``epoch``
        (the next one) for the next ``__iter__``; used only if that asks for the same
        epoch, worker and pool (else dropped). The gap between epochs was one unhidden pool
        read (1/6 of an epoch at 100k cells with the defaults)."""
        items = self.plan(epoch, worker, num_workers)
        if not items:
            return False
        self.drop_read_ahead()
        fut = bg.submit(self._read_pool, reader, items[0], epoch)
        self._ahead = (self._ahead_key(epoch, worker, num_workers, items[0]), fut, bg)
        return True

    def _take_read_ahead(self, epoch: int, worker: int, num_workers: int,
                         first: sampling.WorkItem) -> tuple[Future[Any], ThreadPoolExecutor] | None:
        ahead = self._ahead
        if ahead is not None and ahead[0] == self._ahead_key(epoch, worker, num_workers, first):
            self._ahead = None
            return ahead[1], ahead[2]
        self.drop_read_ahead()
        return None

    def drop_read_ahead(self) -> None:
        """Forget the next epoch's first pool read ahead at the end of an epoch (frees its
        memory; the next ``__iter__`` then reads it itself)."""
        ahead, self._ahead = self._ahead, None
        # in a forked child (a DataLoader worker) the future and executor are copies whose
        # locks a parent thread may have held at fork time: just let them go
        if ahead is not None and ahead[0][0] == os.getpid():
            ahead[1].cancel()
            ahead[2].shutdown(wait=False, cancel_futures=True)
