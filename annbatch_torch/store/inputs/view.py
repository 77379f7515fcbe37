"""One AnnData input as the writer and in-place reading both see it.

:class:`InputSource` is the view of one input (opened by :mod:`.open`): row count, var names, a
probe of each matrix / obsm / obs column (kind, dtype, shape, categories:
:class:`MatrixProbe`, :class:`ObsProbe`), its description for the rules
(:meth:`InputSource.describe`, :mod:`.harmonize`), and readers of row blocks. A damaged or
truncated file is named with the fix (download it again, or re-save it) on both paths.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from ...errors import AnnBatchError, InputError
from ..elements import (
    CategoricalElement,
    CSCElement,
    DenseElement,
    Element,
    NullableStringElement,
    StringElement,
    element_from_memory,
    encoding_type,
    is_group,
    open_element,
    read_index,
)
from ..manifest import RAW_X
from ..metadata import read_dataframe
from .fingerprint import fingerprint
from .harmonize import (
    InputField,
)
from .legacy import LegacyStore
from .open import (
    H5_ERRORS,
    damaged_reason,
    disk_usage,
    input_label,
    open_store,
    resave_command,
    resolve_input,
)

__all__ = ["InputSource", "MatrixProbe", "ObsProbe", "open_input"]

logger = logging.getLogger(__name__)


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


def _probe_disk_matrix(node: Any) -> MatrixProbe:
    enc = encoding_type(node)
    if is_group(node):
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
    if is_group(node):
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


class _ObsProbes(Mapping[Any, ObsProbe]):
    """The probes of an input's obs columns, each made when first looked up (a column's
    categories are read then): a pass-1 task of the parallel writer, which reads a few
    columns of an input opened again, does not read every column's categories."""

    def __init__(self, columns: list[Any], probe: Callable[[Any], ObsProbe]) -> None:
        self._probe = probe
        self._probes: dict[Any, ObsProbe | None] = dict.fromkeys(columns)  # None: not yet

    def __getitem__(self, column: Any) -> ObsProbe:
        p = self._probes[column]  # (KeyError for a column it does not have)
        if p is None:
            p = self._probes[column] = self._probe(column)
        return p

    def __iter__(self) -> Iterator[Any]:
        return iter(self._probes)

    def __len__(self) -> int:
        return len(self._probes)

    def __contains__(self, column: object) -> bool:
        return column in self._probes


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

    def __init__(self, obj: Any, index: int, *, chunk_cache: bool = False,
                 lean: bool = False) -> None:
        self.index = index
        self._lean = lean
        self._var_names: np.ndarray | None = None
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
        if lean:  # its genes were checked where the write began (see open_input)
            return
        names = pd.Index(self.var_names)
        missing = np.flatnonzero(names.isna())
        if missing.size:  # (an in-memory AnnData's; a store's are decoded to strings)
            self.close()
            raise InputError(
                f"{self.label}: var_names hold {missing.size} missing value(s) (None or NaN; "
                f"the first at position {int(missing[0])}); genes cannot be aligned without "
                "names. Fix: name every gene (e.g. adata.var_names = "
                "adata.var['gene_ids'].astype(str)) or drop the unnamed ones."
            )
        if not names.is_unique:
            self.close()
            dup = names[names.duplicated()].unique()[:5].tolist()
            raise InputError(
                f"{self.label}: var_names are not unique (e.g. {dup}); genes cannot be aligned. "
                "Fix: adata.var_names_make_unique() (or drop the duplicates) and save it again."
            )
        raw_names = None if self.raw_var_names is None else pd.Index(self.raw_var_names)
        if raw_names is not None and raw_names.hasnans:
            self.matrices[RAW_X] = MatrixProbe("damaged", np.dtype(np.float32), (), why=(
                f"{self.label}: raw.var_names hold missing values (None or NaN); raw genes "
                "cannot be aligned. Fix: name every gene of adata.raw, or leave raw out"))
        elif raw_names is not None and not raw_names.is_unique:
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

    @property
    def var_names(self) -> np.ndarray:
        """Its var names (read when first asked for by an input opened ``lean``)."""
        if self._var_names is None:
            self._var_names = read_index(self.group["var"], interned=True)
        return self._var_names

    @var_names.setter
    def var_names(self, names: np.ndarray) -> None:
        self._var_names = names

    def _probe_disk(self) -> None:
        g = self.group
        if not self._lean:
            self.var_names = read_index(g["var"], interned=True)
        self._obs_index = g["obs"][_attr_str(g["obs"].attrs.get("_index", "_index"))]
        self.n_obs = int(self._obs_index.shape[0])
        self.matrices: dict[str, MatrixProbe] = {}
        self.obsm: dict[str, MatrixProbe] = {}
        if "X" in g:
            self.matrices["X"] = self._safe(MatrixProbe, _probe_disk_matrix, lambda: g["X"])
        self.raw_var_names = None
        if "raw" in g and is_group(g["raw"]) and "X" in g["raw"]:
            raw = g["raw"]
            try:
                self.raw_var_names = read_index(raw["var"], interned=True)
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
        order = list(dict.fromkeys(_attr_str(c) for c in obs.attrs.get("column-order", [])))
        order += [k for k in obs if k not in order and k != index_key
                  and k != "__categories"]
        self.obs = _ObsProbes(order, self._probe_obs)
        if not self._lean:  # a column that cannot be read refuses the input here
            for c in order:
                self.obs[c]

    def _probe_obs(self, column: Any) -> ObsProbe:
        try:
            return self._safe(ObsProbe, _probe_disk_obs, lambda: self.group["obs"][column])
        except (OSError, RuntimeError, KeyError) as e:  # as in __init__
            raise InputError(damaged_reason(self.label, f"obs/{column}", e)) from e

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
        name = f"obs/{column}"
        if self.adata is not None:
            probe = self.obs[column]
            s = self.adata.obs[column]
            if probe.kind in ("categorical", "string"):
                return element_from_memory(s.astype("category"), name)
            na = {"na_value": np.nan} if probe.dtype.kind == "f" else {}
            return DenseElement(s.to_numpy(dtype=probe.dtype, **na), name=name)
        if column not in self.obs:  # (its probe is not needed to read it)
            raise KeyError(column)
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
        except H5_ERRORS as e:
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
            return read_dataframe(group, len(names), self.label, what, index=names)
        except (AnnBatchError, OSError, KeyError, ValueError) as e:
            logger.warning("%s: its %s columns are not read (%s: %s).", self.label, what,
                           type(e).__name__, e)
            return pd.DataFrame(index=pd.Index(names, dtype=object))

    def names(self, a: int, b: int) -> np.ndarray:
        """obs_names of rows ``[a, b)`` as an object array of str.

        HDF5 keeps what it read of a string dataset (its global heap) for as long as the
        file is open, and the writer keeps its inputs open through the whole write: an
        HDF5 input's index is refreshed (``H5Drefresh``) after each read, which lets that
        go.
        """
        if self.adata is not None:
            return np.asarray(self.adata.obs_names[a:b], dtype=object)
        out = StringElement(self._obs_index, "obs_names").read(a, b)
        if self._h5 is not None and not self.legacy:
            self._obs_index.id.refresh()
        return out

    def name_blocks(self, block: int) -> Iterator[np.ndarray]:
        """Every obs_name, in row order, as object arrays of str of ``block`` rows at most."""
        for a in range(0, self.n_obs, block):
            yield self.names(a, min(self.n_obs, a + block))

    # -- bookkeeping ----------------------------------------------------------------
    def record(self, digest: str | None = None) -> dict[str, Any]:
        """The manifest's description of this input (path, size, mtime, content
        fingerprint, n_obs); ``digest``: its content fingerprint when computed
        already (:class:`~annbatch_torch.store.inputs.fingerprint.Fingerprints`)."""
        if self.path is None:
            return {"path": None, "name": self.label, "kind": self.kind, "size": None,
                    "mtime": None, "n_obs": self.n_obs}
        try:
            size, mtime = disk_usage(self.path)
            return {"path": str(self.path), "name": self.path.name, "kind": self.kind,
                    "size": size, "mtime": mtime,
                    "fingerprint": digest or fingerprint(self.path),
                    "n_obs": self.n_obs}
        except FileNotFoundError as e:
            raise InputError(
                f"{self.label}: vanished while the collection was written (deleted or "
                "moved), so the collection cannot record it; nothing was written. Put it "
                "back, or leave it out of the inputs, and write again."
            ) from e

    def close(self) -> None:
        if self._h5 is not None:
            self._h5.close()
            self._h5 = None


def _attr_str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def open_input(obj: Any, index: int, *, lean: bool = False) -> InputSource:
    """Open one input (path or AnnData) as an :class:`InputSource`; ``lean``: for a task
    that only routes its rows (the parallel writer's pass 1, given the gene maps): its var
    names are read only if asked for, and not checked again."""
    return InputSource(obj, index, lean=lean)


