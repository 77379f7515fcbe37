"""Pool buffers and dense batch arrays reused, never handed out while anything still uses
them."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import numpy as np

__all__ = ["BufferCache", "DenseBuffers"]


class BufferCache:
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
        self.keep = keep
        self.allocations = 0  # buffers allocated (not reused) so far
        self._owners: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {"keep": self.keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["keep"])  # type: ignore[misc]

    def _free_owners(self) -> list[np.ndarray]:
        # references to a free buffer: the list, the loop variable, getrefcount's argument
        return [o for o in self._owners if sys.getrefcount(o) <= 3]

    def take(self, n: int, dtype: np.dtype) -> np.ndarray:
        """An uninitialised 1-D array of ``n`` items of ``dtype``."""
        dtype = np.dtype(dtype)
        nbytes = n * dtype.itemsize
        if self._pid != os.getpid():  # a forked child: the lock may have been copied held
            self.__init__(self.keep)  # type: ignore[misc]
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
            self.allocations += 1
            if len(self._owners) >= self.keep and free:
                self._owners = [o for o in self._owners if o is not free[0]]
            if len(self._owners) < self.keep:
                self._owners.append(owner)
            return owner[:nbytes].view(dtype)

    def clear(self) -> None:
        """Forget every buffer (memory still in use elsewhere stays valid)."""
        with self._lock:
            self._owners.clear()

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self._owners)


class DenseBuffers:
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
        self.keep = keep
        self.allocations = 0  # arrays allocated (not reused) so far
        self._owners: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {"keep": self.keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["keep"])  # type: ignore[misc]

    def take(self, shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
        """An array of ``shape`` and ``dtype`` with arbitrary contents (zero it)."""
        if self._pid != os.getpid():  # a forked child: the lock may have been copied held
            self.__init__(self.keep)  # type: ignore[misc]
        with self._lock:
            # references to a free array: the list, the loop variable, getrefcount's argument
            free = [o for o in self._owners if sys.getrefcount(o) <= 3]
            for o in free:
                if o.shape == shape and o.dtype == dtype:
                    return o
            out = np.empty(shape, dtype=dtype)
            self.allocations += 1
            if len(self._owners) >= self.keep and free:
                self._owners = [o for o in self._owners if o is not free[0]]
            if len(self._owners) < self.keep:
                self._owners.append(out)
            return out

    def clear(self) -> None:
        """Forget every array (arrays still in use elsewhere stay valid)."""
        with self._lock:
            self._owners.clear()
