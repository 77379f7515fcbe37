"""AnnData inputs: what one is, how it is opened and named, and what it holds.

An input is an ``.h5ad`` path (read with h5py, never loaded whole), an AnnData zarr store
path (``zarr.open_group``) or an in-memory :class:`anndata.AnnData` (or an object that
looks like one: ``obs``, ``var_names``, ``n_obs``, ``X``, ``layers``, ``obsm``; a backed
AnnData is read from its file; a backed view is refused). :func:`resolve_input`,
:func:`open_store` and :func:`input_label` say what an input is, open it (or refuse it with
the fix) and name it, for :func:`~annbatch_torch.create_anndata_collection` and for
in-place reading (:mod:`annbatch_torch.store.inplace`) alike.

:class:`InputSource` is the view of one input both paths share: row count, var names, a
probe of each matrix / obsm / obs column (kind, dtype, shape, categories), its description
for the rules (:meth:`InputSource.describe`), and readers of row blocks.
:func:`plan_fields` picks the fields to offer from the probes of all inputs and harmonises
each by the rules of :mod:`annbatch_torch.store.harmonize`; :func:`open_inputs`,
:func:`nonempty` and :func:`warn_shared_obs_names` are the checks both paths make of a
list of inputs (the same input twice, inputs without cells, obs_names shared by inputs).

Legacy ``.h5ad`` files (anndata < 0.7: obs / var / obsm as HDF5 compound datasets,
categories in ``uns['<col>_categories']``) are read too: their obs, var and obsm are decoded
once when opened (:class:`LegacyStore`); X and layers, plain datasets or groups of
``data`` / ``indices`` / ``indptr``, are read by rows as usual. A damaged or truncated file
is named with the fix (download it again, or re-save it) on both paths.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from ..errors import AnnBatchError, InputError
from .elements import (
    CategoricalElement,
    CSCElement,
    DenseElement,
    Element,
    NullableStringElement,
    StringElement,
    element_from_memory,
    encoding_type,
    open_element,
    read_index,
)
from .fingerprint import fingerprint
from .harmonize import (
    Harmonized,
    InputField,
    empty_input_reason,
    harmonize_field,
    missing_reason,
    name_reason,
    no_x_reason,
    note_strings,
)
from .manifest import RAW_X, field_name_problem, looks_like_collection
from .metadata import read_dataframe

__all__ = [
    "FieldPlan",
    "InputSource",
    "LegacyStore",
    "MatrixProbe",
    "ObsProbe",
    "backed_file",
    "damaged_reason",
    "disk_usage",
    "input_label",
    "nonempty",
    "open_input",
    "open_inputs",
    "open_store",
    "plan_fields",
    "resave_command",
    "resolve_input",
    "warn_shared_obs_names",
]

logger = logging.getLogger(__name__)

_FIX_TYPES = "pass .h5ad files, AnnData zarr stores or anndata.AnnData objects"
#: what an in-memory input must have to be read as an AnnData (duck typing)
_ANNDATA_ATTRS = ("obs", "var_names", "n_obs", "X", "layers", "obsm")


@dataclass(frozen=True)
class MatrixProbe:
    """What an input holds under a matrix field (``X``, ``layers/k``, ``obsm/k``)."""

    kind: str  # "csr", "csc", "dense", "unsupported" or "damaged"
    dtype: np.dtype
    shape: tuple[int, ...]
    nnz: int | None = None  # stored entries of a sparse matrix
    why: str = ""  # what it is when unsupported, what failed when damaged


@dataclass(frozen=True)
class ObsProbe:
    """What an input holds in one obs column."""

    kind: str  # "categorical", "numeric", "bool", "string", "unsupported" or "damaged"
    dtype: np.dtype
    categories: tuple[Any, ...] | None = None
    ordered: bool = False
    why: str = ""
    n_rows: int | None = None


# -- what an input is, and its name ------------------------------------------------------
def backed_file(adata: Any, label: str) -> Path | None:
    """The file of a backed AnnData (read from there: the file's rows, the file's obs), or
    ``None`` for an in-memory one. A backed *view* is refused: reading its file would
    silently take every cell of it, not the view's."""
    if not getattr(adata, "isbacked", False) or getattr(adata, "filename", None) is None:
        return None
    if getattr(adata, "is_view", False):
        raise InputError(
            f"{label}: a view of the backed AnnData {adata.filename} ({adata.n_obs} cells); "
            "backed inputs are read from their file, which would take all of its cells. "
            "Pass view.to_memory() (loads just these cells) or write the subset first "
            "(view.write_h5ad(path)) and pass the path."
        )
    return Path(adata.filename)


def _looks_like_anndata(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in _ANNDATA_ATTRS) and isinstance(
        getattr(obj, "obs", None), pd.DataFrame)


def resolve_input(obj: Any, index: int) -> Path | Any:
    """What input ``index`` is: the path to read (a path as given, ``~`` expanded, or the
    file of a backed AnnData) or an in-memory AnnData (an :class:`anndata.AnnData`, or an
    object with its ``obs``, ``var_names``, ``n_obs``, ``X``, ``layers`` and ``obsm``: a
    wrapper is read through those).

    Raises
    ------
    InputError
        For anything else, and for a view of a backed AnnData (see :func:`backed_file`).
    """
    import anndata as ad

    if isinstance(obj, ad.AnnData) or _looks_like_anndata(obj):
        return backed_file(obj, f"input #{index}") or obj
    if isinstance(obj, str | os.PathLike):
        from .remote import is_url

        if is_url(obj):
            raise InputError(
                f"input #{index} {obj!r}: inputs are read from local (or mounted) files; "
                "download the .h5ad / .zarr first. Collections, not inputs, live on object "
                "stores: create_anndata_collection(inputs, 's3://bucket/prefix').")
        return Path(obj).expanduser()
    raise InputError(f"input #{index}: got a {type(obj).__name__}; {_FIX_TYPES}.")


