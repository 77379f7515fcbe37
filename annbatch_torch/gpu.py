"""Holding a pool on the GPU and cutting batches out of it there (the ``gpu`` extra).

:class:`DevicePool` uploads a pool once (``{field path: scipy CSR matrix or numpy array}``,
one asynchronous copy per buffer, from pinned host memory where that pays) and then cuts
batches out of it on the device: CSR fields are densified there by a small cupy kernel (or
returned as ``torch.sparse_csr_tensor``), dense fields are sliced there. Nothing is copied
back to the host, and the host does no per-batch work beyond a few index look-ups.

Everything but the densification kernel is plain torch, so the same code runs with the pool
on the CPU (``DevicePool(pool, "cpu")``: scipy densifies), which is how the tests check it on
machines without a GPU.

cupy is imported lazily, inside the functions that need it: importing this module, and the
whole CPU path, never imports cupy.

Streams: all device work (uploads, the kernel, slicing) is queued on torch's *current*
stream of the device, cupy's kernel included (launched on a cupy ``ExternalStream`` wrapping
torch's stream), so tensors handed back are safe to use on that stream without any host
synchronisation. A pool uploaded on one stream and cut on another is handled with an event
and ``Tensor.record_stream``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
from torch.utils.data import get_worker_info

__all__ = ["DevicePool", "check_device"]

#: Largest value an int32 index tensor may hold (torch sparse CSR uses signed indices).
_INT32_MAX = 2**31 - 1
#: Host buffers at least this large are pinned before their upload (async, ~3-5x faster
#: copies); smaller ones are copied straight from pageable memory.
_PIN_MIN_BYTES = 1 << 20
#: Threads per block of the densification kernel (one block per row, grid-stride).
_THREADS = 256
#: Most blocks launched by one densification kernel.
_MAX_BLOCKS = 65535

#: torch dtypes of the arrays a pool uploads.
_TORCH_DTYPES = {
    np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64, np.dtype(np.bool_): torch.bool,
}

_INSTALL_HINT = (
    "pip install 'annbatch-torch[gpu]' (it installs cupy-cuda13x; on CUDA 12 install "
    "cupy-cuda12x instead, matching torch.version.cuda)"
)
_WORKER_HINT = (
    "device pools need num_workers=0: CUDA cannot be used in forked DataLoader workers. "
    "Iterate the dataset in the main process (DataLoader(ds, batch_size=None, num_workers=0)), "
    "or keep device=None and move batches from workers with annbatch_torch.to_device(batch, "
    "'cuda') instead."
)


# --------------------------------------------------------------------------- device checks


def _import_cupy() -> Any:
    """``import cupy``, or an ImportError that names the fix."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        raise ImportError(
            f"A device pool on CUDA needs cupy, which could not be imported "
            f"({type(e).__name__}: {e}). Install it with {_INSTALL_HINT}."
        ) from e
    return cupy


def _check_device(device: torch.device | str | int, *, need_cupy: bool) -> torch.device:
    try:
        # an int means a CUDA index (torch.device(int) asks for an accelerator that may be absent)
        is_index = isinstance(device, int | np.integer) and not isinstance(device, bool)
        dev = torch.device("cuda", int(device)) if is_index else torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a torch device: {e}") from e
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(
            f"device={device!r}: device pools support CUDA devices ('cuda', 'cuda:1') and "
            f"'cpu' only; for other accelerators keep device=None and move batches with "
            f"annbatch_torch.to_device(batch, {dev.type!r})."
        )
    if get_worker_info() is not None:
        raise RuntimeError(f"device={device!r} inside a DataLoader worker: {_WORKER_HINT}")
    if not torch.cuda.is_available():
        build = (
            f"torch {torch.__version__} was built without CUDA"
            if torch.version.cuda is None
            else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU"
        )
        raise RuntimeError(
            f"device={device!r}: CUDA is not available here ({build}). Install a CUDA build "
            f"of torch on a machine with an NVIDIA GPU and driver, or pass device=None to keep "
            f"the CPU path."
        )
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"device={device!r}: there are {count} CUDA device(s) here.")
    if need_cupy:
        _import_cupy()
    return torch.device("cuda", index)


