"""Sources of rows: the interface the reader pulls row ranges from.

A *source* is an ordered list of "shards" (each a group of AnnData elements with ``n_obs``
rows) plus a schema (``fields``). :class:`~annbatch_torch.store.collection.Collection` is the
on-disk kind; :mod:`annbatch_torch.store.inputs.inplace` builds the same interface over AnnData
inputs read in place. Both answer the same questions about cells without reading a matrix
(:attr:`Source.obs_names`, :meth:`Source.obs_names_at`, :meth:`Source.obs_at`,
:meth:`Source.category_counts`, built on :mod:`annbatch_torch.store.metadata`).

Handles are opened lazily and per process: a source pickles without any open handle
and reopens in whichever process reads it (safe under ``fork`` and ``spawn``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from ..errors import CollectionError, SchemaError
from .elements import CategoricalElement, Element, open_element
from .manifest import FieldInfo
from .metadata import (
    MISSING_CATEGORY,
    as_categorical,
    as_row_ids,
    check_codes,
    count_codes,
    gather,
    split_by_shard,
)
from .rawstrings import RawStringArray

__all__ = ["Source", "field_node", "reads_metadata"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def reads_metadata(method: Callable[..., T]) -> Callable[..., T]:
    """``method`` of a source that reads its shards' metadata: from the source as it was
    opened (:meth:`Source.check_current` before and after, as batch reads do), and whose
    failures to read bytes (a truncated or corrupted chunk) raise :class:`CollectionError`
    with the source's fix (``Source.DAMAGE_FIX``)."""

    @functools.wraps(method)
    def wrapped(self: Source, *args: Any, **kwargs: Any) -> T:
        self.check_current()
        try:
            out = method(self, *args, **kwargs)
        except CollectionError:
            raise
        except (OSError, RuntimeError) as e:  # e.g. rawzarr's ChunkError, a codec's error
            self.check_current()  # a rewrite explains it
            raise CollectionError(f"{self.describe()}: {type(e).__name__}: {e}. "
                                  f"{self.DAMAGE_FIX}") from e
        self.check_current()
        return out

    return wrapped


def field_node(group: Any, field: str, where: str) -> Any:
    """Return the h5py/zarr node of field string ``field`` inside an AnnData ``group``."""
    if field == "X":
        parts = ["X"]
    else:
        kind, _, key = field.partition("/")
        parts = [kind, key]
    node = group
    for p in parts:
        try:
            node = node[p]
        except KeyError:
            raise CollectionError(
                f"{where}: field {field!r} is missing (no {'/'.join(parts)!r} in the store); "
                "the store is damaged or incomplete, rewrite it."
            ) from None
    return node