def input_label(index: int, path: Path | None) -> str:
    """How messages name input ``index``: its resolved absolute path (so a relative path
    reads the same on every path), or ``"<AnnData #index>"``."""
    return str(Path(path).resolve()) if path is not None else f"<AnnData #{index}>"


def resave_command(path: Path | str) -> str:
    """The command that re-saves an AnnData file with the installed anndata."""
    p = Path(path)
    if p.is_dir():
        out = p.with_name(p.stem + ".resaved.zarr")
        return (f"python -c \"import anndata as ad; ad.read_zarr('{p}')"
                f".write_zarr('{out}')\"")
    out = p.with_name(p.stem + ".resaved.h5ad")
    return f"python -c \"import anndata as ad; ad.read_h5ad('{p}').write_h5ad('{out}')\""


def damaged_reason(label: str, what: str, exc: BaseException) -> str:
    """The one message, on both paths, for an input whose bytes cannot be read."""
    p = Path(label)
    again = (f" If it still opens where it came from, re-save it there: "
             f"{resave_command(p)}." if label.startswith(("/", ".")) else "")
    return (f"{label}: cannot read {what} ({type(exc).__name__}: {exc}); the file is damaged "
            "or truncated (e.g. an interrupted download or copy). Fix: download or copy it "
            f"again.{again}")


# -- h5py nodes whose failed reads name the file -----------------------------------------
_H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError)


class _GuardedDataset:
    """An h5py dataset whose failed reads raise :class:`InputError` naming the file, the
    node and the fix (h5py's own errors name neither)."""

    def __init__(self, node: Any, label: str) -> None:
        self._node, self._label = node, label

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)

    def __len__(self) -> int:
        return len(self._node)

    def __getitem__(self, key: Any) -> Any:
        try:
            return self._node[key]
        except _H5_ERRORS as e:
            raise InputError(damaged_reason(self._label, f"{self._node.name!r}", e)) from e

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[()]
        return np.asarray(out, dtype=dtype)


class _GuardedGroup:
    """An h5py group (or file) whose children are guarded (see :class:`_GuardedDataset`)."""

    def __init__(self, node: Any, label: str) -> None:
        self._node, self._label = node, label

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)

    def __contains__(self, key: Any) -> bool:
        try:
            return key in self._node
        except _H5_ERRORS as e:
            raise InputError(damaged_reason(self._label, f"{self._node.name!r}", e)) from e

    def __iter__(self) -> Any:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def keys(self) -> list[str]:
        try:
            return list(self._node.keys())
        except _H5_ERRORS as e:
            raise InputError(damaged_reason(self._label, f"{self._node.name!r}", e)) from e

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        try:
            return _guard(self._node[key], self._label)
        except _H5_ERRORS as e:
            raise InputError(damaged_reason(self._label, f"{key!r}", e)) from e


def _guard(node: Any, label: str) -> Any:
    import h5py

    if isinstance(node, h5py.Dataset):
        return _GuardedDataset(node, label)
    if isinstance(node, h5py.Group):
        return _GuardedGroup(node, label)
    return node


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


def _decode_legacy(root: Any) -> dict[str, Any]:
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


# -- opening -----------------------------------------------------------------------------
def _not_hdf5(path: Path) -> str:
    if path.suffix.lower() in (".h5ad", ".h5", ".hdf5"):
        return (f"{path}: not an HDF5 file, though named {path.suffix} (damaged, truncated or "
                f"of another format); {_FIX_TYPES}.")
    return f"{path}: is neither an HDF5 (.h5ad) file nor a zarr store; {_FIX_TYPES}."


