"""A block of CSR rows in the collection's gene order, in routing order: one compiled loop.

Pass 1 gets each input's rows with that input's column indices; the collection stores them
in its own var order, rows sorted by column, in the order pass 1 routes them. Done with
scipy that is three passes (a mapped copy of the indices, ``sort_indices``, a fancy row
index), the sort a comparison sort per row; :func:`remap_rows` makes one pass: each row's
columns are mapped and marked in a bitmap of the collection's genes (a few KiB, it stays
in cache), then read back in order. Compiled by numba; it releases the GIL, so the Dask
writer's threads remap in parallel.
"""

from __future__ import annotations

import numba
import numpy as np
import scipy.sparse as sp
from numba.cpython.unsafe.numbers import trailing_zeros

__all__ = ["remap_rows"]


def _remap_py(indptr, indices, data, col_map, order, words, vals,  # type: ignore[no-untyped-def]
              out_indptr, out_indices, out_data):  # pragma: no cover
    one = np.uint64(1)
    o = 0
    for r in range(order.shape[0]):
        s = order[r]
        lo, hi = indptr[s], indptr[s + 1]
        wmin, wmax = words.shape[0], -1
        for j in range(lo, hi):
            c = col_map[indices[j]]
            if c < 0:  # a gene the collection does not keep
                continue
            w = c >> 6
            bit = one << np.uint64(c & 63)
            if words[w] & bit:  # a column twice in one row: leave it to scipy
                for k in range(min(wmin, w), max(wmax, w) + 1):
                    words[k] = 0
                return -1
            words[w] |= bit
            vals[c] = data[j]
            wmin = min(wmin, w)
            wmax = max(wmax, w)
        for w in range(wmin, wmax + 1):
            x = words[w]
            while x:
                c = (w << 6) + trailing_zeros(x)
                out_indices[o] = c
                out_data[o] = vals[c]
                o += 1
                x &= x - one
            words[w] = 0
        out_indptr[r + 1] = o
    return o


try:  # numba's cache (__pycache__ beside this file, else the user's cache folder)
    _remap = numba.njit(nogil=True, cache=True)(_remap_py)
except RuntimeError:  # nowhere writable to cache it: compiled in each process instead
    _remap = numba.njit(nogil=True)(_remap_py)


def remap_rows(m: sp.csr_matrix, col_map: np.ndarray, n_out: int, dtype: np.dtype,
               order: np.ndarray | None = None) -> sp.csr_matrix | None:
    """Rows ``order`` of CSR ``m`` (default: all, in order) with column ``j`` moved to
    ``col_map[j]`` (``-1``: dropped), each row's columns sorted, values cast to ``dtype``.

    Returns ``None`` when a row of ``m`` holds a column twice (a non-canonical matrix): the
    caller sorts it with scipy, which keeps both entries.
    """
    dtype = np.dtype(dtype)
    indptr = np.asarray(m.indptr, dtype=np.int64)
    n_rows = m.shape[0]
    rows = (np.arange(n_rows, dtype=np.int64) if order is None
            else np.asarray(order, dtype=np.int64))
    if m.data.dtype == np.float16 or dtype == np.float16:  # numba has no float16
        return None
    nnz = int(indptr[-1])
    out_indptr = np.zeros(rows.size + 1, dtype=np.int64)
    out_indices = np.empty(nnz, dtype=np.int32)
    out_data = np.empty(nnz, dtype=dtype)
    words = np.zeros(-(-max(n_out, 1) // 64), dtype=np.uint64)
    vals = np.empty(max(n_out, 1), dtype=m.data.dtype)
    kept = _remap(indptr, np.asarray(m.indices), np.asarray(m.data),
                  np.asarray(col_map, dtype=np.int64), rows, words, vals, out_indptr,
                  out_indices, out_data)
    if kept < 0:
        return None
    if kept < nnz:
        out_indices, out_data = out_indices[:kept].copy(), out_data[:kept].copy()
    out = sp.csr_matrix((out_data, out_indices, out_indptr), shape=(rows.size, n_out))
    out.has_sorted_indices = True
    return out