def check_device(device: torch.device | str | int) -> torch.device:
    """Validate a device for :class:`DevicePool` and return it with its index filled in.

    Parameters
    ----------
    device
        ``"cuda"``, ``"cuda:1"``, a CUDA ``torch.device`` or index, or ``"cpu"`` (the pool is
        then held as CPU tensors and densified by scipy: the GPU code path without a GPU).

    Returns
    -------
    torch.device
        ``cuda:<index>`` (the current device where none was given), or ``cpu``.

    Raises
    ------
    ValueError
        Not a torch device, a device type other than CUDA/CPU, or a CUDA index out of range.
    RuntimeError
        CUDA is not available, or this runs inside a DataLoader worker (device pools need
        ``num_workers=0``: CUDA cannot be used in forked workers).
    ImportError
        cupy is missing (``pip install 'annbatch-torch[gpu]'``).
    """
    return _check_device(device, need_cupy=True)


# --------------------------------------------------------------------------- fields


@dataclass
class _CsrField:
    """A CSR field on the device. ``indptr`` starts at 0 and is int64; ``indices`` is int32
    when every column index fits, else int64; ``data`` is float32."""

    data: torch.Tensor
    indices: torch.Tensor
    indptr: torch.Tensor
    indptr_host: np.ndarray
    n_cols: int


@dataclass
class _DenseField:
    """A numeric array on the device (float32, int64 or bool, as ``convert.to_tensor``)."""

    values: torch.Tensor


@dataclass
class _HostField:
    """A value ``convert.to_tensor`` passes through (strings, objects): kept on the host."""

    values: np.ndarray


@dataclass
class _Rows:
    """The pool rows of one batch: ``start:stop`` when ``host`` is None, else ``host``
    (a numpy array) / ``dev`` (the same rows, an int64 tensor on the device)."""

    start: int
    stop: int
    host: np.ndarray | None
    dev: torch.Tensor | None

    @property
    def n(self) -> int:
        return self.stop - self.start if self.host is None else len(self.host)


@dataclass
class _CsrSlice:
    """One batch's rows of a CSR field: ``row_lo[i]:row_hi[i]`` are the positions of row
    ``i``'s entries in the field's ``data`` / ``indices``; ``nnz`` (a host int) is their
    total; ``span`` is ``(lo, hi)`` when the rows are consecutive (entries ``lo:hi``)."""

    row_lo: torch.Tensor
    row_hi: torch.Tensor
    nnz: int
    span: tuple[int, int] | None


def _index_dtype(nnz: int, n_cols: int) -> torch.dtype:
    """int32 when every crow / column index of a CSR matrix fits, else int64."""
    return torch.int32 if nnz < _INT32_MAX and n_cols < _INT32_MAX else torch.int64


def _numeric(value: np.ndarray) -> np.ndarray | None:
    """``value`` with the dtype ``convert.to_tensor`` gives it (float -> float32, integer ->
    int64, bool kept), C-contiguous; None for kinds it passes through."""
    kind = value.dtype.kind
    if kind == "f":
        value = value.astype(np.float32, copy=False)
    elif kind in ("i", "u"):
        value = value.astype(np.int64, copy=False)
    elif kind != "b":
        return None
    return np.ascontiguousarray(value)


def _slice_csr(f: _CsrField, rows: _Rows) -> _CsrSlice:
    if rows.host is None:
        lo, hi = int(f.indptr_host[rows.start]), int(f.indptr_host[rows.stop])
        return _CsrSlice(
            f.indptr[rows.start : rows.stop], f.indptr[rows.start + 1 : rows.stop + 1],
            hi - lo, (lo, hi),
        )
    assert rows.dev is not None
    ip = f.indptr_host
    nnz = int((ip[rows.host + 1] - ip[rows.host]).sum()) if len(rows.host) else 0
    return _CsrSlice(f.indptr[rows.dev], f.indptr[rows.dev + 1], nnz, None)


