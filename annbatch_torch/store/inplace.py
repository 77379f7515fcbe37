"""Turning what users pass as ``source`` into a :class:`~.collection.Source`.

Besides written collections, AnnData inputs can be read *in place*
(:class:`InPlaceSource`): ``.h5ad`` files through h5py, AnnData zarr stores through
zarr, and in-memory ``AnnData`` objects, opened as the writer opens them
(:mod:`.inputs`), each field harmonised across inputs by the writer's rules
(:mod:`.harmonize`). No offline shuffle is needed, but chunk reads hit
the inputs' own layout: h5ad datasets are usually stored contiguously or in large
compressed chunks, so each random chunk read decompresses more than it uses, and an
input sorted by cell type needs small chunks and large pools to mix well. Expect several
times lower throughput than a collection (see ``benchmarks/README.md``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..errors import CollectionError, InputError
from .collection import MAX_LABEL_CATEGORIES, Source, open_collection, too_many_categories
from .elements import (
    CategoricalElement,
    CSCElement,
    CSRElement,
    Element,
    StringElement,
    element_from_memory,
    read_index,
)
from .harmonize import MATRIX_KINDS, InputField, harmonize_field
from .inputs import input_label, open_store, resolve_input
from .manifest import MANIFEST_NAME, FieldInfo

__all__ = ["InPlaceSource", "as_source"]

#: how an in-place user leaves a field out, ending the fix of a refusal
_OMIT = "leave it out of the selector"


def _names(items: Sequence[str], limit: int = 3) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit
                                       else "")


def _memory_value(adata: Any, field: str) -> Any:
    if field == "X":
        return adata.X
    kind, _, key = field.partition("/")
    container = getattr(adata, kind)
    return container[key]


class InPlaceSource(Source):
    """AnnData inputs read where they are; each input is one "shard".

    All inputs must share the same var_names (in the same order); categorical obs columns
    get global categories (the union across inputs) and codes are remapped on read.

    Parameters
    ----------
    inputs
        ``.h5ad`` paths, AnnData zarr store paths, or ``AnnData`` objects (backed ones are
        reopened from their file, so obs edits made in memory are not seen; views of backed
        objects are refused with the fix).
    """

    def __init__(self, inputs: Sequence[Any]) -> None:
        super().__init__()
        if not inputs:
            raise InputError("No inputs given; pass at least one .h5ad/.zarr path or AnnData.")
        self._paths: list[Path | None] = []
        self._memory: list[Any] = []
        for i, x in enumerate(inputs):
            target = resolve_input(x, i)
            is_path = isinstance(target, Path)
            self._paths.append(target if is_path else None)
            self._memory.append(None if is_path else target)
        self._inspect()

    def describe(self) -> str:
        return "in-place[" + ", ".join(map(self.shard_name, range(len(self._paths)))) + "]"

    def shard_name(self, shard: int) -> str:
        return input_label(shard, self._paths[shard])

    def _open_shard(self, shard: int) -> Any:
        from .zarrs import read_group

        p = self._paths[shard]
        assert p is not None
        group = open_store(p)
        # zarr arrays decode through zarrs' pipeline if installed
        return read_group(group) if p.is_dir() else group

    def element(self, shard: int, field: str) -> Element:
        adata = self._memory[shard]
        if adata is None:
            return super().element(shard, field)
        self._check_pid()
        key = (shard, field)
        el = self._elements.get(key)
        if el is None:
            el = element_from_memory(_memory_value(adata, field), field)
            self._elements[key] = el
        return el

    def code_map(self, shard: int, field: str) -> np.ndarray | None:
        return self._code_maps.get((shard, field))

    def _input_fields(self, shard: int) -> tuple[dict[str, InputField], pd.Index, int]:
        """What input ``shard`` holds under each field it offers, its var names and rows."""
        where = self.shard_name(shard)
        adata = self._memory[shard]
        if adata is not None:
            has_x = adata.X is not None
            names = [f"layers/{k}" for k in adata.layers]
            names += [f"obsm/{k}" for k in adata.obsm]
            for k in adata.obs.columns:
                if isinstance(k, str):
                    names.append(f"obs/{k}")
                else:  # no field string names it: "obs/7" means the column "7"
                    self._unavailable.setdefault(
                        f"obs/{k}", f"{where}: the obs column name {k!r} is not a string, so "
                        "no field names it. Fix: rename it, e.g. adata.obs.columns = "
                        "adata.obs.columns.astype(str).")
            var_names = pd.Index(adata.var_names.astype(str))
            n_rows = int(adata.n_obs)
        else:
            group = self._open_shard(shard)
            self._handles[shard] = group
            has_x = "X" in group
            names = []
            for kind in ("layers", "obsm"):
                if kind in group:
                    names += [f"{kind}/{k}" for k in group[kind]]
            obs = group["obs"]
            index_key = obs.attrs.get("_index", "_index")
            names += [f"obs/{k}" for k in obs if k != index_key]
            var_names = pd.Index(read_index(group["var"]))
            n_rows = int(obs[index_key].shape[0])
        if has_x:
            names.insert(0, "X")
        else:  # e.g. embeddings only: obsm / obs stay selectable
            self._unavailable.setdefault(
                "X", f"{where} has no X (it is None); select obsm, layers or obs fields.")
        out: dict[str, InputField] = {}
        for name in names:
            try:
                el = self.element(shard, name)
            except InputError as e:
                self._unavailable.setdefault(name, str(e))
                continue
            if isinstance(el, StringElement):
                self._unavailable.setdefault(
                    name,
                    f"{where}: {name!r} holds strings, not categories, so it is no label "
                    "(anndata keeps a string column as strings when every value is distinct, "
                    "e.g. barcodes). Select a categorical column, or store integer ids, e.g. "
                    f"adata.obs['{name.partition('/')[2]}_id'] = "
                    f"adata.obs['{name.partition('/')[2]}'].astype('category').cat.codes.",
                )
                continue
            if isinstance(el, CategoricalElement) and len(el.categories) > MAX_LABEL_CATEGORIES:
                self._unavailable.setdefault(name, too_many_categories(where, name,
                                                                      len(el.categories)))
                continue
            if isinstance(el, CSRElement | CSCElement):
                out[name] = InputField(where, "csr", np.dtype(el.dtype), (el.n_cols,))
            elif isinstance(el, CategoricalElement):
                out[name] = InputField(where, "categorical", np.dtype(el.dtype),
                                       categories=tuple(el.categories), ordered=el.ordered)
            elif el.kind == "dense":
                shape = tuple(getattr(el, "shape", (el.n_rows,))[1:])
                if name.startswith("obs/"):
                    kind = "bool" if el.dtype == bool else "numeric"
                    out[name] = InputField(where, kind, np.dtype(el.dtype))
                else:
                    out[name] = InputField(where, "dense", np.dtype(el.dtype), shape)
            if el.n_rows != n_rows:
                raise InputError(
                    f"{where}: field {name!r} has {el.n_rows} rows but obs has {n_rows}; the "
                    "AnnData is inconsistent, fix or rewrite it."
                )
        return out, var_names, n_rows

    def _inspect(self) -> None:
        self._pid = os.getpid()
        self._code_maps: dict[tuple[int, str], np.ndarray] = {}
        self._unavailable: dict[str, str] = {}
        probed = [self._input_fields(i) for i in range(len(self._paths))]
        per_input = [(f, vn) for f, vn, _ in probed]
        var_names = per_input[0][1]
        for i, (_, vn) in enumerate(per_input):
            if not vn.equals(var_names):
                raise InputError(
                    f"{self.shard_name(i)}: var_names differ from {self.shard_name(0)}'s; in-place "
                    "reading needs one gene order. Write a collection instead: "
                    "create_anndata_collection(inputs, out, var_join='inner' or 'outer')."
                )
        common = set(per_input[0][0])
        for f, _ in per_input[1:]:
            common &= set(f)
        for name in set().union(*(f for f, _ in per_input)) - common:
            lacking = [self.shard_name(i) for i, (f, _) in enumerate(per_input) if name not in f]
            self._unavailable.setdefault(
                name,
                f"it is missing from {_names(lacking)}; in-place reading offers only fields "
                "every input has.",
            )
        fields: dict[str, FieldInfo] = {}
        for name in sorted(common, key=lambda n: (n != "X", n)):
            infos = [f[name] for f, _ in per_input]
            kinds = {i.kind for i in infos}
            if len(kinds) > 1 and kinds <= set(MATRIX_KINDS):
                # dense in one file, sparse in another: a pool mixing them cannot be
                # assembled, so the field is not offered in place (the writer converts)
                desc = [f"{i.where}: {i.kind} {[None, *i.shape]}" for i in infos]
                self._unavailable[name] = (
                    f"the inputs store it differently ({'; '.join(desc)}). Store it the same "
                    "way in every file (e.g. adata.X = scipy.sparse.csr_matrix(adata.X)), or "
                    "write a collection: create_anndata_collection(inputs, out) converts "
                    "every input to one kind."
                )
                continue
            try:
                h = harmonize_field(name, infos, _OMIT)
            except InputError as e:
                self._unavailable[name] = str(e)
                continue
            info = h.info
            if h.code_tables is not None:
                n_cats = len(info.categories or ())
                if n_cats > MAX_LABEL_CATEGORIES:
                    self._unavailable[name] = too_many_categories(self.describe(), name, n_cats)
                    continue
                for shard, table in enumerate(h.code_tables):
                    self._code_maps[(shard, name)] = table
                # the reader remaps every shard's codes to global int64 codes
                info = replace(info, dtype="int64")
            fields[name] = info
        self.fields = fields
        self.var_names = pd.Index(var_names, name="var_names")
        self.shard_sizes = [n for _, _, n in probed]
        self.close()

    def __repr__(self) -> str:
        return f"InPlaceSource({self.describe()}, n_obs={self.n_obs}, fields={list(self.fields)})"


def _looks_like_zarr(p: Path) -> bool:
    return any((p / n).is_file() for n in (".zgroup", "zarr.json", ".zmetadata"))


def as_source(obj: Any) -> Source:
    """Resolve a user ``source`` argument: a Source, a collection folder, or AnnData inputs."""
    if isinstance(obj, Source):
        return obj
    if isinstance(obj, str | os.PathLike):
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

