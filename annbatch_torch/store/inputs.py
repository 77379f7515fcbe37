"""AnnData inputs: what one is, how it is opened, and the writer's view of it.

An input is an ``.h5ad`` path (read with h5py, never loaded whole), an AnnData zarr store
path (``zarr.open_group``) or an in-memory :class:`anndata.AnnData` (a backed AnnData is
read from its file; a backed view is refused). :func:`resolve_input`, :func:`open_store`
and :func:`input_label` say what an input is, open it (or refuse it with the fix) and name
it, for :func:`~annbatch_torch.create_anndata_collection` and for in-place reading
(:mod:`annbatch_torch.store.inplace`) alike.

:class:`InputSource` is the writer's view of one input: row count, var names, a probe of
each matrix / obsm / obs column (kind, dtype, shape, categories), and readers of row
blocks; :mod:`annbatch_torch.write.schema` turns the probes of all inputs into the
collection's schema by the rules of :mod:`annbatch_torch.store.harmonize`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from ..errors import InputError
from .elements import (
    CategoricalElement,
    CSCElement,
    DenseElement,
    Element,
    StringElement,
    element_from_memory,
    encoding_type,
    open_element,
    read_index,
)

__all__ = [
    "InputSource",
    "MatrixProbe",
    "ObsProbe",
    "backed_file",
    "disk_usage",
    "input_label",
    "open_input",
    "open_store",
    "resolve_input",
]

_FIX_TYPES = "pass .h5ad files, AnnData zarr stores or anndata.AnnData objects"


@dataclass(frozen=True)
class MatrixProbe:
    """What an input holds under a matrix field (``X``, ``layers/k``, ``obsm/k``)."""

    kind: str  # "csr", "csc", "dense" or "unsupported"
    dtype: np.dtype
    shape: tuple[int, ...]
    nnz: int | None = None  # stored entries of a sparse matrix
    why: str = ""  # reason when unsupported


@dataclass(frozen=True)
class ObsProbe:
    """What an input holds in one obs column."""

    kind: str  # "categorical", "numeric", "bool", "string" or "unsupported"
    dtype: np.dtype
    categories: tuple[Any, ...] | None = None
    ordered: bool = False
    why: str = ""


def backed_file(adata: Any, label: str) -> Path | None:
    """The file of a backed AnnData (read from there: the file's rows, the file's obs), or
    ``None`` for an in-memory one. A backed *view* is refused: reading its file would
    silently take every cell of it, not the view's."""
    if not getattr(adata, "isbacked", False) or adata.filename is None:
        return None
    if getattr(adata, "is_view", False):
        raise InputError(
            f"{label}: a view of the backed AnnData {adata.filename} ({adata.n_obs} cells); "
            "backed inputs are read from their file, which would take all of its cells. "
            "Pass view.to_memory() (loads just these cells) or write the subset first "
            "(view.write_h5ad(path)) and pass the path."
        )
    return Path(adata.filename)


def resolve_input(obj: Any, index: int) -> Path | Any:
    """What input ``index`` is: the path to read (a path as given, ``~`` expanded, or the
    file of a backed AnnData) or an in-memory AnnData.

    Raises
    ------
    InputError
        For anything else, and for a view of a backed AnnData (see :func:`backed_file`).
    """
    import anndata as ad

    if isinstance(obj, ad.AnnData):
        return backed_file(obj, f"input #{index}") or obj
    if isinstance(obj, str | os.PathLike):
        return Path(obj).expanduser()
    raise InputError(f"input #{index}: got a {type(obj).__name__}; {_FIX_TYPES}.")


def input_label(index: int, path: Path | None) -> str:
    """How messages name input ``index``: its path, or ``"<AnnData #index>"``."""
    return str(path) if path is not None else f"<AnnData #{index}>"


def _not_hdf5(path: Path) -> str:
    if path.suffix.lower() in (".h5ad", ".h5", ".hdf5"):
        return (f"{path}: not an HDF5 file, though named {path.suffix} (damaged, truncated or "
                f"of another format); {_FIX_TYPES}.")
    return f"{path}: is neither an HDF5 (.h5ad) file nor a zarr store; {_FIX_TYPES}."