def open_store(path: Path, *, chunk_cache: bool = True,
               legacy_parts: dict[str, Any] | None = None) -> Any:
    """Open the ``.h5ad`` file or AnnData zarr store at ``path`` read-only.

    Parameters
    ----------
    path
        A file (HDF5) or a folder (zarr v2/v3).
    chunk_cache
        Keep h5py's chunk cache (~1 MB per dataset). Off for inputs read once in large
        sequential slices, as the writer does.
    legacy_parts
        A legacy file's decoded obs / var / obsm from an earlier open
        (:attr:`LegacyStore.parts`), so it is not decoded again.

    Returns
    -------
    An open h5py file (its reads name the file when they fail; close it when done), a
    :class:`LegacyStore` for a legacy ``.h5ad``, or a ``zarr.Group``. It has ``obs`` and
    ``var``; ``X`` may be absent (an AnnData whose X is None).

    Raises
    ------
    InputError
        If ``path`` is missing, neither HDF5 nor zarr, damaged, or not an AnnData store.
    """
    label = input_label(0, path)
    if not path.exists():
        raise InputError(f"{path}: no such file or folder; check the path ({_FIX_TYPES}).")
    if path.is_dir():
        import zarr

        if looks_like_collection(path):
            raise InputError(
                f"{path}: is an annbatch_torch collection, not an AnnData input. Read it with "
                "AnnBatchDataset(path) or open_collection(path); to write a new collection, "
                "pass the inputs it was written from (its manifest lists them under 'inputs').")
        try:
            group: Any = zarr.open_group(str(path), mode="r")
        except Exception as e:
            raise InputError(f"{path}: is a folder but not a zarr store ({type(e).__name__}: "
                             f"{e}); {_FIX_TYPES}.") from e
        if "obs" in group and not hasattr(group["obs"], "keys"):
            raise InputError(
                f"{path}: obs is a single array, the layout of anndata < 0.7, which is read "
                f"from .h5ad files only. Fix: re-save it: {resave_command(path)}")
    else:
        import h5py

        if not h5py.is_hdf5(str(path)):
            raise InputError(_not_hdf5(path))
        try:
            # without the cache, a dataset read once in large slices does not hold ~9 MB
            # (cache plus HDF5 free lists) per open dataset
            raw = h5py.File(str(path), "r", **({} if chunk_cache else {"rdcc_nbytes": 0}))
        except OSError as e:
            raise InputError(damaged_reason(label, "the file", e)) from e
        group = _GuardedGroup(raw, label)
        try:
            if "obs" in group and "var" in group and isinstance(raw["obs"], h5py.Dataset):
                try:
                    parts = legacy_parts or _decode_legacy(group)
                except InputError:
                    raise
                except Exception as e:  # a layout this reader does not know
                    raise InputError(
                        f"{label}: a file written by anndata < 0.7 whose obs / var cannot be "
                        f"decoded ({type(e).__name__}: {e}). Fix: re-save it with the "
                        f"installed anndata: {resave_command(path)}") from e
                group = LegacyStore(group, parts)
        except BaseException:
            raw.close()
            raise
    keys = set(group.keys())
    if not {"obs", "var"} <= keys:
        if hasattr(group, "close"):
            group.close()
        missing = sorted({"obs", "var", "X"} - keys)
        raise InputError(f"{path}: not an AnnData store (no {missing} at its root); "
                         f"{_FIX_TYPES}.")
    return group


# -- probes: what an input stores under a field ------------------------------------------
def _is_group(node: Any) -> bool:
    return hasattr(node, "keys") and not hasattr(node, "dtype")


def _probe_disk_matrix(node: Any) -> MatrixProbe:
    enc = encoding_type(node)
    if _is_group(node):
        if enc in ("csr_matrix", "csc_matrix") and "data" in node and "shape" in node.attrs:
            shape = tuple(int(s) for s in node.attrs["shape"])
            return MatrixProbe(enc[:3], np.dtype(node["data"].dtype), shape,
                               int(node["data"].shape[0]))
        return MatrixProbe("unsupported", np.dtype("f4"), (), why=f"encoding {enc!r}")
    return MatrixProbe("dense", np.dtype(node.dtype), tuple(int(s) for s in node.shape))


def _probe_memory_matrix(value: Any) -> MatrixProbe:
    if sp.issparse(value):
        if value.format in ("csr", "csc"):
            return MatrixProbe(value.format, np.dtype(value.dtype), tuple(value.shape),
                               value.nnz)
        return MatrixProbe("unsupported", np.dtype(value.dtype), tuple(value.shape),
                           why=f"a scipy.sparse {value.format} matrix")
    if isinstance(value, pd.DataFrame):
        value = value.to_numpy()
    if isinstance(value, np.ndarray):
        return MatrixProbe("dense", value.dtype, tuple(value.shape))
    return MatrixProbe("unsupported", np.dtype("f4"), (), why=f"type {type(value).__name__}")


def _probe_disk_obs(node: Any) -> ObsProbe:
    enc = encoding_type(node)
    if enc == "categorical":
        el = open_element(node, "obs")
        return ObsProbe("categorical", np.dtype(node["codes"].dtype),
                        tuple(el.categories),  # type: ignore[attr-defined]
                        bool(node.attrs.get("ordered", False)), n_rows=el.n_rows)
    if enc in ("nullable-integer", "nullable-boolean"):
        n = int(node["values"].shape[0])
        if bool(np.asarray(node["mask"][...]).any()):
            return ObsProbe("numeric", np.dtype("f8"), n_rows=n)
        dt = np.dtype(node["values"].dtype)
        return ObsProbe("bool" if dt.kind == "b" else "numeric", dt, n_rows=n)
    if enc == "nullable-string-array":
        return ObsProbe("string", np.dtype(object), n_rows=int(node["values"].shape[0]))
    if _is_group(node):
        return ObsProbe("unsupported", np.dtype(object), why=f"encoding {enc!r}")
    dt, n = np.dtype(node.dtype), int(node.shape[0]) if node.shape else 0
    if enc == "string-array" or dt.kind in "SUOT":
        return ObsProbe("string", np.dtype(object), n_rows=n)
    if len(node.shape) != 1 or dt.kind not in "biuf":
        return ObsProbe("unsupported", dt, why=f"dtype {dt} with {len(node.shape)} dims",
                        n_rows=n)
    return ObsProbe("bool" if dt.kind == "b" else "numeric", dt, n_rows=n)


