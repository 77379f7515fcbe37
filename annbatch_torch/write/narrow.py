"""The stored dtype of a collection's sparse matrices: the narrowest that holds every value.

Count matrices are small whole numbers (most below 256, nearly all below 65,536) and the
column indices of a 20k-60k gene panel fit in 16 bits, so storing them as float32 and int32
spends twice the bytes (or more) that the information needs, and cold or remote reading is
bound by bytes. Pass 1 of the writer streams every value of X, the layers and raw/X once
anyway: :class:`ValueRange` notes, block by block and for each shard the rows go to, their
smallest and largest value, whether all are whole numbers and whether float32 holds them
exactly. After pass 1, :func:`stored_dtype` picks what pass 2 stores in each shard (a count
above 65,535 widens the shard it lands in, not the whole collection):

* ``data_dtype="auto"``: whole numbers in range -> ``uint8`` / ``uint16`` / ``uint32``
  (``int8`` / ``int16`` / ``int32`` when negatives occur); otherwise float32 when it holds
  every value exactly, else the field's own dtype (float64). Nothing is ever lost.
* ``data_dtype="field"``: each field's own dtype, as collections were written before.
* ``data_dtype=<numpy dtype>``: that dtype, refused with :class:`~annbatch_torch.InputError`
  (naming the field, a value and the fix) when it would not hold every value exactly.
* ``index_dtype="auto"``: ``uint16`` when the matrix has at most 65,536 columns, else int32;
  ``"int32"``: always int32 (the layout of collections written before).

What readers deliver does not change: the field's dtype in the manifest stays what it was
(float32 for float32 inputs), readers widen the stored values into their pool buffers, and
each shard records what it stores (``ShardInfo.stored``), so an appended shard may store
another dtype than the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError

__all__ = ["AUTO", "FIELD", "ValueRange", "asked_dtype", "check_dtype_options",
           "dtype_options", "stored_dtype", "stored_index_dtype", "MAX_UINT16_COLUMNS"]

AUTO = "auto"
#: ``data_dtype="field"``: each field's own dtype (the layout before the option)
FIELD = "field"
#: matrices with at most this many columns store their column indices as uint16
MAX_UINT16_COLUMNS = 1 << 16
#: elements examined at a time (bounds the scan's scratch memory: 8 MiB of float64)
_SLICE = 1 << 20
_INTS = [np.dtype(t) for t in ("uint8", "int8", "uint16", "int16", "uint32", "int32")]
#: dtypes a user may ask values to be stored as
_ALLOWED = ("uint8", "uint16", "uint32", "int8", "int16", "int32", "int64", "float32",
            "float64")


@dataclass
class ValueRange:
    """What pass 1 saw of one matrix field's values (the non-zeros of its CSR blocks)."""

    count: int = 0
    lo: float = 0.0
    hi: float = 0.0
    #: every value is a whole number
    whole: bool = True
    #: float32 holds every value exactly
    fits_float32: bool = True
    #: float64 holds every value exactly (integers above 2**53 it may not)
    fits_float64: bool = True
    #: a value that is not a whole number, one that float32 does not hold, one that float64
    #: does not hold (for messages)
    fraction: float | None = None
    inexact: float | None = None
    inexact64: int | None = None
    #: the inputs where ``lo``, ``hi``, ``fraction``, ``inexact`` and ``inexact64`` were
    #: seen
    where: dict[str, str] = field(default_factory=dict)

    def observe(self, values: np.ndarray, label: str = "") -> None:
        """Note ``values`` (any numeric dtype; NaN and inf were refused before) of the
        input ``label``."""
        values = np.asarray(values).reshape(-1)
        if not values.size:
            return
        for a in range(0, values.size, _SLICE):
            self._observe(values[a : a + _SLICE], label)

    def _observe(self, v: np.ndarray, label: str) -> None:
        lo, hi = v.min().item(), v.max().item()
        if not self.count or lo < self.lo:
            self.lo, self.where["lo"] = lo, label
        if not self.count or hi > self.hi:
            self.hi, self.where["hi"] = hi, label
        self.count += int(v.size)
        if v.dtype.kind == "b":
            return
        if v.dtype.kind == "f":
            if self.whole:
                frac = np.flatnonzero(v != np.trunc(v))
                if not frac.size and lo <= 0:  # -0.0 is no whole number: 0 has no sign
                    frac = np.flatnonzero((v == 0) & np.signbit(v))
                if frac.size:
                    self.whole, self.fraction = False, float(v[frac[0]])
                    self.where["fraction"] = label
            if self.fits_float32 and v.dtype.itemsize > 4:
                with np.errstate(over="ignore"):  # beyond float32's range: inf, unequal
                    off = np.flatnonzero(v.astype(np.float32).astype(v.dtype) != v)
                if off.size:
                    self.fits_float32, self.inexact = False, float(v[off[0]])
                    self.where["inexact"] = label
        elif (v.dtype.itemsize >= 4 and (self.fits_float32 or self.fits_float64)
              and max(-lo, hi) > 1 << 24):  # else every value is exact in float32
            big = np.flatnonzero(np.abs(v.astype(np.int64, copy=False)) > 1 << 24)
            if big.size:  # integers above 2**24 (float32) and 2**53 (float64) may not fit
                w = v[big].astype(np.int64)
                for flt, ok, key in ((np.float32, "fits_float32", "inexact"),
                                     (np.float64, "fits_float64", "inexact64")):
                    if not getattr(self, ok):
                        continue
                    with np.errstate(invalid="ignore"):  # near 2**63 floats round past int64:
                        back = w.astype(flt).astype(np.int64)  # then unequal, as it is
                    off = np.flatnonzero(back != w)
                    if off.size:
                        setattr(self, ok, False)
                        setattr(self, key, int(w[off[0]]) if key == "inexact64"
                                else float(w[off[0]]))
                        self.where[key] = label

    def merge(self, other: ValueRange) -> None:
        """Add what ``other`` saw (another task's share of the same field)."""
        if not other.count:
            return
        for key, theirs, better in (("lo", other.lo, other.lo < self.lo),
                                    ("hi", other.hi, other.hi > self.hi)):
            if not self.count or better:
                setattr(self, key, theirs)
                self.where[key] = other.where.get(key, "")
        self.count += other.count
        if self.whole and not other.whole:
            self.whole, self.fraction = False, other.fraction
            self.where["fraction"] = other.where.get("fraction", "")
        if self.fits_float32 and not other.fits_float32:
            self.fits_float32, self.inexact = False, other.inexact
            self.where["inexact"] = other.where.get("inexact", "")
        if self.fits_float64 and not other.fits_float64:
            self.fits_float64, self.inexact64 = False, other.inexact64
            self.where["inexact64"] = other.where.get("inexact64", "")

    def holds(self, dtype: np.dtype) -> str | None:
        """Why ``dtype`` does not hold every value seen exactly (``None``: it does)."""
        dtype = np.dtype(dtype)
        if not self.count:
            return None
        if dtype.kind in "iu":
            if not self.whole:
                return f"{self._at('fraction')}{self.fraction!r} is not a whole number"
            info = np.iinfo(dtype)
            if self.lo < info.min or self.hi > info.max:
                key = "lo" if self.lo < info.min else "hi"
                return (f"{self._at(key)}{_num(getattr(self, key))} is outside {dtype}'s "
                        f"range [{info.min}, {info.max}]")
            return None
        if dtype == np.float32 and not self.fits_float32:
            return f"{self._at('inexact')}float32 cannot hold {self.inexact!r} exactly"
        if dtype == np.float64 and not self.fits_float64:
            return f"{self._at('inexact64')}float64 cannot hold {self.inexact64!r} exactly"
        if dtype.itemsize < 4:
            return f"{dtype} is narrower than float32"
        return None

    def _at(self, key: str) -> str:
        label = self.where.get(key)
        return f"in {label}, " if label else ""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def check_dtype_options(data_dtype: Any, index_dtype: Any, error: type[Exception] = InputError
                        ) -> tuple[np.dtype | str | None, np.dtype | None]:
    """``data_dtype`` / ``index_dtype`` of a writer as the writer's options keep them:
    ``None`` for ``"auto"``, ``"field"`` as it is, else a dtype; or ``error`` naming the
    option and what it takes."""
    data: np.dtype | str | None = None
    if isinstance(data_dtype, str) and data_dtype == FIELD:
        data = FIELD
    elif not (isinstance(data_dtype, str) and data_dtype == AUTO):
        try:  # None is refused (np.dtype(None) would be float64)
            data = None if data_dtype is None else np.dtype(data_dtype)
        except TypeError:
            data = None
        if data is None or data.name not in _ALLOWED:
            raise error(f"data_dtype={data_dtype!r} is not a dtype values can be stored as; use "
                        f"'auto' (the narrowest that holds every value exactly), 'field' (each "
                        f"field's own dtype, as before) or one of {', '.join(_ALLOWED)}.")
    index: np.dtype | None = None
    if not (isinstance(index_dtype, str) and index_dtype == AUTO):
        try:
            ok = np.dtype(index_dtype) == np.int32
        except TypeError:
            ok = False
        if not ok:
            raise error(f"index_dtype={index_dtype!r} must be 'auto' (uint16 for matrices of "
                        f"at most {MAX_UINT16_COLUMNS} genes, else int32) or 'int32' (the "
                        "layout of earlier collections).")
        index = np.dtype(np.int32)
    return data, index