class Source:
    """Common interface of row sources (collections and in-place AnnData lists)."""

    #: field string -> schema
    fields: dict[str, FieldInfo]
    #: per-shard row counts
    shard_sizes: list[int]
    var_names: pd.Index
    #: the genes of field ``raw/X`` (AnnData's raw), ``None`` without it
    raw_var_names: pd.Index | None = None
    #: what one shard is called in messages ("input" when reading inputs in place)
    PART = "shard"
    #: the fix a read failure's message ends with (what to do about damaged bytes)
    DAMAGE_FIX = ("The store may be damaged; rewrite it with create_anndata_collection(..., "
                  "overwrite=True).")

    def __init__(self) -> None:
        self._pid: int | None = None
        self._handles: dict[int, Any] = {}
        self._elements: dict[tuple[int, str], Element] = {}

    def check_current(self) -> None:
        """Raise :class:`~annbatch_torch.CollectionError` when what this source reads was
        replaced since it was opened (collections; inputs read in place are not checked)."""

    # -- pickling: drop handles, reopen lazily ------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pid"] = None
        state["_handles"] = {}
        state["_elements"] = {}
        state["_obs_names"] = {}  # per process: a spawned worker reads its own when asked
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _check_pid(self) -> None:
        pid = os.getpid()
        if self._pid != pid:  # first use in this process (or forked child): fresh handles
            self._handles = {}
            self._elements = {}
            self._pid = pid

    def close(self) -> None:
        """Close every handle this process opened (they reopen on the next read)."""
        for h in self._handles.values():
            close = getattr(h, "close", None)
            if close is not None and self._pid == os.getpid():
                with contextlib.suppress(Exception):  # best effort
                    close()
        self._handles = {}
        self._elements = {}

    @property
    def has_open_handles(self) -> bool:
        """Whether this object currently holds open file handles."""
        return bool(self._handles)

    # -- geometry ------------------------------------------------------------------
    @property
    def n_obs(self) -> int:
        return int(sum(self.shard_sizes))

    @property
    def n_vars(self) -> int:
        return len(self.var_names)

    @property
    def shard_offsets(self) -> np.ndarray:
        """Global row where each shard starts, plus the total at the end."""
        return np.concatenate([[0], np.cumsum(self.shard_sizes, dtype=np.int64)])

    def categories(self, column: str) -> list[Any]:
        """Global categories of categorical obs ``column`` (codes index into them)."""
        key = column if column.startswith("obs/") else f"obs/{column}"
        info = self.fields.get(key)
        if info is None or info.kind != "categorical":
            cats = [k[4:] for k, v in self.fields.items() if v.kind == "categorical"]
            raise SchemaError(
                f"{self.describe()}: {column!r} is not a categorical obs column; categorical "
                f"columns are {cats}."
            )
        return list(info.categories or ())

    #: the obs column whose classes are contiguous runs of rows (a collection written
    #: with ``group_by``), or ``None``
    group_by: str | None = None

    def identity(self) -> str | None:
        """What identifies this source's rows, which a resume state records (the plan's
        ``source_id``); ``None``: not known (inputs read in place)."""
        return None

    # -- reading -------------------------------------------------------------------
    def describe(self) -> str:
        raise NotImplementedError

    def shard_name(self, shard: int) -> str:
        raise NotImplementedError

    def _open_shard(self, shard: int) -> Any:
        raise NotImplementedError

    def code_map(self, shard: int, field: str) -> np.ndarray | None:
        """Local->global category code table of a categorical field, or None if identity."""
        return None

    def shard_group(self, shard: int) -> Any:
        """This process's open group of ``shard`` (opened lazily, cached; reopened in any
        other process, see ``_check_pid``)."""
        self._check_pid()
        group = self._handles.get(shard)
        if group is None:
            group = self._open_shard(shard)
            self._handles[shard] = group
        return group

    def element(self, shard: int, field: str) -> Element:
        """The ``Element`` of ``field`` in ``shard`` (opened lazily, cached)."""
        self._check_pid()
        key = (shard, field)
        el = self._elements.get(key)
        if el is None:
            node = field_node(self.shard_group(shard), field, self.shard_name(shard))
            self._check_node(shard, field, node)
            el = open_element(node, field, self.shard_name(shard))
            sizes = self.__dict__.get("shard_sizes")  # unknown while a source inspects itself
            if sizes is not None and el.n_rows != sizes[shard]:
                raise CollectionError(
                    f"{self.shard_name(shard)}: field {field!r} has {el.n_rows} rows but the "
                    f"manifest says {self.shard_sizes[shard]}; the store is damaged, rewrite it."
                )
            self._check_element(shard, field, el)
            self._elements[key] = el
        return el

    def _check_node(self, shard: int, field: str, node: Any) -> None:
        """Hook: validate the raw h5py/zarr node of a field before it is wrapped."""

    def _check_element(self, shard: int, field: str, el: Element) -> None:
        """Refuse an element whose kind or width disagrees with the schema in ``fields``."""
        info = self.__dict__.get("fields", {}).get(field)
        if info is None:
            return
        kind = "csr" if el.kind == "csr" else "categorical" if el.kind == "categorical" else (
            "strings" if el.kind == "strings" else "dense"
        )
        want = "dense" if info.kind in ("dense", "numeric", "bool") else info.kind
        if kind != want:
            stored = {"csr": "a sparse (CSR/CSC) matrix", "dense": "a dense array",
                      "categorical": "a categorical", "strings": "strings"}[kind]
            raise CollectionError(
                f"{self.shard_name(shard)}: field {field!r} is stored as {stored} but "
                f"{self.describe()} declares it {info.kind!r}; all shards must store a field "
                "the same way. Rewrite the collection with create_anndata_collection(..., "
                "overwrite=True), which converts inputs to one kind per field."
            )
        shape = getattr(el, "shape", None)
        declared = tuple(info.shape[1:])
        if shape is not None and declared and None not in declared and (
            tuple(shape[1:]) != declared
        ):
            raise CollectionError(
                f"{self.shard_name(shard)}: field {field!r} has shape {tuple(shape)} but "
                f"{self.describe()} declares {list(info.shape)} (rows free); the store is "
                "damaged, rewrite it."
            )

    def check_field(self, field: str) -> FieldInfo:
        """The schema of ``field``, or a :class:`SchemaError` saying why it is unavailable.

        The message names the source and the field, lists what is available and, where
        known, why the field was left out (strings, too many categories, inputs that store
        it differently).
        """
        info = self.fields.get(field)
        if info is not None:
            return info
        available = sorted(self.fields)
        reason = self.unavailable.get(field)
        if reason is not None:
            raise SchemaError(f"{self.describe()}: field {field!r} cannot be selected: {reason}")
        key = field.partition("/")[2]
        similar = [f for f in available if f.partition("/")[2] == key and key]
        hint = f" Did you mean {similar}?" if similar else ""
        raise SchemaError(
            f"{self.describe()}: field {field!r} does not exist.{hint} Available fields: "
            f"{available}."
        )

    def stored_value_dtypes(self, field: str) -> list[np.dtype]:
        """The dtype of the values of sparse field ``field`` as each shard stores them (one
        per shard, in order): what readers widen from. Opens each shard's element (and
        closes what it opened); a collection answers from its manifest."""
        opened = self.has_open_handles
        try:
            return [np.dtype(self.element(s, field).dtype)
                    for s in range(len(self.shard_sizes))]
        finally:
            if not opened:
                self.close()

    @property
    def unavailable(self) -> dict[str, str]:
        """Fields present in the inputs but not offered, with the reason (see check_field)."""
        return dict(self.__dict__.get("_unavailable", {}))

    # -- cell metadata (never X; see store/metadata.py) --------------------------------
    @property
    def obs_names(self) -> pd.Index:
        """The obs_names (cell names) of every row, in global row order.

        The same as ``obs_names_at(numpy.arange(n_obs))`` (see :meth:`obs_names_at`): a
        collection's rows in its shuffled order, inputs read in place in the inputs'
        order (input 0's cells first). Built anew on each access from the cached names.
        """
        return self.obs_names_at(np.arange(self.n_obs))

    @reads_metadata
    def obs_names_at(self, rows: Any) -> pd.Index:
        """The obs_names (cell names) of global row ids ``rows``.

        Global row ids are positions in the source (shard 0's rows first, see
        :attr:`~annbatch_torch.Source.shard_offsets`; read in place, a "shard" is an
        input); they are what ``AnnBatchDataset(..., return_index=True)`` yields as
        ``batch["index"]``. Only each shard's obs index is read (the array the ``obs``
        group's ``_index`` attribute names; an in-memory AnnData's ``obs_names``), never
        ``X``; what was read is kept in this object (in this process: a pickled source,
        e.g. one sent to a spawned DataLoader worker, carries none and reads its own when
        asked). A collection written in zarr v3 (the default) with ``compressor="raw"``
        (the default) or ``"none"`` keeps its shards' index chunks as bytes (the names'
        UTF-8 plus about 8 bytes a cell) and decodes the names asked for on each call;
        other collections and inputs read in place keep every name of a shard asked about
        as a Python str (roughly 70-100 bytes a cell).

        Duplicate obs_names are returned as they are stored: a name that repeats (within
        an input, or across inputs; the writer and in-place reading warn about both but
        keep the names) comes back once per row id that holds it, so different row ids can
        give the same name. A row id always names one cell; a name may not. A collection
        and the inputs read in place answer alike.

        Parameters
        ----------
        rows
            Integer array-like of global row ids (list, numpy array, CPU torch tensor), in
            any order, duplicates allowed.

        Returns
        -------
        pandas.Index
            ``len(rows)`` names (object dtype, str), in the order of ``rows``.

        Raises
        ------
        IndexError
            If an id lies outside ``[0, n_obs)`` (the message gives the range).
        TypeError
            If ``rows`` is not integer.

        Notes
        -----
        Writing predictions or embeddings back to an AnnData in its original order: collect
        each batch's ``batch["index"]`` with its output, map the ids to names and reorder by
        the AnnData's obs_names::

            ids = np.concatenate([b["index"].numpy() for b in batches])
            emb = np.concatenate(outputs)              # row i belongs to ids[i]
            names = coll.obs_names_at(ids)
            adata.obsm["emb"] = emb[pd.Index(names).get_indexer(adata.obs_names)]

        This needs unique obs_names across the inputs (``get_indexer`` refuses the
        repeated names described above; make them unique before writing, e.g.
        ``anndata.concat(..., index_unique="-")`` or ``adata.obs_names_make_unique()``) and
        every cell of ``adata`` among ``ids`` (``get_indexer`` returns -1 for a missing
        one, which would silently take the last row: check ``(indexer >= 0).all()``, or
        iterate with ``drop_last=False``). With ``even_batches="pad"`` some ids repeat:
        keep only the rows whose ``batch["mask"]`` is true first (``get_indexer`` refuses
        repeated names too). Read in place, a row id is already the position in the
        inputs' concatenation (``anndata.concat(inputs)``), no name needed.
        """
        ids = as_row_ids(rows, self.n_obs, self.describe())
        out = np.empty(ids.size, dtype=object)
        for shard, positions, local in split_by_shard(ids, self.shard_offsets):
            out[positions] = self._shard_obs_names(shard)[local]
        return pd.Index(out, dtype=object)

    def _shard_obs_names(self, shard: int) -> np.ndarray | RawStringArray:
        cache: dict[int, np.ndarray | RawStringArray] = self.__dict__.setdefault(
            "_obs_names", {})
        names = cache.get(shard)
        if names is None:
            names = self._read_obs_names(shard)
            if isinstance(names, np.ndarray):
                names.flags.writeable = False
            cache[shard] = names
        return names

    def _read_obs_names(self, shard: int) -> np.ndarray | RawStringArray:
        """The obs_names of ``shard`` (read once, then cached): an object array of str, or
        a :class:`~annbatch_torch.store.rawstrings.RawStringArray` that decodes the names
        asked for (``names[positions]``)."""
        raise NotImplementedError

    def _obs_fields(self) -> dict[str, FieldInfo]:
        """Every obs column's schema, in order (a collection's manifest may record more
        than it offers as fields)."""
        return {k: v for k, v in self.fields.items() if k.startswith("obs/")}

    def _obs_column(self, column: str, categorical: bool = False) -> tuple[str, FieldInfo]:
        """``(field, schema)`` of obs column ``column`` (``"cell_type"`` or
        ``"obs/cell_type"``), or a :class:`SchemaError` listing the columns."""
        if not isinstance(column, str):
            raise SchemaError(f"{self.describe()}: obs column names are strings, got {column!r}.")
        key = column if column.startswith("obs/") else f"obs/{column}"
        known = self._obs_fields()
        info = known.get(key)
        if info is not None and (info.kind == "categorical" or not categorical):
            return key, info
        cols = [k[4:] for k, v in known.items() if v.kind == "categorical" or not categorical]
        what = "categorical obs column" if categorical else "obs column"
        why = (f" ({self.unavailable[key]})" if key in self.unavailable else
               f" (it is {info.kind!r})" if info is not None else "")
        whose = "the collection" if self.PART == "shard" else "the inputs"
        raise SchemaError(
            f"{self.describe()}: {column!r} is not a {what} of {whose}{why}; "
            f"{what}s are {cols}."
        )

    def _global_codes(self, shard: int, key: str, codes: np.ndarray, n_categories: int,
                      start: int = 0) -> np.ndarray:
        """Codes of categorical ``key`` read from ``shard``, checked, as global codes (an
        input read in place stores its own: :meth:`code_map` maps them)."""
        table = self.code_map(shard, key)
        n_local = n_categories if table is None else len(table) - 1
        check_codes(codes, n_local, self.shard_name(shard), key, start)
        return codes if table is None else table[codes.astype(np.int64, copy=False)]

    @reads_metadata
    def obs_at(self, rows: Any, columns: str | Sequence[str] | None = None) -> pd.DataFrame:
        """obs columns of global row ids ``rows``, without reading ``X``.

        Parameters
        ----------
        rows
            Integer array-like of global row ids, any order, duplicates allowed (see
            :meth:`obs_names_at`).
        columns
            obs column names (``"cell_type"`` or ``"obs/cell_type"``); one name or a list.
            ``None``: every obs column the source offers, in its order (a collection's
            manifest order; in place, the first input's column order).

        Returns
        -------
        pandas.DataFrame
            One row per id, in the order of ``rows``, indexed by the cells' obs_names
            (repeated names included, see :meth:`obs_names_at`); categorical columns as
            :class:`pandas.Categorical` with the source's global categories (and its
            ``ordered``; missing values NaN), numeric and bool columns with the field's
            dtype. A collection and the inputs it was written from give equal frames for
            the same cells.

        Raises
        ------
        SchemaError
            If a column is not an obs column of the source (the message lists them).
        IndexError
            If an id lies outside ``[0, n_obs)``.
        """
        ids = as_row_ids(rows, self.n_obs, self.describe())
        if columns is None:
            keys = list(self._obs_fields())
        else:
            names = [columns] if isinstance(columns, str) else list(columns)
            keys = [self._obs_column(c)[0] for c in names]
        parts = split_by_shard(ids, self.shard_offsets)
        infos = self._obs_fields()
        data: dict[str, Any] = {}
        for key in keys:
            info = infos[key]
            n_cats = len(info.categories or ())
            dtype = np.dtype(np.int64) if info.kind == "categorical" else np.dtype(info.dtype)
            out = np.empty(ids.size, dtype=dtype)
            for shard, positions, local in parts:
                values = gather(self.element(shard, key), local)
                if info.kind == "categorical":
                    values = self._global_codes(shard, key, values, n_cats)
                out[positions] = values
            data[key[4:]] = (as_categorical(out, info.categories or (), info.ordered)
                             if info.kind == "categorical" else out)
        return pd.DataFrame(data, index=self.obs_names_at(ids))

    @reads_metadata
    def category_counts(self, column: str) -> pd.Series:
        """Cells per category of categorical obs ``column``, counted from the shards' codes.

        Reads the codes arrays only (in place, a string column's values), a block of whole
        chunks at a time, never ``X``; the result is cached in this object (a copy is
        returned).

        Parameters
        ----------
        column
            A categorical obs column (``"cell_type"`` or ``"obs/cell_type"``).

        Returns
        -------
        pandas.Series
            int64 counts named ``"count"``, indexed by the source's global categories in
            their order (:meth:`~annbatch_torch.Source.categories`), categories without
            cells included (0). Cells with a missing value (code -1) are counted under one
            more entry, ``NaN``, last, present only when there are any (as
            ``value_counts(dropna=False)`` counts them).

        Raises
        ------
        SchemaError
            If ``column`` is not a categorical obs column (the message lists them).
        """
        key, info = self._obs_column(column, categorical=True)
        cache: dict[str, pd.Series] = self.__dict__.setdefault("_counts", {})
        if key not in cache:
            cats = list(info.categories or ())
            counts = np.zeros(len(cats) + 1, dtype=np.int64)
            for shard in range(len(self.shard_sizes)):
                el = self.element(shard, key)
                where = self.shard_name(shard)
                if not isinstance(el, CategoricalElement):
                    raise CollectionError(
                        f"{where}: {key!r} is not stored as a categorical; {self.DAMAGE_FIX}")
                table = self.code_map(shard, key)
                if table is None:
                    counts += count_codes(el, len(cats), where, key)
                else:  # local codes: entry 0 the missing ones, 1 + c local category c
                    local = count_codes(el, len(table) - 1, where, key)
                    np.add.at(counts, np.r_[0, table[:-1].astype(np.int64) + 1], local)
            labels, values = cats, counts[1:]
            if counts[0]:
                labels, values = [*cats, MISSING_CATEGORY], np.r_[counts[1:], counts[0]]
            cache[key] = pd.Series(values, index=pd.Index(labels, name=key[4:]), name="count")
            logger.debug("%s: counted %d cells of %r", self.describe(), counts.sum(), key)
        return cache[key].copy()
