"""The rules that make one field agree across inputs, for the writer and in-place reading.

:func:`~annbatch_torch.create_anndata_collection` (in :mod:`annbatch_torch.write.schema`)
and :class:`~annbatch_torch.store.inputs.inplace.InPlaceSource` describe what each input holds
under a field as an :class:`InputField` (both through
:meth:`~annbatch_torch.store.inputs.view.InputSource.describe`, and both select fields with
:func:`~annbatch_torch.store.inputs.plan.plan_fields`) and call :func:`harmonize_field`, so that
a field gets the same kind, dtype, global categories, local-to-global code tables and
``ordered`` flag on both paths, or the same refusal (an
:class:`~annbatch_torch.errors.InputError` naming the input, the field and the fix;
in-place reading records it as the reason the field is not offered). Pure functions: no
I/O (the caller scans a string column's values when asked to, see ``string_categories``).

What a field becomes
    X and layers are CSR (a dense or CSC input included), obsm entries dense 2-D arrays (a
    sparse one included), obs columns categorical, numeric or bool; a string obs column is a
    categorical of its distinct values, sorted (a warning when they look like per-cell ids).
    In place a dense X / layer is read as CSR storing every entry, zeros included
    (:class:`~annbatch_torch.store.elements.DenseAsCSRElement`: dropping the zeros would
    read the whole matrix when the input is opened; values are the same, a pool takes the
    dense bytes plus a column index per entry), and a sparse obsm entry is densified by
    row block; so batches have one layout whether they come from the inputs or from a
    collection, and inputs storing a field differently (dense here, CSR there) agree.

Values
    Numbers only: dtype kinds ``b``, ``i``, ``u``, ``f``. Complex numbers, dates and
    durations (``datetime64`` / ``timedelta64``), objects are refused with the conversion
    to run (a collection's manifest and torch batches hold real numbers). dtype:
    ``np.result_type`` of the inputs' dtypes (float64 for integer counts beside float32
    ones; the writer, which sees every value, delivers float32 when each is exact in it,
    ``Harmonized.mixed``); a CSR field of float16 becomes float32
    (scipy.sparse has no float16); uint64 becomes int64, what torch batches carry (torch
    has no uint64): an obs column holding a value of 2**63 or more (it would wrap to a
    negative number) is refused with the fix (float64, exact up to 2**53, or labels). The
    values of a uint64 *matrix* are checked by the writer (it reads every block); in place
    they are not scanned and pass through. NaN and inf in a matrix (X, layers, raw/X, obsm)
    are refused on both paths: by the writer in each block it reads, in place in each block
    a pool reads (naming the input, the row and the column).

Shapes
    One row shape in every input; an obsm entry is 2-D (cells x columns): a 1-D or 3-D one
    is refused with the reshape to run.

obs columns (``"categorical"`` or ``"string"``, ``"numeric"``, ``"bool"``)
    Categorical (or strings) in every input or in none. bool in every input: bool;
    otherwise numeric, ``np.result_type`` of the dtypes (bool promotes like an integer; a
    nullable column with missing values is described as float64 by its reader).

Categories
    Plain labels only: strings, numbers, booleans (what JSON holds; Timestamp, Interval,
    Period... are refused with ``.astype(str).astype('category')``). The union in first-seen
    order, as plain Python scalars of one pandas Index (integer and float categories
    together become floats). The categories of one column must be of one kind (numeric,
    string, other, mixed) in every input, else ``1`` and ``"1"`` would be two classes; and
    booleans never meet numbers in one column's categories, even inside mixed sets (Python
    takes ``True == 1``: ``1`` would silently merge into ``True``). Ordered only when every
    input is ordered with the same categories in the same order; ordered inputs that
    disagree give an unordered field and a warning.

Names
    A field name becomes a folder in a collection, so a name that cannot be one (an obs
    column ``"CD4/CD8"``, ``""``, a non-string name) is left out on both paths with the same
    reason (:func:`name_reason`), although in place such a column could be read: one
    collection and its inputs then offer the same fields.

Fields nobody asked for (the writer's ``layers=`` / ``obsm=`` / ``obs_columns=`` left
``None``, and every field in place, where the selector is checked later) are left out with
the reason when a rule refuses them (recorded in ``unavailable``; the writer logs a
warning); a field asked for must pass. An input without cells takes no part in any of these
decisions (it is skipped with a warning).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from ...errors import InputError
from ..manifest import FieldInfo

__all__ = [
    "COLUMN_KINDS",
    "MATRIX_KINDS",
    "Harmonized",
    "InputField",
    "category_kind",
    "column_kind",
    "empty_input_reason",
    "field_expr",
    "harmonize_field",
    "input_problem",
    "missing_reason",
    "name_reason",
    "no_x_reason",
    "note_strings",
    "target_kind",
]

logger = logging.getLogger(__name__)

#: kinds of a 2-D field (X, layers, obsm) as an input stores it
MATRIX_KINDS = ("csr", "csc", "dense")
#: kinds of an obs column as an input stores it
COLUMN_KINDS = ("categorical", "string", "numeric", "bool")
#: the largest value an int64 (what torch batches carry) holds
_INT64_MAX = 2**63 - 1
#: string columns with more distinct values than this (and than half the rows) look like ids
_ID_LIKE = 10_000


@dataclass(frozen=True)
class InputField:
    """What one input holds under one field, as the rules see it.

    Attributes
    ----------
    where
        The input's label (its path or ``"<AnnData #i>"``), used in messages.
    kind
        One of :data:`MATRIX_KINDS` or :data:`COLUMN_KINDS`, or ``"unsupported"``.
    dtype
        The values' dtype (a categorical's codes: not used).
    shape
        The shape of one row: ``(n_cols,)`` for a matrix, ``()`` for an obs column.
    categories
        A categorical's categories, in its order (a string column's: filled in by
        :func:`harmonize_field` through ``string_categories``).
    ordered
        Whether a categorical is ordered.
    why
        What an ``"unsupported"`` field is (e.g. ``"encoding 'awkward-array'"``).
    max_value
        The largest value of a uint64 obs column (scanned by the caller), else ``None``.
    """

    where: str
    kind: str
    dtype: np.dtype
    shape: tuple[int, ...] = ()
    categories: tuple[Any, ...] | None = None
    ordered: bool = False
    why: str = ""
    max_value: int | None = None


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
    local_categories
        A categorical's categories per input, in the order its codes index them (a
        string column's: its sorted distinct values), else ``None``.
    """

    info: FieldInfo
    code_tables: list[np.ndarray] | None = None
    local_categories: list[tuple[Any, ...]] | None = None
    #: a matrix field that is float64 only because integer inputs meet float32 ones (no
    #: input holds float64): a writer that sees every value may deliver float32 instead
    mixed: bool = False


