"""Rows of a sparse matrix copied to their places, in a pool or in a dense batch: compiled
loops.

A pool's rows are read in stored order (one ``preadv`` and one CRC-32C per chunk, into a
per-thread scratch buffer of a few MiB) and then put at their shuffled places in the pool's
buffers by :func:`scatter_rows`, widened on the way from what a shard stores (``uint8`` /
``uint16`` counts, ``uint16`` column indices: ``write/narrow.py``) to what the pool holds
(float32 values, int32 indices). The loop is compiled by numba and releases the GIL, so the
reader's threads scatter in parallel; done in numpy it would cost a Python step per row (or
an element index of 8 bytes per non-zero) and one more pass over the pool.
:func:`scatter_rows_range` copies column indices so, keeping the least and the greatest it
copies: the check that they lie inside the matrix costs no pass of its own.

:func:`todense_rows` densifies CSR rows into a reused dense array, zeroing each row just
before filling it (while it is in the cache): one pass over the dense memory where zeroing
it all and then scattering (scipy's ``csr_todense``) makes two.
"""

from __future__ import annotations

import threading

import numpy as np

from ..store.native import compiled
from .buffers import fresh_bytes

__all__ = ["densifies", "scatter_rows", "scatter_rows_range", "scratch", "todense_rows"]


# Indices are made unsigned inside the copy (scatter_rows checks they are not negative): a
# signed index costs a wrap-around test per element (negative indices count from the end),
# which keeps LLVM from vectorizing the copy (measured 2-5x slower for a widening copy).
# (np.uint64(j): without the JIT, numpy 1.x would make uint64 + int a float.)
def _scatter_py(src, starts, lens, out, dests):  # type: ignore[no-untyped-def]  # pragma: no cover
    for r in range(lens.shape[0]):
        s = np.uint64(starts[r])
        d = np.uint64(dests[r])
        for j in range(np.uint64(lens[r])):
            k = np.uint64(j)
            out[d + k] = src[s + k]


# the same copy, also keeping the least and the greatest item copied (column indices
# checked on the way, while in the cache: no pass over the pool afterwards); lohi holds the
# starting pair, in the source's dtype, and receives the result
def _scatter_range_py(src, starts, lens, out, dests, lohi):  # type: ignore[no-untyped-def]  # pragma: no cover
    lo = lohi[0]
    hi = lohi[1]
    for r in range(lens.shape[0]):
        s = np.uint64(starts[r])
        d = np.uint64(dests[r])
        for j in range(np.uint64(lens[r])):
            k = np.uint64(j)
            v = src[s + k]
            out[d + k] = v
            lo = min(lo, v)
            hi = max(hi, v)
    lohi[0] = lo
    lohi[1] = hi


# signed column indices here: todense_rows does not check them (a CSR batch handed in by a
# caller may hold anything), and a negative one stays inside its row
def _todense_py(indptr, indices, data, out, zero):  # type: ignore[no-untyped-def]  # pragma: no cover
    for i in range(out.shape[0]):
        row = out[i]
        if zero:
            row[:] = 0
        for j in range(indptr[i], indptr[i + 1]):
            row[indices[j]] += data[j]


# compiled (nogil, cached); importing store/native.py also keeps forked children from
# inheriting numba's compiler lock held by another thread
_scatter = compiled(_scatter_py)
_scatter_range = compiled(_scatter_range_py)
_todense = compiled(_todense_py)

#: dtype kinds the loop copies between (native byte order)
_KINDS = "biuf"


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
    args = _checked_rows(src, starts, lens, out, dests)
    if args is not None:
        _scatter(src, args[0], args[1], out, args[2])


def scatter_rows_range(src: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                       out: np.ndarray, dests: np.ndarray) -> tuple[int, int] | None:
    """:func:`scatter_rows` of integer items that also returns the least and the greatest
    item copied (``None`` when no item was): column indices checked as they are copied.

    Raises
    ------
    ValueError
        As :func:`scatter_rows`, or if ``src`` does not hold integers.
    """
    if src.dtype.kind not in "iu":
        raise ValueError(f"scatter_rows_range copies integers, got {src.dtype}")
    args = _checked_rows(src, starts, lens, out, dests)
    if args is None or not int(args[1].sum()):
        return None
    info = np.iinfo(src.dtype)
    lohi = np.array([info.max, info.min], dtype=src.dtype)
    _scatter_range(src, args[0], args[1], out, args[2], lohi)
    return int(lohi[0]), int(lohi[1])


