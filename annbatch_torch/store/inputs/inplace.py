"""Turning what users pass as ``source`` into a :class:`~.collection.Source`.

Besides written collections, AnnData inputs can be read *in place*
(:class:`InPlaceSource`): ``.h5ad`` files through h5py, AnnData zarr stores through
zarr, and in-memory ``AnnData`` objects, opened, probed and named as the writer does
(:mod:`.inputs`), each field picked and harmonised across inputs by the writer's rules
(:func:`~.inputs.plan_fields`, :mod:`.harmonize`), so a field has the kind, dtype and
categories it has in a collection written from the same inputs: X and layers are CSR
(a dense one is read as CSR storing every entry), obsm entries dense, string obs columns
categoricals; and every matrix block read (X, layers, raw/X, obsm) is checked finite as
the writer checks its inputs (NaN or inf refused, naming the input, the row and the column).
Cell metadata (``obs_names``, ``obs_names_at``, ``obs_at``, ``category_counts``) is read as
a collection's is (:class:`~annbatch_torch.store.source.Source`), with the same answers for
the same cells. No offline shuffle is needed, but chunk reads hit the inputs' own layout:
h5ad datasets are usually stored contiguously or in large compressed chunks, so each
random chunk read decompresses more than it uses, and an input sorted by cell type needs
small chunks and large pools to mix well. Expect several times lower throughput than a
collection (see ``benchmarks/README.md``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ...errors import CollectionError, InputError
from ..collection import MAX_LABEL_CATEGORIES, open_collection, too_many_categories
from ..elements import (
    CSCElement,
    CSRElement,
    DenseAsCSRElement,
    DenseElement,
    Element,
    SparseAsDenseElement,
    StringCodesElement,
    element_from_memory,
    open_element,
)
from ..manifest import MANIFEST_NAME, RAW_X, FieldInfo
from ..metadata import shard_obs_names
from ..source import Source, field_node
from .legacy import LegacyStore
from .open import open_store, resolve_input
from .plan import InputNames, nonempty, open_inputs, plan_fields, warn_shared_obs_names
from .view import InputSource

__all__ = ["InPlaceSource", "open_source"]

#: how an in-place user leaves a field out, ending the fix of a refusal
_OMIT = "leave it out of the selector"


def _memory_value(adata: Any, field: str) -> Any:
    if field == "X":
        return adata.X
    if field == RAW_X:
        return adata.raw.X
    kind, _, key = field.partition("/")
    container = getattr(adata, kind)
    return container[key]


class InPlaceSource(Source):
    """AnnData inputs read where they are; each input (with cells) is one "shard".

    All inputs must share the same var_names (in the same order); categorical obs columns
    get global categories (the union across inputs) and codes are remapped on read.

    Parameters
    ----------
    inputs
        ``.h5ad`` paths, AnnData zarr store paths, or ``AnnData`` objects (backed ones are
        reopened from their file, so obs edits made in memory are not seen; views of backed
        objects are refused with the fix). The same input twice is refused; an input
        without cells is skipped with a warning.
    """

    PART = "input"
    DAMAGE_FIX = ("The input may be damaged or truncated (e.g. an interrupted download or "
                  "copy): download or copy it again, or re-save it from its source.")

    def __init__(self, inputs: Sequence[Any]) -> None:
        super().__init__()
        if not inputs:
            raise InputError("No inputs given; pass at least one .h5ad/.zarr path or AnnData.")
        self._pid = os.getpid()
        sources = open_inputs(inputs)
        try:
            self._inspect(sources)
        finally:
            for s in sources:
                s.close()
            self.close()

    def describe(self) -> str:
        return "in-place[" + ", ".join(self._labels) + "]"

    def shard_name(self, shard: int) -> str:
        return self._labels[shard]

    def _open_shard(self, shard: int) -> Any:
        from ..zarrs import read_group

        p = self._paths[shard]
        assert p is not None
        group = open_store(p, legacy_parts=self._legacy.get(shard))
        # zarr arrays decode through zarrs' pipeline if installed
        return read_group(group) if p.is_dir() else group

    def _group(self, shard: int) -> Any:
        group = self._handles.get(shard)
        if group is None:
            group = self._open_shard(shard)
            self._handles[shard] = group
        return group

    def _raw_element(self, shard: int, field: str) -> Element:
        adata = self._memory[shard]
        if adata is not None:
            value = _memory_value(adata, field)
            info = self._planned.get(field)
            if (field.startswith("obs/") and isinstance(value, pd.Series)
                    and (info is None or info.kind == "categorical")
                    and not pd.api.types.is_numeric_dtype(value.dtype)
                    and not pd.api.types.is_bool_dtype(value.dtype)):
                value = value.astype("category")  # strings: as the writer reads them
            return element_from_memory(value, field)
        where = self.shard_name(shard)
        node = field_node(self._group(shard), field, where)
        return open_element(node, field, where)

    def _present(self, shard: int, field: str, el: Element) -> Element:
        """``el`` as the field's kind: a dense X / layer as CSR, a sparse obsm entry as
        dense, a string column as codes of its sorted values (how a collection stores
        them)."""
        info = self._planned.get(field)
        if info is None:
            return el
        where = self.shard_name(shard)
        if info.kind == "csr" and isinstance(el, DenseElement):
            return DenseAsCSRElement(el.array, field, where)
        if info.kind == "dense" and isinstance(el, CSRElement | CSCElement):
            return SparseAsDenseElement(el, field)
        if info.kind == "categorical" and el.kind == "strings":
            return StringCodesElement(el, list(self._local[(shard, field)]), field)
        return el

    def _read_obs_names(self, shard: int) -> np.ndarray:
        adata = self._memory[shard]
        if adata is not None:  # as the writer takes them (InputSource.names)
            return np.asarray(adata.obs_names, dtype=object)
        return shard_obs_names(self.shard_group(shard), self.shard_sizes[shard],
                               self.shard_name(shard))

    def element(self, shard: int, field: str) -> Element:
        self._check_pid()
        key = (shard, field)
        el = self._elements.get(key)
        if el is None:
            el = self._raw_element(shard, field)
            if isinstance(el, CSCElement):  # loaded whole: rows are read from its CSR copy
                el = el.as_csr_element()
            el = self._present(shard, field, el)
            info = self._planned.get(field)
            if info is not None and info.kind in ("csr", "dense"):
                el = _finite(el, field, self.shard_name(shard))
            sizes = self.__dict__.get("shard_sizes")
            if sizes is not None and el.n_rows != sizes[shard]:
                raise CollectionError(
                    f"{self.shard_name(shard)}: field {field!r} has {el.n_rows} rows but obs "
                    f"has {sizes[shard]}; the AnnData is inconsistent, re-save it.")
            self._elements[key] = el
        return el

    def code_map(self, shard: int, field: str) -> np.ndarray | None:
        return self._code_maps.get((shard, field))

    def _inspect(self, all_sources: list[InputSource]) -> None:
        sources = nonempty(all_sources)
        first = pd.Index(sources[0].var_names)
        for s in sources[1:]:
            if not pd.Index(s.var_names).equals(first):
                raise InputError(
                    f"{s.label}: var_names differ from {sources[0].label}'s; in-place "
                    "reading needs one gene order. Write a collection instead: "
                    "create_anndata_collection(inputs, out, var_join='inner' or 'outer')."
                )
        raw_names, raw_why = _raw_var_names(sources)
        if len(sources) > 1:  # one read of every input's names, only to compare them
            warn_shared_obs_names(InputNames.read(sources))
        self._labels = [s.label for s in sources]
        self._paths: list[Path | None] = [s.path for s in sources]
        self._memory: list[Any] = [s.adata for s in sources]
        self._legacy = {i: s.group.parts for i, s in enumerate(sources)
                        if isinstance(s.group, LegacyStore)}
        plan = plan_fields(sources, requested={} if raw_why is None else {"raw": False},
                           warn=False,
                           omit=dict.fromkeys(("X", "layers", "obsm", "obs", "raw"), _OMIT),
                           category_limit=MAX_LABEL_CATEGORIES,
                           too_many=lambda where, name, n: too_many_categories(where, name, n))
        self._unavailable: dict[str, str] = dict(plan.unavailable)
        if raw_why is not None:
            self._unavailable[RAW_X] = raw_why
        self._code_maps: dict[tuple[int, str], np.ndarray] = {}
        self._local: dict[tuple[int, str], tuple[Any, ...]] = {}
        self._planned = {name: h.info for name, h in plan.fields.items()}
        for i, s in enumerate(sources):  # read the opened inputs, not open them again
            if s.group is not None:
                self._handles[i] = s.group
        fields: dict[str, FieldInfo] = {}
        for name, h in plan.fields.items():
            for shard, (table, cats) in enumerate(zip(h.code_tables or (),
                                                      h.local_categories or ())):
                self._code_maps[(shard, name)] = table
                self._local[(shard, name)] = cats
            try:  # open every input's element once: damaged structure is refused here
                for shard in range(len(sources)):
                    self.element(shard, name)
            except (InputError, CollectionError) as e:
                self._unavailable[name] = str(e)
                continue
            # the reader remaps every shard's codes to global int64 codes
            fields[name] = h.info if h.code_tables is None else replace(h.info, dtype="int64")
        self._elements = {}
        self.fields = fields
        self.var_names = pd.Index(first, name="var_names")
        self.raw_var_names = (pd.Index(raw_names, name="raw_var_names")
                              if raw_names is not None and RAW_X in fields else None)
        self.shard_sizes = [s.n_obs for s in sources]

    def __repr__(self) -> str:
        return f"InPlaceSource({self.describe()}, n_obs={self.n_obs}, fields={list(self.fields)})"


class _FiniteValues:
    """The values of a matrix field read in place (a CSR matrix's ``data``, a dense
    array's rows), checked finite on every read as the writer checks its inputs'
    blocks (:func:`~annbatch_torch.store.checks.check_finite`): one vectorised
    ``numpy.isfinite`` over the values read; integer and bool values pass unscanned.

    ``locate(start, pos)``: the input row and column of entry ``pos`` of a read that
    began at ``start`` (what ``__getitem__``'s slice starts at).
    """

    def __init__(self, values: Any, field: str, where: str,
                 locate: Callable[[int, int], tuple[int, int]]) -> None:
        self.values, self.field, self.where, self.locate = values, field, where, locate
        self.shape = tuple(int(s) for s in values.shape)
        self.dtype = np.dtype(values.dtype)
        self._scan = self.dtype.kind in "fc"

    def __getitem__(self, key: Any) -> np.ndarray:
        out = np.asarray(self.values[key])
        if self._scan and not np.isfinite(out).all():
            start = int(key.start or 0) if isinstance(key, slice) else 0
            self._refuse(start, out)
        return out

    def _refuse(self, start: int, out: np.ndarray) -> None:
        flat = out.reshape(-1)
        bad = ~np.isfinite(flat)
        pos = int(np.flatnonzero(bad)[0])
        row, col = self.locate(start, pos)
        raise NonFiniteValues(
            f"{self.where}: field {self.field!r} holds {int(bad.sum())} non-finite value(s) "
            f"(NaN or inf) in the rows read, the first ({flat[pos]}) at row {row}, column "
            f"{col}. Matrices must be finite; create_anndata_collection refuses this input "
            "too. Fix: replace them in the input (e.g. `m.data = np.nan_to_num(m.data)` for a "
            f"sparse matrix, or drop the affected cells) and save it again, or {_OMIT}."
        )


class NonFiniteValues(InputError):
    """An input read in place holds NaN or inf in a matrix: the input's fault, as the
    writer says of it (readers keep this class when they add where they met it; an
    input's damage they report as a :class:`~annbatch_torch.ReadError`)."""


def _finite(el: Element, field: str, where: str) -> Element:
    """``el`` (a matrix field as :meth:`InPlaceSource._present` gives it) reading its values
    through :class:`_FiniteValues`."""
    sparse = el.sparse if isinstance(el, SparseAsDenseElement) else el
    if isinstance(sparse, CSRElement):
        csr = sparse

        def locate_entry(start: int, pos: int) -> tuple[int, int]:
            entry = start + pos
            row = int(np.searchsorted(csr.indptr, entry, side="right")) - 1
            lo, hi = int(csr.indptr[row]), int(csr.indptr[row + 1])  # read by whole rows
            return row, int(np.asarray(csr.indices[lo:hi])[entry - lo])

        csr.data = _FiniteValues(csr.data, field, where, locate_entry)
        return el
    if isinstance(el, DenseElement) and len(el.shape) > 1:
        width = int(np.prod(el.shape[1:])) or 1
        return DenseElement(_FiniteValues(
            el.array, field, where,
            lambda start, pos: (start + pos // width, pos % width)), name=el.name)
    return el


def _raw_var_names(sources: list[InputSource]) -> tuple[pd.Index | None, str | None]:
    """The inputs' one raw gene order, or why raw cannot be read in place (their raw genes
    differ); ``(None, None)`` when some input has no raw (the field plan says so)."""
    if any(s.raw_var_names is None for s in sources):
        return None, None
    first = pd.Index(sources[0].raw_var_names)
    for s in sources[1:]:
        if not pd.Index(s.raw_var_names).equals(first):
            return None, (
                f"{s.label}: raw.var_names differ from {sources[0].label}'s; in-place reading "
                "needs one raw gene order. Write a collection instead (it joins raw genes "
                "like X's): create_anndata_collection(inputs, out)."
            )
    return first, None


def _looks_like_zarr(p: Path) -> bool:
    return any((p / n).is_file() for n in (".zgroup", "zarr.json", ".zmetadata"))


def open_source(obj: Any) -> Source:
    """The :class:`~annbatch_torch.Source` that :class:`~annbatch_torch.AnnBatchDataset`
    reads for ``obj``.

    Parameters
    ----------
    obj
        A :class:`~annbatch_torch.Source` (returned as it is), a collection folder or URL
        (opened with :func:`~annbatch_torch.open_collection`; credentials of a URL from the
        environment), or AnnData inputs read in place: a ``.h5ad`` / AnnData-zarr path, an
        ``AnnData`` (or an object that looks like one), or a list of those.

    Returns
    -------
    Source
        A :class:`~annbatch_torch.Collection` or the inputs read in place; file handles
        open lazily, in every process that reads.

    Raises
    ------
    CollectionError
        A folder that is neither a collection nor an AnnData zarr store, or an unfinished
        collection.
    TypeError
        Anything else.
    """
    if isinstance(obj, Source):
        return obj
    if isinstance(obj, str | os.PathLike):
        from ..remote.location import is_url, url_typo

        if is_url(obj):  # a collection on an object store (credentials from the environment)
            text = os.fspath(obj)
            if url_typo(text) is None and _names_input(text):
                resolve_input(text, 0)  # an AnnData file by URL: raises the download advice
            return open_collection(text)  # a mangled URL (s3:/bucket) is refused there
        p = Path(obj).expanduser()
        if p.is_dir() and (p / MANIFEST_NAME).exists():
            return open_collection(p)
        if p.is_dir() and any(p.glob(MANIFEST_NAME + ".tmp")):
            return open_collection(p)  # raises: unfinished collection
        if p.is_dir() and not _looks_like_zarr(p):
            raise CollectionError(
                f"{p}: neither an annbatch_torch collection ({MANIFEST_NAME} is missing) nor an "
                "AnnData zarr store (no .zgroup / zarr.json). If it is a collection whose write "
                "was interrupted, rewrite it with create_anndata_collection(..., "
                "overwrite=True); otherwise pass the collection folder or .h5ad/.zarr inputs."
            )
        return InPlaceSource([p])
    if isinstance(obj, Sequence) and not isinstance(obj, str | bytes):
        return InPlaceSource(list(obj))
    if hasattr(obj, "obs") and hasattr(obj, "var_names"):
        return InPlaceSource([obj])
    raise TypeError(
        f"source must be a Collection, a collection folder, an AnnData, or a list of .h5ad / "
        f".zarr paths or AnnData objects; got {type(obj).__name__}."
    )


def _names_input(url: str) -> bool:
    """Whether ``url`` names an AnnData input rather than a collection: a ``.h5ad`` object,
    or anything on a plain HTTP server (which holds no collection)."""
    return url.lower().startswith(("http:", "https:")) or url.lower().endswith(".h5ad")
