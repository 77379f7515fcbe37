"""Workers of a plain ``DataLoader`` send batches densified on arrival in the loader's order.

A plain ``DataLoader`` hands batches to the training loop in task order (worker 0's first,
worker 1's first, ..., worker 0's second, ...: torch deals tasks to the workers in turn),
and keeps a batch that arrives before its turn until the batches before it have come. Where
a batch's CSR keys are densified as the main process unpickles it (``read/handoff.py``,
the ``"pool"`` policy), each batch kept so is a dense array alive in the main process: at
the start of an epoch the workers race through their first pool reads, and one that
finishes first sends its batches ahead of the others; later a worker reading its next pool
lets the others run ahead. With ``W`` workers and ``prefetch_factor`` 2 up to ``2W - 1``
dense batches wait (4 x 20,000 genes x 4,096 cells is 1.3 GB beside the one in use).

Here each worker sends a dense batch only once every batch before it in the loader's order
has reached the main process: worker ``w``'s ``j``-th batch waits until the main process has
begun receiving ``j + 1`` batches of each worker before ``w`` and ``j`` of each worker after
it (fewer of a worker whose iterator ended first: it says how many it sent). The main
process counts the batches it receives from each worker (:func:`arrived`, as it unpickles
the batch, before densifying it) in a small table of shared memory the dataset made before
its workers started (:class:`SendOrder`); the waiting worker reads it. The worker's batch
is ready meanwhile (its pools are read by threads of their own), so the wait costs the
training loop nothing: batch ``g`` is sent while the main process densifies batch ``g - 1``.

A table is shared by the main process that made it and the DataLoader workers it starts
(forked: the mapping is inherited; spawned: torch's pickler sends the memory). Each loader
iteration writes a lane of its own, chosen by a token its workers share (torch's base seed
of the iteration and the dataset's iteration count); a wait also ends when the loader shuts
its workers down, when the main process is gone, and after :data:`STALL_S` seconds without a
batch received from the workers waited for (a training step that long, or two iterations of
one dataset at once that drew the same lane): the worker then sends the rest of its
iteration as torch asks, as without this table.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
import weakref
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

__all__ = ["STALL_S", "SendOrder", "Turn", "arrived"]

logger = logging.getLogger(__name__)

#: lanes of a table (loader iterations that may run at once over one dataset)
LANES = 64
#: workers a lane has a row for (a loader with more workers sends as torch asks)
MAX_WORKERS = 64
#: seconds a worker waits without a batch received from the workers it waits for before it
#: stops waiting for the rest of its iteration
STALL_S = 30.0
#: a cell: the token of the iteration that wrote it (31 bits) above a count (32 bits)
_SHIFT = 32
_LOW = (1 << _SHIFT) - 1
ARRIVED, ENDED = 0, 1  # per worker: batches received (main process); sent in all + 1 (worker)

_TABLES: weakref.WeakValueDictionary[str, SendOrder] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


class SendOrder:
    """A dataset's table of batches received per DataLoader worker (see the module's text).

    Made in the process that owns the dataset; its forked and spawned DataLoader workers
    share it. A copy (``copy.deepcopy``, or a pickle that does not carry shared memory)
    makes a table of its own, owned by the process that made the copy."""

    def __init__(self) -> None:
        self._make()

    def _make(self) -> None:
        self.id = secrets.token_hex(8)
        self.owner = os.getpid()
        self._t = torch.zeros((LANES, MAX_WORKERS, 2), dtype=torch.int64).share_memory_()
        self._c = self._t.numpy()
        _TABLES[self.id] = self

    def __getstate__(self) -> dict[str, Any]:
        return {"id": self.id, "owner": self.owner, "t": self._t}

    def __setstate__(self, state: dict[str, Any]) -> None:
        t = state["t"]
        if not t.is_shared() or os.getppid() != state["owner"]:
            # a private copy of the memory (a plain pickle), or a process that is not a
            # worker of the owner (a rank the owner spawned, a pickle loaded elsewhere):
            # never the owner's table
            self._make()
            return
        self.id, self.owner, self._t = state["id"], state["owner"], t
        self._c = t.numpy()

    def __copy__(self) -> SendOrder:
        return self  # the same process: the same table

    def __deepcopy__(self, memo: dict[int, Any]) -> SendOrder:
        return SendOrder()

    def turn(self, iteration: int) -> Turn | None:
        """The sending order of this DataLoader worker's ``iteration`` (its dataset copy's
        ``iter()`` count), ``None`` outside a worker of the table's owner or beyond
        :data:`MAX_WORKERS` workers."""
        info = get_worker_info()
        if info is None or info.num_workers > MAX_WORKERS or os.getppid() != self.owner:
            return None
        base = int(info.seed) - int(info.id)  # the same in every worker of the iteration
        token = hash((base, int(iteration))) & 0x7FFFFFFF or 1
        return Turn(self.id, self._c[token % LANES], token, int(info.id),
                    int(info.num_workers), _stop_event())

    def __repr__(self) -> str:
        return f"SendOrder(id={self.id!r}, owner={self.owner})"


def _stop_event() -> Any:
    """The ``done_event`` of the torch worker loop running this code (set when the loader
    shuts its workers down), found on the stack; ``None`` when not found."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_worker_loop":
            return frame.f_locals.get("done_event")
        frame = frame.f_back
    return None


