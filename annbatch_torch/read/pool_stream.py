"""A worker's pools, read in order: the next one in the background while the current one
is consumed (prefetch), and the next epoch's first one while an epoch's last is consumed
(read-ahead).

:class:`PoolStream` turns complete :class:`~annbatch_torch.sampling.WorkItem`\\ s (ranges,
row order) into pools: a :class:`~annbatch_torch.read.host_pool.HostPool`, or a
:class:`~annbatch_torch.read.device_pool.DevicePool` uploaded in the prefetch thread (the
upload overlaps the current pool's batches). Without the read-ahead every epoch would start
with a read nothing overlaps (one pool in six at 100k cells with the defaults); a pool read
ahead is used only by a stream asked for the very same pool (same rows in the same order)
in the same process, and dropped otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..sampling import WorkItem
from .buffers import DenseBuffers
from .device_pool import DevicePool
from .genes import GeneSelection, MemberGenes
from .handoff import PoolMemory
from .host_pool import HostPool
from .reader import PoolReader

__all__ = ["PoolStream", "ReadAhead"]


@dataclass
class ReadAhead:
    """The next epoch's first pool, being read by ``executor`` in process ``pid``; its
    ``future`` gives ``(item, pool)``."""

    item: WorkItem
    future: Future[Any]
    executor: ThreadPoolExecutor
    pid: int

    def serves(self, item: WorkItem) -> bool:
        """Whether this is ``item``'s pool, read in this process."""
        return (self.pid == os.getpid() and self.item == item
                and np.array_equal(self.item.order, item.order))


class PoolStream:
    """Pools of one dataset copy, read by ``reader``.

    Parameters
    ----------
    reader
        Reads a pool's rows of the selected fields.
    device
        Hold pools on this device (:class:`DevicePool`); ``None``: host pools.
    genes
        ``{field path: genes}``: cut these fields (X, layers, raw/X) of every pool to
        those genes.
    """

    def __init__(self, reader: PoolReader, device: torch.device | None = None,
                 genes: Mapping[str, GeneSelection | MemberGenes] | None = None) -> None:
        self.reader = reader
        self.device = device
        self.genes = {p: g for p, g in (genes or {}).items() if not g.identity}
        self.ahead: ReadAhead | None = None
        #: dense batch arrays reused across batches and pools (host pools): two per sparse
        #: field (the batch in use and the one being made)
        sparse = [f for f in reader.fields
                  if getattr(reader.source.fields.get(f), "kind", None) == "csr"]
        self.dense = DenseBuffers(keep=2 * max(1, len(sparse)))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["ahead"] = None
        return state

    def read(self, item: WorkItem, shared: bool = False) -> HostPool | DevicePool:
        """Read ``item``'s pool, laid out batch after batch in ``item.order``; ``shared``:
        host batches are densified into shared memory (in DataLoader workers)."""
        values = self.reader.read(item.ranges, item.order, random_access=item.random_access)
        if self.genes:  # cut before any upload: only the selected genes travel
            values = {p: (self.genes[p].cut(v, item.rows) if p in self.genes else v)
                      for p, v in values.items()}
        if self.device is not None:  # uploaded here: overlaps the current pool's batches
            return DevicePool(values, self.device)
        return HostPool(values, shared=shared, dense=self.dense,
                        dtype=self.reader.values_dtype)

    def pools(self, items: Sequence[WorkItem], *, prefetch: bool, shared: bool = False,
              upcoming: Callable[[], WorkItem | None] | None = None,
              memory: PoolMemory | None = None,
              ) -> Iterator[tuple[WorkItem, HostPool | DevicePool]]:
        """``(item, pool)`` for each item in turn; each pool is closed when the next is
        asked for.

        Parameters
        ----------
        items
            The work items, in order.
        prefetch
            Read the next pool in a background thread while the current one is consumed.
        shared
            See :meth:`read`.
        upcoming
            With ``prefetch``: gives the next epoch's first item, read ahead while the
            last pool is consumed and kept for the stream that asks for it.
        memory
            A DataLoader worker's shared pool memory (``read/handoff.py``): pool buffers
            are allocated in it from now on, and kept from one epoch to the next (the
            main process keeps them mapped).
        """
        if memory is not None:
            self.reader.buffers.memory = memory
        if not items:
            self.drop_read_ahead()  # nothing to read: free a pool read ahead for this epoch
            return
        # each item is taken from `items` once (a WorkList computes its row order then),
        # in the prefetch thread where there is one
        n, first = len(items), items[0]
        ahead = self.take_read_ahead(first) if prefetch else None
        bg = ahead.executor if ahead is not None else (
            ThreadPoolExecutor(1, thread_name_prefix="annbatch-prefetch") if prefetch else None)
        kept = False  # bg then reads the next epoch's first pool (self.ahead)
        try:
            nxt: Future[Any] | None = ahead.future if ahead is not None else (
                bg.submit(self._read_item, first, shared) if bg is not None else None)
            ahead = None  # its future holds the pool: no reference may outlive the pool
            for i in range(n):
                if nxt is not None:
                    item, pool = nxt.result()
                else:
                    item, pool = self._read_item(first if i == 0 else items[i], shared)
                nxt = None
                if bg is not None and i + 1 < n:
                    # buffers of the previous pool are reused when the caller let go of its
                    # batches (always for dense batches), else fresh ones are taken
                    nxt = bg.submit(self._read_at, items, i + 1, shared)
                elif bg is not None and upcoming is not None:
                    kept = self._read_ahead(bg, upcoming(), shared)
                yield item, pool
                pool.close()  # batches handed out keep their own references
                del pool, item  # without prefetch: free this pool before the next is read
        finally:
            if bg is not None and not kept:
                bg.shutdown(wait=True, cancel_futures=True)
            if not kept and self.reader.buffers.memory is None:
                self.reader.buffers.clear()

    def _read_item(self, item: WorkItem, shared: bool
                   ) -> tuple[WorkItem, HostPool | DevicePool]:
        return item, self.read(item, shared)

    def _read_at(self, items: Sequence[WorkItem], i: int, shared: bool
                 ) -> tuple[WorkItem, HostPool | DevicePool]:
        return self._read_item(items[i], shared)

    def _read_ahead(self, bg: ThreadPoolExecutor, first: WorkItem | None, shared: bool) -> bool:
        if first is None:
            return False
        self.drop_read_ahead()
        fut = bg.submit(self._read_item, first, shared)
        self.ahead = ReadAhead(first, fut, bg, os.getpid())
        return True

    def take_read_ahead(self, first: WorkItem) -> ReadAhead | None:
        """The pool read ahead if it is ``first``'s (it is handed over once), else
        ``None`` (and any other pool read ahead is dropped)."""
        ahead = self.ahead
        if ahead is not None and ahead.serves(first):
            self.ahead = None
            return ahead
        self.drop_read_ahead()
        return None

    def drop_read_ahead(self, wait: bool = False) -> None:
        """Forget the pool read ahead (frees its memory); ``wait``: until its thread is
        gone."""
        ahead, self.ahead = self.ahead, None
        # in a forked child (a DataLoader worker) the future and executor are copies whose
        # locks a parent thread may have held at fork time: just let them go
        if ahead is not None and ahead.pid == os.getpid():
            ahead.future.cancel()
            ahead.executor.shutdown(wait=wait, cancel_futures=True)

    def close(self) -> None:
        """Drop the read-ahead and the reader's threads and buffers."""
        self.drop_read_ahead()
        self.reader.close()
