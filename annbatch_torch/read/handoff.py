"""Sparse batch values from a DataLoader worker to the main process, through reused slots.

A plain ``DataLoader`` worker hands each batch to the main process by pickling it, and
torch moves every tensor's memory into a fresh shared-memory segment on the way: a batch of
4096 cells x 20,000 genes carries ~100 MB of CSR parts, and every page of the fresh segment
faults in twice (filled in the worker, read in the main process), a cost the in-process
loader never pays. Here a CSR key of a batch travels as an :class:`InSlot`: when the batch
is pickled, its parts are copied into one of a few shared-memory slots the worker keeps
(allocated once, reused), and when the main process unpickles it, :func:`arrive` copies
them out (into reused private buffers) or densifies them straight from the slot, then marks
the slot free in a small shared flags array. A slot is only rewritten after the main
process marked it free, i.e. after it has stopped reading it; when none is free (the main
process has not unpickled the batches sent before) the parts travel as torch would send
them, in fresh shared memory.

Used only where nothing but the queue sees the value between the dataset and the main
process (:func:`plain_worker_sends_csr`): torch's fetcher of this very dataset, with
``batch_size=None`` and no ``collate_fn`` of the caller's, under the default converter.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from .buffers import BufferCache, DenseBuffers
from .csr import csr_tensor_to_dense

__all__ = ["ARRIVED", "InSlot", "arrive", "plain_worker_sends_csr", "release"]

#: shared-memory slots a worker starts with per CSR key (the batch being made and those in
#: flight: torch's DataLoader keeps ``prefetch_factor`` (2) batches per worker in flight);
#: a worker adds one when none is free, up to :data:`MAX_SLOTS`
SLOTS = 3
MAX_SLOTS = 16
_ALIGN = 64


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


class _Ring:
    """A worker's slots and their flags (1: in use until the main process read it)."""

    def __init__(self) -> None:
        self.id = secrets.token_hex(8)
        self.pid = os.getpid()
        self.flags = torch.zeros(MAX_SLOTS, dtype=torch.int32).share_memory_()
        self.slots: list[torch.UntypedStorage] = []
        self.used: list[int] = []  # when each slot was last taken
        self.lock = threading.Lock()

    def take(self, nbytes: int, n_keys: int) -> tuple[int, torch.UntypedStorage] | None:
        """A slot of at least ``nbytes`` (grown if smaller), marked in use: a new one while
        there are fewer than ``SLOTS`` per key of the batch (at most :data:`MAX_SLOTS`),
        then the free one taken least recently; ``None`` when every slot is in flight.
        Every slot is made in the first batches and then used in turn, so the main process
        maps them all early (and keeps them mapped), not one more late in training."""
        flags = self.flags.numpy()
        with self.lock:
            if len(self.slots) < min(MAX_SLOTS, SLOTS * max(1, n_keys)):
                k = len(self.slots)
                self.slots.append(torch.UntypedStorage._new_shared(nbytes + nbytes // 4
                                                                   + _ALIGN))
                self.used.append(0)
            else:
                free = [k for k in range(len(self.slots)) if flags[k] == 0]
                if not free:
                    return None
                k = min(free, key=self.used.__getitem__)
                if self.slots[k].nbytes() < nbytes:
                    self.slots[k] = torch.UntypedStorage._new_shared(nbytes + nbytes // 4
                                                                     + _ALIGN)
            self.used[k] = max(self.used) + 1
            flags[k] = 1
            return k, self.slots[k]

    def give_back(self, k: int) -> None:
        """Free slot ``k`` that was taken but not sent."""
        self.flags[k] = 0


_RING: tuple[int, _Ring] | None = None