def _probe_memory_obs(s: pd.Series) -> ObsProbe:
    dt, n = s.dtype, len(s)
    if isinstance(dt, pd.CategoricalDtype):
        codes_dtype = s.cat.codes.dtype
        return ObsProbe("categorical", np.dtype(codes_dtype), tuple(dt.categories.tolist()),
                        bool(dt.ordered), n_rows=n)
    if pd.api.types.is_bool_dtype(dt) and not s.hasnans:
        return ObsProbe("bool", np.dtype(bool), n_rows=n)
    if isinstance(dt, pd.DatetimeTZDtype):
        return ObsProbe("unsupported", np.dtype("M8[ns]"), why=f"dtype {dt}", n_rows=n)
    if pd.api.types.is_numeric_dtype(dt) or pd.api.types.is_bool_dtype(dt):
        base = dt if isinstance(dt, np.dtype) else np.dtype(dt.numpy_dtype)
        if s.hasnans and base.kind != "f":  # missing integers / booleans: float64 NaN
            base = np.dtype("f8")
        return ObsProbe("numeric", base, n_rows=n)
    if isinstance(dt, np.dtype) and dt.kind in "mM":
        return ObsProbe("unsupported", dt, why=f"dtype {dt}", n_rows=n)
    if pd.api.types.is_string_dtype(dt) or dt is np.dtype(object):
        return ObsProbe("string", np.dtype(object), n_rows=n)
    return ObsProbe("unsupported", np.dtype(object), why=f"dtype {dt}", n_rows=n)


def _damaged(probe_cls: type, e: InputError) -> Any:
    if probe_cls is MatrixProbe:
        return MatrixProbe("damaged", np.dtype("f4"), (), why=str(e))
    return ObsProbe("damaged", np.dtype(object), why=str(e))


# -- readers of row blocks (the writer) --------------------------------------------------
class _LazyCSR:
    """On-disk CSR read by row blocks; ``indptr`` is read per block, never whole."""

    def __init__(self, group: Any) -> None:
        self.data, self.indices, self.indptr_node = group["data"], group["indices"], group["indptr"]
        self.n_cols = int(group.attrs["shape"][1])

    def indptr(self, a: int, b: int) -> np.ndarray:
        return np.asarray(self.indptr_node[a : b + 1], dtype=np.int64)

    def read(self, a: int, b: int, ip: np.ndarray | None = None) -> sp.csr_matrix:
        ip = self.indptr(a, b) if ip is None else ip
        lo, hi = int(ip[0]), int(ip[-1])
        return sp.csr_matrix(
            (np.asarray(self.data[lo:hi]), np.asarray(self.indices[lo:hi]), ip - lo),
            shape=(b - a, self.n_cols),
        )


class _MemCSR(_LazyCSR):
    def __init__(self, m: sp.csr_matrix) -> None:
        self.data, self.indices, self.indptr_node = m.data, m.indices, m.indptr
        self.n_cols = int(m.shape[1])


class _Dense:
    def __init__(self, array: Any) -> None:
        self.array = array
        self.n_cols = int(array.shape[1])

    def indptr(self, a: int, b: int) -> None:
        return None

    def read(self, a: int, b: int, ip: Any = None) -> np.ndarray:
        return np.asarray(self.array[a:b])