def _checked_rows(src: np.ndarray, starts: np.ndarray, lens: np.ndarray, out: np.ndarray,
                  dests: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The rows' ``(starts, lens, dests)`` as int64 once every row is known to lie inside
    ``src`` and ``out`` (``None``: no row), else ``ValueError``."""
    starts = np.asarray(starts, dtype=np.int64)
    lens = np.asarray(lens, dtype=np.int64)
    dests = np.asarray(dests, dtype=np.int64)
    if not (starts.shape == lens.shape == dests.shape and starts.ndim == 1):
        raise ValueError("scatter_rows: starts, lens and dests must be 1-D and of one length")
    if not lens.size:
        return None
    if src.ndim != 1 or out.ndim != 1 or not out.flags.writeable:
        raise ValueError("scatter_rows copies between 1-D arrays into a writeable one")
    for a in (src, out):
        if (a.dtype.kind not in _KINDS or not a.dtype.isnative or a.dtype == np.float16
                or not a.flags.c_contiguous):
            raise ValueError(f"scatter_rows: cannot copy {a.dtype} arrays (numbers in native "
                             "byte order, contiguous, not float16)")
    # each bound alone first: their sums could wrap past int64
    if (int(lens.min()) < 0 or int(starts.min()) < 0 or int(dests.min()) < 0
            or int(lens.max()) > min(src.size, out.size) or int(starts.max()) > src.size
            or int(dests.max()) > out.size or int((starts + lens).max()) > src.size
            or int((dests + lens).max()) > out.size):
        raise ValueError(f"scatter_rows: rows fall outside the source ({src.size} items) or "
                         f"the destination ({out.size} items)")
    return starts, lens, dests


def densifies(data: np.dtype, out: np.dtype) -> bool:
    """Whether :func:`todense_rows` densifies values of dtype ``data`` into ``out``: the
    same dtype, or integer or float values (a shard's narrow counts, float64 values) into
    float32 / float64, cast on the way exactly as numpy's ``astype`` casts them."""
    data, out = np.dtype(data), np.dtype(out)
    if not (out.kind in _KINDS and out.isnative and out != np.float16):
        return False
    # (the loop adds in float64, exact for floats and integers of up to 32 bits, whose one
    # rounding to float32 is then numpy's; wider integers only into float64, rounded once)
    return data == out or (data.kind in "iuf" and data.isnative and data != np.float16
                           and out.kind == "f" and (data.itemsize <= 4 or out == np.float64
                                                    or data.kind == "f"))


def todense_rows(indptr: np.ndarray, indices: np.ndarray, data: np.ndarray, out: np.ndarray,
                 zero: bool) -> None:
    """``out[i] += row i`` of the CSR ``(data, indices, indptr)`` for every row of ``out``
    (``indptr`` holds ``len(out) + 1`` absolute offsets into ``indices`` and ``data``);
    ``zero``: each row of ``out`` is zeroed first. ``out`` is C-contiguous 2-D, of
    ``data``'s dtype or a float dtype integer values are cast to (:func:`densifies`); the
    column indices (any integer dtype) must lie in ``[0, out.shape[1])`` (not checked, as
    in scipy's kernel: pools' indices were checked when read)."""
    if (out.ndim != 2 or not out.flags.c_contiguous or not out.flags.writeable
            or not densifies(data.dtype, out.dtype) or indices.dtype.kind not in "iu"
            or len(indptr) != out.shape[0] + 1):
        raise ValueError("todense_rows: out must be a writeable C-contiguous 2-D array of "
                         "the values' dtype (or a float dtype for integer values), with one "
                         "row per indptr step")
    if out.shape[0]:
        _todense(indptr, indices, data, out, zero)


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
        buf = bufs[slot] = fresh_bytes(max(nbytes, 1))
    return buf[:nbytes].view(dtype)