def _ring() -> _Ring:
    global _RING
    if _RING is None or _RING[0] != os.getpid():
        _RING = (os.getpid(), _Ring())
    return _RING[1]


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class InSlot:
    """A CSR key of a batch made in a DataLoader worker, sent through a reused slot (see
    the module's text) and delivered by :func:`arrive` in the main process.

    Parameters
    ----------
    csr
        The key's value, a CPU ``torch.sparse_csr_tensor``.
    dense
        Deliver it densified (``densify=True``), else as CSR.
    n_keys
        The batch's keys sent this way (the main process keeps reused buffers per key).
    """

    __slots__ = ("csr", "dense", "n_keys")

    def __init__(self, csr: torch.Tensor, dense: bool, n_keys: int = 1) -> None:
        self.csr, self.dense, self.n_keys = csr, dense, n_keys

    def __reduce__(self) -> tuple[Any, ...]:
        t = self.csr
        shape = (int(t.shape[0]), int(t.shape[1]))
        parts = [t.crow_indices(), t.col_indices(), t.values()]
        plain = (arrive, (*parts, shape, self.dense, self.n_keys, None, ("", 0, 0), -1))
        # this runs in the queue's feeder thread, which drops a batch whose pickling raises
        # (the loader would wait for it forever): any failure sends it as torch would
        ring, k = None, -1
        try:
            ring = _ring()
            got = ring.take(sum(_aligned(p.nbytes) for p in parts), self.n_keys)
            if got is None:  # every slot still in flight
                return plain
            k, st = got
            views, off = [], 0
            for p in parts:
                v = torch.empty(0, dtype=p.dtype).set_(st, off // p.element_size(), p.shape)
                v.copy_(p)
                views.append(v)
                off += _aligned(p.nbytes)
        except Exception:
            if ring is not None and k >= 0:
                ring.give_back(k)
            return plain
        info = get_worker_info()
        who = (ring.id, ring.pid, info.num_workers if info is not None else 1)
        return (arrive, (*views, shape, self.dense, self.n_keys, ring.flags, who, k))


#: dense arrays of arrived batches, reused once the training loop let go of them (the
#: batch in use, one a loop may prefetch and the one being made, per key)
ARRIVED = DenseBuffers(keep=3)
#: CSR parts of arrived batches, likewise
_PARTS = BufferCache(keep=9)
#: the slots last read, kept mapped in this process (torch maps a storage it receives anew
#: unless one of it is alive here, and a fresh mapping faults in again page by page): those
#: of live workers, at most ``SLOTS + 1`` per worker and key, the least recently read let
#: go first; a worker that exited loses its slots when another worker's batch arrives
_MAPPED: dict[tuple[str, int], torch.UntypedStorage] = {}
_RINGS: dict[str, int] = {}  # ring id -> its worker's pid
_MAPPED_LOCK = threading.Lock()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _keep_mapped(who: tuple[str, int, int], k: int, storage: torch.UntypedStorage,
                 n_keys: int) -> None:
    ring, pid, workers = who
    with _MAPPED_LOCK:
        if ring not in _RINGS:  # a new worker: forget the slots of workers gone
            gone = {r for r, p in _RINGS.items() if not _alive(p)}
            for key in [key for key in _MAPPED if key[0] in gone]:
                del _MAPPED[key]
            for r in gone:
                del _RINGS[r]
            _RINGS[ring] = pid
        _MAPPED.pop((ring, k), None)
        _MAPPED[(ring, k)] = storage
        while len(_MAPPED) > max(1, workers) * (SLOTS + 1) * max(1, n_keys):
            del _MAPPED[next(iter(_MAPPED))]


def release() -> None:
    """Let go of what this process keeps to take batches from DataLoader workers: the
    workers' slots it keeps mapped and the dense and CSR buffers it reuses (batches still
    in use stay valid). For a main process done with its loaders."""
    with _MAPPED_LOCK:
        _MAPPED.clear()
        _RINGS.clear()
    ARRIVED.clear()
    _PARTS.clear()


def arrive(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor,
           shape: tuple[int, int], dense: bool, n_keys: int, flags: torch.Tensor | None,
           who: tuple[str, int, int], k: int) -> torch.Tensor:
    """Unpickling an :class:`InSlot` in the main process: the key densified by scipy (in
    the values' dtype) into an array the training loop let go of, or its CSR copied into
    private buffers; then its slot is marked free (``flags[k] = 0``: a plain store, seen by
    the worker long after this process's reads of the slot ended, behind the queue's and
    the allocator's locks). ``who``: the worker's ring id, pid and worker count."""
    try:
        if flags is not None:
            _keep_mapped(who, k, values.untyped_storage(), n_keys)
        if dense:
            ARRIVED.keep = max(ARRIVED.keep, 3 * n_keys)
            return csr_tensor_to_dense(torch.sparse_csr_tensor(
                crow, col, values, size=shape, check_invariants=False), ARRIVED)
        if flags is None:  # fresh shared memory of its own: nothing to give back
            return torch.sparse_csr_tensor(crow, col, values, size=shape,
                                           check_invariants=False)
        _PARTS.keep = max(_PARTS.keep, 9 * n_keys)
        own = []
        for p in (crow, col, values):
            a = _PARTS.take(p.numel(), p.numpy().dtype)
            np.copyto(a, p.numpy())
            own.append(torch.from_numpy(a))
        return torch.sparse_csr_tensor(*own, size=shape, check_invariants=False)
    finally:
        if flags is not None:
            flags[k] = 0
