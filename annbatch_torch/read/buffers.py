"""Pool buffers and dense batch arrays reused, never handed out while anything still uses
them."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from typing import Any

import numpy as np

__all__ = ["BufferCache", "DenseBuffers", "fresh_bytes"]


def _libc_madvise() -> Any:
    if not sys.platform.startswith("linux"):  # pragma: no cover - Linux only
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _libc_madvise()
_MADV_NOHUGEPAGE = 15  # Linux <sys/mman.h>


def fresh_bytes(nbytes: int) -> np.ndarray:
    """An uninitialised ``uint8`` array of ``nbytes``, on plain pages (Linux).

    numpy asks the kernel for transparent huge pages on every allocation of 4 MiB or more
    (``madvise(MADV_HUGEPAGE)``), and where the kernel's THP ``defrag`` setting is
    ``madvise`` (the common default) each first touch of such memory may stall while the
    kernel compacts memory to build a 2-MiB page: several times the cost of plain pages
    when the page cache fills RAM, as it does while a loader reads. Pool buffers and read
    scratch are written front to back and reused, so huge pages bring them nothing back:
    this declines huge pages (``MADV_NOHUGEPAGE``) before anything touches the memory.
    From 1 MiB on, the memory is a private mapping of its own, given back to the kernel
    as soon as the array is garbage (memory malloc takes from its heaps may stay with the
    process for good: a read thread's scratch would outlive the thread).
    """
    if nbytes >= 1 << 20 and hasattr(mmap, "MAP_PRIVATE"):  # (not on Windows)
        out = np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                            dtype=np.uint8)
    else:
        out = np.empty(nbytes, dtype=np.uint8)
    if _MADVISE is not None and nbytes >= 1 << 22:
        page = mmap.PAGESIZE
        addr = out.ctypes.data
        start, stop = -(-addr // page) * page, (addr + nbytes) // page * page
        if stop > start:
            _MADVISE(start, stop - start, _MADV_NOHUGEPAGE)  # advice: a failure is harmless
    return out


class _Reused:
    """Arrays handed out again once nothing but this object references them: the
    bookkeeping :class:`BufferCache` and :class:`DenseBuffers` share (what is remembered,
    which are free, a fresh state in a forked child and after unpickling)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        #: in a DataLoader worker whose batches travel by reference (``read/handoff.py``),
        #: the worker's shared pool memory: arrays are allocated in it, and an array is
        #: free only once the main process has also let go of what was sent from it
        self.memory: Any = None
        self.allocations = 0  # arrays allocated (not reused) so far
        self._owners: list[np.ndarray] = []
        self._takes = 0  # arrays handed out so far
        self._handed: dict[int, int] = {}  # id of a kept array -> the take that last gave it
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {"keep": self.keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        _Reused.__init__(self, state["keep"])

    def _after_fork(self) -> None:
        """A forked child starts afresh: the lock may have been copied held (pool memory
        set in this very process is kept)."""
        if self._pid != os.getpid():
            memory = self.memory
            _Reused.__init__(self, self.keep)
            if memory is not None and getattr(memory, "pid", None) == os.getpid():
                self.memory = memory

    def _free_owners(self) -> list[np.ndarray]:
        # a free array is referenced by the list and the loop only; how many references
        # that makes depends on the interpreter (3.14 borrows the loop variable's), so it
        # is measured on a probe held the same way
        probe = [np.empty(0)]
        floor = [sys.getrefcount(o) for o in probe][0]  # noqa: RUF015 (same shape as below)
        free = [o for o in self._owners if sys.getrefcount(o) <= floor]
        if self.memory is not None:
            free = [o for o in free if not self.memory.busy(o)]
        return free

    def _hand_out(self, owner: np.ndarray) -> None:
        """Note that ``owner`` is handed out (now)."""
        self._takes += 1
        self._handed[id(owner)] = self._takes

    def _remember(self, owner: np.ndarray, free: list[np.ndarray]) -> None:
        """Count a fresh ``owner`` and keep it for reuse; when ``keep`` are kept already,
        in place of a free one, else of the one out longest if it has been out for
        ``2 * keep`` takes (a caller holding on to it for good: it stays valid there, and
        is freed, not reused, once let go of); else the fresh one is not kept (the kept
        ones come back soon: a caller holding one array more than ``keep`` still gets
        most of them reused)."""
        self.allocations += 1
        if len(self._owners) >= self.keep:
            if free:
                gone = free[0]
            else:
                gone = min(self._owners, key=lambda o: self._handed.get(id(o), 0))
                if self._takes - self._handed.get(id(gone), 0) < 2 * self.keep:
                    return
            self._owners = [o for o in self._owners if o is not gone]
            self._handed.pop(id(gone), None)
        self._owners.append(owner)

    def clear(self) -> None:
        """Forget every array (arrays still in use elsewhere stay valid)."""
        self._after_fork()
        with self._lock:
            self._owners.clear()
            self._handed.clear()


class BufferCache(_Reused):
    """Reusable pool buffers, never handed out while anything still uses them.

    Fresh 100-MB buffers cost page faults on first touch (~20% of a pool read here). A
    buffer is handed out again only when nothing but this cache references it: every
    view, CSR matrix or ``torch.from_numpy`` tensor made from it holds a reference, so a
    batch a caller keeps is never overwritten (the cache then allocates a new buffer).

    Parameters
    ----------
    keep
        Buffers remembered for reuse (the rest are freed when released).
    """

    def __init__(self, keep: int = 6) -> None:
        super().__init__(keep)

    def take(self, n: int, dtype: np.dtype) -> np.ndarray:
        """An uninitialised 1-D array of ``n`` items of ``dtype``."""
        dtype = np.dtype(dtype)
        nbytes = n * dtype.itemsize
        self._after_fork()
        with self._lock:
            free = self._free_owners()
            fits = [o for o in free if o.nbytes >= nbytes]
            # a free buffer too small for this request (e.g. from an epoch's short last
            # pool) is not kept around: it would hold memory and rarely fit again
            small = {id(o) for o in free if o.nbytes < nbytes}
            if small:
                self._owners = [o for o in self._owners if id(o) not in small]
                for i in small:
                    self._handed.pop(i, None)
            if fits:
                owner = min(fits, key=lambda o: o.nbytes)
                self._hand_out(owner)
                return owner[:nbytes].view(dtype)
            # room to grow: pools' sizes vary; private pages never touched cost no memory
            # (shared pool memory is committed whole: less room there)
            owner = (None if self.memory is None
                     else self.memory.allocate(nbytes + nbytes // 8 + 64))
            if owner is None:  # no pool memory, or none to be had (populating the pages
                # here, MADV_POPULATE_WRITE, was measured slower: one thread, before the reads
                # start, where the read threads fault them in parallel)
                owner = fresh_bytes(nbytes + nbytes // 2 + 64)
            self._remember(owner, free)
            self._hand_out(owner)
            return owner[:nbytes].view(dtype)

    def take_pair(self, n: int, first: np.dtype, second: np.dtype
                  ) -> tuple[np.ndarray, np.ndarray]:
        """Two uninitialised 1-D arrays of ``n`` items each, of ``first`` and ``second``
        (a CSR pool's values and column indices), in one buffer: a pool's buffers are then
        of one size whatever the two dtypes (a cache of buffers of two sizes would drop
        the smaller ones a larger request finds free, and allocate anew every pool). The
        wider part comes first; the other starts at a multiple of 64 bytes."""
        a, b = np.dtype(first), np.dtype(second)
        wide, narrow = (a, b) if a.itemsize >= b.itemsize else (b, a)
        at = -(-n * wide.itemsize // 64) * 64
        raw = self.take(at + n * narrow.itemsize, np.dtype(np.uint8))
        x = raw[: n * wide.itemsize].view(wide)
        y = raw[at : at + n * narrow.itemsize].view(narrow)
        return (x, y) if wide is a else (y, x)

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self._owners)


class DenseBuffers(_Reused):
    """Dense batch arrays reused once the consumer has let go of them.

    A fresh array of a 4096 x 20000 batch is 328 MB whose first touch costs page faults;
    one the consumer dropped (nothing but this cache references it: a tensor made with
    ``torch.from_numpy`` holds a reference) is handed out again, to be zeroed and filled.
    A training loop still holds the previous batch while the next one is made: two are
    kept (the one in use and the one being made), so at most two batches' worth of dense
    memory stays allocated.

    Parameters
    ----------
    keep
        Arrays remembered for reuse.
    """

    def __init__(self, keep: int = 2) -> None:
        super().__init__(keep)

    def take(self, shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
        """An array of ``shape`` and ``dtype`` with arbitrary contents (zero it)."""
        self._after_fork()
        with self._lock:
            free = self._free_owners()
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            fits = [o for o in free if o.nbytes >= nbytes]
            if fits:  # an epoch's short last batch too: the next full one finds it again
                owner = min(fits, key=lambda o: o.nbytes)
                self._hand_out(owner)
                return owner[:nbytes].view(dtype).reshape(shape)
            # numpy's allocation, huge pages and all (unlike pool buffers, fresh_bytes): a
            # dense batch is written row by row across its whole width, and fills ~8%
            # faster on 2-MiB pages, which pays back the slower first touch in a long run
            owner = np.empty(nbytes, dtype=np.uint8)
            self._remember(owner, free)
            self._hand_out(owner)
            return owner.view(dtype).reshape(shape)
