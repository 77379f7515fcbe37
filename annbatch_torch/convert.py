"""Turning numpy/scipy batches into tensors, and moving them to a device.

:func:`batch_dict_converter` is the default ``batch_converter``: it runs inside the
DataLoader worker on a ``dict`` of numpy arrays / ``scipy.sparse.csr_matrix`` values and
returns ``dict[str, torch.Tensor]``. Compose with it in your own converter::

    def my_converter(batch):
        out = abt.batch_dict_converter(batch)
        out["x"] = out["x"].log1p()
        return out
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from .read.csr import csr_tensor_to_dense

__all__ = ["Batch", "batch_dict_converter", "csr_to_torch", "to_tensor", "to_device"]

# torch warns of its sparse CSR tensors being in beta (and of unchecked invariants) where
# this package builds them, and where a CSR tensor is rebuilt on crossing a worker queue
# (a batch's, or any other DataLoader's): ignored there only, not where the caller's own
# code builds one (torch gives each warning once per process, so a caller's tensor built
# after the package's may say nothing either way).
for _msg in ("Sparse CSR tensor support is in beta", "Sparse invariant checks are implicitly"):
    for _where in (r"annbatch_torch\.", r"torch\.multiprocessing\.reductions"):
        warnings.filterwarnings("ignore", message=_msg, category=UserWarning, module=_where)


def _tensor_of(value: np.ndarray) -> torch.Tensor | None:
    """The torch tensor a numpy array is the exact view of (``tensor.numpy()``), if any."""
    base = value.base
    if (
        isinstance(base, torch.Tensor) and base.device.type == "cpu"
        and base.is_contiguous() and value.flags.c_contiguous
        and base.data_ptr() == value.ctypes.data and base.numel() == value.size
        and base.dtype == torch.from_numpy(value[:0]).dtype
    ):
        return base.view(value.shape)
    return None


def csr_to_torch(m: sp.csr_matrix | sp.csr_array, dtype: Any = np.float32) -> torch.Tensor:
    """A ``torch.sparse_csr_tensor`` sharing the scipy matrix's buffers where possible.

    Values become ``dtype`` (float32: the dtype a dense batch has, so ``densify`` changes the
    layout of a batch, never its dtype; int32 counts and float64 values are cast, float32
    ones shared). Index tensors are int32 when every index fits (half the bytes of int64,
    and no widening copy of scipy's int32 indices: ~14 ms per 4096 x 20k batch here), else
    int64.
    """
    small = m.nnz < 2**31 - 1 and m.shape[1] < 2**31 - 1
    idx = np.int32 if small else np.int64
    crow = torch.from_numpy(np.ascontiguousarray(m.indptr, dtype=idx))
    col = torch.from_numpy(np.ascontiguousarray(m.indices, dtype=idx))
    values = torch.from_numpy(np.ascontiguousarray(m.data, dtype=dtype))
    return torch.sparse_csr_tensor(crow, col, values, size=m.shape, check_invariants=False)


def to_tensor(value: Any, keep_dtype: bool = False) -> torch.Tensor | Any:
    """Convert one batch value: CSR -> sparse CSR tensor; arrays -> tensors with float
    kept as float32, integers as int64 and bools as bool. Other objects pass through.
    ``keep_dtype``: numbers keep their dtype (sparse values and arrays alike)."""
    if isinstance(value, torch.Tensor):
        return value
    if sp.issparse(value):
        if value.format != "csr":
            value = value.tocsr()
        return csr_to_torch(value, dtype=value.dtype if keep_dtype else np.float32)
    if isinstance(value, np.ndarray):
        if (value.dtype == np.float32 or value.dtype.kind == "b" or value.dtype == np.int64
                or (keep_dtype and value.dtype.kind in "iuf")):
            same = _tensor_of(value)
            if same is not None:
                return same
            if keep_dtype:
                return torch.from_numpy(np.ascontiguousarray(value))
        kind = value.dtype.kind
        if kind == "f" and value.dtype != np.float32:
            value = value.astype(np.float32)
        elif kind in ("i", "u") and value.dtype != np.int64:
            value = value.astype(np.int64)
        elif kind not in ("f", "i", "u", "b"):
            return value
        return torch.from_numpy(np.ascontiguousarray(value))
    return value


class Batch(dict):  # type: ignore[type-arg]
    """The ``dict[str, Tensor]`` :func:`batch_dict_converter` returns: a plain ``dict``,
    which torch's default collation refuses with the fix. A ``DataLoader`` left at its
    default ``batch_size=1`` (or given ``batch_size=N``) would otherwise stack whole batches
    into ``(N, batch_size, n_vars)`` tensors without a word."""


def _refuse_collate(batch: Any, *, collate_fn_map: Any = None) -> Any:
    raise TypeError(
        "AnnBatchDataset yields whole batches, but this DataLoader collates them again "
        "(its batch_size is not None; the default is 1): use DataLoader(dataset, "
        "batch_size=None, ...) or annbatch_torch.AnnBatchDataLoader(dataset, ...), and set "
        "batch_size on the dataset."
    )


try:  # torch's documented extension point of default_collate (collate_fn_map)
    from torch.utils.data._utils.collate import default_collate_fn_map

    default_collate_fn_map.setdefault(Batch, _refuse_collate)
except ImportError:  # pragma: no cover - a torch without collate_fn_map
    pass


def batch_dict_converter(batch: Mapping[str, Any], *, keep_dtype: Collection[str] = ()
                         ) -> dict[str, torch.Tensor]:
    """Default ``batch_converter``: ``{key: numpy/scipy}`` -> ``{key: Tensor}``.

    Sparse matrices become ``torch.sparse_csr_tensor`` with float32 values (as dense
    batches; int32 index tensors when they fit, else int64); float arrays become float32,
    integer arrays int64 (category codes; -1 marks a missing label: use
    ``cross_entropy(..., ignore_index=-1)``), bool arrays stay bool.

    Parameters
    ----------
    batch
        One batch as the dataset assembled it: each key of the selector (and ``"index"``,
        ``"mask"`` when asked for) mapped to a numpy array or a scipy CSR matrix.
    keep_dtype
        Keys whose numbers keep their dtype (sparse values and arrays alike): the dataset
        passes the matrix keys of ``AnnBatchDataset(out_dtype=...)``.

    Returns
    -------
    dict of str to torch.Tensor
        A ``Batch`` (a ``dict`` subclass that torch's ``default_collate`` passes through
        unchanged) with one tensor per key.
    """
    return Batch({k: to_tensor(v, k in keep_dtype) for k, v in batch.items()})


def to_device(
    batch: Mapping[str, Any],
    device: torch.device | str,
    densify: bool = True,
    non_blocking: bool = True,
) -> dict[str, Any]:
    """Move a batch to ``device``; sparse CSR tensors travel as CSR (small) and are
    densified there when ``densify``.

    On CUDA the CPU components are pinned first so the copies are asynchronous; batches
    already on a GPU (``AnnBatchDataset(device="cuda")``) move as they are. Copies *to*
    the CPU are synchronous: a non-blocking device-to-host copy could still be running
    when the values are read.

    Parameters
    ----------
    batch
        A batch of tensors (what the dataset or loader yields); values that are not tensors
        are passed through.
    device
        Where to move it: ``"cuda"``, ``"cuda:1"``, ``"cpu"``, a :class:`torch.device`.
    densify
        Turn sparse CSR tensors into dense float32 tensors on ``device`` (default). With
        ``False`` they arrive as CSR.
    non_blocking
        Copy asynchronously to a GPU (from pinned memory); ignored for the CPU.

    Returns
    -------
    dict of str to Any
        The batch on ``device``, same keys.
    """
    device = torch.device(device)
    pin = device.type == "cuda"
    non_blocking = non_blocking and device.type != "cpu"
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor):
            out[k] = v
            continue
        if v.layout == torch.sparse_csr:
            parts = [v.crow_indices(), v.col_indices(), v.values()]
            if pin:
                parts = [_pinned(p) for p in parts]
            crow, col, vals = (p.to(device, non_blocking=non_blocking) for p in parts)
            t = torch.sparse_csr_tensor(crow, col, vals, size=v.shape, check_invariants=False)
            if densify:  # on the CPU by scipy: torch's CPU to_dense is ~9x slower
                # dense float32 on every device, whatever the stored dtype (int counts,
                # float64): the CPU and GPU paths give the same batches
                t = (csr_tensor_to_dense(t, dtype=np.float32) if device.type == "cpu"
                     else t.to_dense().to(torch.float32))
            out[k] = t
        else:
            out[k] = (_pinned(v) if pin else v).to(device, non_blocking=non_blocking)
    return out


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in page-locked memory when it is a CPU tensor (GPU tensors cannot be pinned)."""
    return t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t