def _gather_csr(
    f: _CsrField, s: _CsrSlice, index_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(crow, col, values)`` of the batch: fresh tensors on the pool's device, crow from 0,
    index tensors of ``index_dtype``. No host synchronisation."""
    dev = f.data.device
    if s.span is not None:
        lo, hi = s.span
        crow = torch.empty(len(s.row_lo) + 1, dtype=index_dtype, device=dev)
        if len(s.row_lo):
            crow[:-1] = s.row_lo - lo
            crow[-1:] = s.row_hi[-1:] - lo
        else:
            crow.zero_()
        return crow, f.indices[lo:hi].to(index_dtype, copy=True), f.data[lo:hi].clone()
    counts = s.row_hi - s.row_lo
    crow64 = torch.zeros(len(counts) + 1, dtype=torch.int64, device=dev)
    torch.cumsum(counts, 0, out=crow64[1:])
    # position in data/indices of each output entry: row start + offset within the row
    src = torch.repeat_interleave(s.row_lo - crow64[:-1], counts, output_size=s.nnz)
    src += torch.arange(s.nnz, dtype=torch.int64, device=dev)
    return crow64.to(index_dtype), f.indices[src].to(index_dtype), f.data[src]


# --------------------------------------------------------------------------- backends


class _Backend:
    """How a CSR batch is densified. All other pool logic is plain torch."""

    name = "base"

    @classmethod
    def check(cls, device: torch.device) -> None:
        """Raise if this backend cannot work on ``device``."""

    def densify(self, f: _CsrField, s: _CsrSlice) -> torch.Tensor:
        """Dense ``(n, n_cols)`` float32 tensor of the batch, on the pool's device."""
        raise NotImplementedError


class _NumpyBackend(_Backend):
    """scipy densifies (CPU pools only): the reference the other backends must equal."""

    name = "numpy"

    @classmethod
    def check(cls, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"the numpy backend needs device='cpu', got {device}.")

    def densify(self, f: _CsrField, s: _CsrSlice) -> torch.Tensor:
        crow, col, vals = _gather_csr(f, s, torch.int64)
        n = len(crow) - 1
        m = sp.csr_matrix((vals.numpy(), col.numpy(), crow.numpy()), shape=(n, f.n_cols))
        return torch.from_numpy(np.ascontiguousarray(m.toarray(), dtype=np.float32))


class _TorchBackend(_Backend):
    """torch scatter-add (any device; no cupy). Duplicate entries are summed, as scipy."""

    name = "torch"

    def densify(self, f: _CsrField, s: _CsrSlice) -> torch.Tensor:
        n = len(s.row_lo)
        out = torch.zeros((n, f.n_cols), dtype=torch.float32, device=f.data.device)
        if s.nnz == 0 or f.n_cols == 0:
            return out
        crow, col, vals = _gather_csr(f, s, torch.int64)
        rows = torch.repeat_interleave(
            torch.arange(n, device=out.device), crow[1:] - crow[:-1], output_size=s.nnz
        )
        out.view(-1).index_put_((rows * f.n_cols + col,), vals, accumulate=True)
        return out


# One CUDA block per output row (grid-stride over rows); the block's threads stride over the
# row's entries, so reads of data/indices are coalesced. atomicAdd sums duplicate entries as
# scipy does (plain adds into a zeroed row otherwise: exact). Column indices out of range
# (a damaged pool; the reader checks them) are skipped rather than written out of bounds.
_KERNEL_SOURCE = r"""
extern "C" __global__ void annbatch_csr_densify_{name}(
    const float* __restrict__ data,
    const {index}* __restrict__ indices,
    const long long* __restrict__ row_lo,
    const long long* __restrict__ row_hi,
    const long long n_rows,
    const long long n_cols,
    float* out)
{{
    for (long long r = blockIdx.x; r < n_rows; r += gridDim.x) {{
        const long long lo = row_lo[r];
        const long long hi = row_hi[r];
        float* row = out + r * n_cols;
        for (long long j = lo + threadIdx.x; j < hi; j += blockDim.x) {{
            const unsigned long long c = (unsigned long long)indices[j];
            if (c < (unsigned long long)n_cols) {{  // never write outside the row
                atomicAdd(row + c, data[j]);
            }}
        }}
    }}
}}
"""
_KERNELS: dict[str, Any] = {}
_KERNELS_LOCK = threading.Lock()


def _kernel(cp: Any, index_dtype: torch.dtype) -> Any:
    name = "i32" if index_dtype == torch.int32 else "i64"
    with _KERNELS_LOCK:
        k = _KERNELS.get(name)
        if k is None:
            index = "int" if name == "i32" else "long long"
            src = _KERNEL_SOURCE.format(name=name, index=index)
            k = _KERNELS[name] = cp.RawKernel(src, f"annbatch_csr_densify_{name}")
    return k


class _CupyBackend(_Backend):
    """A cupy kernel densifies straight from the pool's buffers (CUDA pools)."""

    name = "cupy"

    def __init__(self) -> None:
        self.cp = _import_cupy()

    @classmethod
    def check(cls, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"the cupy backend needs a CUDA device, got {device}.")

    def densify(self, f: _CsrField, s: _CsrSlice) -> torch.Tensor:
        n = len(s.row_lo)
        dev = f.data.device
        out = torch.zeros((n, f.n_cols), dtype=torch.float32, device=dev)
        if s.nnz == 0 or f.n_cols == 0:
            return out
        cp = self.cp
        kernel = _kernel(cp, f.indices.dtype)
        stream = torch.cuda.current_stream(dev)
        with cp.cuda.Device(dev.index), cp.cuda.ExternalStream(stream.cuda_stream):
            # zero-copy views of torch's buffers; the kernel runs on torch's stream
            args = (
                cp.from_dlpack(f.data), cp.from_dlpack(f.indices),
                cp.from_dlpack(s.row_lo.contiguous()), cp.from_dlpack(s.row_hi.contiguous()),
                np.int64(n), np.int64(f.n_cols), cp.from_dlpack(out),
            )
            kernel((min(n, _MAX_BLOCKS),), (_THREADS,), args)
        return out


_BACKENDS: dict[str, type[_Backend]] = {
    "numpy": _NumpyBackend, "torch": _TorchBackend, "cupy": _CupyBackend,
}


# --------------------------------------------------------------------------- the pool


class DevicePool:
    """A pool held on a device, cut into batches there.

    Parameters
    ----------
    pool
        ``{field path: value}``: ``scipy.sparse`` matrices (converted to CSR; data becomes
        float32) or numpy arrays whose first axis is the row (dense ``obsm`` rows, ``obs``
        codes). All values have the same number of rows.
    device
        ``"cuda"``, ``"cuda:1"`` (see :func:`check_device`) or ``"cpu"``.
    order
        Optional 1-D integer array of pool rows: batch rows ``start:stop`` are then the pool
        rows ``order[start:stop]``, gathered on the device (the host needs not permute the
        pool). Default: the pool's own row order.
    pin_memory
        Pin host buffers before their (asynchronous) upload. Default ``None``: buffers of at
        least 1 MiB, on CUDA. Ignored on the CPU.
    _backend
        Private (tests): ``"numpy"`` (scipy, CPU), ``"torch"`` (scatter-add, any device) or
        ``"cupy"`` (kernel, CUDA). Default: cupy on CUDA, numpy on the CPU.

    Notes
    -----
    Batches are fresh tensors (they never alias the pool), so :meth:`close` frees the pool
    even while batches are alive. Values (float32 after upload) equal the CPU path's
    (``scipy.sparse.csr_matrix.toarray`` + ``astype(float32)``) exactly; duplicate CSR
    entries are summed, as scipy sums them. Create and use pools in the main process only:
    CUDA cannot be used in forked DataLoader workers.

    Examples
    --------
    >>> dpool = DevicePool(pool, "cuda")  # doctest: +SKIP
    >>> for b in range(n_batches):  # doctest: +SKIP
    ...     batch = dpool.batch(b * bs, min((b + 1) * bs, len(dpool)), densify=True)
    >>> dpool.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        pool: Mapping[str, Any],
        device: torch.device | str | int,
        *,
        order: np.ndarray | None = None,
        pin_memory: bool | None = None,
        _backend: str | None = None,
    ) -> None:
        if _backend is not None and _backend not in _BACKENDS:
            raise ValueError(f"_backend must be one of {sorted(_BACKENDS)}, got {_backend!r}.")
        need_cupy = _backend in (None, "cupy")
        self.device: torch.device = _check_device(device, need_cupy=need_cupy)
        cuda = self.device.type == "cuda"
        name = _backend or ("cupy" if cuda else "numpy")
        _BACKENDS[name].check(self.device)
        self._backend: _Backend = _BACKENDS[name]()
        self._pin = bool(cuda and pin_memory is not False)
        self._pin_min = 0 if pin_memory else _PIN_MIN_BYTES
        self._stream: torch.cuda.Stream | None = None
        self._ready: torch.cuda.Event | None = None
        self._streams_seen: set[int] = set()
        self._fields: dict[str, _CsrField | _DenseField | _HostField] = {}
        self._closed = False

        n_rows: int | None = None
        for path, value in pool.items():
            n = _n_rows(path, value)
            if n_rows is None:
                n_rows = n
            elif n != n_rows:
                raise ValueError(
                    f"pool field {path!r} has {n} rows, but an earlier field has {n_rows}."
                )
        self.n_pool_rows: int = n_rows or 0

        if cuda:
            self._stream = torch.cuda.current_stream(self.device)
            self._streams_seen.add(self._stream.cuda_stream)
        self._order_host: np.ndarray | None = None
        self._order_dev: torch.Tensor | None = None
        if order is not None:
            o = np.asarray(order)
            if o.ndim != 1 or (o.size and o.dtype.kind not in "iu"):
                raise ValueError(f"order must be a 1-D integer array, got shape {o.shape} "
                                 f"and dtype {o.dtype}.")
            o = o.astype(np.int64, copy=False)
            if o.size and (o.min() < 0 or o.max() >= self.n_pool_rows):
                raise IndexError(
                    f"order holds rows outside the pool's {self.n_pool_rows} rows "
                    f"(min {o.min()}, max {o.max()})."
                )
            self._order_host = np.ascontiguousarray(o)
            self._order_dev = self._upload(self._order_host)
        for path, value in pool.items():
            self._fields[path] = self._upload_field(path, value)
        if cuda:
            self._ready = torch.cuda.Event()
            self._ready.record(self._stream)

    # -- upload

    def _upload(self, arr: np.ndarray) -> torch.Tensor:
        """One copy of a contiguous host array onto the device (never aliasing ``arr``)."""
        if self.device.type == "cpu":
            return torch.from_numpy(np.array(arr, copy=True))
        if self._pin and arr.nbytes >= self._pin_min:
            # straight into pinned memory (torch's caching host allocator: reused across
            # pools, and kept alive until the asynchronous copy is done)
            host = torch.empty(arr.shape, dtype=_TORCH_DTYPES[arr.dtype], pin_memory=True)
            host.numpy()[...] = arr
        else:  # pageable: the copy below has read it when it returns
            host = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        return host.to(self.device, non_blocking=True)

    def _upload_field(self, path: str, value: Any) -> _CsrField | _DenseField | _HostField:
        if sp.issparse(value):
            m = value if value.format == "csr" else value.tocsr()
            ip = np.array(m.indptr, dtype=np.int64)  # a copy: kept for host look-ups
            lo, hi = int(ip[0]), int(ip[-1])
            n_cols = int(m.shape[1])
            idx = np.int32 if n_cols < _INT32_MAX else np.int64
            data = np.ascontiguousarray(m.data[lo:hi], dtype=np.float32)
            indices = np.ascontiguousarray(m.indices[lo:hi], dtype=idx)
            ip0 = ip - lo if lo else ip
            return _CsrField(
                data=self._upload(data), indices=self._upload(indices),
                indptr=self._upload(ip0), indptr_host=ip0, n_cols=n_cols,
            )
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        arr = np.asarray(value)
        num = _numeric(arr)
        if num is None:
            return _HostField(arr.copy())
        return _DenseField(self._upload(num))

    # -- properties

    def __len__(self) -> int:
        """Batchable rows: ``len(order)`` when an order was given, else the pool's rows."""
        return self.n_pool_rows if self._order_host is None else len(self._order_host)

    @property
    def fields(self) -> tuple[str, ...]:
        """The pool's field paths."""
        return tuple(self._fields)

    @property
    def nbytes(self) -> int:
        """Bytes this pool holds on its device (0 once closed)."""
        total = 0 if self._order_dev is None else _tensor_bytes(self._order_dev)
        for f in self._fields.values():
            if isinstance(f, _CsrField):
                total += sum(_tensor_bytes(t) for t in (f.data, f.indices, f.indptr))
            elif isinstance(f, _DenseField):
                total += _tensor_bytes(f.values)
        return total

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    # -- batches

    def _rows(self, start: int, stop: int) -> _Rows:
        n = len(self)
        if not (isinstance(start, int | np.integer) and isinstance(stop, int | np.integer)):
            raise TypeError(f"start and stop must be ints, got {start!r} and {stop!r}.")
        start, stop = int(start), int(stop)
        if not 0 <= start <= stop <= n:
            raise IndexError(f"batch rows {start}:{stop} are outside the pool's {n} rows.")
        if self._order_host is None:
            return _Rows(start, stop, None, None)
        assert self._order_dev is not None
        return _Rows(start, stop, self._order_host[start:stop], self._order_dev[start:stop])

    def _sync_stream(self) -> None:
        """Make the current stream wait for the upload; keep the pool's memory from being
        reused while that stream may still read it."""
        if self._ready is None:
            return
        cur = torch.cuda.current_stream(self.device)
        if cur.cuda_stream in self._streams_seen:
            return
        cur.wait_event(self._ready)
        for t in self._tensors():
            t.record_stream(cur)
        self._streams_seen.add(cur.cuda_stream)

    def _tensors(self) -> Iterator[torch.Tensor]:
        if self._order_dev is not None:
            yield self._order_dev
        for f in self._fields.values():
            if isinstance(f, _CsrField):
                yield from (f.data, f.indices, f.indptr)
            elif isinstance(f, _DenseField):
                yield f.values

    def batch(self, start: int, stop: int, densify: bool = True) -> dict[str, Any]:
        """Rows ``start:stop`` of the pool (of ``order`` when given), on the device.

        Parameters
        ----------
        start, stop
            Row range, ``0 <= start <= stop <= len(self)``; an empty range gives 0-row
            tensors.
        densify
            CSR fields as dense float32 ``(stop - start, n_cols)`` tensors, densified on the
            device; otherwise as ``torch.sparse_csr_tensor`` (crow indices from 0; int32
            index tensors when every index fits, else int64).

        Returns
        -------
        dict
            ``{field path: value}``: tensors on the device (float -> float32, integer ->
            int64, bool kept, as :func:`~annbatch_torch.convert.to_tensor`); fields of other
            dtypes (strings, objects) as numpy rows on the host.
        """
        if self._closed:
            raise RuntimeError("this DevicePool is closed.")
        rows = self._rows(start, stop)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                self._sync_stream()
                return self._batch(rows, densify)
        return self._batch(rows, densify)

    def _batch(self, rows: _Rows, densify: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path, f in self._fields.items():
            if isinstance(f, _CsrField):
                s = _slice_csr(f, rows)
                if densify:
                    out[path] = self._backend.densify(f, s)
                else:
                    idx = _index_dtype(s.nnz, f.n_cols)
                    crow, col, vals = _gather_csr(f, s, idx)
                    out[path] = torch.sparse_csr_tensor(
                        crow, col, vals, size=(rows.n, f.n_cols), check_invariants=False
                    )
            elif isinstance(f, _DenseField):
                v = f.values
                out[path] = v[rows.start : rows.stop].clone() if rows.dev is None else v[rows.dev]
            else:
                v = f.values
                out[path] = v[rows.start : rows.stop].copy() if rows.host is None else v[rows.host]
        return out

    def batches(self, batch_size: int, densify: bool = True) -> Iterator[dict[str, Any]]:
        """All batches in order: rows ``[b * batch_size, (b + 1) * batch_size)``, the last
        one possibly shorter."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        for start in range(0, len(self), batch_size):
            yield self.batch(start, min(start + batch_size, len(self)), densify)

    # -- release

    def close(self) -> None:
        """Drop the device buffers (they return to torch's caching allocator; batches
        already handed out stay valid). Idempotent."""
        self._fields = {}
        self._order_dev = None
        self._order_host = None
        self._ready = None
        self._closed = True

    def __enter__(self) -> DevicePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.nbytes / 2**20:,.1f} MiB"
        return (
            f"DevicePool({len(self)} rows, fields={list(self._fields)}, device={self.device}, "
            f"backend={self._backend.name}, {state})"
        )


def _n_rows(path: str, value: Any) -> int:
    shape = getattr(value, "shape", None)
    if shape is None:
        shape = np.shape(value)
    if len(shape) == 0:
        raise ValueError(f"pool field {path!r} is a scalar; pool values need a row axis.")
    return int(shape[0])


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