class Turn:
    """One DataLoader worker's place in its loader's order for one iteration: :meth:`wait`
    before each dense batch it sends, :meth:`end` when its iterator ends.

    Parameters
    ----------
    table_id
        The :class:`SendOrder` the main process counts into.
    lane
        The iteration's lane of the table, ``(MAX_WORKERS, 2)`` int64.
    token
        The iteration's token (31 bits, not 0).
    worker, num_workers
        This worker and the loader's worker count.
    stop
        The worker loop's ``done_event``, or ``None``.
    """

    def __init__(self, table_id: str, lane: np.ndarray, token: int, worker: int,
                 num_workers: int, stop: Any) -> None:
        self.table_id, self.lane, self.token = table_id, lane, token
        self.worker, self.num_workers, self.stop = worker, num_workers, stop
        self.sent = 0  # batches sent this iteration
        self.waiting = num_workers > 1
        self._parent = os.getppid()
        others = np.arange(num_workers) != worker
        self._others = np.flatnonzero(others)
        self._before = (np.arange(num_workers) < worker)[others].astype(np.int64)

    def _missing(self) -> tuple[bool, int]:
        """``(ready, progress)``: whether every batch before the next one has been received
        and the count received from the others so far."""
        rows = self.lane[self._others]
        arrived, ended = rows[:, ARRIVED], rows[:, ENDED]
        mine = (arrived >> _SHIFT) == self.token
        got = np.where(mine, arrived & _LOW, 0)
        need = self.sent + self._before
        done = ((ended >> _SHIFT) == self.token) & ((ended & _LOW) > 0)
        need = np.where(done, np.minimum(need, (ended & _LOW) - 1), need)
        return bool(np.all(got >= need)), int(got.sum())

    def wait(self) -> tuple[str, int, int]:
        """Wait for this worker's turn to send its next batch; its position, for
        :func:`arrived` in the main process."""
        if self.waiting:
            self._wait()
        self.sent += 1
        return self.table_id, self.token, self.worker

    def _wait(self) -> None:
        ready, progress = self._missing()
        if ready:
            return
        nap, since, last_look = 0.0002, time.monotonic(), 0.0
        while True:
            time.sleep(nap)
            nap = min(nap * 2, 0.002)
            ready, now_progress = self._missing()
            if ready:
                return
            now = time.monotonic()
            if now_progress != progress:
                progress, since = now_progress, now
            elif now - since > STALL_S:
                logger.warning(
                    "DataLoader worker %d: no batch of the other workers reached the main "
                    "process for %.0f s; sending the rest of this epoch's dense batches as "
                    "torch asks for them (batches that arrive early wait densified in the "
                    "main process).", self.worker, STALL_S)
                self.waiting = False
                return
            if now - last_look > 0.05:
                last_look = now
                if os.getppid() != self._parent or (self.stop is not None
                                                    and self.stop.is_set()):
                    self.waiting = False  # the loader is shutting down: nothing to order
                    return

    def end(self) -> None:
        """This worker's iterator ended after :attr:`sent` batches: the others stop waiting
        for more of it."""
        self.lane[self.worker, ENDED] = (self.token << _SHIFT) | (self.sent + 1)


def arrived(position: tuple[str, int, int]) -> None:
    """Count a batch received by this process from the worker at ``position`` (see
    :meth:`Turn.wait`); nothing for a table this process does not own."""
    table_id, token, worker = position
    order = _TABLES.get(table_id)
    if order is None or order.owner != os.getpid():
        return
    with _LOCK:
        cell = order._c[token % LANES, worker]
        v = int(cell[ARRIVED])
        cell[ARRIVED] = v + 1 if (v >> _SHIFT) == token else (token << _SHIFT) | 1

