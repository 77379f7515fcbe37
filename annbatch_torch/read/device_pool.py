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

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
from torch.utils.data import get_worker_info

from . import gpu_backends as _gb
from .gpu_backends import (
    BACKENDS,
    Backend,
    CsrField,
    DenseField,
    HostField,
    Rows,
    gather_csr,
    index_dtype,
    numeric,
    slice_csr,
)
from .gpu_backends import import_cupy as _import_cupy  # a name of its own: tests replace it

__all__ = ["DevicePool", "check_device"]

#: Host buffers at least this large are pinned before their upload (async, ~3-5x faster
#: copies); smaller ones are copied straight from pageable memory.
_PIN_MIN_BYTES = 1 << 20

#: torch dtypes of the arrays a pool uploads.
_TORCH_DTYPES = {
    np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64, np.dtype(np.bool_): torch.bool,
}

_WORKER_HINT = (
    "device pools need num_workers=0: CUDA cannot be used in forked DataLoader workers. "
    "Iterate the dataset in the main process (DataLoader(ds, batch_size=None, num_workers=0)), "
    "or keep device=None and move batches from workers with annbatch_torch.to_device(batch, "
    "'cuda') instead."
)


# --------------------------------------------------------------------------- device checks


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
    (``scipy.sparse.csr_matrix.toarray`` + ``astype(float32)``) exactly for CSR without
    duplicate entries (what the writer stores). Duplicates are summed, as scipy sums them,
    but in float32 and, on CUDA, in no fixed order: three or more of one cell may differ
    from scipy by rounding. Create and use pools in the main process only:
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
        if _backend is not None and _backend not in BACKENDS:
            raise ValueError(f"_backend must be one of {sorted(BACKENDS)}, got {_backend!r}.")
        need_cupy = _backend in (None, "cupy")
        self.device: torch.device = _check_device(device, need_cupy=need_cupy)
        cuda = self.device.type == "cuda"
        name = _backend or ("cupy" if cuda else "numpy")
        BACKENDS[name].check(self.device)
        self._backend: Backend = BACKENDS[name]()
        self._pin = bool(cuda and pin_memory is not False)
        self._pin_min = 0 if pin_memory else _PIN_MIN_BYTES
        self._stream: torch.cuda.Stream | None = None
        self._ready: torch.cuda.Event | None = None
        self._streams_seen: set[int] = set()
        self._fields: dict[str, CsrField | DenseField | HostField] = {}
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

    def _upload_field(self, path: str, value: Any) -> CsrField | DenseField | HostField:
        if sp.issparse(value):
            m = value if value.format == "csr" else value.tocsr()
            ip = np.array(m.indptr, dtype=np.int64)  # a copy: kept for host look-ups
            lo, hi = int(ip[0]), int(ip[-1])
            n_cols = int(m.shape[1])
            idx = np.int32 if n_cols < _gb._INT32_MAX else np.int64
            data = np.ascontiguousarray(m.data[lo:hi], dtype=np.float32)
            indices = np.ascontiguousarray(m.indices[lo:hi], dtype=idx)
            ip0 = ip - lo if lo else ip
            return CsrField(
                data=self._upload(data), indices=self._upload(indices),
                indptr=self._upload(ip0), indptr_host=ip0, n_cols=n_cols,
            )
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        arr = np.asarray(value)
        num = numeric(arr)
        if num is None:
            return HostField(arr.copy())
        return DenseField(self._upload(num))

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
            if isinstance(f, CsrField):
                total += sum(_tensor_bytes(t) for t in (f.data, f.indices, f.indptr))
            elif isinstance(f, DenseField):
                total += _tensor_bytes(f.values)
        return total

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    # -- batches

    def _rows(self, start: int, stop: int) -> Rows:
        n = len(self)
        if not (isinstance(start, int | np.integer) and isinstance(stop, int | np.integer)):
            raise TypeError(f"start and stop must be ints, got {start!r} and {stop!r}.")
        start, stop = int(start), int(stop)
        if not 0 <= start <= stop <= n:
            raise IndexError(f"batch rows {start}:{stop} are outside the pool's {n} rows.")
        if self._order_host is None:
            return Rows(start, stop, None, None)
        assert self._order_dev is not None
        return Rows(start, stop, self._order_host[start:stop], self._order_dev[start:stop])

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
            if isinstance(f, CsrField):
                yield from (f.data, f.indices, f.indptr)
            elif isinstance(f, DenseField):
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

    def _batch(self, rows: Rows, densify: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path, f in self._fields.items():
            if isinstance(f, CsrField):
                s = slice_csr(f, rows)
                if densify:
                    out[path] = self._backend.densify(f, s)
                else:
                    idx = index_dtype(s.nnz, f.n_cols)
                    crow, col, vals = gather_csr(f, s, idx)
                    out[path] = torch.sparse_csr_tensor(
                        crow, col, vals, size=(rows.n, f.n_cols), check_invariants=False
                    )
            elif isinstance(f, DenseField):
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
