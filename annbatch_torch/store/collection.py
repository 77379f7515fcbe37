"""A written :class:`Collection`, described by its manifest, and :func:`open_collection`.

:class:`Collection` is the on-disk :class:`~annbatch_torch.store.source.Source` written by
:func:`~annbatch_torch.create_anndata_collection` (local, or on an object store through the
local mirror of :mod:`annbatch_torch.store.remote`): its shards, fields and global
categories from the manifest, obs / var metadata, and the check that what it reads is still
the collection that was opened.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..errors import CollectionError
from .manifest import (
    MANIFEST_NAME,
    FieldInfo,
    Manifest,
    ShardInfo,
    read_manifest,
    var_names_digest,
)
from .metadata import read_dataframe, shard_obs_names
from .source import Source, reads_metadata

if TYPE_CHECKING:
    from .rawstrings import RawStringArray
    from .remote.mirror import Mirror

__all__ = [
    "Collection", "open_collection", "MAX_LABEL_CATEGORIES", "too_many_categories",
]

logger = logging.getLogger(__name__)

#: A categorical obs column with more categories than this is not offered as a field: it
#: is an identifier (barcodes, per-cell ids), not a label. No real label set comes close
#: (cell types, donors, datasets: hundreds to tens of thousands). Integer ids in a numeric
#: obs column remain selectable.
MAX_LABEL_CATEGORIES = 100_000


def too_many_categories(where: str, field: str, n: int) -> str:
    col = field.partition("/")[2]
    return (
        f"{where}: {field!r} has {n} categories, more than the {MAX_LABEL_CATEGORIES} a label "
        "may have (annbatch_torch.store.collection.MAX_LABEL_CATEGORIES); it looks like a per-cell "
        "identifier. Select a label column, or store integer ids in a numeric column, e.g. "
        f"adata.obs['{col}_id'] = adata.obs['{col}'].cat.codes, and select that."
    )


class Collection(Source):
    """A finished collection on disk (see ``store/manifest.py``).

    Use :func:`open_collection` to get one. Besides the rows the reader pulls, it answers
    questions about cells and genes without reading any matrix, as every
    :class:`~annbatch_torch.Source` does (inputs read in place too):
    :attr:`~annbatch_torch.Source.obs_names`, :meth:`~annbatch_torch.Source.obs_names_at`
    (cell names of global row ids, the way back to an AnnData's order),
    :meth:`~annbatch_torch.Source.obs_at` (obs columns of rows),
    :meth:`~annbatch_torch.Source.category_counts` (cells per category); and :attr:`var`
    (gene metadata).

    Parameters
    ----------
    path
        The collection folder (what :func:`open_collection` resolved).
    manifest
        Its parsed ``manifest.json``, when the caller read it already (else read here,
        again if the file was replaced while it was read).
    mirror
        The local mirror of a collection on an object store (:func:`open_collection` makes
        it from the URL); ``None`` for a local collection.

    Attributes
    ----------
    path
        The collection folder (for a collection on an object store: the local mirror of
        its metadata; ``url`` names it).
    url
        The collection's URL when it is on an object store, else ``None``.
    manifest
        The parsed ``manifest.json``.
    """

    def __init__(self, path: str | os.PathLike[str], manifest: Manifest | None = None,
                 mirror: Mirror | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.mirror = mirror
        self.url = None if mirror is None else mirror.location.url
        # on a store: the manifest the mirror holds (a second HEAD could see a newer one)
        self._manifest_id = self._identity() if mirror is None else mirror.synced_identity
        if manifest is None:
            manifest = read_manifest(self.path)
            while mirror is None and (now := self._identity()) != self._manifest_id:
                self._manifest_id = now  # replaced while it was read: read it again
                manifest = read_manifest(self.path)
        self.manifest = manifest
        self.fields = dict(self.manifest.fields)
        recorded = self.manifest.extra.get("unavailable", {})
        self._unavailable = (
            {str(k): str(v) for k, v in recorded.items()} if isinstance(recorded, dict) else {}
        )
        for name, info in list(self.fields.items()):
            if info.kind == "categorical" and len(info.categories or ()) > MAX_LABEL_CATEGORIES:
                del self.fields[name]
                self._unavailable[name] = too_many_categories(
                    str(self.path), name, len(info.categories or ())
                )
        self.shard_sizes = [s.n_obs for s in self.manifest.shards]
        self.var_names = pd.Index(self.manifest.var_names, name="var_names")
        raw_names = self.manifest.raw_var_names
        self.raw_var_names = None if raw_names is None else pd.Index(raw_names,
                                                                     name="raw_var_names")

    def check_current(self) -> None:
        """Raise :class:`~annbatch_torch.CollectionError` when another process rewrote this
        collection (``overwrite=True``) since it was opened: its rows cannot be mixed with
        the ones read before. Shards added since (the old ones kept as they were) pass. One
        ``stat`` of ``manifest.json`` while it is unchanged."""
        now = self._identity()
        if now == self._manifest_id:
            return
        try:
            if now is None:
                shards = None
            elif self.mirror is not None:  # the new manifest's shard list, from the store
                shards = self.mirror.current_shards()
            else:
                shards = read_manifest(self.path).shards
        except (CollectionError, FileNotFoundError):
            shards = None
        ours = self.manifest.shards
        if shards is not None and len(shards) >= len(ours) and all(
                a.generation is not None and a == b for a, b in zip(ours, shards)):
            self._manifest_id = now  # only added to: every shard read here is as it was
            return
        raise CollectionError(
            f"{self.describe()}: the collection was rewritten (create_anndata_collection(..., "
            "overwrite=True) or prepare_collection, in this process or another) since this "
            "Collection was opened; its rows cannot be mixed with those read before. Open it "
            "again (a new AnnBatchDataset or open_collection) to read the new collection.")

    @property
    def shards(self) -> list[ShardInfo]:
        """Shard folders (relative to ``path``) and their row counts."""
        return list(self.manifest.shards)

    def shard_path(self, shard: int) -> Path:
        return self.path / self.manifest.shards[shard].path

    @property
    def group_by(self) -> str | None:
        """The obs column whose classes are contiguous inside every shard
        (``create_anndata_collection(group_by=...)``), or ``None``: also when a shard does
        not record it (appended by a version that did not group its new shards)."""
        return self.manifest.grouped_by()

    def _identity(self) -> tuple[int, int, int] | None:
        return (_manifest_identity(self.path) if self.mirror is None
                else self.mirror.manifest_identity())

    def identity(self) -> str:
        """What identifies the collection's rows, which a resume state records (the plan's
        ``source_id``): a digest of what decides which cell is at which row id (the writer's
        seed and shuffle, the inputs with cells, in order, by row count and size, each
        append's seed and row count, the gene axes), nothing else: the same collection
        copied, opened again, rewritten with other shard sizes or memory, or after an append
        of no cells resumes."""
        m = self.manifest
        doc = {
            "identity": 1,  # the version of this digest's contents
            "n_obs": m.n_obs, "seed": m.seed, "shuffle": m.shuffle, "var_join": m.var_join,
            "var_names": var_names_digest(m.var_names),
            "raw_var_names": (None if m.raw_var_names is None
                              else var_names_digest(m.raw_var_names)),
            "inputs": [[int(i.get("n_obs") or 0), int(i.get("size") or 0)] for i in m.inputs
                       if i.get("n_obs")],
            "appended": [[a.get("seed"), int(a.get("n_obs") or 0)]
                         for a in m.extra.get("appended") or [] if a.get("n_obs")],
        }
        text = json.dumps(doc, sort_keys=True, default=str)
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        return str(self.path) if self.url is None else self.url

    def shard_name(self, shard: int) -> str:
        if self.url is not None:
            return f"{self.url}/{self.manifest.shards[shard].path}"
        return str(self.shard_path(shard))

    def stored_value_dtypes(self, field: str) -> list[np.dtype]:
        """As :meth:`Source.stored_value_dtypes`, from the manifest (no shard opened):
        a shard's recorded ``stored`` dtype, else the field's (collections written
        before)."""
        logical = self.check_field(field).dtype
        return [np.dtype(s.stored.get(f"{field}/data", logical)) for s in self.manifest.shards]

    # -- cell and gene metadata (never X; see store/metadata.py) ---------------------
    def _read_obs_names(self, shard: int) -> np.ndarray | RawStringArray:
        return shard_obs_names(
            self.shard_group(shard), self.shard_sizes[shard], self.shard_name(shard),
            check=functools.partial(self._check_node, shard), by_position=True,
        )

    def _obs_fields(self) -> dict[str, FieldInfo]:
        # the manifest's: a categorical with too many categories to be a field included
        return {k: v for k, v in self.manifest.fields.items() if k.startswith("obs/")}

    @property
    def var(self) -> pd.DataFrame:
        """Gene metadata: a :class:`pandas.DataFrame` indexed by ``var_names``.

        Holds whatever columns the shards' ``var`` group stores (read from shard 0; every
        shard stores the same), read as obs columns are read
        (``store.metadata.read_dataframe``): categoricals as
        :class:`pandas.Categorical`, strings as str, numeric and bool as stored. A
        collection whose writer kept no var columns gives an empty DataFrame with the
        index. Read once and cached in this object (a copy is returned).

        Raises
        ------
        CollectionError
            If shard 0 has no ``var`` group or its index disagrees with the manifest's
            var names.
        """
        return self._gene_frame("var", self.var_names)

    @property
    def raw_var(self) -> pd.DataFrame | None:
        """Gene metadata of ``raw``: a :class:`pandas.DataFrame` indexed by
        ``raw_var_names``, read as :attr:`var` is (from shard 0's ``raw/var``); ``None``
        when the collection carries no ``raw/X``."""
        if self.raw_var_names is None:
            return None
        return self._gene_frame("raw/var", self.raw_var_names)

    @reads_metadata
    def _gene_frame(self, what: str, names: pd.Index) -> pd.DataFrame:
        frames: dict[str, pd.DataFrame] = self.__dict__.setdefault("_gene_frames", {})
        cached = frames.get(what)
        if cached is None:
            if not self.shard_sizes:
                cached = pd.DataFrame(index=pd.Index(names, dtype=object, name=None))
            else:
                where = self.shard_name(0)
                node = self.shard_group(0)
                for part in what.split("/"):
                    if part not in node:
                        raise CollectionError(
                            f"{where}: the shard has no {what!r} group; the collection is "
                            "damaged, rewrite it with create_anndata_collection(..., "
                            "overwrite=True)."
                        )
                    node = node[part]
                cached = read_dataframe(node, len(names), where, what,
                                        check=functools.partial(self._check_node, 0))
                if not cached.index.equals(names):
                    raise CollectionError(
                        f"{where}: the {what} index differs from the manifest's "
                        f"{'raw ' if what != 'var' else ''}var names; the collection is "
                        "damaged, rewrite it."
                    )
            frames[what] = cached
        return cached.copy()

    def _check_node(self, shard: int, field: str, node: Any) -> None:
        if not self.manifest.all_chunks_written:
            return
        # zarr reads a missing chunk file as its fill value (zeros): without this check a
        # deleted chunk would yield wrong numbers silently. The writer wrote every chunk.
        if hasattr(node, "nchunks"):
            arrays: list[tuple[str, Any]] = [(field, node)]
        else:  # a group's arrays: counted from their metadata where that is enough
            census = getattr(node, "chunk_files", None)
            arrays = [(f"{field}/{k}", (census and census(k)) or node[k])
                      for k in node.array_keys()]
        for name, arr in arrays:
            if hasattr(arr, "require_chunks"):  # rawzarr: an absent inner chunk is damage too
                arr.require_chunks = True
            have, want = arr if isinstance(arr, tuple) else (int(arr.nchunks_initialized),
                                                             int(arr.nchunks))
            if have < want:
                raise CollectionError(
                    f"{self.shard_name(shard)}: array {name!r} has {have} of its {want} chunk "
                    "files; chunk files were deleted or not copied. Copy the collection again "
                    "or rewrite it with create_anndata_collection(..., overwrite=True)."
                )

    def _open_shard(self, shard: int) -> Any:
        from .groups import open_fast_group
        from .zarrs import read_group

        p = self.shard_path(shard)
        try:
            # raw chunks are read directly, others through zarr (zarrs' pipeline if installed)
            return read_group(open_fast_group(p, self.mirror))
        except Exception as e:
            raise CollectionError(
                f"{self.shard_name(shard)}: cannot open shard {shard} ({type(e).__name__}: "
                f"{e}); the collection is damaged, rewrite it with "
                "create_anndata_collection(..., overwrite=True)."
            ) from e

    def __repr__(self) -> str:
        fields = ", ".join(self.fields)
        return (
            f"Collection({self.describe()!r}, n_obs={self.n_obs}, n_vars={self.n_vars}, "
            f"shards={len(self.shard_sizes)}, fields=[{fields}]"
            + (f", group_by={self.group_by!r}" if self.group_by else "") + ")"
        )


def _manifest_identity(root: Path) -> tuple[int, int, int] | None:
    """``(inode, size, mtime)`` of ``root/manifest.json``, ``None`` while it is absent."""
    try:
        st = os.stat(root / MANIFEST_NAME)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def open_collection(path: str | os.PathLike[str], *,
                    storage_options: dict[str, Any] | None = None,
                    cache_dir: str | os.PathLike[str] | None = None,
                    cache_size: int | None = None) -> Collection:
    """Open a finished collection written by :func:`create_anndata_collection`.

    Parameters
    ----------
    path
        The collection folder (the one holding ``manifest.json``), or its URL on an
        object store (``s3://bucket/prefix``, ``gs://``, ``az://``).
    storage_options
        For a URL: the fsspec filesystem's options (for S3, s3fs's: ``key``,
        ``secret``, ``endpoint_url``, ``anon``, ``client_kwargs``...); unset ones come
        from the environment.
    cache_dir
        For a URL: the folder of the local chunk cache and metadata mirror, shared by
        every process and job naming it. ``None``: a temporary folder removed when this
        process exits.
    cache_size
        For a URL: bytes the chunk cache may hold (least recently used chunks are
        evicted beyond it). ``None``: a quarter of the cache folder's free disk space.

    Raises
    ------
    CollectionError
        If ``path`` is not a finished collection, its manifest is damaged or newer than
        this version, or a shard folder is missing.
    """
    from .remote.location import is_url

    if is_url(path):
        from .remote.location import RemoteLocation
        from .remote.mirror import Mirror

        mirror = Mirror(RemoteLocation(str(path), storage_options), cache_dir, cache_size)
        coll = Collection(mirror.sync(), mirror=mirror)
    else:
        if storage_options is not None or cache_dir is not None or cache_size is not None:
            from ..errors import InputError

            raise InputError(f"{path}: storage_options, cache_dir and cache_size are for a "
                             "collection on an object store (a URL such as s3://bucket/"
                             "prefix); a local folder is read directly.")
        coll = Collection(path)
    probe = "X" if "X" in coll.fields else next(iter(coll.fields), None)
    for i, s in enumerate(coll.manifest.shards):
        if not coll.shard_path(i).is_dir():
            raise CollectionError(
                f"{coll.describe()}: shard {s.path!r} listed in the manifest is missing; the "
                "collection is incomplete, rewrite it with create_anndata_collection(..., "
                "overwrite=True)."
            )
        rows = _stored_rows(coll.shard_path(i), probe) if probe is not None else None
        if rows is not None and rows != s.n_obs:
            raise CollectionError(
                f"{coll.shard_name(i)}: field {probe!r} has {rows} rows but the manifest says "
                f"{s.n_obs}; the collection is damaged, rewrite it with "
                "create_anndata_collection(..., overwrite=True)."
            )
    return coll


def _stored_rows(shard_dir: Path, field: str) -> int | None:
    """Rows of ``field`` in a shard from its zarr metadata alone (one small JSON read),
    or ``None`` when that metadata is not where zarr v2/v3 keep it (checked on read)."""
    import json

    node = shard_dir / field
    if field.startswith("obs/") and (node / "codes").is_dir():
        node = node / "codes"
    for meta in ("zarr.json", ".zarray", ".zattrs"):
        f = node / meta
        if not f.is_file():
            continue
        try:
            obj = json.loads(f.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(obj, dict):
            return None
        shape = obj.get("shape")
        if meta == "zarr.json" and obj.get("node_type") != "array":
            shape = (obj.get("attributes") or {}).get("shape")
        if isinstance(shape, list) and shape and isinstance(shape[0], int):
            return shape[0]
    return None