# -- names and messages ------------------------------------------------------------------
def target_kind(field: str) -> str | None:
    """The kind a matrix field has on both paths: ``"csr"`` for X, layers and raw/X,
    ``"dense"`` for obsm; ``None`` for an obs column."""
    group = "X" if field == "X" else field.partition("/")[0]
    return {"X": "csr", "layers": "csr", "raw": "csr", "obsm": "dense"}.get(group)


def field_expr(field: str) -> str:
    """How the user's code names ``field`` of an AnnData, e.g. ``adata.obs['c']``."""
    if field == "X":
        return "adata.X"
    if field == "raw/X":
        return "adata.raw.X"
    group, _, key = field.partition("/")
    return f"adata.{group}[{key!r}]"


def _what(field: str) -> str:
    if field == "X":
        return "X"
    if field == "raw/X":
        return "raw (raw.X)"
    group, _, key = field.partition("/")
    return {"layers": "layer", "obsm": "obsm entry", "obs": "obs column"}[group] + f" {key!r}"


def missing_reason(field: str, lacking: Sequence[str], having: Sequence[str], omit: str,
                   have: Sequence[Any] = ()) -> str:
    """Why a field some inputs lack (or, asked for, every input) is left out or refused;
    ``have`` lists what the first lacking input has of the field's group."""
    few = ", ".join(lacking[:3]) + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
    if having:
        where = f"it is in {having[0]}"
    else:
        where = f"it has {list(have)}" if field != "X" else "no input has X"
    fix = ("set it there (e.g. adata.X = adata.layers['counts']) and save the input again"
           if field == "X" else f"add it to {'that input' if len(lacking) == 1 else 'them'}")
    if field == "raw/X" and not having:
        where = "no input has raw"
    return (f"{few}: {'has' if len(lacking) == 1 else 'have'} no {_what(field)} ({where}); "
            f"a field is read from every input, so each needs it. Fix: {fix}, or {omit}.")


def no_x_reason(where: str) -> str:
    """Why X is not there: the inputs have none (X is None)."""
    return f"{where} has no X (it is None); select obsm, layers or obs fields."


def name_reason(where: str, field: Any, why: str, omit: str) -> str:
    """Why a field whose name cannot name a folder (``field_name_problem``) is left out
    (``field``: the field string, or a non-string obs column name itself)."""
    what = _what(field) if isinstance(field, str) else f"obs column {field!r}"
    key = field.partition("/")[2] if isinstance(field, str) else field
    return (f"{where}: {what} cannot be stored: its name cannot be stored as a folder "
            f"name of a collection ({why}). Fix: rename it in the inputs (e.g. "
            f"adata.obs.rename(columns={{{key!r}: 'new_name'}})), or {omit}.")