def dtype_options(opts: dict[str, Any]) -> dict[str, str]:
    """The writer's ``data_dtype`` / ``index_dtype`` as the manifest's writer record keeps
    them (``"auto"`` or a dtype name): an append stores its new shards the same way."""
    return {key: AUTO if opts.get(key) is None else FIELD if opts[key] == FIELD
            else np.dtype(opts[key]).name for key in ("data_dtype", "index_dtype")}


def asked_dtype(opts: dict[str, Any]) -> np.dtype | None:
    """The writer's explicit ``data_dtype`` (``None`` for ``"auto"`` and ``"field"``)."""
    asked = opts.get("data_dtype")
    return None if asked is None or isinstance(asked, str) else np.dtype(asked)


def stored_dtype(field: str, logical: np.dtype, seen: ValueRange | None,
                 asked: np.dtype | str | None) -> np.dtype:
    """The dtype field ``field`` (whose values readers deliver as ``logical``) is stored
    as: ``asked`` when it holds every value of ``seen`` (else :class:`InputError`
    naming the input of a value it cannot hold), ``logical`` for ``"field"``, or the
    narrowest that holds them (``asked`` is ``None``)."""
    logical = np.dtype(logical)
    seen = seen if seen is not None else ValueRange()
    if isinstance(asked, str):  # "field": as collections were written before the option
        return logical
    if asked is not None:
        why = seen.holds(asked)
        if why is not None:
            raise InputError(
                f"{field} cannot be stored as data_dtype={asked.name!r}: {why}. "
                "Fix: data_dtype='auto' (the narrowest dtype that holds every value "
                f"exactly) or a wider dtype such as {_wider(seen)!r}.")
        return asked
    if logical.kind == "b":
        return np.dtype(np.uint8)
    if seen.whole:
        for dt in _INTS:
            if dt.itemsize <= max(logical.itemsize, 4) and seen.holds(dt) is None:
                return dt
    if logical.kind == "f" and logical.itemsize > 4 and seen.fits_float32:
        return np.dtype(np.float32)
    if logical.kind == "f" and logical.itemsize < 4:
        return np.dtype(np.float32)
    return logical


def _wider(seen: ValueRange) -> str:
    if seen.whole:
        for dt in _INTS:
            if seen.holds(dt) is None:
                return dt.name
        return "int64"
    return "float32" if seen.fits_float32 else "float64"


def stored_index_dtype(n_cols: int, asked: np.dtype | None) -> np.dtype:
    """The dtype of a CSR field's column indices: ``uint16`` for at most
    :data:`MAX_UINT16_COLUMNS` columns unless ``asked`` says int32."""
    if asked is None and n_cols <= MAX_UINT16_COLUMNS:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)