def open_store(path: Path, *, chunk_cache: bool = True) -> Any:
    """Open the ``.h5ad`` file or AnnData zarr store at ``path`` read-only.

    Parameters
    ----------
    path
        A file (HDF5) or a folder (zarr v2/v3).
    chunk_cache
        Keep h5py's chunk cache (~1 MB per dataset). Off for inputs read once in large
        sequential slices, as the writer does.

    Returns
    -------
    An open ``h5py.File`` (close it when done) or a ``zarr.Group``. It has ``obs`` and
    ``var``; ``X`` may be absent (an AnnData whose X is None).

    Raises
    ------
    InputError
        If ``path`` is missing, neither HDF5 nor zarr, or not an AnnData store.
    """
    if not path.exists():
        raise InputError(f"{path}: no such file or folder; check the path ({_FIX_TYPES}).")
    if path.is_dir():
        import zarr

        try:
            group: Any = zarr.open_group(str(path), mode="r")
        except Exception as e:
            raise InputError(f"{path}: is a folder but not a zarr store ({type(e).__name__}: "
                             f"{e}); {_FIX_TYPES}.") from e
    else:
        import h5py

        if not h5py.is_hdf5(str(path)):
            raise InputError(_not_hdf5(path))
        try:
            # without the cache, a dataset read once in large slices does not hold ~9 MB
            # (cache plus HDF5 free lists) per open dataset
            group = h5py.File(str(path), "r", **({} if chunk_cache else {"rdcc_nbytes": 0}))
        except OSError as e:
            raise InputError(f"{path}: cannot be opened as an HDF5 file ({e}); {_FIX_TYPES}."
                             ) from e
    keys = set(group.keys())
    if not {"obs", "var"} <= keys:
        if hasattr(group, "close"):
            group.close()
        missing = sorted({"obs", "var", "X"} - keys)
        raise InputError(f"{path}: not an AnnData store (no {missing} at its root); "
                         f"{_FIX_TYPES}.")
    return group


def _no_x(label: str) -> InputError:
    return InputError(
        f"{label}: X is None; create_anndata_collection needs X. Fix: set it (e.g. adata.X = "
        "adata.layers['counts']) and save the input again, or read the input in place with "
        "AnnBatchDataset, which selects obsm, layers and obs fields without X."
    )


def _is_group(node: Any) -> bool:
    return hasattr(node, "keys") and not hasattr(node, "dtype")


def _probe_disk_matrix(node: Any) -> MatrixProbe:
    enc = encoding_type(node)
    if _is_group(node):
        if enc in ("csr_matrix", "csc_matrix"):
            shape = tuple(int(s) for s in node.attrs["shape"])
            return MatrixProbe(enc[:3], np.dtype(node["data"].dtype), shape,
                               int(node["data"].shape[0]))
        return MatrixProbe("unsupported", np.dtype("f4"), (), why=f"encoding {enc!r}")
    dtype = np.dtype(node.dtype)
    if len(node.shape) != 2 or dtype.kind not in "biuf":
        return MatrixProbe("unsupported", dtype, tuple(node.shape),
                           why=f"{len(node.shape)}-d array of dtype {dtype}")
    return MatrixProbe("dense", dtype, tuple(int(s) for s in node.shape))


def _probe_memory_matrix(value: Any) -> MatrixProbe:
    if sp.issparse(value) and value.format in ("csr", "csc"):
        return MatrixProbe(value.format, np.dtype(value.dtype), tuple(value.shape), value.nnz)
    if isinstance(value, pd.DataFrame):
        value = value.to_numpy()
    if isinstance(value, np.ndarray) and value.ndim == 2 and value.dtype.kind in "biuf":
        return MatrixProbe("dense", value.dtype, tuple(value.shape))
    return MatrixProbe("unsupported", np.dtype("f4"), (), why=f"type {type(value).__name__}")


def _probe_disk_obs(node: Any) -> ObsProbe:
    enc = encoding_type(node)
    if enc == "categorical":
        cats = open_element(node, "obs").categories  # type: ignore[attr-defined]
        return ObsProbe("categorical", np.dtype(node["codes"].dtype), tuple(cats),
                        bool(node.attrs.get("ordered", False)))
    if enc in ("nullable-integer", "nullable-boolean"):
        has_na = bool(np.asarray(node["mask"][...]).any())
        if has_na:
            return ObsProbe("numeric", np.dtype("f8"))
        dt = np.dtype(node["values"].dtype)
        return ObsProbe("bool" if dt.kind == "b" else "numeric", dt)
    if enc == "nullable-string-array":
        return ObsProbe("string", np.dtype(object))
    if _is_group(node):
        return ObsProbe("unsupported", np.dtype(object), why=f"encoding {enc!r}")
    dt = np.dtype(node.dtype)
    if enc == "string-array" or dt.kind in "SUOT":
        return ObsProbe("string", np.dtype(object))
    if node.ndim != 1 or dt.kind not in "biuf":
        return ObsProbe("unsupported", dt, why=f"dtype {dt} with {node.ndim} dims")
    return ObsProbe("bool" if dt.kind == "b" else "numeric", dt)


def _probe_memory_obs(s: pd.Series) -> ObsProbe:
    dt = s.dtype
    if isinstance(dt, pd.CategoricalDtype):
        codes_dtype = s.cat.codes.dtype
        return ObsProbe("categorical", np.dtype(codes_dtype), tuple(dt.categories.tolist()),
                        bool(dt.ordered))
    if pd.api.types.is_bool_dtype(dt) and not s.hasnans:
        return ObsProbe("bool", np.dtype(bool))
    if pd.api.types.is_numeric_dtype(dt) or pd.api.types.is_bool_dtype(dt):
        if s.hasnans or not isinstance(dt, np.dtype):
            return ObsProbe("numeric", np.dtype("f8") if s.hasnans else np.dtype(dt.numpy_dtype))
        return ObsProbe("numeric", dt)
    if pd.api.types.is_string_dtype(dt) or dt is np.dtype(object):
        return ObsProbe("string", np.dtype(object))
    return ObsProbe("unsupported", np.dtype(object), why=f"dtype {dt}")


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


