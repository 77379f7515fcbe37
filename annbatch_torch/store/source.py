"""Sources of rows: the interface the reader pulls row ranges from.

A *source* is an ordered list of "shards" (each a group of AnnData elements with ``n_obs``
rows) plus a schema (``fields``). :class:`~annbatch_torch.store.collection.Collection` is the
on-disk kind; :mod:`annbatch_torch.store.inputs.inplace` builds the same interface over AnnData
inputs read in place.

Handles are opened lazily and per process: a source pickles without any open handle
and reopens in whichever process reads it (safe under ``fork`` and ``spawn``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np
import pandas as pd

from ..errors import CollectionError, SchemaError
from .elements import Element, open_element
from .manifest import FieldInfo

__all__ = ["Source", "field_node"]


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

    @property
    def unavailable(self) -> dict[str, str]:
        """Fields present in the inputs but not offered, with the reason (see check_field)."""
        return dict(self.__dict__.get("_unavailable", {}))