def empty_input_reason(where: str) -> str:
    """The warning for an input without cells."""
    return (f"{where}: has no cells (n_obs == 0); skipped: it takes no part in the fields' "
            "kinds, dtypes and categories. Drop it from the inputs to silence this.")


def note_strings(where: str, column: str, n_categories: int, n_rows: int) -> None:
    """Log that string column ``column`` becomes a categorical, warning when its values look
    like per-cell ids (both paths say the same)."""
    logger.info("%s: obs column %r holds strings; taken as categorical (%d categories).",
                where, column, n_categories)
    if n_categories > _ID_LIKE and n_categories > n_rows // 2:
        logger.warning("%s: obs column %r looks like per-cell IDs (%d distinct values); a "
                       "label column holds few. Leave it out (obs_columns=[...] for the "
                       "writer, the selector in place).", where, column, n_categories)


def _dtype_problem(field: str, f: InputField, omit: str) -> str | None:
    dt = np.dtype(f.dtype)
    if dt.kind in "biuf":
        return None
    expr = field_expr(field)
    if dt.kind == "c":
        return (f"{f.where}: {_what(field)} holds complex numbers ({dt}); a collection and "
                "torch batches hold real numbers. Fix: keep the real part or the magnitude, "
                f"e.g. {expr} = numpy.abs({expr}) (or {expr}.real), or {omit}.")
    if dt.kind in "mM":
        return (f"{f.where}: {_what(field)} holds dates or durations ({dt}), neither numbers "
                f"nor labels. Fix: as labels, {expr} = {expr}.astype(str).astype('category'); "
                f"as numbers, e.g. {expr} = {expr}.astype('int64') (nanoseconds), or {omit}.")
    return (f"{f.where}: {_what(field)} holds values of dtype {dt}, not numbers. Fix: store "
            f"numbers (e.g. {expr} = {expr}.astype('float32')) or, for labels, a categorical, "
            f"or {omit}.")


def input_problem(field: str, f: InputField, omit: str) -> str | None:
    """Why one input's ``f`` cannot take part in ``field`` on either path, else ``None``.

    Covers what does not depend on the other inputs: an unsupported storage, a dtype that is
    not a number, an obsm entry that is not 2-D.
    """
    if f.kind == "damaged":  # ``why`` is the whole message, with its fix
        return f"{f.why.rstrip('.')}. Or {omit}."
    if f.kind == "unsupported":
        if np.dtype(f.dtype).kind in "cmM":
            return _dtype_problem(field, f, omit)
        store_as = ("a categorical, numeric or bool column" if field.startswith("obs/")
                    else "a CSR/CSC sparse matrix or a dense numeric array")
        return (f"{f.where}: {_what(field)} is stored as {f.why}, which annbatch_torch cannot "
                f"read. Fix: store it as {store_as}, or {omit}.")
    if f.kind in ("categorical", "string"):
        return None
    why = _dtype_problem(field, f, omit)
    if why is not None:
        return why
    if target_kind(field) == "dense" and len(f.shape) != 1:
        dims = len(f.shape) + 1
        return (f"{f.where}: {_what(field)} is a {dims}-D array (rows of shape {f.shape}); an "
                f"obsm entry must be 2-D (cells x columns). Fix: {field_expr(field)} = "
                f"{field_expr(field)}.reshape(adata.n_obs, -1), or {omit}.")
    return None


# -- obs columns -------------------------------------------------------------------------
def category_kind(categories: Sequence[Any]) -> str | None:
    """``"numeric"``, ``"string"``, ``"other"`` (e.g. bool) or ``"mixed"`` for a list of
    categories, ``None`` when it is empty."""
    if not len(categories):
        return None
    kinds = {"string" if isinstance(v, str) else
             "numeric" if isinstance(v, int | float | np.number) and not isinstance(v, bool)
             else "other" for v in categories}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool | np.bool_)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float | np.integer | np.floating) and not _is_bool(v)


def _category_type_problem(column: str, f: InputField, omit: str) -> str | None:
    bad = next((v for v in f.categories or () if not (isinstance(v, str) or _is_bool(v)
                                                      or _is_number(v))), None)
    if bad is None:
        return None
    expr = field_expr(f"obs/{column}")
    return (f"{f.where}: obs column {column!r} has categories of type {type(bad).__name__} "
            f"(e.g. {bad!r}); a label is a string, a number or a boolean (a collection keeps "
            f"categories as JSON). Fix: {expr} = {expr}.astype(str).astype('category'), or "
            f"{omit}.")


