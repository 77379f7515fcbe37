"""What an AnnData input is, its name, and opening it with damage named.

An input is an ``.h5ad`` path (read with h5py, never loaded whole), an AnnData zarr store
path (``zarr.open_group``) or an in-memory :class:`anndata.AnnData` (or an object that
looks like one: ``obs``, ``var_names``, ``n_obs``, ``X``, ``layers``, ``obsm``; a backed
AnnData is read from its file; a backed view is refused). :func:`resolve_input`,
:func:`open_store` and :func:`input_label` say what an input is, open it (or refuse it with
the fix) and name it, for :func:`~annbatch_torch.create_anndata_collection` and for
in-place reading (:mod:`annbatch_torch.store.inputs.inplace`) alike. An HDF5 file that fails
to read is named with the fix (:func:`damaged_reason`, :func:`resave_command`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ...errors import InputError
from ..manifest import looks_like_collection
from .legacy import LegacyStore, decode_legacy

__all__ = [
    "H5_ERRORS",
    "backed_file",
    "damaged_reason",
    "disk_usage",
    "input_label",
    "open_store",
    "resave_command",
    "resolve_input",
]

_FIX_TYPES = "pass .h5ad files, AnnData zarr stores or anndata.AnnData objects"


#: what an in-memory input must have to be read as an AnnData (duck typing)
_ANNDATA_ATTRS = ("obs", "var_names", "n_obs", "X", "layers", "obsm")


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
    # an AnnData exists only once anndata's class is: a path never imports anndata (~1 s
    # with dask installed, in each process that checks its inputs); the class looked up,
    # not the module, which another thread may be importing (bound, not yet its class)
    anndata_class = getattr(sys.modules.get("anndata"), "AnnData", None)
    if ((anndata_class is not None and isinstance(obj, anndata_class))
            or _looks_like_anndata(obj)):
        return backed_file(obj, f"input #{index}") or obj
    if isinstance(obj, str | os.PathLike):
        from ..remote.location import is_url

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
H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError)


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
        except H5_ERRORS as e:
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
        except H5_ERRORS as e:
            raise InputError(damaged_reason(self._label, f"{self._node.name!r}", e)) from e

    def __iter__(self) -> Any:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def keys(self) -> list[str]:
        try:
            return list(self._node.keys())
        except H5_ERRORS as e:
            raise InputError(damaged_reason(self._label, f"{self._node.name!r}", e)) from e

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        try:
            return _guard(self._node[key], self._label)
        except H5_ERRORS as e:
            raise InputError(damaged_reason(self._label, f"{key!r}", e)) from e


def _guard(node: Any, label: str) -> Any:
    import h5py

    if isinstance(node, h5py.Dataset):
        return _GuardedDataset(node, label)
    if isinstance(node, h5py.Group):
        return _GuardedGroup(node, label)
    return node


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
                    parts = legacy_parts or decode_legacy(group)
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
