"""Pool buffers and dense batch arrays reused, never handed out while anything still uses
them."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import numpy as np

__all__ = ["BufferCache", "DenseBuffers"]


class _Reused:
    """Arrays handed out again once nothing but this object references them: the
    bookkeeping :class:`BufferCache` and :class:`DenseBuffers` share (what is remembered,
    which are free, a fresh state in a forked child and after unpickling)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.allocations = 0  # arrays allocated (not reused) so far
        self._owners: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {"keep": self.keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        _Reused.__init__(self, state["keep"])

    def _after_fork(self) -> None:
        """A forked child starts afresh: the lock may have been copied held."""
        if self._pid != os.getpid():
            _Reused.__init__(self, self.keep)

    def _free_owners(self) -> list[np.ndarray]:
        # references to a free array: the list, the loop variable, getrefcount's argument
        return [o for o in self._owners if sys.getrefcount(o) <= 3]

    def _remember(self, owner: np.ndarray, free: list[np.ndarray]) -> None:
        """Count a fresh ``owner`` and keep it for reuse, in place of a free one when
        ``keep`` are kept already."""
        self.allocations += 1
        if len(self._owners) >= self.keep and free:
            self._owners = [o for o in self._owners if o is not free[0]]
        if len(self._owners) < self.keep:
            self._owners.append(owner)

    def clear(self) -> None:
        """Forget every array (arrays still in use elsewhere stay valid)."""
        with self._lock:
            self._owners.clear()


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
            if fits:
                return min(fits, key=lambda o: o.nbytes)[:nbytes].view(dtype)
            # room to grow: pools' sizes vary; pages never touched cost no memory (RSS)
            owner = np.empty(nbytes + nbytes // 2 + 64, dtype=np.uint8)
            self._remember(owner, free)
            return owner[:nbytes].view(dtype)

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
            for o in free:
                if o.shape == shape and o.dtype == dtype:
                    return o
            out = np.empty(shape, dtype=dtype)
            self._remember(out, free)
            return out
