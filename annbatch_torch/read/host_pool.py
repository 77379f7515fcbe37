"""A pool held in host memory, cut into batches: the host twin of :class:`DevicePool`.

:class:`HostPool` wraps what :meth:`PoolReader.read` returns (``{field path: CSR matrix or
numpy array}``, laid out batch after batch) and gives batches with the same call as
:class:`~annbatch_torch.read.device_pool.DevicePool`: ``pool.batch(start, stop, densify)``.
A batch is a zero-copy row slice of the pool (a CSR of views, or an array view); CSR
fields named by ``densify`` are densified by scipy, inside a DataLoader worker straight into
shared memory (handed on to the main process without another copy).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import scipy.sparse as sp

from .buffers import DenseBuffers
from .csr import densify_csr, row_slice

__all__ = ["HostPool"]


class HostPool:
    """A pool of rows in host memory.

    Parameters
    ----------
    values
        ``{field path: value}``: CSR matrices or numpy arrays with one row per pool row,
        already in the order batches are cut (batch ``b`` is rows ``[b * bs, (b + 1) * bs)``).
    shared
        Densify into shared memory (set in DataLoader workers).
    dense
        Dense batch arrays to reuse once the consumer let go of them (not with ``shared``).
    dtype
        The dtype of densified CSR fields (``AnnBatchDataset(out_dtype=...)``); ``None``:
        float32.
    """

    def __init__(self, values: Mapping[str, Any], *, shared: bool = False,
                 dense: DenseBuffers | None = None, dtype: np.dtype | None = None) -> None:
        self.values: dict[str, Any] = dict(values)
        self.dtype = np.dtype(np.float32 if dtype is None else dtype)
        self.shared = shared
        self.dense = None if shared else dense
        self.n_pool_rows = next((int(v.shape[0]) for v in self.values.values()), 0)

    def __len__(self) -> int:
        return self.n_pool_rows

    @property
    def fields(self) -> tuple[str, ...]:
        """The pool's field paths."""
        return tuple(self.values)

    def batch(self, start: int, stop: int, densify: bool | Collection[str] = True
              ) -> dict[str, Any]:
        """Rows ``start:stop`` of every field, without copying.

        Parameters
        ----------
        start, stop
            Row range of the pool.
        densify
            ``True`` (as :meth:`DevicePool.batch`): every CSR field as a dense array
            (float32, or the pool's ``dtype``); a collection of field paths: those;
            ``False``: none (CSR views of the pool).
        """
        out: dict[str, Any] = {}
        for path, value in self.values.items():
            part = row_slice(value, start, stop)
            if sp.issparse(part) and (densify is True or (densify and path in densify)):
                part = densify_csr(part, dtype=self.dtype, shared=self.shared,
                                   buffers=self.dense)
            out[path] = part
        return out

    def close(self) -> None:
        """Let go of the pool's buffers (batches handed out keep their own references)."""
        self.values = {}

    def __repr__(self) -> str:
        return f"HostPool({len(self)} rows, fields={list(self.values)})"