def column_kind(column: Any, inputs: Sequence[InputField], omit: str) -> str:
    """The kind of obs ``column`` across ``inputs``: ``"categorical"`` (a string column
    counts as one), ``"bool"`` or ``"numeric"``.

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
    cat = [f.kind in ("categorical", "string") for f in inputs]
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
    with_bool = next(((i, v) for i, cats in enumerate(local) for v in cats if _is_bool(v)), None)
    with_number = next(((i, v) for i, cats in enumerate(local) for v in cats if _is_number(v)),
                       None)
    if with_bool is not None and with_number is not None:
        (i, vb), (j, vn) = with_bool, with_number
        there = "there" if i != j else "there too"
        raise InputError(
            f"{inputs[i].where}: obs column {column!r} has the boolean category {vb!r} there "
            f"and the number {vn!r} in {inputs[j].where if i != j else 'it'} ({there}): "
            f"Python takes True == 1 and False == 0, so {vn!r} would silently become {vb!r}. "
            f"Fix: make them one type in every input, e.g. adata.obs[{column!r}] = "
            f"adata.obs[{column!r}].astype(str).astype('category'), or {omit}."
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


# -- matrices ----------------------------------------------------------------------------
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
    if dtype == np.uint64:  # what torch batches carry (torch has no uint64)
        return np.dtype(np.int64)
    return dtype


def _check_range(column: str, inputs: Sequence[InputField], omit: str) -> None:
    for f in inputs:
        if f.max_value is not None and f.max_value > _INT64_MAX:
            expr = field_expr(f"obs/{column}")
            raise InputError(
                f"{f.where}: obs column {column!r} holds {f.max_value} ({f.dtype}), above "
                f"2**63 - 1: batches carry it as int64 (torch has no uint64), where it would "
                f"wrap to a negative number. Fix: {expr} = {expr}.astype('float64') (exact "
                f"up to 2**53), or as labels {expr} = {expr}.astype(str).astype('category'), "
                f"or {omit}."
            )


def harmonize_field(field: str, inputs: Sequence[InputField], omit: str,
                    string_categories: Callable[[int], Sequence[Any]] | None = None
                    ) -> Harmonized:
    """The schema of ``field`` that every input's values fit (see the module docs).

    Parameters
    ----------
    field
        The field string (``"X"``, ``"layers/k"``, ``"raw/X"``, ``"obsm/k"``, ``"obs/c"``).
    inputs
        Each input's description of the field, in input order (inputs without cells left
        out by the caller).
    omit
        How the caller's user leaves the field out, ending the fix in messages.
    string_categories
        ``string_categories(i)``: the sorted distinct values of input ``i``'s string column,
        called only once the inputs agree the column is categorical.

    Raises
    ------
    InputError
        When the inputs cannot agree (see the module docs); the message names the input,
        the field and the fix.
    """
    inputs = list(inputs)
    for f in inputs:
        why = input_problem(field, f, omit)
        if why is not None:
            raise InputError(why)
    kind = target_kind(field)
    if kind is not None:
        shape = _row_shape(field, inputs, omit)
        dtype = _dtype(kind, inputs)
        floats = [np.dtype(f.dtype) for f in inputs if np.dtype(f.dtype).kind == "f"]
        mixed = dtype == np.float64 and bool(floats) and all(d.itemsize <= 4 for d in floats)
        return Harmonized(FieldInfo(kind, str(dtype), (None, *shape)), mixed=mixed)
    column = field.partition("/")[2]
    kind = column_kind(column, inputs, omit)
    if kind != "categorical":
        _check_range(column, inputs, omit)
        dtype = np.dtype(bool) if kind == "bool" else _dtype(kind, inputs)
        return Harmonized(FieldInfo(kind, str(dtype), (None,)))
    if any(f.kind == "string" for f in inputs):
        if string_categories is None:
            raise ValueError(f"{field}: a string column needs string_categories")
        inputs = [replace(f, categories=tuple(string_categories(i)), ordered=False)
                  if f.kind == "string" else f for i, f in enumerate(inputs)]
    for f in inputs:
        why = _category_type_problem(column, f, omit)
        if why is not None:
            raise InputError(why)
    categories, ordered, codes_dtype, tables = _union_categories(column, inputs, omit)
    info = FieldInfo("categorical", str(codes_dtype), (None,), tuple(categories), ordered)
    return Harmonized(info, tables, [tuple(f.categories or ()) for f in inputs])
