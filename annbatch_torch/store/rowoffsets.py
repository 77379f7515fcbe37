"""A CSR matrix's row offsets (its ``indptr``) held in a few bytes a row.

Every process that reads a collection keeps each open shard's ``indptr`` in memory: one
offset a row. As ``int64`` that is 8 bytes a cell, 800 MB per process at 10^8 cells (and
a DataLoader runs one process per worker). :class:`RowOffsets` keeps the same values as
an ``int64`` base every ``2**shift`` rows plus each row's offset from its block's base in
the narrowest unsigned dtype that holds them: ``uint16`` (about 2 bytes a row), else
``uint32`` (about 4), else ``int64``. A uint16 layout may hold a few blocks whose offsets
pass 65,535 (a run of deep cells) in a side table of int64 offsets (``wide`` blocks), so
that one such run does not widen every row of the shard. Reading any offset stays a gather
and an add (``base[r >> shift] + off[r]``, from the side table in a wide block).

Indexing follows numpy's ``int64`` array: an integer, a slice or an integer array gives
the offsets at those places (``int64``), ``np.searchsorted`` and ``np.asarray`` work.
"""
from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

from .native import compiled, load_now

__all__ = ["RowOffsets"]

#: the largest block (rows a base serves) tried: bases cost 8 bytes per 2**_MAX_SHIFT rows
_MAX_SHIFT = 16
#: the smallest block worth a uint16 layout (its bases cost 8 / 2**shift bytes a row)
_MIN_SHIFT_16 = 3


def _expand_py(base, off, shift, a, out, wide, table):  # type: ignore[no-untyped-def]  # pragma: no cover
    low = (1 << shift) - 1
    has_wide = wide.shape[0] > 0
    for i in range(out.shape[0]):
        r = a + i
        k = r >> shift
        if has_wide and wide[k] >= 0:
            out[i] = base[k] + table[(wide[k] << shift) + (r & low)]
        else:
            out[i] = base[k] + off[r]


#: offsets ``[a, a + len(out))`` into ``out``: one compiled loop, without the GIL (a
#: piece's slice is read by several threads at once; numpy's few small steps each hold it)
_expand = compiled(_expand_py)
#: slices a process expands with numpy before it loads :data:`_expand`, unless a compiled
#: loop ran already and :data:`_expand` is in numba's disk cache: numba's start (~0.3 s in
#: a process that ran none yet, such as one reading an h5ad in place) or a compile of it
#: (~0.1 s where no cache can be written) is paid only by a reader that goes on for long
_EXPAND_FROM_CALLS = 4096
_slices = 0  # slices expanded with numpy so far (this process)


def _block_spans(ip: np.ndarray, shift: int) -> np.ndarray:
    """Each block's largest offset from its base: ``ip[last row] - ip[first row]``."""
    n = ip.shape[0]
    step = 1 << shift
    ends = np.minimum(np.arange(step - 1, n + step - 1, step), n - 1)
    return ip[ends] - ip[::step]


def _max_offset(ip: np.ndarray, shift: int) -> int:
    """The largest ``ip[r] - ip[(r >> shift) << shift]`` (``ip`` non-decreasing)."""
    return int(_block_spans(ip, shift).max()) if ip.shape[0] else 0


def _layout(ip: np.ndarray) -> tuple[int, Any, np.ndarray | None]:
    """The block shift, the offset dtype and the wide blocks (uint16 only; ``None``: none)
    that hold ``ip`` in the fewest bytes."""
    n = max(ip.shape[0], 1)
    best: tuple[float, int, Any, np.ndarray | None] = (8 + 8 / n, 62, np.int64, None)
    shift = _MAX_SHIFT  # uint32: the largest blocks whose offsets all fit
    while shift >= _MIN_SHIFT_16 and _max_offset(ip, shift) >= 1 << 32:
        shift -= 1
    if shift >= _MIN_SHIFT_16:
        best = min(best, (4 + 8 * -(-n >> shift) / n, shift, np.uint32, None),
                   key=lambda b: b[0])
    if ip.shape[0]:
        for shift in range(_MIN_SHIFT_16, _MAX_SHIFT + 1):  # uint16, some blocks wide
            wide = np.flatnonzero(_block_spans(ip, shift) >= 1 << 16)
            nb = -(-n >> shift)
            extra = 8 * nb + ((8 * wide.size) << shift) if wide.size else 0  # index, table
            size = (2 * n + 8 * nb + extra) / n
            if size < best[0]:
                best = (size, shift, np.uint16, wide if wide.size else None)
    return best[1], best[2], best[3]


