"""Sparse batch values from a DataLoader worker to the main process, without a copy.

A plain ``DataLoader`` worker hands each batch to the main process by pickling it, and
torch moves every tensor's memory into a fresh shared-memory segment on the way: a batch of
4096 cells x 20,000 genes carries ~60 MB of CSR parts, copied once in the worker and faulted
in page by page on both sides, a cost the in-process loader never pays (its batches are
views of the pool). Here the worker reads its pools into shared memory of its own
(:class:`PoolMemory`, the allocator of the reader's buffer cache), a CSR key of a batch
travels as an :class:`InSlot`, and pickling it sends where its parts lie in that memory
(which slot, which generation of it, the offset), not the bytes: the main process maps each
slot once (the storage itself travels only until it does) and :func:`arrive` hands the
training loop tensors viewing it; a key to be dense is densified by :func:`arrive` straight
from the slot into an array the training loop let go of (:data:`ARRIVED`), and the slot is
given back at once.

A slot is reused only once the main process has let go of every batch it sent from it.
Each slot has four counters in a small shared array: batches ``sent`` from it (written by
the worker as it pickles one), batches ``done`` (written by the main process when no tensor
of its own views the slot any more: the storage's use count is back to the one reference
the main process keeps; checked whenever a batch arrives), its ``gen`` (bumped by the
worker when it frees the slot's memory; the main process then unmaps it) and the generation
``mapped`` by the main process (the worker sends the storage itself until it is). The
worker's buffer cache hands a pool buffer out again only when its own references are gone
and ``sent == done``; a batch the training loop keeps therefore keeps its slot, and the
worker reads its next pools into other memory.

Used only where nothing but the queue sees the value between the dataset and the main
process (:func:`plain_worker_sends_csr`): torch's fetcher of this very dataset, with
``batch_size=None`` and no ``collate_fn`` of the caller's, under the default converter.
A part outside the worker's pool memory (the memory ran out of slots, a converter's copy)
travels as torch sends it.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from . import send_order
from .buffers import DenseBuffers
from .csr import PendingCSR

__all__ = ["ARRIVED", "InSlot", "PoolMemory", "arrive", "dense_nbytes", "forget_exited",
           "mark_position", "plain_worker_sends_csr", "pool_memory", "release"]

logger = logging.getLogger(__name__)

#: slots a worker's pool memory can have at once (pool buffers: two per CSR field and pool,
#: for the pool being read, the pools whose batches are in flight or held)
MAX_SLOTS = 64
SENT, DONE, GEN, MAPPED = range(4)
_KNOWN = MAX_SLOTS  # counters row whose first cell the main process sets once it knows them


def plain_worker_sends_csr(dataset: Any) -> bool:
    """Whether ``dataset``'s batches are being fetched right now by a plain ``DataLoader``
    worker that hands them on as they are: torch's iterable fetcher, called by its worker
    loop, holding this very dataset (not a wrapper of it, which may touch the values), with
    ``batch_size=None`` and no ``collate_fn`` of the caller's (torch's ``default_convert``).
    Then a CSR key may travel as an :class:`InSlot`: nothing sees it in between. Found on
    the stack (the fetcher's frame is short-lived: looking at it keeps nothing alive);
    ``False`` when not known, and the worker hands tensors on as before."""
    if get_worker_info() is None:
        return False
    from torch.utils.data._utils.collate import default_convert

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "fetch":
            back = frame.f_back
            fetcher = frame.f_locals.get("self")
            return (back is not None and back.f_code.co_name == "_worker_loop"
                    and getattr(fetcher, "dataset", None) is dataset
                    and getattr(fetcher, "collate_fn", None) is default_convert
                    and getattr(fetcher, "auto_collation", True) is False)
        frame = frame.f_back
    return False


class PoolMemory:
    """A DataLoader worker's shared memory for pool buffers (see the module's text): the
    allocator of its reader's :class:`~annbatch_torch.read.buffers.BufferCache`."""

    def __init__(self) -> None:
        self.id = secrets.token_hex(8)
        self.pid = os.getpid()
        self.counters = torch.zeros((MAX_SLOTS + 1, 4), dtype=torch.int64).share_memory_()
        self._c = self.counters.numpy()
        self._c[:, MAPPED] = -1  # nothing mapped yet
        self.slots: dict[int, torch.UntypedStorage] = {}
        self.lock = threading.Lock()
        # slots whose array became garbage, applied under the lock by the next call (the
        # finalizer may run anywhere, even in a garbage collection inside a locked call)
        self._retired: collections.deque[int] = collections.deque()

    def allocate(self, nbytes: int) -> np.ndarray | None:
        """A fresh ``uint8`` array of ``nbytes`` in a new slot; ``None`` when every slot
        is live or still held by the main process, or when the shared memory cannot be
        had (a full ``/dev/shm``): the caller then takes private memory, and batches cut
        from it travel as torch sends them. Shared memory is committed whole when made
        (untouched pages count too). The slot is freed (its generation bumped) once the
        array is garbage."""
        c = self._c
        with self.lock:
            self._apply_retired()
            k = next((k for k in range(MAX_SLOTS)
                      if k not in self.slots and c[k, SENT] == c[k, DONE]), None)
            if k is None:
                return None
            try:
                storage = torch.UntypedStorage._new_shared(max(1, nbytes))
            except (RuntimeError, OSError) as e:
                logger.warning("DataLoader worker %d: no shared memory for a pool buffer of "
                               "%d MB (%s); its batches travel as torch sends them (a "
                               "copy each). Give /dev/shm more room (docker run "
                               "--shm-size).", os.getpid(), nbytes >> 20, e)
                return None
            # the tensor's own array (not a slice of it): views of it name it as their base,
            # so its reference count tells whether one is alive
            owner = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
            self.slots[k] = storage
        weakref.finalize(owner, self._retired.append, k)
        return owner

    def _apply_retired(self) -> None:
        """Free the slots whose arrays are garbage (under the lock)."""
        while self._retired:
            k = self._retired.popleft()
            self.slots.pop(k, None)
            self._c[k, GEN] += 1

    def locate(self, t: torch.Tensor) -> tuple[int, torch.UntypedStorage, int] | None:
        """``(slot index, its storage, byte offset)`` of a contiguous CPU tensor lying in a
        live slot, else ``None``."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        a, n = t.data_ptr(), t.numel() * t.element_size()
        with self.lock:
            self._apply_retired()
            for k, s in self.slots.items():
                if s.data_ptr() <= a and a + n <= s.data_ptr() + s.nbytes():
                    return k, s, a - s.data_ptr()
        return None

    def busy(self, owner: np.ndarray) -> bool:
        """Whether batches sent from ``owner``'s slot are still held by the main process
        (``False`` for an array of no slot)."""
        a, c = owner.ctypes.data, self._c
        with self.lock:
            self._apply_retired()
            for k, s in self.slots.items():
                if s.data_ptr() == a:
                    return bool(c[k, SENT] != c[k, DONE])
        return False

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("PoolMemory belongs to one worker process and is not pickled")


_MEMORY: tuple[int, PoolMemory] | None = None


def pool_memory() -> PoolMemory:
    """This process's :class:`PoolMemory` (one per worker process; a forked child makes
    its own)."""
    global _MEMORY
    if _MEMORY is None or _MEMORY[0] != os.getpid():
        _MEMORY = (os.getpid(), PoolMemory())
    return _MEMORY[1]


def _this_memory() -> PoolMemory | None:
    return _MEMORY[1] if _MEMORY is not None and _MEMORY[0] == os.getpid() else None


class InSlot:
    """A CSR key of a batch made in a DataLoader worker, sent by reference to the worker's
    pool memory (see the module's text) and delivered by :func:`arrive` in the main
    process.

    Parameters
    ----------
    m
        The key's value: a scipy CSR matrix of views of the worker's pool (its values and
        column indices in the dtypes the pool holds, perhaps a shard's narrow ones).
    dense
        Deliver it densified (``densify=True``), else as a CSR tensor (values cast to
        ``dtype``).
    later
        Not ``dense``: deliver it as a :class:`~.csr.PendingCSR` that the loader densifies
        once it hands the batch over (an ``AnnBatchDataLoader``'s ``"main"`` policy).
    n_keys
        The batch's keys sent this way (the main process keeps dense arrays per key).
    dtype
        The dtype of the values delivered (cast on arrival where the pool's differ).
    """

    __slots__ = ("counts", "dense", "dtype", "later", "m", "n_keys", "ordered", "position")

    def __init__(self, m: Any, dense: bool = False, n_keys: int = 1,
                 dtype: Any = np.float32, later: bool = False) -> None:
        self.m, self.dense, self.n_keys, self.dtype = m, dense, n_keys, np.dtype(dtype)
        self.later = later and not dense
        #: the batch's place in its loader's order (``read/send_order.py``), whether this
        #: key counts the batch as received (its first dense key), whether the batch was
        #: sent in that order
        self.position: tuple[str, int, int, int] | None = None
        self.counts = self.ordered = False

    def __reduce__(self) -> tuple[Any, ...]:
        m = self.m
        shape = (int(m.shape[0]), int(m.shape[1]))
        crow = np.asarray(m.indptr)  # a few KB: in the pickle itself
        parts = (torch.from_numpy(np.ascontiguousarray(m.indices)),
                 torch.from_numpy(np.ascontiguousarray(m.data)))
        memory = _this_memory()
        found = None if memory is None else [memory.locate(p) for p in parts]
        order = (self.position, self.counts, self.ordered)
        deliver = (self.dense, self.later, self.dtype.str)
        if memory is None or found is None or None in found:  # as torch sends them
            return (arrive, (crow, list(parts), shape, deliver, self.n_keys, None, order))
        c = memory._c
        refs: list[Any] = []
        with memory.lock:  # counted before the main process can see the batch
            for p, (k, slot, off) in zip(parts, found):  # type: ignore[misc]
                gen = int(c[k, GEN])
                storage = _Storage(slot, memory.pid) if c[k, MAPPED] != gen else None
                refs.append((k, gen, storage, off, p.numel(), p.dtype))
            for k, *_ in refs:
                c[k, SENT] += 1
            counters = memory.counters if c[_KNOWN, 0] == 0 else None
        info = get_worker_info()
        who = (memory.id, memory.pid, counters, info.num_workers if info is not None else 1)
        return (arrive, (crow, refs, shape, deliver, self.n_keys, who, order))


def dense_nbytes(batch: Any) -> int:
    """The bytes of ``batch``'s :class:`InSlot` keys to be densified on arrival."""
    if not isinstance(batch, dict):
        return 0
    return sum(int(v.m.shape[0]) * int(v.m.shape[1]) * v.dtype.itemsize
               for v in batch.values() if isinstance(v, InSlot) and v.dense)


def mark_position(batch: Any, place: tuple[tuple[str, int, int, int], bool]) -> None:
    """Give ``batch``'s dense :class:`InSlot` keys their place in the loader's order and
    whether it was sent in that order (``Turn.wait``'s answer; the first of them counts
    the batch as received); nothing for a batch without one."""
    if not isinstance(batch, dict):
        return
    position, ordered = place
    first = True
    for value in batch.values():
        if isinstance(value, InSlot) and value.dense:
            value.position, value.ordered, value.counts = position, ordered, first
            first = False


class _Storage:
    """A slot's storage on its way to the main process (as torch sends a storage: by file
    descriptor, handed over by the sending worker on request)."""

    __slots__ = ("pid", "storage")

    def __init__(self, storage: torch.UntypedStorage, pid: int) -> None:
        self.storage, self.pid = storage, pid

    def __reduce__(self) -> tuple[Any, ...]:
        from torch.multiprocessing.reductions import reduce_storage

        rebuild, args = reduce_storage(self.storage)
        return (_received_storage, (rebuild, args, self.pid))


def _received_storage(rebuild: Any, args: tuple[Any, ...], pid: int) -> torch.UntypedStorage:
    """Unpickling a :class:`_Storage`: torch's rebuild, whose failure because the worker
    died before handing its memory over (its connection reset) is named as such."""
    try:
        return rebuild(*args)
    except (ConnectionError, EOFError) as e:
        raise RuntimeError(
            f"DataLoader worker (pid {pid}) exited unexpectedly before this process received "
            "the shared memory of a batch it sent; the batches received before stay "
            "valid.") from e


#: dense arrays of arrived batches, reused once the training loop let go of them (the
#: batch in use, one the loop may hold and those the DataLoader keeps while it puts the
#: batches of several workers back in order), per key
ARRIVED = DenseBuffers(keep=3)
#: at most this many per key are kept for reuse (a burst of batches arriving out of order
#: from many workers takes fresh ones beyond it)
MAX_ARRIVED = 6


@dataclass
class _Mapped:
    """A worker's slot as this process maps it."""

    storage: torch.UntypedStorage
    gen: int
    received: int = 0  # batches received from its index (this generation and before)
    released: int = 0  # of which this process let go (written to ``done``)
    idle: int = 1  # the storage's use count with nothing but this map holding it


@dataclass
class _Worker:
    pid: int
    counters: np.ndarray  # (a view of the shared tensor: keeps it mapped)
    slots: dict[int, _Mapped] = field(default_factory=dict)


_WORKERS: dict[str, _Worker] = {}  # pool memory id -> the worker's slots mapped here
_LOCK = threading.Lock()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _use_count(storage: torch.UntypedStorage) -> int:
    return int(torch._C._storage_Use_Count(storage._cdata))


def _sweep() -> None:
    """Give back the slots no tensor here views any more (``done = received``) and unmap
    those the worker freed (generation moved on). Under :data:`_LOCK`."""
    for w in _WORKERS.values():
        c = w.counters
        for k in list(w.slots):
            m = w.slots[k]
            if c[k, GEN] != m.gen:  # freed by the worker: its memory is never written again
                if m.received == c[k, SENT]:  # (else a batch of it is still on its way)
                    c[k, DONE] = m.received
                    del w.slots[k]
            elif m.released != m.received and _use_count(m.storage) <= m.idle:
                c[k, DONE] = m.released = m.received


def forget_exited() -> None:
    """Unmap the pool memory of DataLoader workers that exited (batches still in use stay
    valid: their tensors hold their own mapping). Cheap; called as a dataset starts an
    iteration in the main process, and when a new worker's first batch arrives."""
    with _LOCK:
        _drop_exited()


def _drop_exited() -> None:
    """:func:`forget_exited` under :data:`_LOCK`."""
    for gone in [i for i, x in _WORKERS.items() if not _alive(x.pid)]:
        del _WORKERS[gone]


def _worker(who: tuple[str, int, torch.Tensor | None, int]) -> _Worker:
    mem_id, pid, counters, _ = who
    w = _WORKERS.get(mem_id)
    if w is None:
        if counters is None:
            raise RuntimeError(
                "a DataLoader worker's batch refers to shared memory this process no "
                "longer maps: annbatch_torch.read.handoff.release() was called while the "
                "loader's workers were running; call it only once they have exited.")
        _drop_exited()  # workers that exited: their memory is unmapped
        w = _WORKERS[mem_id] = _Worker(pid, counters.numpy())
        w.counters[_KNOWN, 0] = 1
    return w


def arrive(crow: np.ndarray, parts: list[Any], shape: tuple[int, int],
           deliver: tuple[bool, bool, str], n_keys: int,
           who: tuple[str, int, torch.Tensor | None, int] | None,
           order: tuple[tuple[str, int, int, int] | None, bool, bool] = (None, False, False)
           ) -> torch.Tensor | PendingCSR:
    """Unpickling an :class:`InSlot` in the main process: a CSR tensor viewing the worker's
    slots, or densified from them (scipy's layout) into an array the training loop let go
    of, or a :class:`~.csr.PendingCSR` viewing them; ``deliver``: densified now, later,
    and the dtype of the values delivered. ``parts``: the column indices and values as tensors
    (sent as torch sends them) or as references ``(slot, generation, storage or None,
    byte offset, numel, dtype)`` into the pool memory of worker ``who`` (its id, pid,
    counters (sent until this process knows them) and the loader's worker count);
    ``order``: the batch's place in its loader's order, whether this key counts it as
    received (``read/send_order.py``; first, so that the worker sending the next batch
    sends it while this one is densified) and whether it was sent in that order."""
    position, counts, ordered = order
    if position is not None and counts:
        send_order.arrived(position)
    if who is not None:
        with _LOCK:
            w = _worker(who)
            views = []
            for k, gen, storage, off, n, dtype in parts:
                m = w.slots.get(k)
                if storage is not None and (m is None or m.gen != gen):
                    # a slot made anew: the worker reused its index once every batch sent
                    # from it before was let go of (sent == done, ``done`` written here)
                    if m is not None:
                        w.counters[k, DONE] = m.received
                    done = int(w.counters[k, DONE])
                    m = w.slots[k] = _Mapped(storage, gen, done, done, _use_count(storage))
                    w.counters[k, MAPPED] = gen
                elif m is None or m.gen != gen:
                    raise RuntimeError(
                        f"a DataLoader worker (pid {w.pid}) sent a batch in slot {k} "
                        f"generation {gen}, which this process does not map; "
                        "annbatch_torch.read.handoff.release() may have been called while "
                        "the loader's workers were running.")
                m.received += 1
                views.append(torch.empty(0, dtype=dtype).set_(m.storage, off // dtype.itemsize,
                                                               (n,)))
            # the storages sent: from now on only the views and the map hold them
            parts[:] = views
            del views
    dense, later, dtype = deliver[0], deliver[1], np.dtype(deliver[2])
    pending = PendingCSR(crow, parts[0], parts[1], shape, dtype)
    parts.clear()
    out: torch.Tensor | PendingCSR
    if dense:
        # the batch in use, one the loop may hold on to, and those the DataLoader keeps
        # while it puts batches from several workers back in order (prefetch 2 each;
        # none where the workers send in the loader's order)
        workers = 1 if who is None or ordered else who[3]
        ARRIVED.keep = max(ARRIVED.keep, min(2 + 2 * workers, MAX_ARRIVED) * n_keys)
        out = pending.to_dense(ARRIVED)  # lets go of the slot's views
    elif later:
        out = pending
    else:
        out = pending.to_csr()
    del pending
    if who is not None:
        with _LOCK:
            _sweep()
    return out


def release() -> None:
    """Let go of the DataLoader workers' slots this process maps and of the dense arrays
    it reuses (batches still in use stay valid). For a main process whose loaders'
    workers have exited."""
    with _LOCK:
        live = sorted(w.pid for w in _WORKERS.values() if _alive(w.pid))
        if live:
            logger.warning("annbatch_torch.read.handoff.release(): DataLoader workers %s "
                           "still run; slots their batches still view stay taken for good. "
                           "Call it once the loaders' workers have exited.", live)
        for w in _WORKERS.values():
            w.counters[_KNOWN, 0] = 0
            for k, m in w.slots.items():
                w.counters[k, MAPPED] = -1
                if _use_count(m.storage) <= m.idle:  # one still viewed stays taken for good
                    w.counters[k, DONE] = m.received
        _WORKERS.clear()
    ARRIVED.clear()
