"""Legacy ``.h5ad`` files (anndata < 0.7), decoded once when opened.

Their obs, var and obsm are HDF5 compound datasets, categories in ``uns['<col>_categories']``:
:class:`LegacyStore` decodes them once into in-memory groups that read as a modern file's; X
and layers, plain datasets or groups of ``data`` / ``indices`` / ``indptr``, are read by rows
as usual.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import InputError
from ..elements import (
    encoding_type,
)

__all__ = ["LegacyStore", "decode_legacy"]


# -- legacy h5ad (anndata < 0.7) ---------------------------------------------------------
class _MemGroup(dict):
    """In-memory members standing in for an h5py / zarr group (keys, ``attrs``)."""

    def __init__(self, members: Mapping[str, Any], attrs: Mapping[str, Any] | None = None):
        super().__init__(members)
        self.attrs = dict(attrs or {})


def _decode(values: np.ndarray) -> np.ndarray:
    if values.dtype.kind in "SO":
        return np.array([v.decode() if isinstance(v, bytes) else v for v in values],
                        dtype=object)
    if values.dtype.kind == "U":
        return values.astype(object)
    return values


def _legacy_frame(ds: Any, uns: Any) -> _MemGroup:
    """A compound dataset (first field: the index) as an AnnData dataframe group; integer
    fields with ``uns['<field>_categories']`` become categoricals (as anndata reads them)."""
    arr = np.asarray(ds[()])
    names = list(arr.dtype.names or ())
    if not names:
        raise InputError(f"{ds.name!r} is not a compound dataset")
    members: dict[str, Any] = {"_index": _decode(np.asarray(arr[names[0]]))}
    for name in names[1:]:
        col = np.asarray(arr[name])
        key = f"{name}_categories"
        cats = None
        if uns is not None and key in uns and col.dtype.kind in "iu":
            cats = _decode(np.atleast_1d(np.asarray(uns[key][()])))
            if not (col < len(cats)).all():  # anndata's test: these are not its codes
                cats = None
        if cats is not None:
            if cats.dtype == object and all(isinstance(v, str) for v in cats):
                cats = cats.astype(str)
            members[name] = _MemGroup({"codes": col.astype(np.int64), "categories": cats},
                                      {"encoding-type": "categorical", "ordered": False})
        else:
            members[name] = _decode(col)
    return _MemGroup(members, {"_index": "_index", "column-order": names[1:],
                               "encoding-type": "dataframe"})


def _legacy_matrix(node: Any) -> Any:
    """A legacy X / layer: a dataset as it is; a group of data / indices / indptr with
    ``h5sparse_format`` attributes with the attributes anndata 0.7+ writes."""
    if not hasattr(node, "keys") or encoding_type(node) is not None:
        return node
    fmt = node.attrs.get("h5sparse_format")
    fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
    if fmt in ("csr", "csc") and "h5sparse_shape" in node.attrs:
        shape = tuple(int(s) for s in node.attrs["h5sparse_shape"])
        return _MemGroup({k: node[k] for k in ("data", "indices", "indptr") if k in node},
                         {"encoding-type": f"{fmt}_matrix", "shape": shape})
    return node


def decode_legacy(root: Any) -> dict[str, Any]:
    """obs, var, raw.var and obsm of a legacy file, decoded into memory (read once per
    input)."""
    uns = root["uns"] if "uns" in root else None  # noqa: SIM401 - h5py groups have no get
    parts: dict[str, Any] = {"obs": _legacy_frame(root["obs"], uns),
                             "var": _legacy_frame(root["var"], uns)}
    if "raw.var" in root and not hasattr(root["raw.var"], "keys"):
        parts["raw.var"] = _legacy_frame(root["raw.var"], uns)
    if "obsm" in root:
        obsm = root["obsm"]
        if hasattr(obsm, "keys"):  # a group already: read its members by rows
            parts["obsm"] = None
        else:
            arr = np.asarray(obsm[()])
            parts["obsm"] = _MemGroup({k: np.asarray(arr[k]) for k in arr.dtype.names or ()})
    return parts


class LegacyStore(_MemGroup):
    """A legacy ``.h5ad`` (anndata < 0.7) presented as a current AnnData store: decoded
    ``obs``, ``var`` and ``obsm`` (:attr:`parts`, kept by callers so a reopen does not
    decode again) and the file's X and layers."""

    def __init__(self, root: Any, parts: dict[str, Any]) -> None:
        members: dict[str, Any] = {"obs": parts["obs"], "var": parts["var"]}
        if parts.get("obsm") is not None:
            members["obsm"] = parts["obsm"]
        elif "obsm" in root:
            members["obsm"] = root["obsm"]
        if "X" in root:
            members["X"] = _legacy_matrix(root["X"])
        if "layers" in root:
            layers = root["layers"]
            members["layers"] = _MemGroup({k: _legacy_matrix(layers[k]) for k in layers})
        if "raw.X" in root:  # raw as anndata < 0.7 wrote it: raw.X, raw.var at the root
            raw = {"X": _legacy_matrix(root["raw.X"])}
            if parts.get("raw.var") is not None:
                raw["var"] = parts["raw.var"]
            members["raw"] = _MemGroup(raw)
        super().__init__(members)
        self.root, self.parts = root, parts

    def close(self) -> None:
        self.root.close()
