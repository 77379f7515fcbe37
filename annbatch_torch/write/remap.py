"""A block of CSR rows in the collection's gene order, in routing order: one compiled loop.

Pass 1 gets each input's rows with that input's column indices; the collection stores them
in its own var order, rows sorted by column, in the order pass 1 routes them. Done with
scipy that is three passes (a mapped copy of the indices, ``sort_indices``, a fancy row
index), the sort a comparison sort per row; :func:`remap_rows` makes one pass over the
rows: each row's columns are mapped and copied into place, then sorted there by a radix
sort of two 8-bit digits (a 30,000-gene panel; 256 counters and a row of scratch, in
cache), which costs a row of ~250 genes less than a bitmap of the panel's 30,000 bits read
back word by word. Compiled by numba; it releases the GIL, so the Dask writer's threads
remap in parallel. Where the input's genes keep the collection's order (some perhaps
dropped) and its rows are sorted, the mapped rows are sorted as they are copied: no sort.
Where they keep it and none is dropped, the block needs no compiled loop at all
(:func:`needs_compiled_remap`): a numpy gather of the column indices and scipy's row index
are as fast, and a process that runs no other compiled loop is spared numba's start (its
runtime and the loop's cached machine code, loaded on a process's first compiled call).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numba
import numpy as np
import scipy.sparse as sp

from ..store.native import compiled

__all__ = ["check_col_map", "load_remap", "needs_compiled_remap", "remap_rows", "rows_increase"]

logger = logging.getLogger(__name__)


def _remap_py(indptr, indices, data, col_map, order, n_digits, bits, count,  # type: ignore[no-untyped-def]
              tmp_c, tmp_v, out_indptr, out_indices, out_data):  # pragma: no cover
    # each row: its kept columns mapped and copied into place, then sorted there by an LSD
    # radix sort of ``n_digits`` digits of ``bits`` bits (ping-pong with the row-sized
    # scratch ``tmp_*``; ``count`` holds ``1 << bits`` counters); -1 for a column twice
    mask = (1 << bits) - 1
    o = 0
    for r in range(order.shape[0]):
        s = order[r]
        k = o
        for j in range(indptr[s], indptr[s + 1]):
            c = col_map[indices[j]]
            if c >= 0:  # else a gene the collection does not keep
                out_indices[k] = c
                out_data[k] = data[j]
                k += 1
        n = k - o
        src_c = out_indices[o:k]
        src_v = out_data[o:k]
        dst_c = tmp_c[:n]
        dst_v = tmp_v[:n]
        for d in range(n_digits):
            shift = d * bits
            count[:] = 0
            for i in range(n):
                count[(src_c[i] >> shift) & mask] += 1
            total = 0
            for i in range(mask + 1):
                x = count[i]
                count[i] = total
                total += x
            for i in range(n):
                c = src_c[i]
                at = (c >> shift) & mask
                p = count[at]
                count[at] = p + 1
                dst_c[p] = c
                dst_v[p] = src_v[i]
            src_c, dst_c = dst_c, src_c
            src_v, dst_v = dst_v, src_v
        if n_digits & 1:  # the sorted row is in the scratch
            dst_c[:] = src_c
            dst_v[:] = src_v
        for i in range(o + 1, k):
            if out_indices[i] <= out_indices[i - 1]:  # a column twice (or a row not sorted
                return -1  # with n_digits == 0): leave it to scipy
        o = k
        out_indptr[r + 1] = o
    return o


def _radix_digits(n_out: int) -> tuple[int, int]:
    """``(digits, bits)`` of the radix sort of columns in ``[0, n_out)``: the fewest digits
    of at most 8 bits (256 counters, in L1), evened out (15 bits: two of 8)."""
    width = max(int(n_out - 1).bit_length(), 1)
    digits = -(-width // 8)
    return digits, -(-width // digits)


def needs_compiled_remap(col_map: np.ndarray | None, is_sorted: bool) -> bool:
    """Whether blocks of sorted CSR rows mapped by ``col_map`` (``is_sorted``: it keeps the
    order of the columns it keeps) are remapped by :func:`remap_rows`: their genes change
    order, or some are dropped (which numpy does in more passes than the compiled loop's
    one). A map that only renumbers every column in order is a numpy gather as fast."""
    return col_map is not None and (not is_sorted or bool(np.any(col_map < 0)))


def check_col_map(col_map: np.ndarray, n_in: int, n_out: int) -> None:
    """Refuse a map that does not send each of ``n_in`` columns into ``[-1, n_out)``."""
    if col_map.shape != (n_in,) or (col_map.size and (
            int(col_map.min()) < -1 or int(col_map.max()) >= n_out)):
        raise ValueError(f"remap_rows: col_map must map each of the {n_in} columns "
                         f"into [-1, {n_out})")


def rows_increase(m: sp.csr_matrix) -> bool:
    """Whether each row of ``m`` has strictly increasing column indices, read from its
    arrays (whatever its ``has_sorted_indices`` flag says)."""
    indptr, indices = np.asarray(m.indptr), np.asarray(m.indices)
    if indices.size < 2:
        return True
    down = indices[1:] <= indices[:-1]
    starts = indptr[1:-1]
    starts = starts[(starts > 0) & (starts < indices.size)]
    down[starts - 1] = False  # (a row's first column against the row before's last)
    return not bool(down.any())


def _keeps_order(m: sp.csr_matrix, col_map: np.ndarray) -> bool:
    """Whether ``col_map`` keeps the order of the columns it keeps (the input's genes in the
    collection's order, some perhaps dropped) and ``m``'s rows are sorted: the mapped rows
    are sorted then, as they are copied."""
    kept = col_map[col_map >= 0]
    return bool(np.all(kept[1:] > kept[:-1])) and bool(m.has_sorted_indices)


_remap = compiled(_remap_py)


def _compiled_kind(dtype: np.dtype) -> bool:
    return dtype.kind in "biuf" and dtype.isnative and dtype.itemsize <= 8 and dtype != np.float16


#: non-zeros from which a block is remapped by two threads (when the process may use two
#: CPUs and the caller asks for them)
SPLIT_NNZ = 1 << 20


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def remap_rows(m: sp.csr_matrix, col_map: np.ndarray, n_out: int, dtype: np.dtype,
               order: np.ndarray | None = None, threads: int = 1) -> sp.csr_matrix | None:
    """Rows ``order`` of CSR ``m`` (default: all, in order) with column ``j`` moved to
    ``col_map[j]`` (``-1``: dropped), each row's columns sorted, values cast to ``dtype``;
    ``threads=2``: the second half of the rows by a second thread (blocks of at least
    :data:`SPLIT_NNZ` non-zeros, on a process with two CPUs or more).

    Returns ``None`` where the compiled loop does not apply and scipy must do it: a row of
    ``m`` holds a column twice (a non-canonical matrix; scipy keeps both entries), an
    output ``dtype`` numba has no loop for (float16, longdouble; the values are cast to
    ``dtype`` before the loop, so any input dtype numpy casts from will do), or numba's JIT
    is disabled (``NUMBA_DISABLE_JIT``).

    Raises
    ------
    ValueError
        If ``order`` names a row outside ``m``, or ``col_map`` does not map every column
        of ``m`` into ``[-1, n_out)`` (checked before the compiled loop, which does not).
    """
    dtype = np.dtype(dtype)
    indptr = np.asarray(m.indptr, dtype=np.int64)
    n_rows = m.shape[0]
    rows = (np.arange(n_rows, dtype=np.int64) if order is None
            else np.asarray(order, dtype=np.int64))
    col_map = np.asarray(col_map, dtype=np.int64)
    if numba.config.DISABLE_JIT or not _compiled_kind(dtype):
        return None
    if rows.ndim != 1 or (rows.size and (int(rows.min()) < 0 or int(rows.max()) >= n_rows)):
        raise ValueError(f"remap_rows: order must hold row numbers of the {n_rows} rows")
    check_col_map(col_map, m.shape[1], n_out)
    indices = np.asarray(m.indices)
    if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= m.shape[1]):
        raise ValueError(f"remap_rows: column indices outside [0, {m.shape[1]})")
    lens = indptr[rows + 1] - indptr[rows]
    nnz = int(lens.sum())
    out_indptr = np.zeros(rows.size + 1, dtype=np.int64)
    out_indices = np.empty(nnz, dtype=np.int32)
    out_data = np.empty(nnz, dtype=dtype)
    # cast before (a copy only where the dtypes differ): one compiled loop per output
    # dtype and index width, not per input dtype too (each a compile, or a load from
    # numba's cache in a fresh process)
    data = np.asarray(m.data, dtype=dtype)

    digits, bits = _radix_digits(n_out)
    if _keeps_order(m, col_map):
        digits = 0  # each row's columns mapped in place are sorted already: no sort
    longest = max(int(lens.max()) if lens.size else 0, 1)

    def run(r0: int, r1: int, o: int) -> int:
        """Rows ``rows[r0:r1]`` into the output from entry ``o`` (their indptr relative to
        ``o``); the count kept, -1 for a column twice in a row."""
        count = np.empty(1 << bits, dtype=np.int64)  # each thread its own scratch
        tmp_c = np.empty(longest, dtype=np.int32)
        tmp_v = np.empty(longest, dtype=dtype)
        return int(_remap(indptr, indices, data, col_map, rows[r0:r1], digits, bits, count,
                          tmp_c, tmp_v, out_indptr[r0:], out_indices[o:], out_data[o:]))

    h = rows.size // 2
    if threads > 1 and nnz >= SPLIT_NNZ and h and usable_cpus() > 1:
        bound = int(lens[:h].sum())  # the first half's entries, before any is dropped
        got: list[Any] = []  # the helper's count, or what it raised

        def second() -> None:
            try:
                got.append(run(h, rows.size, bound))
            except BaseException as e:  # re-raised in the caller's thread
                got.append(e)

        helper = threading.Thread(target=second, name="annbatch-remap")
        helper.start()  # a thread per block (joined below): nothing lingers to fork with
        try:
            first = run(0, h, 0)
        finally:
            helper.join()
        if isinstance(got[0], BaseException):
            raise got[0]
        tail = int(got[0])
        if first < 0 or tail < 0:
            return None
        if first < bound:  # genes the collection does not keep: close the gap
            out_indices[first : first + tail] = out_indices[bound : bound + tail]
            out_data[first : first + tail] = out_data[bound : bound + tail]
        out_indptr[h + 1 :] += first
        kept = first + tail
    else:
        kept = run(0, rows.size, 0)
    if kept < 0:
        return None
    if kept < nnz:
        out_indices, out_data = out_indices[:kept].copy(), out_data[:kept].copy()
    out = sp.csr_matrix((out_data, out_indices, out_indptr), shape=(rows.size, n_out))
    out.has_sorted_indices = True
    return out


def load_remap() -> None:
    """Load the compiled loop now, in this thread (numba's start and its cached machine
    code: ~0.25 s in a fresh process); a failure is left to the first real call."""
    try:
        m = sp.csr_matrix(np.ones((1, 1), dtype=np.float32))
        m.indices = m.indices.astype(np.int32)
        remap_rows(m, np.zeros(1, dtype=np.int64), 1, np.dtype(np.float32))
    except Exception:  # the real call meets (and reports) the same trouble
        logger.debug("loading the compiled gene remap ahead failed", exc_info=True)