# -- one input ---------------------------------------------------------------------------
class InputSource:
    """One input, opened read-only: the view the writer and in-place reading share.

    Attributes
    ----------
    index
        Position in the list of inputs.
    label
        Its path (or ``"<AnnData #i>"``), used in every message.
    path
        Absolute path, or ``None`` for an in-memory AnnData.
    kind
        ``"h5ad"``, ``"zarr"`` or ``"memory"``.
    n_obs
        Number of rows.
    var_names
        Its var names (unique, else :class:`InputError`).
    matrices, obsm, obs
        Probes of ``X`` (absent when X is None) and ``layers/<k>``, of ``obsm/<k>`` and
        of obs columns.
    legacy
        Whether it is a legacy ``.h5ad`` (anndata < 0.7).
    """

    def __init__(self, obj: Any, index: int, *, chunk_cache: bool = False) -> None:
        self.index = index
        self._h5: Any = None
        self.adata: Any = None
        self.group: Any = None
        self.legacy = False
        target = resolve_input(obj, index)
        if isinstance(target, Path):
            self.path = target.resolve()
            self.label = input_label(index, self.path)
            self._open_disk(chunk_cache)
            try:
                self._probe_disk()
            except InputError:
                self.close()
                raise
            except (OSError, RuntimeError, KeyError) as e:  # e.g. a zarr store's bytes
                self.close()
                raise InputError(damaged_reason(self.label, "obs / var", e)) from e
        else:
            self.adata, self.path, self.kind = target, None, "memory"
            self.label = input_label(index, None)
            self._probe_memory()
        names = pd.Index(self.var_names)
        if not names.is_unique:
            self.close()
            dup = names[names.duplicated()].unique()[:5].tolist()
            raise InputError(
                f"{self.label}: var_names are not unique (e.g. {dup}); genes cannot be aligned. "
                "Fix: adata.var_names_make_unique() (or drop the duplicates) and save it again."
            )
        raw_names = None if self.raw_var_names is None else pd.Index(self.raw_var_names)
        if raw_names is not None and not raw_names.is_unique:
            dup = raw_names[raw_names.duplicated()].unique()[:5].tolist()
            self.matrices[RAW_X] = MatrixProbe("damaged", np.dtype(np.float32), (), why=(
                f"{self.label}: raw.var_names are not unique (e.g. {dup}); raw genes cannot "
                "be aligned. Fix: adata.raw.var_names_make_unique() (or drop the duplicates) "
                "and save it again"))

    # -- opening --------------------------------------------------------------------
    def _open_disk(self, chunk_cache: bool) -> None:
        assert self.path is not None
        # the writer reads rows once: no chunk cache
        self.group = open_store(self.path, chunk_cache=chunk_cache)
        self.kind = "zarr" if self.path.is_dir() else "h5ad"
        self._h5 = self.group if self.kind == "h5ad" else None
        self.legacy = isinstance(self.group, LegacyStore)

    def _probe_disk(self) -> None:
        g = self.group
        self.var_names = read_index(g["var"])
        self._obs_index = g["obs"][_attr_str(g["obs"].attrs.get("_index", "_index"))]
        self.n_obs = int(self._obs_index.shape[0])
        self.matrices: dict[str, MatrixProbe] = {}
        self.obsm: dict[str, MatrixProbe] = {}
        if "X" in g:
            self.matrices["X"] = self._safe(MatrixProbe, _probe_disk_matrix, lambda: g["X"])
        self.raw_var_names = None
        if "raw" in g and _is_group(g["raw"]) and "X" in g["raw"]:
            raw = g["raw"]
            try:
                self.raw_var_names = read_index(raw["var"])
            except (KeyError, ValueError, TypeError, OSError) as e:
                self.matrices[RAW_X] = MatrixProbe(
                    "damaged", np.dtype(np.float32), (), why=damaged_reason(
                        self.label, "raw/var", e))
            else:
                self.matrices[RAW_X] = self._safe(MatrixProbe, _probe_disk_matrix,
                                                  lambda: raw["X"])
        for key, sub in (("layers", self.matrices), ("obsm", self.obsm)):
            if key in g:
                for k in g[key]:
                    sub[f"{key}/{k}"] = self._safe(MatrixProbe, _probe_disk_matrix,
                                                   lambda key=key, k=k: g[key][k])
        obs = g["obs"]
        index_key = _attr_str(obs.attrs.get("_index", "_index"))
        order = [_attr_str(c) for c in obs.attrs.get("column-order", [])]
        order += [k for k in obs if k not in order and k != index_key
                  and k != "__categories"]
        self.obs = {c: self._safe(ObsProbe, _probe_disk_obs, lambda c=c: obs[c])
                    for c in order}

    @staticmethod
    def _safe(probe_cls: type, probe: Any, node: Any) -> Any:
        try:
            return probe(node())
        except InputError as e:
            return _damaged(probe_cls, e)

    def _probe_memory(self) -> None:
        a = self.adata
        self.var_names = np.asarray(a.var_names, dtype=object)
        self.n_obs = int(a.n_obs)
        self.matrices = {} if a.X is None else {"X": _probe_memory_matrix(a.X)}
        self.matrices.update({f"layers/{k}": _probe_memory_matrix(v) for k, v in a.layers.items()})
        self.obsm = {f"obsm/{k}": _probe_memory_matrix(v) for k, v in a.obsm.items()}
        self.obs = {c: _probe_memory_obs(a.obs[c]) for c in a.obs.columns}  # names as they are
        self.raw_var_names = None
        if a.raw is not None:
            self.matrices[RAW_X] = _probe_memory_matrix(a.raw.X)
            self.raw_var_names = np.asarray(a.raw.var_names, dtype=object)

    # -- what it holds --------------------------------------------------------------
    @property
    def has_x(self) -> bool:
        return "X" in self.matrices

    def keys(self, group: str) -> list[Any]:
        """Its keys of ``group`` (``"layers"``, ``"obsm"``, ``"obs"``), in its order."""
        if group == "obs":
            return list(self.obs)
        probes = self.obsm if group == "obsm" else self.matrices
        return [k.partition("/")[2] for k in probes if k.startswith(f"{group}/")]

    def has(self, group: str, key: Any) -> bool:
        """Whether it stores ``key`` of ``group`` (``"X"``, ``"layers"``, ``"obsm"``,
        ``"obs"``)."""
        if group == "X":
            return self.has_x
        if group == "obs":
            return key in self.obs
        return f"{group}/{key}" in (self.obsm if group == "obsm" else self.matrices)

    def describe(self, field: str, column: Any = None) -> InputField:
        """What it holds under ``field``, for the rules of :mod:`.harmonize` (an obs column
        with a non-string name is passed as ``column``)."""
        where = self.label
        if field in ("X", RAW_X) or field.startswith(("layers/", "obsm/")):
            p = self.matrices.get(field) or self.obsm[field]
            if p.kind in ("unsupported", "damaged"):
                return self._unsupported(field, p.kind, p.dtype, p.why)
            shape = p.shape
            n_genes = len(self.raw_var_names if field == RAW_X else self.var_names)
            if not shape or shape[0] != self.n_obs or (not field.startswith("obsm/") and (
                    len(shape) != 2 or shape[1] != n_genes)):
                want = (f"{self.n_obs} rows" if field.startswith("obsm/") else
                        f"{self.n_obs} x {n_genes}")
                of = "its raw" if field == RAW_X else "the AnnData"
                return InputField(where, "damaged", p.dtype, why=(
                    f"{where}: {field} has shape {shape} but {of} is {self.n_obs} x "
                    f"{n_genes} (expected {want}); the file is inconsistent or "
                    f"damaged. Fix: re-save it from its source"))
            return InputField(where, p.kind, p.dtype, tuple(int(s) for s in shape[1:]))
        col = field[4:] if column is None else column
        p = self.obs[col]
        if p.kind in ("unsupported", "damaged"):
            return self._unsupported(field, p.kind, p.dtype, p.why)
        if p.n_rows is not None and p.n_rows != self.n_obs:
            return InputField(where, "damaged", p.dtype, why=(
                f"{where}: {field} has {p.n_rows} rows but obs has {self.n_obs}; the file is "
                "inconsistent or damaged. Fix: re-save it from its source"))
        max_value = None
        if p.kind == "numeric" and p.dtype == np.uint64 and self.n_obs:
            max_value = self._column_max(col)
        return InputField(where, p.kind, p.dtype, categories=p.categories, ordered=p.ordered,
                          max_value=max_value)

    def _unsupported(self, field: str, kind: str, dtype: np.dtype, why: str) -> InputField:
        if kind == "damaged":
            return InputField(self.label, "damaged", dtype, why=why.rstrip("."))
        if self.legacy:
            why += (f" (in a file written by anndata < 0.7; re-save it with the installed "
                    f"anndata to read it: {resave_command(self.path or '')})")
        return InputField(self.label, "unsupported", dtype, why=why)

    def _column_max(self, column: Any, block: int = 1 << 22) -> int:
        el = self.obs_reader(column)
        top = 0
        for a in range(0, self.n_obs, block):
            v = np.asarray(el.read(a, min(self.n_obs, a + block)))
            if v.size:
                top = max(top, int(v.max()))
        return top

    # -- readers --------------------------------------------------------------------
    def _value(self, key: str) -> Any:
        if self.adata is None:
            kind, _, k = key.partition("/")
            return self.group[kind][k] if k else self.group[kind]
        if key == "X":
            return self.adata.X
        if key == RAW_X:
            return self.adata.raw.X
        kind, _, k = key.partition("/")
        v = getattr(self.adata, kind)[k]
        return v.to_numpy() if isinstance(v, pd.DataFrame) else v

    def matrix_reader(self, key: str, csc_limit: int) -> Any:
        """A reader with ``indptr(a, b)`` (or None for dense) and ``read(a, b, indptr)``."""
        probe = self.matrices.get(key) or self.obsm[key]
        value = self._value(key)
        if probe.kind == "csr":
            return _MemCSR(value) if self.adata is not None else _LazyCSR(value)
        if probe.kind == "csc":
            if self.adata is not None:
                return _MemCSR(value.tocsr())
            fix = ("or raise max_memory: a CSC input is held whole and converted to CSR, "
                   "which takes about 4x its size of the writer's working memory.")
            return _MemCSR(CSCElement(value, key, self.label, limit=csc_limit, fix=fix)._csr)
        return _Dense(value)

    def obs_reader(self, column: Any) -> Element:
        """An :class:`Element` over obs ``column``: codes (categorical, and in-memory
        strings, which become categorical with sorted categories), values, or strings."""
        probe = self.obs[column]
        name = f"obs/{column}"
        if self.adata is not None:
            s = self.adata.obs[column]
            if probe.kind in ("categorical", "string"):
                return element_from_memory(s.astype("category"), name)
            na = {"na_value": np.nan} if probe.dtype.kind == "f" else {}
            return DenseElement(s.to_numpy(dtype=probe.dtype, **na), name=name)
        node = self.group["obs"][column]
        if encoding_type(node) == "nullable-string-array":
            return NullableStringElement(node, name)
        return open_element(node, name, self.label)

    def string_categories(self, column: Any, limit: int | None = None,
                          block: int = 1 << 20) -> list[Any]:
        """Sorted distinct values of a string obs column (streamed in blocks on disk); the
        scan stops once more than ``limit`` values are found."""
        el = self.obs_reader(column)
        if isinstance(el, CategoricalElement):
            return list(el.categories)
        seen: set[Any] = set()
        for a in range(0, self.n_obs, block):
            seen.update(pd.unique(el.read(a, min(self.n_obs, a + block))))
            if limit is not None and len(seen) > limit + 1:
                break
        return sorted(v for v in seen if isinstance(v, str))

    def named_read(self, what: str, read: Callable[[], Any]) -> Any:
        """``read()``, whose failure to read bytes (a damaged chunk of a zarr input, say)
        becomes an :class:`InputError` naming this input, ``what`` and the fix."""
        try:
            return read()
        except AnnBatchError:
            raise
        except _H5_ERRORS as e:
            raise InputError(damaged_reason(self.label, what, e)) from e

    def var_frame(self, raw: bool = False) -> pd.DataFrame:
        """Its ``var`` dataframe (gene metadata, one row per var name; ``raw``: that of its
        ``raw``); columns it cannot read are left out with a warning, as
        :func:`~annbatch_torch.store.metadata.read_dataframe` does."""
        names = self.raw_var_names if raw else self.var_names
        if self.adata is not None:
            return (self.adata.raw.var if raw else self.adata.var).copy()
        what = "raw/var" if raw else "var"
        try:
            group = self.group["raw"]["var"] if raw else self.group["var"]
            return read_dataframe(group, len(names), self.label, what)
        except (AnnBatchError, OSError, KeyError, ValueError) as e:
            logger.warning("%s: its %s columns are not read (%s: %s).", self.label, what,
                           type(e).__name__, e)
            return pd.DataFrame(index=pd.Index(names, dtype=object))

    def names(self, a: int, b: int) -> np.ndarray:
        """obs_names of rows ``[a, b)`` as an object array of str."""
        if self.adata is not None:
            return np.asarray(self.adata.obs_names[a:b], dtype=object)
        return StringElement(self._obs_index, "obs_names").read(a, b)

    # -- bookkeeping ----------------------------------------------------------------
    def record(self) -> dict[str, Any]:
        """The manifest's description of this input (path, size, mtime, content
        fingerprint, n_obs)."""
        if self.path is None:
            return {"path": None, "name": self.label, "kind": self.kind, "size": None,
                    "mtime": None, "n_obs": self.n_obs}
        size, mtime = disk_usage(self.path)
        return {"path": str(self.path), "name": self.path.name, "kind": self.kind,
                "size": size, "mtime": mtime, "fingerprint": fingerprint(self.path),
                "n_obs": self.n_obs}

    def close(self) -> None:
        if self._h5 is not None:
            self._h5.close()
            self._h5 = None