class RowOffsets:
    """Row offsets of a CSR matrix (``n_rows + 1`` non-decreasing integers from 0), held
    compactly and read like an ``int64`` array.

    Parameters
    ----------
    indptr
        The offsets, non-decreasing (the caller checks them: decreasing ones would wrap
        in an unsigned layout); copied, not kept.
    """

    __slots__ = ("_base", "_n", "_off", "_shift", "_table", "_wide")

    def __init__(self, indptr: Any) -> None:
        ip = np.asarray(indptr, dtype=np.int64)
        if ip.ndim != 1:
            raise ValueError(f"row offsets must be 1-D, got shape {ip.shape}")
        self._n = int(ip.shape[0])
        shift, dtype, wide = _layout(ip)
        self._shift = shift
        step = self._step
        # a copy: a one-element view would keep the whole int64 array alive
        self._base = np.array(ip[::step]) if self._n else np.zeros(1, np.int64)
        off = np.empty(self._n, dtype=dtype)
        whole = (self._n // step) * step
        nb = whole // step
        np.subtract(ip[:whole].reshape(nb, step), self._base[:nb, None],
                    out=off[:whole].reshape(nb, step), casting="unsafe")
        if whole < self._n:
            np.subtract(ip[whole:], self._base[nb], out=off[whole:], casting="unsafe")
        self._off = off  # (in a wide block: wrapped, never read)
        #: per block, its row in the side table (-1: none; empty: no wide block at all)
        self._wide = np.zeros(0, dtype=np.int64)
        #: the wide blocks' offsets from their bases, ``2**shift`` a block
        self._table = np.zeros(0, dtype=np.int64)
        if wide is not None:
            self._wide = np.full(len(self._base), -1, dtype=np.int64)
            self._wide[wide] = np.arange(wide.size)
            rows = (wide[:, None] << shift) + np.arange(step)
            inside = rows < self._n
            table = np.zeros(rows.shape, dtype=np.int64)
            table[inside] = (ip[rows[inside]]
                             - np.broadcast_to(self._base[wide][:, None], rows.shape)[inside])
            self._table = table.ravel()

    # -- array-like surface ------------------------------------------------------------
    @property
    def shape(self) -> tuple[int]:
        return (self._n,)

    @property
    def ndim(self) -> int:
        return 1

    @property
    def size(self) -> int:
        return self._n

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.int64)

    @property
    def nbytes(self) -> int:
        """Bytes held (bases, offsets, wide blocks), not the ``8 * len(self)`` of the
        values."""
        return int(self._base.nbytes + self._off.nbytes + self._wide.nbytes
                   + self._table.nbytes)

    def __len__(self) -> int:
        return self._n

    @property
    def _step(self) -> int:
        """Rows a base serves (the int64 layout's one base serves them all)."""
        return 1 << self._shift if self._shift < 62 else max(self._n, 1)

    def __repr__(self) -> str:
        return (f"RowOffsets({self._n} offsets, {self._off.dtype} a row, a base every "
                f"{self._step} rows)")

    def _at(self, rows: np.ndarray) -> np.ndarray:
        """Offsets at non-negative ``rows`` (int64 array; out of range raises)."""
        off = self._off[rows]  # raises IndexError past the end
        blocks = rows >> self._shift
        out = self._base[blocks] + off
        if self._wide.size:
            w = self._wide[blocks]
            hit = w >= 0
            if hit.any():
                low = (1 << self._shift) - 1
                out[hit] = self._base[blocks[hit]] + self._table[(w[hit] << self._shift)
                                                                 + (rows[hit] & low)]
        return out

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (bool, np.bool_)):
            raise IndexError("row offsets are indexed by integers, slices or arrays, not a bool")
        if isinstance(key, slice):  # the readers' common case: a piece's rows
            a, b, step = key.indices(self._n)
            if step == 1:
                return self._slice(a, b)
            return self._at(np.arange(a, b, step, dtype=np.int64))
        if isinstance(key, (int, np.integer)):
            k = int(key)
            if k < 0:
                k += self._n
            if not 0 <= k < self._n:
                raise IndexError(f"index {int(key)} is out of bounds for {self._n} row offsets")
            block = k >> self._shift
            if self._wide.size and self._wide[block] >= 0:
                return self._at(np.array([k]))[0]
            return self._base[block] + np.int64(self._off[k])
        if key is Ellipsis:
            return self._at(np.arange(self._n, dtype=np.int64))
        rows = np.asarray(key)
        if rows.size == 0:
            return np.empty(rows.shape, dtype=np.int64)
        if rows.dtype == bool:
            if rows.shape != (self._n,):
                raise IndexError(f"a boolean index of shape {rows.shape} does not match "
                                 f"{self._n} row offsets")
            rows = np.flatnonzero(rows)
        elif rows.dtype.kind not in "iu":
            raise IndexError(f"row offsets are indexed by integers, not {rows.dtype}")
        elif rows.dtype.kind == "u" and int(rows.max()) >= self._n:
            raise IndexError(f"an index is out of bounds for {self._n} row offsets")
        if rows.ndim == 0:
            return self[int(rows)]
        rows = rows.astype(np.int64, copy=False)
        if rows.size and int(rows.min()) < 0:
            rows = np.where(rows < 0, rows + self._n, rows)
            if int(rows.min()) < 0:
                raise IndexError(f"an index is out of bounds for {self._n} row offsets")
        return self._at(rows)

    def _slice(self, a: int, b: int) -> np.ndarray:
        """Offsets ``[a, b)`` (``0 <= a``, ``b <= n``)."""
        global _slices
        if b <= a:
            return np.empty(0, dtype=np.int64)
        if numba.config.DISABLE_JIT or not load_now(_expand, _slices, _EXPAND_FROM_CALLS):
            _slices += 1
            return self._at(np.arange(a, b, dtype=np.int64))
        out = np.empty(b - a, dtype=np.int64)
        _expand(self._base, self._off, self._shift, a, out, self._wide, self._table)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if copy is False:
            raise ValueError("row offsets are held compactly: an int64 array of them is "
                             "always a copy")
        out = self[...]
        return out if dtype is None else out.astype(dtype, copy=False)

    def lengths(self, start: int, stop: int) -> np.ndarray:
        """Entries of rows ``[start, stop)`` (``int64``): ``np.diff(self[start : stop + 1])``."""
        return np.diff(self[start : stop + 1])

    def searchsorted(self, v: Any, side: str = "left", sorter: Any = None) -> Any:
        """``np.searchsorted`` over the offsets: the bases, then one block's stored
        offsets per value (nothing expanded)."""
        if sorter is not None:
            raise ValueError("row offsets are sorted already: sorter must be None")
        if side not in ("left", "right"):
            raise ValueError(f"side must be 'left' or 'right', not {side!r}")
        values = np.asarray(v)
        out = np.empty(values.shape, dtype=np.intp)
        step = self._step
        for i, x in enumerate(values.ravel().tolist()):
            if isinstance(x, float):  # the integer that places like it: ceil on the left
                if not math.isfinite(x):
                    out.flat[i] = 0 if x == -math.inf else self._n  # NaN sorts last
                    continue
                x = math.ceil(x) if side == "left" else math.floor(x)
            k = int(np.searchsorted(self._base, x, side=side)) - 1  # last block before x
            if k < 0:
                out.flat[i] = 0
                continue
            a = k * step
            block = self._off[a : min(a + step, self._n)]
            if self._wide.size and self._wide[k] >= 0:
                w = int(self._wide[k]) * step
                block = self._table[w : w + len(block)]
            rel = x - int(self._base[k])  # >= 0: the block's base is at most x
            pos = (len(block) if rel > np.iinfo(block.dtype).max
                   else int(np.searchsorted(block, block.dtype.type(rel), side=side)))
            out.flat[i] = a + pos
        return out if values.ndim else int(out)
