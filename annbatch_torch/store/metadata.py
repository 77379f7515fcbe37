"""Cell and gene metadata of a collection, read without the matrices.

The pieces behind a collection's answers to :meth:`~annbatch_torch.Source.obs_names_at`,
:meth:`~annbatch_torch.Source.obs_at`, :meth:`~annbatch_torch.Source.category_counts` and
:attr:`~annbatch_torch.store.collection.Collection.var`: global row ids checked and split by
shard, a shard's obs index, category codes counted chunk by chunk, an AnnData ``var``
dataframe group read column by column. Each reads only the arrays it names (``obs/_index``,
``obs/<column>``, ``var/...``), never ``X``, ``layers`` or ``obsm``.

Everything here works on one already opened shard group (or one element); caching and the
per-process handles are :class:`~annbatch_torch.store.collection.Collection`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from ..errors import AnnBatchError, CollectionError, InputError, ReadError
from .elements import (
    GROUP_MEMBERS,
    CategoricalElement,
    Element,
    encoding_type,
    index_key,
    is_group,
    open_element,
    read_index,
)
from .rawstrings import RawStringArray

__all__ = [
    "MISSING_CATEGORY",
    "as_row_ids",
    "split_by_shard",
    "shard_obs_names",
    "shard_name_hashes",
    "NAME_HASHES",
    "gather",
    "check_codes",
    "count_codes",
    "as_categorical",
    "read_dataframe",
]

logger = logging.getLogger(__name__)

#: the index label under which :meth:`Source.category_counts` counts missing values
#: (code -1), present only when some cell has one: ``NaN``, as in
#: ``pandas.Series.value_counts(dropna=False)``.
MISSING_CATEGORY = float("nan")

#: rows of a codes array counted per read (rounded to whole chunks)
COUNT_BLOCK_ROWS = 1 << 20

#: ``check(element, node)``: a collection's check of a node before it is read, the one its
#: field reads make (``Collection._check_node`` of the shard: every chunk file present when
#: the writer wrote every chunk); raises :class:`CollectionError` naming the shard and
#: ``element`` (``"obs/_index"``, ``"var/gene_symbol"``)
NodeCheck = Callable[[str, Any], None]

_REWRITE = "rewrite it with create_anndata_collection(..., overwrite=True)."


def as_row_ids(rows: Any, n_obs: int, where: str) -> np.ndarray:
    """``rows`` as a 1-D int64 array of global row ids, each checked inside ``[0, n_obs)``.

    Parameters
    ----------
    rows
        Integer array-like (list, numpy array, CPU torch tensor); any order, duplicates
        allowed. A scalar counts as one id.
    n_obs
        Rows of the collection.
    where
        The collection, for messages.

    Raises
    ------
    TypeError
        If ``rows`` is not integer (a boolean mask, floats, strings).
    ValueError
        If ``rows`` has more than one dimension.
    IndexError
        If an id lies outside ``[0, n_obs)``; negative ids are not counted from the end.
    """
    arr = np.asarray(rows)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(
            f"{where}: row ids must be one-dimensional, got shape {arr.shape}; pass "
            "rows.ravel() (e.g. torch.cat of the batches' 'index')."
        )
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind == "b":
        raise TypeError(
            f"{where}: row ids must be integers, got a boolean array; for a mask over the "
            "collection's rows pass numpy.flatnonzero(mask)."
        )
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"{where}: row ids must be integers (global row ids, e.g. batch['index'] with "
            f"return_index=True), got dtype {arr.dtype}."
        )
    # unsigned ids are compared as they are (a uint64 above 2**63 would wrap in int64)
    bad = arr[arr >= n_obs] if arr.dtype.kind == "u" else arr[(arr < 0) | (arr >= n_obs)]
    if bad.size:
        shown = ", ".join(str(int(v)) for v in bad[:5])
        more = f" and {bad.size - 5} more" if bad.size > 5 else ""
        raise IndexError(
            f"{where}: row ids out of range: {shown}{more}; the collection's global row ids "
            f"lie in [0, {n_obs}) (negative ids do not count from the end)."
        )
    return arr.astype(np.int64, copy=False)


def split_by_shard(
    rows: np.ndarray, offsets: np.ndarray
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Group checked global row ids by shard.

    Parameters
    ----------
    rows
        Global row ids (from :func:`as_row_ids`).
    offsets
        ``Source.shard_offsets``: where each shard starts, plus the total.

    Returns
    -------
    list of (shard, positions, local)
        For each shard that holds some of ``rows``, in shard order: the positions in
        ``rows`` of its ids and the ids' rows within the shard.
    """
    if rows.size == 0:
        return []
    shard = np.searchsorted(offsets, rows, side="right") - 1
    order = np.argsort(shard, kind="stable")
    sorted_shards = shard[order]
    starts = np.flatnonzero(np.r_[True, sorted_shards[1:] != sorted_shards[:-1]])
    stops = np.r_[starts[1:], sorted_shards.size]
    out = []
    for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
        s = int(sorted_shards[a])
        positions = order[a:b]
        out.append((s, positions, rows[positions] - offsets[s]))
    return out