def _attr_str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def disk_usage(path: Path) -> tuple[int, float]:
    """Total size in bytes and latest mtime of a file or of every file under a folder."""
    st = path.stat()
    if not path.is_dir():
        return int(st.st_size), float(st.st_mtime)
    size, mtime = 0, float(st.st_mtime)
    for root, _dirs, files in os.walk(path):
        for f in files:
            s = os.stat(os.path.join(root, f))
            size += s.st_size
            mtime = max(mtime, s.st_mtime)
    return size, mtime


def open_input(obj: Any, index: int) -> InputSource:
    """Open one input (path or AnnData) as an :class:`InputSource`."""
    return InputSource(obj, index)


# -- checks of a list of inputs (both paths) ---------------------------------------------
def _same_as(targets: list[Any]) -> tuple[int, int] | None:
    seen: dict[Any, int] = {}
    for j, t in enumerate(targets):
        if isinstance(t, Path):
            try:
                st = t.stat()
                key: Any = ("file", st.st_dev, st.st_ino)
            except OSError:
                key = ("path", str(t.resolve()))
        else:
            key = ("object", id(t))
        if key in seen:
            return seen[key], j
        seen[key] = j
    return None


def open_inputs(objs: Sequence[Any], *, chunk_cache: bool = False) -> list[InputSource]:
    """Open every input as an :class:`InputSource` (closed again if one fails).

    Raises
    ------
    InputError
        For an input that is not one, and for the same input passed twice (the same file,
        by any path or as a backed AnnData, or the same AnnData object): its cells would be
        read twice.
    """
    targets = [resolve_input(x, i) for i, x in enumerate(objs)]
    twice = _same_as(targets)
    if twice is not None:
        i, j = twice
        ti, tj = targets[i], targets[j]
        what = (f"the same file ({Path(tj).resolve()})" if isinstance(tj, Path)
                else "the same AnnData object")
        raise InputError(
            f"input #{i} ({input_label(i, ti if isinstance(ti, Path) else None)}) and input "
            f"#{j} ({input_label(j, tj if isinstance(tj, Path) else None)}) are {what}; its "
            "cells would be read twice. Fix: pass each input once."
        )
    sources: list[InputSource] = []
    try:
        for i, t in enumerate(targets):
            sources.append(InputSource(t, i, chunk_cache=chunk_cache))
    except BaseException:
        for s in sources:
            s.close()
        raise
    return sources


