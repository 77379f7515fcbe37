"""Workers of a plain ``DataLoader`` send batches densified on arrival in the loader's order.

A plain ``DataLoader`` hands batches to the training loop in task order (worker 0's first,
worker 1's first, ..., worker 0's second, ...: torch deals tasks to the workers in turn,
from worker 0 each epoch), and keeps a batch that arrives before its turn until the batches
before it have come. Where a batch's CSR keys are densified as the main process unpickles
it (``read/handoff.py``, the ``"pool"`` policy), each batch kept so is a dense array alive
in the main process: at the start of an epoch the workers race through their first pool
reads, and one that finishes first sends its batches ahead of the others; later a worker
reading its next pool lets the others run ahead. With ``W`` workers and ``prefetch_factor``
2 up to ``2W - 1`` dense batches wait (491 MB each at 4,096 cells x 30,000 genes).

Here each worker sends such a batch only once every batch before it in the loader's order
has reached the main process: worker ``w``'s ``j``-th batch waits until the main process has
begun receiving ``j + 1`` batches of each worker before ``w`` and ``j`` of each worker after
it (fewer of a worker whose iterator ended first: it says how many it sent). The main
process counts the batches it receives from each worker (:func:`arrived`, as it unpickles
the batch, before densifying it) in a small table of shared memory the dataset made before
its workers started (:class:`SendOrder`); the waiting worker reads it. The worker's batch
is ready meanwhile (its pools are read by threads of their own), so the wait costs the
training loop nothing: batch ``g`` is sent while the main process densifies batch ``g - 1``.
Batches smaller than :data:`ORDER_BYTES` dense (``SendOrder.min_bytes``) are sent as torch
asks (counted all the same): a few of them waiting cost little memory, and a wait would
cost them time.

The table is shared by the process that made it and the processes it starts: DataLoader
workers (forked: the mapping and the lock are inherited; spawned or from a fork server: a
twin table, made at the first such start, and its lock travel with the dataset as the
process starts), and DDP ranks started the same way. Each loader iteration takes a lane of
its own under the table's lock (found by a token its workers share and no other iteration
under way has: torch's base seed of the iteration, the main process, the loader iterator's
shutdown event, the dataset copy's iteration count); a lane whose workers all ended is
taken anew, so an iteration that repeats the token of an ended one starts from zero. A wait
also ends when the loader shuts its workers down and when the main process is gone. Without
a batch received for :data:`STALL_S` seconds while the main process has received every
batch sent (it waits for one nobody sends: a loader dealing tasks otherwise, e.g. a resumed
``StatefulDataLoader`` starting at another worker), or for :data:`PAUSE_S` while batches
sent wait in the queue (a training loop that stopped asking), the worker sends the rest of
its iteration as torch asks, as without this table. ``DataLoader(in_order=False)`` keeps no
early batches: the order gains nothing there, and costs a late worker's first batch its
wait.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import multiprocessing
import os
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from multiprocessing import context as mp_context
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

__all__ = ["ORDER_BYTES", "STALL_S", "SendOrder", "Turn", "arrived"]

logger = logging.getLogger(__name__)

#: lanes of a table (loader iterations that may run at once over one dataset)
LANES = 64
#: workers a lane has a row for (a loader with more workers sends as torch asks)
MAX_WORKERS = 64
#: seconds a worker waits without a batch received from the workers it waits for, while the
#: main process has received every batch sent (it waits for one nobody sends), before it
#: stops waiting for the rest of its iteration
STALL_S = 60.0
#: the same while batches sent wait in the queue (the training loop pauses: validation, a
#: checkpoint)
PAUSE_S = 600.0
#: dense bytes from which a batch is sent in order (smaller ones as torch asks)
ORDER_BYTES = 32 << 20
#: seconds a process waits for the table's lock before it stops using the table (a
#: process killed while it held the lock never lets it go)
LOCK_S = 10.0
# a lane's header: the iteration's token, its worker count, when it was last used (ns)
TOKEN, WORKERS, USED = range(3)
# a worker's row: batches received (by the main process), batches sent + 1 once its
# iterator ended (by the worker; 0 before), batches sent so far (by the worker)
ARRIVED, ENDED, SENT = 0, 1, 2

_TABLES: weakref.WeakValueDictionary[str, SendOrder] = weakref.WeakValueDictionary()
#: held while a table's twin is made (:meth:`SendOrder._for_spawned`)
_TWINS = threading.Lock()


def _context(method: str | None) -> Any:
    """The multiprocessing context of ``method`` (``None``: fork where there is one)."""
    try:
        return multiprocessing.get_context(method or "fork")
    except ValueError:  # no fork (Windows)
        return multiprocessing.get_context()


class SendOrder:
    """A dataset's table of batches received per DataLoader worker (see the module's text).

    Made in the process that owns the dataset; the processes it starts with the dataset
    share it. A copy made otherwise (``copy.deepcopy``, a pickle not made to start a
    process) makes a table of its own."""

    def __init__(self) -> None:
        self._make()

    def _make(self, min_bytes: int = ORDER_BYTES, method: str | None = None) -> None:
        self.id = secrets.token_hex(8)
        #: dense bytes from which a batch is sent in order
        self.min_bytes = min_bytes
        n = LANES * 3 + LANES * MAX_WORKERS * 3
        self._t = torch.zeros(n, dtype=torch.int64).share_memory_()
        # forked processes inherit it (and a fork context's lock starts no resource
        # tracker); spawned ones get a twin table whose lock can travel (_for_spawned)
        self._lock = _context(method).Lock()
        self._twin: SendOrder | None = None
        self._bind()

    def _bind(self) -> None:
        self.broken = False  # this process gave up the lock (see _locked)
        a = self._t.numpy()
        self._head = a[: LANES * 3].reshape(LANES, 3)
        self._rows = a[LANES * 3 :].reshape(LANES, MAX_WORKERS, 3)
        _TABLES[self.id] = self

    def __getstate__(self) -> dict[str, Any]:
        if mp_context.get_spawning_popen() is None:  # not starting a process: a copy
            return {"min_bytes": self.min_bytes}
        twin = self._for_spawned()
        return {"id": twin.id, "t": twin._t, "lock": twin._lock, "min_bytes": self.min_bytes,
                "broken": twin.broken}

    def _for_spawned(self) -> SendOrder:
        """The table of the processes this one spawns (or starts from a fork server): this
        one where its lock can travel to them; else a twin with a lock of the spawn
        context, made at the first such start and kept. A fork context's lock cannot
        travel, and it is not swapped: workers forked before and still running would go on
        with the old lock while spawned ones took the new, each holding "the" lock at once.
        A loader's workers all start one way, so each loader's lane lies in one table."""
        if not getattr(self._lock, "_is_fork_ctx", False):
            return self
        with _TWINS:  # (loaders started by two threads at once: one twin, never two)
            if self._twin is None:
                twin = SendOrder.__new__(SendOrder)
                twin._make(self.min_bytes, "spawn")
                self._twin = twin
            return self._twin

    def __setstate__(self, state: dict[str, Any]) -> None:
        t = state.get("t")
        if t is None or not t.is_shared():
            self._make(state["min_bytes"])
            return
        self.id, self._t, self._lock = state["id"], t, state["lock"]
        self.min_bytes = state["min_bytes"]
        self._twin = None
        self._bind()
        self.broken = state["broken"]  # (a lock lost for good is not waited for again)

    def __copy__(self) -> SendOrder:
        return self  # the same process: the same table

    def __deepcopy__(self, memo: dict[int, Any]) -> SendOrder:
        new = SendOrder()
        new.min_bytes = self.min_bytes
        return new

    @contextlib.contextmanager
    def _locked(self) -> Iterator[bool]:
        """The table's lock held for the block; ``False`` (and this process stops using
        the table, with a warning) when it is not had within :data:`LOCK_S` seconds."""
        got = not self.broken and self._lock.acquire(timeout=LOCK_S)
        if not got and not self.broken:
            self.broken = True
            logger.warning(
                "annbatch_torch: the lock of a dataset's send-order table was not released "
                "within %.0f s (a DataLoader worker killed while it held it?); process %d "
                "no longer orders the dense batches of that dataset's loaders.", LOCK_S,
                os.getpid())
        try:
            yield got
        finally:
            if got:
                self._lock.release()

    def lane(self, token: int, workers: int, join: bool = False) -> int | None:
        """The lane of the iteration ``token`` of ``workers`` workers, taken if none has it:
        the lane used longest ago, one whose workers all ended first. ``join`` (a worker
        starting its iteration): a lane of ``token`` whose workers all ended is taken
        anew (the token of an ended iteration used again). ``None`` without the lock."""
        with self._locked() as got:
            return self._lane(token, workers, join) if got else None

    def _ended(self) -> np.ndarray:
        """Per lane: whether it is unused or every worker of its iteration ended."""
        workers = self._head[:, WORKERS]
        counted = np.arange(MAX_WORKERS) < workers[:, None]
        return np.all((self._rows[:, :, ENDED] > 0) | ~counted, axis=1)

    def _lane(self, token: int, workers: int, join: bool = False) -> int:
        head, rows = self._head, self._rows
        found = np.flatnonzero(head[:, TOKEN] == token)
        if found.size and not (join and self._ended()[found[0]]):
            k = int(found[0])
        else:  # a lane unused or ended, the one used longest ago; else the oldest
            free = found if found.size else np.flatnonzero(self._ended())
            pool = free if free.size else np.arange(LANES)
            k = int(pool[np.argmin(head[pool, USED])])
            rows[k] = 0
            head[k, TOKEN], head[k, WORKERS] = token, workers
        head[k, USED] = time.monotonic_ns()
        return k

    def count(self, token: int, workers: int, worker: int) -> None:
        """The main process received a batch of ``worker`` of iteration ``token``."""
        with self._locked() as got:
            if got:
                self._rows[self._lane(token, workers), worker, ARRIVED] += 1

    def end(self, token: int, workers: int, worker: int, sent: int) -> None:
        """``worker``'s iterator of iteration ``token`` ended after ``sent`` batches."""
        with self._locked() as got:
            if got:
                self._rows[self._lane(token, workers), worker, ENDED] = sent + 1

    def turn(self, iteration: int) -> Turn | None:
        """The sending order of this DataLoader worker's ``iteration`` (its dataset copy's
        ``iter()`` count); ``None`` outside a worker, or beyond :data:`MAX_WORKERS`
        workers."""
        info = get_worker_info()
        if info is None or info.num_workers > MAX_WORKERS:
            return None
        # the same in every worker of the iteration, and apart from any other iteration
        # under way: torch's base seed (alike where ranks or loaders seed alike), the
        # main process, the loader iterator's shutdown event, the copy's iter() count
        base = int(info.seed) - int(info.id)
        stop = _stop_event()
        parent = multiprocessing.parent_process()
        key = repr((base, int(iteration), parent.pid if parent is not None else 0,
                    _event_id(stop))).encode()
        # (a stable digest: str hashes differ between spawned processes)
        token = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        token = token & 0x7FFFFFFFFFFFFFFF or 1
        return Turn(self, token, int(info.id), int(info.num_workers), stop)

    def __repr__(self) -> str:
        return f"SendOrder(id={self.id!r})"