def shard_obs_names(group: Any, n_obs: int, where: str, check: NodeCheck | None = None,
                    by_position: bool = False) -> np.ndarray | RawStringArray:
    """The obs_names of one shard (an object array of str), read from the array its ``obs``
    group's ``_index`` attribute names (``obs/_index`` by default), nothing else.

    ``check``: the collection's check of that array before it is read (:data:`NodeCheck`).
    ``by_position``: where the index is a string array of raw ``vlen-utf8`` chunks (a
    collection's shard opened as a :class:`~annbatch_torch.store.groups.FastGroup`), the
    :class:`~annbatch_torch.store.rawstrings.RawStringArray` instead, which decodes only the
    names asked for (``names[positions]``, as with the array).

    Raises
    ------
    CollectionError
        If the shard has no obs index, it does not hold ``n_obs`` names or ``check``
        refuses it (e.g. a chunk file was deleted).
    """
    try:
        obs = group["obs"]
        key = index_key(obs)
        strings = getattr(obs, "strings", None) if by_position else None
        node = (strings(key) if strings is not None else None) or obs[key]
    except KeyError as e:
        raise CollectionError(
            f"{where}: the shard has no obs index ({e}); the collection is damaged, {_REWRITE}"
        ) from None
    if check is not None:
        check(f"obs/{key}", node)
    names = node if isinstance(node, RawStringArray) else read_index(obs)
    if names.shape != (n_obs,):
        raise CollectionError(
            f"{where}: the obs index holds {names.shape[0] if names.ndim else 0} names but the "
            f"manifest says {n_obs} rows; the collection is damaged, rewrite it."
        )
    logger.debug("%s: %s %d obs_names", where,
                 "opened" if isinstance(names, RawStringArray) else "read", n_obs)
    return names


#: a shard's ``uns`` array of the 64-bit hashes of its obs_names (sorted, distinct):
#: what an append compares its new names with, 8 bytes a cell instead of the strings
NAME_HASHES = "annbatch_torch_obs_name_hashes"


def shard_name_hashes(group: Any, where: str) -> np.ndarray | None:
    """The sorted distinct obs_name hashes one shard stores (``uns/`` :data:`NAME_HASHES`),
    ``None`` for a shard written before they were stored.

    Raises
    ------
    CollectionError
        If the array is there but not a sorted 1-D uint64 array of distinct values.
    """
    try:
        node = group["uns"][NAME_HASHES]
    except KeyError:
        return None
    hashes = np.asarray(node[...])
    if hashes.dtype != np.uint64 or hashes.ndim != 1 or (
            hashes.size > 1 and not bool(np.all(hashes[1:] > hashes[:-1]))):
        raise CollectionError(
            f"{where}: uns/{NAME_HASHES} is not the sorted distinct uint64 hashes of the "
            f"shard's obs_names ({hashes.dtype}, shape {hashes.shape}); the collection is "
            f"damaged, {_REWRITE}")
    return hashes


