"""Rows of a sparse matrix copied to their places in a pool, cast as they go: one compiled
loop.

A pool's rows are read in stored order (one ``preadv`` and one CRC-32C per chunk, into a
small per-thread scratch buffer) and then put at their shuffled places in the pool's
buffers by :func:`scatter_rows`, widened on the way from what a shard stores (``uint8`` /
``uint16`` counts, ``uint16`` column indices: ``write/narrow.py``) to what the pool holds
(float32 values, int32 indices). The loop is compiled by numba and releases the GIL, so the
reader's threads scatter in parallel while the scratch they read is still in the CPU's
cache; done in numpy it would cost a Python step per row (or an element index of 8 bytes
per non-zero) and one more pass over the pool.
"""

from __future__ import annotations

import threading

import numba
import numpy as np

__all__ = ["scatter_rows", "scratch"]


@numba.njit(nogil=True, cache=True)
def _scatter(src, starts, lens, out, dests):  # type: ignore[no-untyped-def]  # pragma: no cover
    for r in range(lens.shape[0]):
        s = starts[r]
        d = dests[r]
        for j in range(lens[r]):
            out[d + j] = src[s + j]


def scatter_rows(src: np.ndarray, starts: np.ndarray, lens: np.ndarray, out: np.ndarray,
                 dests: np.ndarray) -> None:
    """Copy row ``r``, ``src[starts[r] : starts[r] + lens[r]]``, to ``out[dests[r]:]``,
    cast to ``out``'s dtype (the caller makes sure it holds every value).

    Raises
    ------
    ValueError
        If a row would be read or written outside ``src`` or ``out`` (checked before the
        compiled loop, which does not check).
    """
    starts = np.asarray(starts, dtype=np.int64)
    lens = np.asarray(lens, dtype=np.int64)
    dests = np.asarray(dests, dtype=np.int64)
    if not (starts.shape == lens.shape == dests.shape and starts.ndim == 1):
        raise ValueError("scatter_rows: starts, lens and dests must be 1-D and of one length")
    if not lens.size:
        return
    if src.ndim != 1 or out.ndim != 1 or not out.flags.writeable:
        raise ValueError("scatter_rows copies between 1-D arrays into a writeable one")
    if (int(lens.min()) < 0 or int(starts.min()) < 0 or int(dests.min()) < 0
            or int((starts + lens).max()) > src.size or int((dests + lens).max()) > out.size):
        raise ValueError(f"scatter_rows: rows fall outside the source ({src.size} items) or "
                         f"the destination ({out.size} items)")
    _scatter(src, starts, lens, out, dests)


_local = threading.local()


def scratch(n: int, dtype: np.dtype, slot: int) -> np.ndarray:
    """A thread's reusable buffer of ``n`` items of ``dtype`` (``slot``: which of its
    buffers, e.g. 0 for values and 1 for indices); grown when too small, never shrunk."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    dtype = np.dtype(dtype)
    nbytes = n * dtype.itemsize
    buf = bufs.get(slot)
    if buf is None or buf.nbytes < nbytes:
        buf = bufs[slot] = np.empty(max(nbytes, 1), dtype=np.uint8)
    return buf[:nbytes].view(dtype)