def nonempty(sources: Sequence[InputSource]) -> list[InputSource]:
    """The inputs that have cells; each one without is skipped with a warning.

    Raises
    ------
    InputError
        When no input has a cell.
    """
    kept = []
    for s in sources:
        if s.n_obs == 0:
            logger.warning("%s", empty_input_reason(s.label))
        else:
            kept.append(s)
    if not kept:
        raise InputError(f"{', '.join(s.label for s in sources)}: no input has cells "
                         "(n_obs == 0 in every one); pass inputs with cells.")
    return kept


def warn_shared_obs_names(sources: Sequence[InputSource], block: int = 1 << 20) -> int:
    """Warn when obs_names appear in more than one input (the count and an example);
    returns the count. Rows are identified by row ids, not by names, so nothing is refused.
    """
    if len(sources) < 2:
        return 0
    hashes, where, first = [], [], []
    for i, s in enumerate(sources):
        parts = [pd.util.hash_array(np.asarray(s.names(a, min(s.n_obs, a + block)),
                                               dtype=object))
                 for a in range(0, s.n_obs, block)]
        h = np.concatenate(parts) if parts else np.zeros(0, np.uint64)
        u, pos = np.unique(h, return_index=True)
        hashes.append(u)
        where.append(np.full(len(u), i, dtype=np.int64))
        first.append(pos)
    all_h = np.concatenate(hashes)
    order = np.argsort(all_h, kind="stable")
    sorted_h = all_h[order]
    dup = np.flatnonzero(sorted_h[1:] == sorted_h[:-1])
    if not dup.size:
        return 0
    n_shared = int(np.unique(sorted_h[dup]).size)
    src_of = np.concatenate(where)[order]
    pos_of = np.concatenate(first)[order]
    k = int(dup[0])
    a, b = sources[int(src_of[k])], sources[int(src_of[k + 1])]
    row = int(pos_of[k])
    name = str(a.names(row, row + 1)[0])
    logger.warning(
        "%d obs_names appear in more than one input (e.g. %r in %s and %s). Nothing is "
        "refused: collections and in-place reading identify rows by row ids (the global row "
        "positions batches carry as 'index'), not by obs_names; but these names do not tell "
        "the cells apart. To make them unique, prefix them per input before writing (e.g. "
        "adata.obs_names = 'batch1_' + adata.obs_names) or concatenate with "
        "anndata.concat(..., index_unique='-').", n_shared, name, a.label, b.label)
    return n_shared


