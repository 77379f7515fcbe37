"""The innards of :class:`~annbatch_torch.read.device_pool.DevicePool`: a pool's fields on a device,
row slices of them, and the backends that densify a CSR batch (scipy on the CPU, torch
scatter-add anywhere, a cupy kernel on CUDA). cupy is imported lazily, by the cupy
backend only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

#: Largest value an int32 index tensor may hold (torch sparse CSR uses signed indices).
_INT32_MAX = 2**31 - 1
#: Threads per block of the densification kernel (one block per row, grid-stride).
_THREADS = 256
#: Most blocks launched by one densification kernel.
_MAX_BLOCKS = 65535

_INSTALL_HINT = (
    "pip install 'annbatch-torch[gpu]' (cupy-cuda13x with the CUDA 13 toolkit wheels it "
    "compiles with); with a CUDA 12 torch (torch.version.cuda) install "
    "'annbatch-torch[gpu-cuda12]' instead"
)


def import_cupy() -> Any:
    """``import cupy``, or an ImportError that names the fix."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        raise ImportError(
            f"A device pool on CUDA needs cupy, which could not be imported "
            f"({type(e).__name__}: {e}). Install it with {_INSTALL_HINT}."
        ) from e
    return cupy


# --------------------------------------------------------------------------- fields


@dataclass
class CsrField:
    """A CSR field on the device. ``indptr`` starts at 0 and is int64; ``indices`` is int32
    when every column index fits, else int64; ``data`` is float32."""

    data: torch.Tensor
    indices: torch.Tensor
    indptr: torch.Tensor
    indptr_host: np.ndarray
    n_cols: int


@dataclass
class DenseField:
    """A numeric array on the device (float32, int64 or bool, as ``convert.to_tensor``)."""

    values: torch.Tensor


@dataclass
class HostField:
    """A value ``convert.to_tensor`` passes through (strings, objects): kept on the host."""

    values: np.ndarray


@dataclass
class Rows:
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


def index_dtype(nnz: int, n_cols: int) -> torch.dtype:
    """int32 when every crow / column index of a CSR matrix fits, else int64."""
    return torch.int32 if nnz < _INT32_MAX and n_cols < _INT32_MAX else torch.int64


def numeric(value: np.ndarray) -> np.ndarray | None:
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


def slice_csr(f: CsrField, rows: Rows) -> _CsrSlice:
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


def gather_csr(
    f: CsrField, s: _CsrSlice, index_dtype: torch.dtype
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


class Backend:
    """How a CSR batch is densified. All other pool logic is plain torch."""

    name = "base"

    @classmethod
    def check(cls, device: torch.device) -> None:
        """Raise if this backend cannot work on ``device``."""

    def densify(self, f: CsrField, s: _CsrSlice) -> torch.Tensor:
        """Dense ``(n, n_cols)`` float32 tensor of the batch, on the pool's device."""
        raise NotImplementedError


class _NumpyBackend(Backend):
    """scipy densifies (CPU pools only): the reference the other backends must equal."""

    name = "numpy"

    @classmethod
    def check(cls, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"the numpy backend needs device='cpu', got {device}.")

    def densify(self, f: CsrField, s: _CsrSlice) -> torch.Tensor:
        crow, col, vals = gather_csr(f, s, torch.int64)
        n = len(crow) - 1
        m = sp.csr_matrix((vals.numpy(), col.numpy(), crow.numpy()), shape=(n, f.n_cols))
        return torch.from_numpy(np.ascontiguousarray(m.toarray(), dtype=np.float32))


class _TorchBackend(Backend):
    """torch scatter-add (any device; no cupy). Duplicate entries are summed, as scipy."""

    name = "torch"

    def densify(self, f: CsrField, s: _CsrSlice) -> torch.Tensor:
        n = len(s.row_lo)
        out = torch.zeros((n, f.n_cols), dtype=torch.float32, device=f.data.device)
        if s.nnz == 0 or f.n_cols == 0:
            return out
        crow, col, vals = gather_csr(f, s, torch.int64)
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


class _CupyBackend(Backend):
    """A cupy kernel densifies straight from the pool's buffers (CUDA pools)."""

    name = "cupy"

    def __init__(self) -> None:
        self.cp = import_cupy()
        try:  # compile now (cached): without NVRTC this fails here, not in mid-epoch
            for index_dtype in (torch.int32, torch.int64):
                _kernel(self.cp, index_dtype).compile()
        except Exception as e:
            raise ImportError(
                f"cupy cannot compile annbatch_torch's densify kernel ({type(e).__name__}: "
                f"{e}); cupy needs the CUDA toolkit's NVRTC. Install it with {_INSTALL_HINT}."
            ) from e

    @classmethod
    def check(cls, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"the cupy backend needs a CUDA device, got {device}.")

    def densify(self, f: CsrField, s: _CsrSlice) -> torch.Tensor:
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


BACKENDS: dict[str, type[Backend]] = {
    "numpy": _NumpyBackend, "torch": _TorchBackend, "cupy": _CupyBackend,
}