def _event_id(event: Any) -> Any:
    """What tells a multiprocessing ``Event`` apart from the others alive in its process
    tree: its semaphore's name (spawn, fork server), else its address (fork: inherited)."""
    semlock = getattr(getattr(event, "_flag", None), "_semlock", None)
    if semlock is None:
        return None
    return semlock.name or semlock.handle


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
    before each batch it sends, :meth:`end` when its iterator ends.

    Parameters
    ----------
    order
        The dataset's table.
    token
        The iteration's token (not 0).
    worker, num_workers
        This worker and the loader's worker count.
    stop
        The worker loop's ``done_event``, or ``None``.
    """

    def __init__(self, order: SendOrder, token: int, worker: int, num_workers: int,
                 stop: Any) -> None:
        self.order, self.token = order, token
        self.worker, self.num_workers, self.stop = worker, num_workers, stop
        self.sent = 0  # batches sent this iteration
        self.waiting = num_workers > 1
        self._parent = multiprocessing.parent_process()  # (the main process)
        self._ppid = os.getppid()  # (a fork's parent: its exit is seen at once)
        self._others = np.flatnonzero(np.arange(num_workers) != worker)
        self._before = (self._others < worker).astype(np.int64)
        k = order.lane(token, num_workers, join=True)  # this iteration's lane
        if k is None:  # no lock: send as torch asks
            k, self.waiting = 0, False
        self._k = k

    def _ready(self) -> tuple[bool, tuple[int, int], bool]:
        """``(ready, progress, starved)``: whether every batch before the next one has been
        received, the batches received and sent so far (of every worker), and whether the
        main process has received every batch sent."""
        head = self.order._head
        k = self._k
        lane = self.order._rows[k, : self.num_workers].copy()
        if head[k, TOKEN] != self.token:  # taken by another iteration: take one again
            again = self.order.lane(self.token, self.num_workers)
            if again is None:  # no lock: send as torch asks
                self.waiting = False
                return True, (-1, -1), False
            self._k = again
            return False, (-1, -1), False
        rows = lane[self._others]
        got, ended = rows[:, ARRIVED], rows[:, ENDED]
        need = self.sent + self._before
        need = np.where(ended > 0, np.minimum(need, ended - 1), need)
        received, sent = int(lane[:, ARRIVED].sum()), int(lane[:, SENT].sum())
        return bool(np.all(got >= need)), (received, sent), sent <= received

    def wait(self, nbytes: int) -> tuple[tuple[str, int, int, int], bool]:
        """Wait for this worker's turn to send its next batch (``nbytes`` dense: a small one
        is sent at once); its position, for :func:`arrived` in the main process, and
        whether it was sent in order."""
        ordered = self.waiting and nbytes >= self.order.min_bytes
        if ordered:
            self._wait()
        self.sent += 1
        self.order._rows[self._k, self.worker, SENT] = self.sent
        return (self.order.id, self.token, self.num_workers, self.worker), ordered

    def _wait(self) -> None:
        ready, progress, _ = self._ready()
        if ready:
            return
        nap, since, last_look = 0.0001, time.monotonic(), 0.0
        while True:
            time.sleep(nap)
            nap = min(nap * 2, 0.001)
            ready, now_progress, starved = self._ready()
            if ready:
                return
            now = time.monotonic()
            if now_progress != progress:
                progress, since = now_progress, now
            elif now - since > (STALL_S if starved else PAUSE_S):
                logger.warning(
                    "DataLoader worker %d: the main process received no batch of the other "
                    "workers for %.0f s (%s); this worker sends the rest of this epoch's "
                    "dense batches as torch asks for them (batches that arrive early wait "
                    "densified in the main process).", self.worker, now - since,
                    "it waits for a batch nobody sends: a loader dealing tasks out of turn"
                    if starved else "the training loop does not ask for batches")
                self.waiting = False
                return
            if now - last_look > 0.05:
                last_look = now
                gone = os.getppid() != self._ppid or (
                    self._parent is not None and not self._parent.is_alive())
                if gone or (self.stop is not None and self.stop.is_set()):
                    self.waiting = False  # the loader is shutting down: nothing to order
                    return

    def end(self) -> None:
        """This worker's iterator ended after :attr:`sent` batches: the others stop waiting
        for more of it."""
        self.order.end(self.token, self.num_workers, self.worker, self.sent)


def arrived(position: tuple[str, int, int, int]) -> None:
    """Count a batch received by this process from the worker at ``position`` (see
    :meth:`Turn.wait`); nothing for a table this process does not know."""
    table_id, token, workers, worker = position
    order = _TABLES.get(table_id)
    if order is not None:
        order.count(token, workers, worker)