# -- which fields, harmonised (both paths) -----------------------------------------------
@dataclass
class FieldPlan:
    """The fields every input can offer, harmonised, and the others with the reason.

    Attributes
    ----------
    fields
        Field string -> :class:`~annbatch_torch.store.harmonize.Harmonized`, in the order
        X, layers, obsm, obs columns (each in first-seen order).
    unavailable
        Field string -> why it is not offered.
    """

    fields: dict[str, Harmonized] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)


def _too_many_strings(where: str, name: str, limit: int) -> str:
    col = name.partition("/")[2]
    return (
        f"{where}: {name!r} holds strings with more than {limit} distinct values, more than "
        "a label may have (annbatch_torch.store.collection.MAX_LABEL_CATEGORIES); it looks "
        "like a per-cell identifier. Select a label column, or store integer ids in a "
        f"numeric column, e.g. adata.obs['{col}_id'] = adata.obs['{col}'].astype('category')"
        ".cat.codes, and select that."
    )


def plan_fields(sources: Sequence[InputSource], *, requested: Mapping[str, Any],
                omit: Mapping[str, str], warn: bool, matrix_width: int | None = None,
                raw_width: int | None = None, category_limit: int | None = None,
                too_many: Any = None) -> FieldPlan:
    """The fields to offer from ``sources`` (inputs with cells), each harmonised by the
    rules of :mod:`.harmonize`, the same way for the writer and in-place reading.

    Parameters
    ----------
    sources
        The opened inputs, without those that have no cells (:func:`nonempty`).
    requested
        ``{"X": bool, "layers": names | None, "obsm": names | None, "obs": names | None,
        "raw": bool | None}``: fields the user asked for (``None``: none named, take what
        every input has; ``"raw"``: ``True`` asks for ``raw/X``, ``False`` leaves it out). A
        field asked for must pass every rule (else :class:`InputError`); others that do
        not are left out with the reason in ``unavailable``. X is asked for when
        ``requested["X"]`` and any input has it; when no input has X it is left out.
    omit
        Per group (``"X"``, ``"layers"``, ``"obsm"``, ``"obs"``), how the user leaves a
        field out: the end of every fix.
    warn
        Log a warning for every field left out (the writer; in place the reason is given
        when the field is selected).
    matrix_width, raw_width
        The width X and layers get (the writer's joined genes), and raw/X (its joined raw
        genes), else each input's.
    category_limit, too_many
        In place: a categorical with more categories is not offered;
        ``too_many(where, field, n)`` says why.

    Raises
    ------
    InputError
        When a field asked for cannot be offered; the message names the input, the field
        and the fix.
    """
    plan = FieldPlan()
    labels = [s.label for s in sources]

    def leave_out(name: str, reason: str, asked: bool) -> None:
        if asked:
            raise InputError(reason)
        plan.unavailable[name] = reason
        if warn:
            logger.warning("%s is not carried: %s", name, reason)

    def take(name: str, key: Any, group: str, asked: bool) -> None:
        fld = name if isinstance(key, str) or group != "obs" else key
        why = field_name_problem(fld)
        having = [s.label for s in sources if s.has(group, key)]
        if why is not None:
            return leave_out(name, name_reason((having or labels)[0], fld, why, omit[group]),
                             asked)
        if len(having) < len(sources):
            lacking = [s.label for s in sources if not s.has(group, key)]
            return leave_out(name, missing_reason(name, lacking, having, omit[group],
                                                  have=sources[0].keys(group)), asked)
        described = [s.describe(name, column=key if group == "obs" else None)
                     for s in sources]
        width = raw_width if group == "raw" else matrix_width
        if width is not None and group in ("X", "layers", "raw"):
            described = [d if d.kind in ("unsupported", "damaged") else
                         InputField(d.where, d.kind, d.dtype, (width,))
                         for d in described]
        try:
            h = harmonize_field(name, described, omit[group],
                                string_categories=lambda i: _strings(sources[i], key))
        except InputError as e:
            return leave_out(name, str(e), asked)
        n_cats = len(h.info.categories or ())
        if category_limit is not None and h.code_tables is not None and n_cats > category_limit:
            strings = [d.where for d in described if d.kind == "string"]
            return leave_out(name, _too_many_strings(strings[0], name, category_limit) if strings
                             else too_many(", ".join(labels), name, n_cats), asked)
        plan.fields[name] = h

    def _strings(s: InputSource, key: Any) -> list[Any]:
        cats = s.string_categories(key, limit=category_limit)
        note_strings(s.label, key, len(cats), s.n_obs)
        return cats

    if any(s.has_x for s in sources):
        take("X", "X", "X", bool(requested.get("X")))
    else:
        plan.unavailable["X"] = no_x_reason(labels[0])
    for group in ("layers", "raw", "obsm", "obs"):
        asked = requested.get(group)
        if group == "raw":
            if asked is False:
                continue
            asked = ["X"] if asked else None
        keys = list(asked) if asked is not None else list(dict.fromkeys(
            k for s in sources for k in s.keys(group)))
        for key in keys:
            name = f"{group}/{key}"
            take(name, key, group, asked is not None)
    return plan