class _NullableStrings(Element):
    def __init__(self, node: Any, name: str) -> None:
        self.values, self.mask = StringElement(node["values"], name), node["mask"]
        self.n_rows, self.name = self.values.n_rows, name

    def read(self, start: int, stop: int) -> np.ndarray:
        out = self.values.read(start, stop)
        out[np.asarray(self.mask[start:stop], dtype=bool)] = None
        return out


class InputSource:
    """One input, opened read-only.

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
        Probes of ``X`` and ``layers/<k>``, of ``obsm/<k>`` and of obs columns.
    """

    def __init__(self, obj: Any, index: int) -> None:
        self.index = index
        self._h5: Any = None
        self.adata: Any = None
        target = resolve_input(obj, index)
        if isinstance(target, Path):
            self.path = target.resolve()
            self.label = input_label(index, self.path)
            self._open_disk()
            self._probe_disk()
        else:
            self.adata, self.path, self.kind = target, None, "memory"
            self.label = input_label(index, None)
            self._probe_memory()
        if self.n_obs == 0:
            raise InputError(f"{self.label}: has no cells (n_obs == 0); drop it from the inputs.")
        names = pd.Index(self.var_names)
        if not names.is_unique:
            dup = names[names.duplicated()].unique()[:5].tolist()
            raise InputError(
                f"{self.label}: var_names are not unique (e.g. {dup}); genes cannot be aligned. "
                "Fix: adata.var_names_make_unique() (or drop the duplicates) and save it again."
            )

    # -- opening --------------------------------------------------------------------
    def _open_disk(self) -> None:
        assert self.path is not None
        self.group = open_store(self.path, chunk_cache=False)  # rows are read once
        self.kind = "zarr" if self.path.is_dir() else "h5ad"
        self._h5 = self.group if self.kind == "h5ad" else None

    def _probe_disk(self) -> None:
        g = self.group
        self.var_names = read_index(g["var"])
        self._obs_index = g["obs"][_attr_str(g["obs"].attrs.get("_index", "_index"))]
        self.n_obs = int(self._obs_index.shape[0])
        if "X" not in g:
            self.close()
            raise _no_x(self.label)
        self.matrices = {"X": _probe_disk_matrix(g["X"])}
        for key, sub in (("layers", self.matrices), ("obsm", {})):
            if key in g:
                for k in g[key]:
                    sub[f"{key}/{k}"] = _probe_disk_matrix(g[key][k])
            if key == "obsm":
                self.obsm = sub
        obs = g["obs"]
        order = [_attr_str(c) for c in obs.attrs.get("column-order", [])]
        self.obs = {c: _probe_disk_obs(obs[c]) for c in order}

    def _probe_memory(self) -> None:
        a = self.adata
        self.var_names = np.asarray(a.var_names, dtype=object)
        self.n_obs = int(a.n_obs)
        if a.X is None:
            raise _no_x(self.label)
        self.matrices = {"X": _probe_memory_matrix(a.X)}
        self.matrices.update({f"layers/{k}": _probe_memory_matrix(v) for k, v in a.layers.items()})
        self.obsm = {f"obsm/{k}": _probe_memory_matrix(v) for k, v in a.obsm.items()}
        self.obs = {c: _probe_memory_obs(a.obs[c]) for c in a.obs.columns}  # names as they are

    # -- readers --------------------------------------------------------------------
    def _value(self, key: str) -> Any:
        if self.adata is None:
            kind, _, k = key.partition("/")
            return self.group[kind][k] if k else self.group[kind]
        if key == "X":
            return self.adata.X
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

    def obs_reader(self, column: str) -> Element:
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
            return _NullableStrings(node, name)
        return open_element(node, name, self.label)

    def string_categories(self, column: str, block: int = 1 << 20) -> list[Any]:
        """Sorted distinct values of a string obs column (streamed in blocks on disk)."""
        el = self.obs_reader(column)
        if isinstance(el, CategoricalElement):
            return list(el.categories)
        seen: set[Any] = set()
        for a in range(0, self.n_obs, block):
            seen.update(pd.unique(el.read(a, min(self.n_obs, a + block))))
        return sorted(v for v in seen if isinstance(v, str))

    def names(self, a: int, b: int) -> np.ndarray:
        """obs_names of rows ``[a, b)`` as an object array of str."""
        if self.adata is not None:
            return np.asarray(self.adata.obs_names[a:b], dtype=object)
        return StringElement(self._obs_index, "obs_names").read(a, b)

    # -- bookkeeping ----------------------------------------------------------------
    def record(self) -> dict[str, Any]:
        """The manifest's description of this input (path, size, mtime, n_obs)."""
        if self.path is None:
            return {"path": None, "name": self.label, "kind": self.kind, "size": None,
                    "mtime": None, "n_obs": self.n_obs}
        size, mtime = disk_usage(self.path)
        return {"path": str(self.path), "name": self.path.name, "kind": self.kind,
                "size": size, "mtime": mtime, "n_obs": self.n_obs}

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
