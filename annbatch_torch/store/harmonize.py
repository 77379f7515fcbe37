"""The rules that make one field agree across inputs, for the writer and in-place reading.

:func:`~annbatch_torch.create_anndata_collection` (in :mod:`annbatch_torch.write.schema`)
and :class:`~annbatch_torch.store.inplace.InPlaceSource` describe what each input holds
under a field as an :class:`InputField` and call :func:`harmonize_field`, so that a field
gets the same kind, dtype, global categories, local-to-global code tables and ``ordered``
flag on both paths, or the same refusal (an :class:`~annbatch_torch.errors.InputError`
naming the inputs, the field and the fix; in-place reading records it as the reason the
field is not offered). Pure functions: no I/O.

Matrices (``"csr"``, ``"dense"``; each caller decides the kind: the writer converts every
X / layer to CSR and every obsm entry to dense, in-place reading offers a field only where
every input stores it the same way)
    One row shape in every input. dtype: ``np.result_type`` of the inputs' dtypes; a CSR
    field of float16 becomes float32 (scipy.sparse has no float16).

obs columns (``"categorical"``, ``"numeric"``, ``"bool"``)
    Categorical in every input or in none. bool in every input: bool; otherwise numeric,
    ``np.result_type`` of the dtypes (bool promotes like an integer; a nullable column with
    missing values is described as float64 by its reader).

Categories
    The union in first-seen order, as plain Python scalars of one pandas Index (integer and
    float categories together become floats). The categories of one column must be of one
    kind (numeric, string, other, mixed) in every input, else ``1`` and ``"1"`` would be
    two classes (and ``True`` and ``1`` one). Ordered only when every input is ordered with
    the same categories in the same order; ordered inputs that disagree give an unordered
    field and a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ..errors import InputError
from .manifest import FieldInfo

__all__ = [
    "COLUMN_KINDS",
    "MATRIX_KINDS",
    "Harmonized",
    "InputField",
    "category_kind",
    "column_kind",
    "harmonize_field",
]

logger = logging.getLogger(__name__)

#: kinds of a 2-D field (X, layers, obsm)
MATRIX_KINDS = ("csr", "dense")
#: kinds of an obs column
COLUMN_KINDS = ("categorical", "numeric", "bool")


@dataclass(frozen=True)
class InputField:
    """What one input holds under one field, as the rules see it.

    Attributes
    ----------
    where
        The input's label (its path or ``"<AnnData #i>"``), used in messages.
    kind
        One of :data:`MATRIX_KINDS` or :data:`COLUMN_KINDS`.
    dtype
        The values' dtype (a categorical's codes: not used).
    shape
        The shape of one row: ``(n_cols,)`` for a matrix, ``()`` for an obs column.
    categories
        A categorical's categories, in its order.
    ordered
        Whether a categorical is ordered.
    """

    where: str
    kind: str
    dtype: np.dtype
    shape: tuple[int, ...] = ()
    categories: tuple[Any, ...] | None = None
    ordered: bool = False


@dataclass(frozen=True)
class Harmonized:
    """One field as every input agrees to hold it.

    Attributes
    ----------
    info
        Its schema; a categorical's dtype is the narrowest integer dtype pandas gives codes
        of its global categories.
    code_tables
        A categorical's local-to-global code table per input (int32; the last entry maps
        code -1, a missing value, to -1), else ``None``.
    """

    info: FieldInfo
    code_tables: list[np.ndarray] | None = None


def category_kind(categories: Sequence[Any]) -> str | None:
    """``"numeric"``, ``"string"``, ``"other"`` (e.g. bool) or ``"mixed"`` for a list of
    categories, ``None`` when it is empty."""
    if not len(categories):
        return None
    kinds = {"string" if isinstance(v, str) else
             "numeric" if isinstance(v, int | float | np.number) and not isinstance(v, bool)
             else "other" for v in categories}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def column_kind(column: Any, inputs: Sequence[InputField], omit: str) -> str:
    """The kind of obs ``column`` across ``inputs``: ``"categorical"``, ``"bool"`` or
    ``"numeric"``.

    Parameters
    ----------
    column
        The obs column's name, used in messages.
    inputs
        Each input's description of the column (kinds in :data:`COLUMN_KINDS`).
    omit
        How the caller's user leaves the field out, ending the fix in messages (e.g.
        ``"leave it out with obs_columns=[...]"``).

    Raises
    ------
    InputError
        If the column is categorical in some inputs but not in others.
    """
    cat = [f.kind == "categorical" for f in inputs]
    if any(cat) and not all(cat):
        a, b = inputs[cat.index(True)], inputs[cat.index(False)]
        raise InputError(
            f"{a.where}: obs column {column!r} is categorical there but {b.kind} ({b.dtype}) "
            f"in {b.where}; a column needs one kind in every input. Fix: convert it in one "
            f"of them (e.g. adata.obs[{column!r}] = adata.obs[{column!r}].astype('category')), "
            f"or {omit}."
        )
    if all(cat):
        return "categorical"
    kinds = {f.kind for f in inputs}
    if kinds == {"bool"}:
        return "bool"
    if "bool" in kinds:
        logger.info("obs column %r is bool in some inputs, numeric in others; taken as %s.",
                    column, np.result_type(*[f.dtype for f in inputs]))
    return "numeric"


def _union_categories(column: Any, inputs: Sequence[InputField], omit: str
                      ) -> tuple[list[Any], bool, np.dtype, list[np.ndarray]]:
    local = [list(f.categories or ()) for f in inputs]
    kinds = [category_kind(cats) for cats in local]
    a = next((i for i, k in enumerate(kinds) if k is not None), 0)
    b = next((i for i, k in enumerate(kinds) if k not in (None, kinds[a])), None)
    if b is not None:
        raise InputError(
            f"{inputs[a].where}: obs column {column!r} has {kinds[a]} categories there but "
            f"{kinds[b]} ones in {inputs[b].where} (e.g. {local[a][0]!r} vs {local[b][0]!r}): "
            "one label would become two classes. Fix: make them one type in every input, "
            f"e.g. adata.obs[{column!r}] = adata.obs[{column!r}].astype(str)"
            f".astype('category'), or {omit}."
        )
    union = pd.Index(list(dict.fromkeys(v for cats in local for v in cats)))
    all_ordered = all(f.ordered for f in inputs)
    ordered = all_ordered and all(cats == local[0] for cats in local)
    if all_ordered and not ordered:
        logger.warning("obs column %r is an ordered categorical whose category order differs "
                       "across inputs; taken as unordered (categories in first-seen order).",
                       column)
    tables = [np.append(union.get_indexer(pd.Index(cats)), -1).astype(np.int32)
              for cats in local]
    codes_dtype = np.dtype(pd.Categorical.from_codes([], categories=union).codes.dtype)
    categories = [v.item() if hasattr(v, "item") else v for v in union]
    return categories, ordered, codes_dtype, tables


def _row_shape(field: str, inputs: Sequence[InputField], omit: str) -> tuple[int, ...]:
    shapes = {f.shape for f in inputs}
    if len(shapes) == 1:
        return shapes.pop()

    def cols(shape: tuple[int, ...]) -> str:
        return " x ".join(map(str, shape))

    each = "; ".join(f"{f.where}: {cols(f.shape)}" for f in inputs)
    raise InputError(
        f"{inputs[0].where}: {field} has {sorted(cols(s) for s in shapes)} columns across "
        f"inputs ({each}); it must have the same width in all. Fix: store it with one width "
        f"in every input, or {omit}."
    )


def _dtype(kind: str, inputs: Sequence[InputField]) -> np.dtype:
    dtype = np.dtype(np.result_type(*[f.dtype for f in inputs]))
    if kind == "csr" and dtype == np.float16:  # scipy.sparse has no float16
        return np.dtype(np.float32)
    return dtype


def harmonize_field(field: str, inputs: Sequence[InputField], omit: str) -> Harmonized:
    """The schema of ``field`` that every input's values fit (see the module docs).

    Parameters
    ----------
    field
        The field string (``"X"``, ``"layers/k"``, ``"obsm/k"``, ``"obs/c"``).
    inputs
        Each input's description of the field, in input order.
    omit
        How the caller's user leaves the field out, ending the fix in messages.

    Raises
    ------
    InputError
        When the inputs cannot agree (see the module docs); the message names the inputs,
        the field and the fix.
    ValueError
        When the inputs describe a matrix with two kinds: callers settle the kind first.
    """
    kinds = {f.kind for f in inputs}
    if kinds <= set(MATRIX_KINDS):
        if len(kinds) != 1:
            raise ValueError(f"{field}: matrix kinds {sorted(kinds)}; settle one kind first")
        kind = kinds.pop()
        shape = _row_shape(field, inputs, omit)
        return Harmonized(FieldInfo(kind, str(_dtype(kind, inputs)), (None, *shape)))
    column = field.partition("/")[2]
    kind = column_kind(column, inputs, omit)
    if kind != "categorical":
        dtype = np.dtype(bool) if kind == "bool" else _dtype(kind, inputs)
        return Harmonized(FieldInfo(kind, str(dtype), (None,)))
    categories, ordered, codes_dtype, tables = _union_categories(column, inputs, omit)
    info = FieldInfo("categorical", str(codes_dtype), (None,), tuple(categories), ordered)
    return Harmonized(info, tables)