def gather(el: Element, local: np.ndarray) -> np.ndarray:
    """Rows ``local`` (any order, duplicates allowed) of a 1-D element, reading the span
    ``[min(local), max(local) + 1)`` once."""
    lo, hi = int(local.min()), int(local.max()) + 1
    return np.asarray(el.read(lo, hi))[local - lo]


def check_codes(codes: np.ndarray, n_categories: int, where: str, column: str,
                start: int = 0) -> None:
    """Refuse category codes outside ``[-1, n_categories)`` (a damaged column).

    ``column`` names it in the message (``"obs/cell_type"``); ``start`` is the shard row
    of ``codes[0]``.
    """
    bad = (codes < -1) | (codes >= n_categories)
    if codes.size and bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ReadError(
            f"{where}: column {column!r} has category code {int(codes[i])} at row "
            f"{start + i}, outside [-1, {n_categories}) of its {n_categories} categories; the "
            "collection is damaged, rewrite it with create_anndata_collection(..., "
            "overwrite=True)."
        )


def count_codes(el: CategoricalElement, n_categories: int, where: str, column: str) -> np.ndarray:
    """Cells per code of a categorical column: ``counts[0]`` the missing ones (code -1),
    ``counts[1 + c]`` category ``c``. Reads the codes array only, a block of whole chunks at
    a time (at most about :data:`COUNT_BLOCK_ROWS` rows in memory)."""
    chunks = getattr(el.codes, "chunks", None)
    chunk = int(chunks[0]) if chunks else 0
    step = chunk * max(1, COUNT_BLOCK_ROWS // chunk) if chunk > 0 else COUNT_BLOCK_ROWS
    counts = np.zeros(n_categories + 1, dtype=np.int64)
    for a in range(0, el.n_rows, step):
        codes = np.asarray(el.read(a, min(el.n_rows, a + step))).astype(np.int64, copy=False)
        check_codes(codes, n_categories, where, column, a)
        counts += np.bincount(codes + 1, minlength=n_categories + 1)
    return counts


def as_categorical(codes: np.ndarray, categories: Any, ordered: bool) -> pd.Categorical:
    """Codes (checked) as a :class:`pandas.Categorical` of ``categories``."""
    return pd.Categorical.from_codes(
        codes.astype(np.int64, copy=False), categories=pd.Index(list(categories)),
        ordered=ordered, validate=False,
    )


def _nullable(node: Any, n_rows: int) -> Any:
    """A nullable-integer / nullable-boolean column as pandas' ``Int64``-style / ``boolean``
    array (values and mask as stored), else ``None``."""
    if encoding_type(node) not in ("nullable-integer", "nullable-boolean"):
        return None
    try:
        values, mask = np.asarray(node["values"][...]), np.asarray(node["mask"][...], bool)
    except AnnBatchError:
        raise  # damage (a truncated zarr.json): not a column to read another way
    except (KeyError, TypeError, ValueError):
        return None
    if values.shape != (n_rows,) or mask.shape != (n_rows,):
        return None  # the element reader reports the damage
    if values.dtype.kind == "b":
        return pd.arrays.BooleanArray(values, mask)
    return pd.arrays.IntegerArray(values, mask)


def read_dataframe(group: Any, n_rows: int, where: str, what: str,
                   check: NodeCheck | None = None,
                   index: np.ndarray | None = None) -> pd.DataFrame:
    """An AnnData dataframe group (``var``) as a :class:`pandas.DataFrame`.

    Columns are read as :mod:`annbatch_torch.store.elements` reads obs columns
    (:func:`~annbatch_torch.store.elements.open_element`): categoricals become
    :class:`pandas.Categorical` with the stored categories, strings object arrays of str,
    numeric and bool as stored, nullable integers / booleans as pandas' nullable arrays
    (``Int64``, ``boolean``, ..., as anndata reads them).
    Columns in the order of the ``column-order`` attribute (else the group's, the index
    excepted). A column stored in an encoding :func:`open_element` cannot read (e.g. a
    nested dataframe or an awkward array) is left out with a logged warning.

    Parameters
    ----------
    group
        The zarr / h5py dataframe group.
    n_rows
        Rows it must hold (index and every column).
    where
        The store, for messages.
    what
        The group's name, for messages (``"var"``).
    check
        A collection's check of each array before it is read (:data:`NodeCheck`). With
        it a column that is absent or lacks a member array (a categorical's
        ``categories``) is damage; without it (an input's ``var``) such a column is left
        out with a logged warning.
    index
        The group's index as the caller read it already (an input's var names): not read
        again.

    Raises
    ------
    CollectionError
        If the index or a column does not hold ``n_rows`` rows, or (with ``check``) a
        column is damaged.
    """
    key = index_key(group)
    try:
        node = group[key]
    except KeyError:
        raise CollectionError(
            f"{where}: {what} has no index (no {what}/{key} array); the store is damaged, "
            "rewrite it."
        ) from None
    if check is not None:
        check(f"{what}/{key}", node)
    names = read_index(group) if index is None else np.asarray(index, dtype=object)
    if names.shape != (n_rows,):
        raise CollectionError(
            f"{where}: {what} index holds {names.shape[0] if names.ndim else 0} names, expected "
            f"{n_rows}; the store is damaged, rewrite it."
        )
    order = group.attrs.get("column-order")
    if order is None:
        columns = [k for k in group if k != key]
    else:
        columns = [c.decode() if isinstance(c, bytes) else str(c) for c in list(order)]
    data: dict[str, Any] = {}
    for col in columns:
        values = _column(group, col, n_rows, where, what, check)
        if values is not None:
            data[col] = values
    index = pd.Index(names, dtype=object, name=None if key == "_index" else key)
    return pd.DataFrame(data, index=index)


def _column(group: Any, col: str, n_rows: int, where: str, what: str,
            check: NodeCheck | None) -> Any:
    """Column ``col`` of dataframe group ``group`` as :func:`read_dataframe` returns it,
    ``None`` when it is left out."""
    name = f"{what}/{col}"

    def left_out(why: str, error: InputError | None = None) -> None:
        if check is not None:  # a collection's writer wrote every column whole
            raise CollectionError(str(error) if error is not None else (
                f"{where}: {what} column {col!r} {why}; the collection is damaged, {_REWRITE}"
            )) from error
        logger.warning("%s: %s column %r is left out of %s: %s", where, what, col, what, why)

    try:
        node = group[col]
    except KeyError:
        return left_out(f"is listed in {what}'s column-order but absent")
    enc = encoding_type(node)
    if is_group(node) and enc not in GROUP_MEMBERS:  # an encoding read by none of us
        logger.warning("%s: %s column %r is left out of %s: its encoding %r cannot be read "
                       "by rows", where, what, col, what, enc)
        return None
    if check is not None:
        check(name, node)
    nullable = _nullable(node, n_rows)
    if nullable is not None:
        return nullable
    try:
        el = open_element(node, name, where)
    except InputError as e:
        return left_out(str(e), e)
    if el.n_rows != n_rows or len(getattr(el, "shape", (n_rows,))) > 1:
        raise CollectionError(
            f"{where}: {what} column {col!r} has shape {getattr(el, 'shape', el.n_rows)}, "
            f"expected {n_rows} values; the store is damaged, rewrite it."
        )
    values = np.asarray(el.read(0, n_rows))
    if isinstance(el, CategoricalElement):
        check_codes(values, len(el.categories), where, name)
        return as_categorical(values, el.categories, el.ordered)
    return values
