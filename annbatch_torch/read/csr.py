"""CSR pieces of a pool on the host: views without copies, row slices, densifying.

:func:`csr_view` builds a ``scipy.sparse.csr_matrix`` over given arrays (pool buffers,
batch slices) without scipy's copies; :func:`row_slice` cuts a zero-copy batch out of a
pool value; :func:`densify_csr` densifies with a compiled row loop
(``scatter.todense_rows``; 2 threads for big batches, or straight into shared memory inside
a DataLoader worker).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from .buffers import DenseBuffers
from .scatter import densifies, todense_rows

try:  # scipy's CSR -> dense kernel, writing into a given (zeroed) buffer
    from scipy.sparse._sparsetools import csr_todense as _csr_todense
except ImportError:  # pragma: no cover
    _csr_todense = None

__all__ = ["PendingCSR", "csr_tensor_to_dense", "csr_view", "densify_csr", "row_slice"]


_SPLIT_MIN = 1 << 22  # dense elements from which densifying is split over two threads
_BLOCKS = 16  # blocks of rows the two threads share out
_helper: tuple[int, ThreadPoolExecutor] | None = None


def _helper_thread() -> ThreadPoolExecutor:
    """One helper thread per process (a forked child makes its own)."""
    global _helper
    if _helper is None or _helper[0] != os.getpid():
        _helper = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="annbatch-densify"))
    return _helper[1]


def _fill_todense(n: int, g: int, indptr: np.ndarray, indices: np.ndarray, data: np.ndarray,
                  out: np.ndarray, zero: bool) -> None:
    if out.flags.c_contiguous and densifies(data.dtype, out.dtype):
        todense_rows(indptr[: n + 1], indices, data, out, zero)  # one pass over ``out``
        return
    if zero:
        out.fill(0)
    # scipy's kernel: one dtype for values and output, int32 or int64 indices
    if indices.dtype not in (np.int32, np.int64) or indptr.dtype != indices.dtype:
        wide = np.int64 if np.int64 in (indices.dtype, indptr.dtype) else np.int32
        indptr, indices = indptr.astype(wide), indices.astype(wide)
    _csr_todense(n, g, indptr, indices, data.astype(out.dtype, copy=False), out)


def _todense_into(m: sp.csr_matrix | sp.csr_array, out: np.ndarray, split: bool,
                  zero: bool = False) -> None:
    """``out += m`` by a compiled row loop (scipy's kernel for another layout of ``out``),
    which releases the GIL (``zero``: ``out`` is zeroed first, else the caller zeroed it):
    with ``split`` the second half of the rows is done by a helper thread."""
    n, g = m.shape
    if _csr_todense is None:  # pragma: no cover - scipy without the private kernel
        if zero:
            out.fill(0)
        out += m.toarray()
        return
    if not split or n < 2:
        _fill_todense(n, g, m.indptr, m.indices, m.data, out, zero)
        return
    # blocks of rows taken in turn by both threads from one iterator: a thread the
    # scheduler holds back (beside DataLoader workers, say) does fewer rows rather than
    # leaving the other one waiting for its half
    step = -(-n // _BLOCKS)
    blocks = iter(range(0, n, step))
    taking = threading.Lock()  # (a free-threaded Python has no GIL to make next() atomic)

    def work() -> None:
        while True:
            with taking:
                lo = next(blocks, None)
            if lo is None:
                return
            hi = min(lo + step, n)  # indptr keeps absolute offsets: a block reads its rows
            _fill_todense(hi - lo, g, m.indptr[lo : hi + 1], m.indices, m.data, out[lo:hi],
                          zero)

    fut = _helper_thread().submit(work)
    try:
        work()
    finally:
        fut.result()


def densify_csr(
    m: sp.csr_matrix | sp.csr_array, dtype: Any = np.float32, shared: bool = False,
    threads: int | None = None, buffers: DenseBuffers | None = None,
) -> np.ndarray:
    """Dense 2-D copy of a CSR matrix, computed by a compiled row loop (torch's CPU
    ``to_dense`` is ~9x slower than scipy's kernel, which this loop beats).

    Parameters
    ----------
    m
        The matrix.
    dtype
        Output dtype (float32).
    shared
        Write the result straight into a fresh shared-memory tensor (returned as its numpy
        view; :func:`to_tensor` hands back that tensor): a DataLoader worker then passes
        the batch on without copying it again.
    threads
        1 or 2 threads; default: 2 for batches of at least 2**22 values when the machine
        has 2+ CPUs and this is not a shared (worker) batch.
    buffers
        Reuse a dense array of this shape that nothing references any more (zeroed
        again, by the same threads) instead of fresh memory, whose first touch costs page
        faults; not with ``shared``.
    """
    n, g = m.shape
    if m.format != "csr" or m.ndim != 2 or not densifies(m.dtype, dtype):
        out = csr_view(m.data, m.indices.astype(np.int64), m.indptr.astype(np.int64),
                       m.shape).toarray() if m.format == "csr" else m.toarray()
        return out if out.dtype == dtype else out.astype(dtype)
    if threads is None:
        threads = 2 if (not shared and n * g >= _SPLIT_MIN and (os.cpu_count() or 1) > 1) else 1
    if shared:
        storage = torch.UntypedStorage._new_shared(max(1, n * g) * np.dtype(dtype).itemsize)
        t = torch.empty(0, dtype=torch.from_numpy(np.empty(0, dtype)).dtype).set_(storage)
        out = t[: n * g].view(n, g).numpy()  # fresh shared memory reads as zeros
    elif buffers is not None:
        out = buffers.take((n, g), np.dtype(dtype))
        _todense_into(m, out, threads > 1, zero=True)
        return out
    else:
        out = np.zeros((n, g), dtype=dtype)
    _todense_into(m, out, threads > 1)
    return out


def csr_view(
    data: np.ndarray, indices: np.ndarray, indptr: np.ndarray, shape: tuple[int, int]
) -> sp.csr_matrix:
    """A ``csr_matrix`` over the given arrays, never copying them.

    ``sp.csr_matrix((data, indices, indptr), copy=False)`` copies ``data`` and ``indices``
    when they are views of an array more than twice their size (scipy's ``prune``), which
    is exactly what pool buffers and batch slices are. The arrays must form a valid CSR
    matrix (the reader builds them so).
    """
    m = sp.csr_matrix(shape, dtype=data.dtype)  # empty: O(rows) to build, nothing checked
    m.indptr, m.indices, m.data = indptr, indices, data
    return m


def row_slice(value: Any, lo: int, hi: int) -> Any:
    """Rows ``[lo, hi)`` of a pool value without copying (a CSR of views, or a view)."""
    if not sp.issparse(value):
        return value[lo:hi]
    start, stop = int(value.indptr[lo]), int(value.indptr[hi])
    indptr = value.indptr[lo : hi + 1] - value.indptr[lo]
    return csr_view(value.data[start:stop], value.indices[start:stop], indptr,
                    (hi - lo, value.shape[1]))


def csr_tensor_to_dense(t: torch.Tensor, buffers: DenseBuffers | None = None,
                        dtype: Any = None) -> torch.Tensor:
    """Densify a CPU ``torch.sparse_csr_tensor`` (:func:`densify_csr`), into ``dtype``
    (``None``: the tensor's values' dtype); ``buffers``: into a reused array (see
    :func:`densify_csr`)."""
    values = t.values().numpy()
    m = csr_view(values, t.col_indices().numpy(), t.crow_indices().numpy(),
                 (int(t.shape[0]), int(t.shape[1])))
    return torch.from_numpy(densify_csr(m, dtype=values.dtype if dtype is None else dtype,
                                        buffers=buffers))


class PendingCSR:
    """A batch's CSR value as tensors of any dtypes (a DataLoader worker's pool slot
    viewed by the main process: 16-bit column indices, integer counts), densified into
    ``dtype`` by :meth:`to_dense`, or made a CSR tensor by :meth:`to_csr`; either lets go
    of the parts (and so of the slot they view).

    Parameters
    ----------
    crow
        Row offsets (int32 or int64).
    col, values
        Column indices and values, 1-D tensors.
    shape
        ``(rows, columns)``.
    dtype
        The values' dtype once delivered.
    """

    __slots__ = ("col", "crow", "dtype", "shape", "values")

    def __init__(self, crow: np.ndarray, col: torch.Tensor, values: torch.Tensor,
                 shape: tuple[int, int], dtype: Any) -> None:
        self.crow, self.col, self.values = crow, col, values
        self.shape, self.dtype = shape, np.dtype(dtype)

    def _take(self) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        parts = (self.crow, self.col, self.values)
        if parts[1] is None:
            raise RuntimeError("this batch value was delivered already")
        self.crow = self.col = self.values = None  # type: ignore[assignment]
        return parts

    def to_dense(self, buffers: DenseBuffers | None = None) -> torch.Tensor:
        """The dense ``(rows, columns)`` tensor of ``dtype`` (``buffers``: into a reused
        array, see :func:`densify_csr`)."""
        crow, col, values = self._take()
        m = csr_view(values.numpy(), col.numpy(), crow, self.shape)
        del col, values
        return torch.from_numpy(densify_csr(m, dtype=self.dtype, buffers=buffers))

    def to_csr(self) -> torch.Tensor:
        """A ``torch.sparse_csr_tensor`` viewing the parts where their dtypes are a CSR
        tensor's (int32 or int64 indices like the row offsets, values of ``dtype``), else
        of copies cast to them."""
        crow, col, values = self._take()
        index = torch.from_numpy(crow).dtype
        if col.dtype != index:
            col = col.to(index)
        if values.dtype != torch.from_numpy(np.empty(0, self.dtype)).dtype:
            values = torch.from_numpy(values.numpy().astype(self.dtype))
        return torch.sparse_csr_tensor(torch.from_numpy(crow), col, values, size=self.shape,
                                       check_invariants=False)
