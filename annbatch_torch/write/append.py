"""Add inputs to a collection without rewriting it: :func:`append_to_collection`.

The new inputs' rows are shuffled among themselves (by ``seed``) into new shards, written by
the writer's own two passes (in this process or on Dask) into a temporary folder beside the
collection, then moved in; ``manifest.json`` is replaced last, atomically, listing the old
shards as they were and the new ones under a new generation. No existing shard file is
opened for writing. Readers that opened the old manifest go on reading the old shards (a
manifest that only adds shards passes their checks); a new open sees all.

The collection's schema is kept: its genes (an ``inner`` collection refuses inputs missing
any of them; an ``outer`` or reference one writes their absent genes as zeros, and refuses
genes it does not have, which would need a wider collection), and raw's genes by the same
rules when it carries ``raw/X``; its fields (each new input must offer every one, with a
dtype that casts safely to the stored one; float matrices into an integer one when their
values are whole numbers that fit, as counts saved as float32 are), and its categories,
which only grow at the end: every stored code keeps its meaning, and new shards store codes
of the collection's code dtype. obs_names a new input repeats, or that the collection holds
already, are a warning (rows are identified by row ids).

Chunked mode draws chunks from every shard, so batches after an append mix old and new cells;
only within a pool, though: rows of the appended inputs sit in their own shards, where a full
rewrite would spread them over all (see ``docs/format.md``, "Appending").
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from ..errors import CollectionError, InputError, check_int
from ..store.collection import MAX_LABEL_CATEGORIES, Collection, open_collection
from ..store.inputs.plan import (
    NAMES_FIX,
    InputNames,
    name_hashes,
    open_inputs,
    warn_repeated_obs_names,
    warn_shared_obs_names,
)
from ..store.inputs.view import InputSource
from ..store.manifest import (
    RAW_X,
    FieldInfo,
    Manifest,
    ShardInfo,
    read_manifest,
    write_manifest,
)
from ..store.metadata import shard_name_hashes, shard_obs_names
from . import budget as _budget
from .budget import parse_memory
from .grouping import check_group_by
from .narrow import FIELD, check_dtype_options
from .parallel import start_cluster
from .publish import remove_stale_temporaries, sibling_path, sync_dir, sync_tree, writer_lock
from .remap import load_remap, needs_compiled_remap
from .schema import OutField, Schema, resolve_schema
from .shardstore import compressors_for
from .writer import DEFAULT_MAX_MEMORY, write_shards

__all__ = ["append_to_collection"]

logger = logging.getLogger(__name__)


def _field_lists(manifest: Manifest) -> dict[str, list[str]]:
    keys = list(manifest.fields)
    return {"layers": [k[7:] for k in keys if k.startswith("layers/")],
            "obsm": [k[5:] for k in keys if k.startswith("obsm/")],
            "obs_columns": [k[4:] for k in keys if k.startswith("obs/")]}


def _check_genes(sources: list[InputSource], manifest: Manifest, where: str) -> None:
    """Refuse inputs whose genes (X's, and raw's when the collection carries raw/X) the
    collection's gene axes cannot take."""
    axes = [("", manifest.var_names, "", lambda s: s.var_names)]
    if RAW_X in manifest.fields and manifest.raw_var_names is not None:
        axes.append(("raw ", manifest.raw_var_names, " (or with raw=False, without raw)",
                     lambda s: s.raw_var_names))
    for what, names, or_raw, genes_of in axes:
        genes = pd.Index(names)
        for s in sources:
            if genes_of(s) is None:  # no raw: the field rule refuses it, with its fix
                continue
            have = pd.Index(genes_of(s))
            missing = genes.difference(have, sort=False)
            if manifest.var_join == "inner" and len(missing):
                raise InputError(
                    f"{s.label}: lacks {len(missing)} of the {len(genes)} {what}genes of "
                    f"{where} (e.g. {list(missing[:3])}), which was written with "
                    "var_join='inner' (every cell has every gene). Fix: add them to the "
                    f"input{' (adata.raw)' if what else ''} (as zeros, if it truly has none), "
                    "or rewrite the collection from all inputs with var_join='outer'"
                    f"{or_raw}.")
            extra = have.difference(genes, sort=False)
            if manifest.var_join == "outer" and len(extra):
                raise InputError(
                    f"{s.label}: has {len(extra)} {what}genes {where} lacks (e.g. "
                    f"{list(extra[:3])}); an outer collection holds every gene of its inputs, "
                    "and appending cannot widen the stored shards. Fix: rewrite the collection "
                    f"from all inputs (create_anndata_collection([...], overwrite=True)){or_raw}"
                    ", or drop those genes.")


def _merge_field(f: OutField, stored: FieldInfo, where: str) -> OutField:
    """The new inputs' field ``f`` written as the collection stores it: the stored dtype
    (a safe cast), and categories that only grow at the end."""
    if f.kind != stored.kind:
        raise InputError(f"{f.key}: the new inputs hold it as {f.kind!r}, {where} stores "
                         f"{stored.kind!r}. Fix: convert the column in the inputs, or rewrite "
                         "the collection.")
    dtype = np.dtype(stored.dtype)
    # matrices: the values are checked to fit block by block (FitsStored), floats into an
    # integer collection to be whole numbers too (counts saved as float32); obs columns
    # are not seen by value checks, so their cast must be safe for any value
    matrix = f.kind in ("csr", "dense")
    counts = matrix and f.dtype.kind == "f" and dtype.kind in "iu"
    how = "same_kind" if matrix else "safe"
    if f.kind != "categorical" and not counts and not np.can_cast(f.dtype, dtype, how):
        raise InputError(f"{f.key}: the new inputs hold {f.dtype}, which does not cast to the "
                         f"stored {dtype} of {where} without loss. Fix: convert it in the "
                         f"inputs (e.g. .astype({str(dtype)!r}) where the values fit), or "
                         "rewrite the collection.")
    if f.kind in ("csr", "dense") and stored.shape[1] != f.width:
        raise InputError(f"{f.key}: {f.width} columns in the new inputs, {stored.shape[1]} in "
                         f"{where}.")
    if f.kind != "categorical":  # the stored dtype wins (never settled to float32 anew)
        return dataclasses.replace(f, dtype=dtype, mixed=False)
    old = list(stored.categories or ())
    if bool(stored.ordered) != bool(f.ordered):
        raise InputError(f"{f.key}: ordered={f.ordered} in the new inputs, "
                         f"ordered={stored.ordered} in {where}. Fix: make the inputs agree.")
    known = set(old)
    grown = old + [c for c in (f.categories or []) if c not in known]
    if len(grown) > MAX_LABEL_CATEGORIES:
        raise InputError(f"{f.key}: the new inputs would give it {len(grown)} categories, more "
                         f"than the {MAX_LABEL_CATEGORIES} a label may have (readers would "
                         "leave it out). Fix: drop the column from the collection (rewrite it).")
    codes = pd.Categorical([], categories=range(len(grown))).codes.dtype
    # more categories than the stored codes can index (e.g. 128 with int8 codes): the new
    # shards store wider codes, the field's dtype widens, and the old shards' codes (a
    # narrower integer, the same values) are widened as they are read
    dtype = max(dtype, codes, key=lambda d: d.itemsize)
    if stored.ordered and grown != old:
        raise InputError(f"{f.key}: an ordered categorical cannot take new categories "
                         f"({[c for c in grown if c not in known][:5]}) at the end of "
                         f"{where}'s order. Fix: rewrite the collection.")
    remap = pd.Index(grown).get_indexer(pd.Index(list(f.categories or []), dtype=object))
    luts = None if f.luts is None else [
        None if lut is None else np.where(lut >= 0, remap[np.maximum(lut, 0)], -1).astype(
            lut.dtype) for lut in f.luts]
    # the stored code dtype (or wider, above), not the new inputs' (narrower when they have
    # fewer categories)
    return dataclasses.replace(f, dtype=dtype, categories=grown, luts=luts)


#: how an append's user leaves out a field the new inputs cannot offer: only by a rewrite
_REWRITE = "rewrite the collection from all inputs (create_anndata_collection([...], {}"
_APPEND_OMIT = {"X": _REWRITE.format("overwrite=True)) from inputs without X"),
                "layers": _REWRITE.format("layers=[...], overwrite=True)) without it"),
                "obsm": _REWRITE.format("obsm=[...], overwrite=True)) without it"),
                "obs": _REWRITE.format("obs_columns=[...], overwrite=True)) without it"),
                "raw": _REWRITE.format("raw=False, overwrite=True)) without raw")}


def _append_schema(sources: list[InputSource], coll: Collection) -> Schema:
    """The schema of an append of ``sources`` (every new input, in order: the gene maps are
    indexed by input, and pass 1 looks an input's up by its index; inputs without cells
    take no part in the checks)."""
    manifest, where = coll.manifest, coll.describe()
    _check_genes([s for s in sources if s.n_obs], manifest, where)
    lists = _field_lists(manifest)
    # raw's genes are aligned to the collection's raw genes, as X's to its var_names
    raw = RAW_X in manifest.fields and manifest.raw_var_names is not None
    try:
        schema = resolve_schema(sources, "inner", lists["obs_columns"], lists["layers"],
                                lists["obsm"], pd.Index(manifest.var_names), raw=raw,
                                raw_reference=pd.Index(manifest.raw_var_names) if raw else None,
                                omit=_APPEND_OMIT)
    except InputError as e:
        raise InputError(f"{e} (Appending to {where}, which stores {list(manifest.fields)}: "
                         "every new input must offer every one of them.)") from None
    got = {f.key: f for f in schema.kept}
    missing = [k for k in manifest.fields if k not in got]
    if missing:
        why = {k: schema.unavailable.get(k, "absent") for k in missing}
        raise InputError(f"the new inputs cannot offer {missing}, which {where} stores "
                         f"({why}). Fix: add those fields to every new input, or rewrite the "
                         "collection without them.")
    schema.fields = [_merge_field(got[k], manifest.fields[k], where) for k in manifest.fields]
    schema.var = coll.var  # the stored gene metadata, as every old shard has it
    if raw:
        schema.raw_var = coll.raw_var
    return schema


def append_to_collection(
    collection: str | os.PathLike[str] | Collection,
    adata_paths: Sequence[str | os.PathLike[str] | Any] | str | os.PathLike[str],
    *,
    seed: int = 0,
    max_memory: int | str | None = DEFAULT_MAX_MEMORY,
    progress: bool = True,
    scheduler: Any = None,
    n_workers: int | None = None,
    value_check: Any = None,
    storage_options: dict[str, Any] | None = None,
    data_dtype: Any = None,
    index_dtype: Any = None,
) -> Collection:
    """Add the cells of ``adata_paths`` to a collection in new shards, rewriting nothing.

    Parameters
    ----------
    collection
        A collection (folder, URL on an object store, or :class:`~annbatch_torch.Collection`).
        On a store the new shards are written to a local staging folder (``TMPDIR``) and
        uploaded under a new generation prefix, the manifest last; the append is refused
        if the collection's manifest changed since it was opened.
    adata_paths
        The inputs to add (``.h5ad`` / AnnData-zarr paths or AnnData objects), none of them
        already in the collection.
    seed
        Seed of the shuffle of the new rows among themselves.
    max_memory, progress, scheduler, n_workers, value_check
        As in :func:`~annbatch_torch.create_anndata_collection`.
    storage_options
        For a collection on an object store: as :func:`~annbatch_torch.open_collection`
        takes them.
    data_dtype, index_dtype
        How the new shards store the values and column indices of X, the layers and raw/X,
        as in :func:`~annbatch_torch.create_anndata_collection`; ``None`` (default): as the
        collection was written (``"field"`` and ``"int32"`` for collections written before
        the options, so that they stay readable by the versions that wrote them).
        The new shards may store other dtypes than the old ones (narrower or wider: each
        shard records its own); readers deliver the fields' dtypes from every shard.

    Returns
    -------
    Collection
        The collection, opened again: its old shards first, then the new ones.

    Notes
    -----
    A collection carrying AnnData's ``raw`` (``raw/X``, carried by default when every input
    has it) takes inputs with ``raw`` only: their raw genes are aligned to the collection's
    raw genes as X's are to its genes. To append inputs without ``raw``, the collection must
    first be rewritten without it (``create_anndata_collection([...], raw=False,
    overwrite=True)``).

    Raises
    ------
    InputError
        For inputs the collection's schema cannot take (missing genes of an ``inner``
        collection, genes an ``outer`` one lacks, the same for raw's genes, missing fields
        (``raw`` included), dtypes that do not cast, floats with fractions for an integer
        field, new categories of an ordered categorical), an input already in the
        collection, and bad arguments. Nothing is written then.
    CollectionError
        If ``collection`` is not a finished collection.
    """

    from ..store.remote.location import is_url

    if isinstance(collection, Collection) and collection.url is not None:
        storage_options = (collection.mirror.location.options if storage_options is None
                           else storage_options)
        collection = collection.url
    seed = check_int("seed", seed, 0, error=InputError)
    check_dtype_options("auto" if data_dtype is None else data_dtype,
                        "auto" if index_dtype is None else index_dtype)
    dtypes = (data_dtype, index_dtype)
    if isinstance(adata_paths, str | os.PathLike) or not isinstance(adata_paths, Sequence):
        adata_paths = [adata_paths]
    if not adata_paths:
        raise InputError("adata_paths is empty; pass at least one .h5ad / zarr / AnnData.")
    budget = None if max_memory is None else parse_memory(max_memory)
    if n_workers is not None and scheduler is None:
        raise InputError(f"n_workers={n_workers!r} needs a scheduler (scheduler='processes' or "
                         "'threads'); without one the append runs in this process.")
    if is_url(collection):
        return _append_remote(str(collection), storage_options, adata_paths, seed=seed,
                              budget=budget, progress=progress, scheduler=scheduler,
                              n_workers=n_workers, value_check=value_check, dtypes=dtypes)
    root = Path(collection.path if isinstance(collection, Collection) else collection)
    root = root.expanduser().absolute()
    read_manifest(root)  # not a collection: refused before the lock file is made beside it
    with writer_lock(root):  # one writer at a time (prepare_collection's lock)
        append_locked(root, adata_paths, seed=seed, budget=budget, progress=progress,
                      scheduler=scheduler, n_workers=n_workers, value_check=value_check,
                      dtypes=dtypes)
    return open_collection(root)


def _append_remote(url: str, storage_options: dict[str, Any] | None,
                   adata_paths: Sequence[Any], **kw: Any) -> Collection:
    """:func:`append_to_collection` of a collection on an object store: the new shards and
    manifest staged locally (beside no old shard), then uploaded (see
    :mod:`.upload`)."""
    import tempfile

    from .upload import upload_collection

    coll = open_collection(url, storage_options=storage_options)
    assert coll.mirror is not None
    staging = Path(tempfile.mkdtemp(prefix="annbatch-append-"))
    try:
        append_locked(staging, adata_paths, coll=coll, **kw)
        upload_collection(staging, coll.mirror.location, overwrite=False,
                          progress=kw["progress"], append_to=coll.mirror.manifest_etag)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return open_collection(url, storage_options=storage_options)


def append_locked(root: Path, adata_paths: Sequence[Any], *, seed: int, budget: int | None,
                  progress: bool, scheduler: Any, n_workers: int | None,
                  value_check: Any, coll: Collection | None = None,
                  dtypes: tuple[Any, Any] = (None, None)) -> None:
    """:func:`append_to_collection` for a caller that holds the collection's lock.
    ``coll``: the collection appended to, when it is not the one at ``root`` (a remote
    one: the new shards and manifest are then written to the staging folder ``root``);
    ``dtypes``: its ``data_dtype`` and ``index_dtype`` (``None``: the collection's)."""
    sources: list[InputSource] = []
    tmp: Path | None = None
    early = None
    try:
        # a local cluster starts while the collection and the inputs are opened
        early = start_cluster(scheduler, n_workers)
        if coll is None:
            coll = open_collection(root)  # the current manifest, under the lock
        manifest = coll.manifest
        sources = open_inputs(adata_paths)
        known = {str(r.get("path")) for r in manifest.inputs}
        again = [s.label for s in sources if s.path is not None and str(s.path) in known]
        if again:
            raise InputError(f"{again} are in {coll.describe()} already: their cells would be "
                             "there twice. Fix: pass only new inputs.")
        n_new = sum(s.n_obs for s in sources)
        if n_new == 0:  # nothing to write: the inputs are recorded, as the writer skips them
            logger.warning("%s: no cells to append; only recorded as inputs.",
                           ", ".join(s.label for s in sources))
            _publish(root, root, manifest, [], None, sources, seed)
            return
        schema = _append_schema(sources, coll)
        group_by = coll.group_by  # None where a shard was appended ungrouped
        check_group_by(schema, group_by, coll.describe())  # before any work
        with_cells = [s for s in sources if s.n_obs]
        names = InputNames.read(with_cells)  # every new input's names read once
        warn_shared_obs_names(names)
        warn_repeated_obs_names(names)
        # compared with the collection's names here, before any work (it only warns; its
        # error, damaged name hashes, comes before anything is written). In this thread: a
        # thread of its own beside the first pass made both wait on each other for the GIL
        # (the append slower by ~0.1-0.3 s at 10^7 cells, ~0.1 s of work)
        warn_names_in_collection(names, coll)
        del names
        check = FitsStored({f.key: f.dtype for f in schema.fields
                            if f.kind in ("csr", "dense")}, value_check, coll.describe())
        shuffle = bool(manifest.shuffle)
        writer = dict(manifest.extra.get("writer") or {})
        opts = _stored_options(writer, coll.describe())
        # a collection written before the options stored each field's dtype, int32 indices
        data_dtype, index_dtype = (writer.get(k, old) if v is None else v for k, v, old in
                                   zip(("data_dtype", "index_dtype"), dtypes, (FIELD, "int32")))
        opts["data_dtype"], opts["index_dtype"] = check_dtype_options(data_dtype, index_dtype)
        opts["group_by"] = group_by  # new shards grouped as the others are
        shard_obs = int(writer.get("n_obs_per_shard") or max(coll.shard_sizes or [1]))
        work = _budget.working_memory(budget, n_new)
        shard_obs = min(shard_obs, max(n_new, 1))
        block_obs = _budget.block_size(sources, schema, work, shuffle, shard_obs, opts)
        first = _next_shard(manifest)
        logger.info("Appending %d cells from %d input(s) to %s (%d cells) as new shards "
                    "from shard_%05d.", n_new, len(sources), coll.describe(), manifest.n_obs,
                    first)
        remove_stale_temporaries(root)
        tmp = sibling_path(root, "tmp")
        tmp.mkdir()
        layout = (shard_obs, block_obs)
        # new inputs' genes are mapped to the collection's order by a compiled loop (none
        # where every new input's genes keep the collection's order), here in this process
        # unless worker processes write: numba's start (~0.2 s of Python holding the GIL) is
        # paid now, in this thread. Beside the first pass in a thread of its own it took
        # turns with the pass's Python for the GIL and cost the append more; a local
        # cluster's threads would all wait for it.
        compiled = any(needs_compiled_remap(schema.axis(f.key).maps[s.index],
                                            schema.axis(f.key).sorted[s.index])
                       for f in schema.fields if f.kind == "csr" for s in with_cells)
        if compiled and scheduler in (None, "threads"):
            load_remap()
        shards, dtypes = write_shards(sources, schema, tmp, n_new, layout, shuffle, seed,
                                      work, opts, progress, check, early or scheduler,
                                      first)
        shards = [dataclasses.replace(s, grouped_by=group_by) for s in shards]
        want = {f.key: str(f.logical) for f in schema.fields}  # the stored ones, codes wider
        differ = {k: (v, want[k]) for k, v in dtypes.items()
                  if k in manifest.fields and v != want[k]}
        if differ:  # never a shard the collection's readers would read as another type
            raise InputError(f"the new shards would store {differ} (new, stored); nothing "
                             f"was added to {coll.describe()}. Fix: convert those fields in the "
                             "inputs.")
        sync_tree(tmp)
        _publish(root, tmp, manifest, shards, schema, sources, seed)
    finally:
        if early is not None:
            early.close()
        for s in sources:
            s.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


#: cells of shards written before obs_name hashes were stored (their names are read, ~1 s
#: per 400k cells) up to which an append's names are compared with theirs; shards with
#: stored hashes (:data:`~annbatch_torch.store.metadata.NAME_HASHES`) are always compared
NAME_CHECK_MAX_CELLS = 2_000_000


def _in_sorted(values: np.ndarray, sorted_: np.ndarray) -> np.ndarray:
    """Mask of ``values`` found in the sorted array ``sorted_``."""
    if not sorted_.size:
        return np.zeros(values.shape, bool)
    at = np.minimum(np.searchsorted(sorted_, values), sorted_.size - 1)
    return sorted_[at] == values


#: leading bits of a name hash that index :class:`_HashFilter`'s table (4 MiB)
_FILTER_BITS = 22


class _HashFilter:
    """Which stored hashes are among ``new`` (sorted distinct uint64), a shard at a time:
    a table of ``new``'s leading bits lets through the few stored hashes that may be
    (a fraction ~ len(new) / 2**22 of the others), and only those are looked up exactly."""

    def __init__(self, new: np.ndarray) -> None:
        self.new = new
        self.table = np.zeros(1 << _FILTER_BITS, dtype=bool)
        self.table[new >> np.uint64(64 - _FILTER_BITS)] = True

    def hits(self, stored: np.ndarray) -> np.ndarray:
        """The hashes of ``stored`` that are in ``new``."""
        maybe = stored[self.table[stored >> np.uint64(64 - _FILTER_BITS)]]
        return maybe[_in_sorted(maybe, self.new)]


def warn_names_in_collection(names: InputNames, coll: Collection) -> int:
    """Warn, per new input, about obs_names ``coll`` holds already (how many, a few of them);
    returns the count. Compares the new names' hashes with the hashes each shard stores
    (8 bytes a cell); a shard written before those were stored has its obs index read
    instead, up to :data:`NAME_CHECK_MAX_CELLS` cells of such shards (beyond, those shards
    are left out, logged at INFO). Not done for a collection on an object store."""
    if coll.url is not None:
        logger.info("%s: obs_names of the new inputs are not compared with the collection's "
                    "(on an object store); rows are row ids, names are metadata: compare "
                    "them yourself with Source.obs_names if they must be unique.",
                    coll.describe())
        return 0
    if not names.sources:
        return 0
    new = np.unique(np.concatenate(names.unique))
    hits = [np.zeros(0, np.uint64)]
    unhashed = []
    among_new = _HashFilter(new)
    for shard in range(len(coll.shard_sizes)):
        stored = shard_name_hashes(coll.shard_group(shard), coll.shard_name(shard))
        if stored is None:
            unhashed.append(shard)
        else:
            hits.append(among_new.hits(stored))
    cells = sum(coll.shard_sizes[s] for s in unhashed)
    if cells > NAME_CHECK_MAX_CELLS:
        logger.info("%s: obs_names of the new inputs are not compared with those of the %d "
                    "shard(s) written before annbatch_torch stored name hashes (%s cells, "
                    "above %s); compare them yourself with Source.obs_names if they must be "
                    "unique.", coll.describe(), len(unhashed), f"{cells:,}",
                    f"{NAME_CHECK_MAX_CELLS:,}")
        unhashed = []
    for shard in unhashed:
        stored = shard_obs_names(coll.shard_group(shard), coll.shard_sizes[shard],
                                 coll.shard_name(shard))
        hits.append(among_new.hits(np.unique(name_hashes(stored))))
        del stored
    hit = np.unique(np.concatenate(hits))
    total = 0
    for i, s in enumerate(names.sources):
        there = np.isin(names.unique[i], hit, assume_unique=True)
        if there.any():
            total += int(there.sum())
            logger.warning("%s: %d obs_names are in %s already (e.g. %s). %s", s.label,
                           int(there.sum()), coll.describe(),
                           ", ".join(map(repr, names.examples(i, names.unique[i][there]))),
                           NAMES_FIX)
    return total


class FitsStored:
    """A ``value_check`` that refuses matrix values the stored dtype cannot hold (an int
    beyond its range, a float beyond the stored float's, a float that is not a whole number
    for an integer collection, an integer or float a float collection would round: int64
    counts above 2**24 into float32, above 2**53 into float64), then runs the caller's
    check."""

    def __init__(self, dtypes: dict[str, np.dtype], then: Any = None,
                 where: str = "the collection") -> None:
        self.dtypes, self.then, self.where = dtypes, then, where

    def __call__(self, label: str, field: str, block: Any) -> None:
        dtype = self.dtypes.get(field)
        values = block.data if sp.issparse(block) else np.asarray(block)
        if dtype is not None and dtype.kind in "iuf" and values.size:
            # as Python numbers (no numpy scalar cast down to a narrow dtype, no bool or
            # uint64 overflow); floats' extremes past NaN (judged by the caller's check),
            # so that no NaN hides an inf or a huge value
            if values.dtype.kind == "f":
                vmin = float(np.fmin.reduce(values, axis=None))
                vmax = float(np.fmax.reduce(values, axis=None))
            else:
                vmin, vmax = int(values.min()), int(values.max())
            if dtype.kind == "f":
                hi = float(np.finfo(dtype).max)
                beyond = vmin < -hi or vmax > hi
                # integers inside the float's exact range (up to 2**24 for float32, 2**53
                # for float64) need no scan, others are cast back and compared (numpy
                # calls int64 -> float64 safe, which rounds above 2**53); floats too,
                # where the cast is not safe
                whole = 2 ** (np.finfo(dtype).nmant + 1)
                if values.dtype.kind in "biu":
                    scan = not (-whole <= vmin and vmax <= whole)
                else:
                    scan = not np.can_cast(values.dtype, dtype, "safe")
                if not beyond and scan:
                    self._exact(label, field, values, dtype)
            elif values.dtype.kind == "f":  # counts saved as floats, cast when whole
                self._whole(label, field, values, dtype)
                # float(max) may round up to 2**bits, which does not fit: compare with it
                beyond = vmin < int(np.iinfo(dtype).min) or vmax >= float(np.iinfo(dtype).max) + 1
            else:
                beyond = vmin < int(np.iinfo(dtype).min) or vmax > int(np.iinfo(dtype).max)
            if beyond:
                raise InputError(f"{label}: {field} holds values in [{vmin}, {vmax}], beyond "
                                 f"the stored {dtype} of {self.where}. Fix: scale or clip "
                                 "them, or rewrite the collection.")
        if self.then is not None:
            self.then(label, field, block)

    def _exact(self, label: str, field: str, values: np.ndarray, dtype: np.dtype) -> None:
        """Refuse values (int64 counts, float64) that the stored float dtype would round."""
        with np.errstate(invalid="ignore", over="ignore"):  # judged here, value by value
            cast = values.astype(dtype)
            same = cast.astype(values.dtype) == values
        if values.dtype.kind in "iu":  # a float past the integer's range casts back to junk
            info, wide = np.iinfo(values.dtype), cast.astype(np.float64)
            same &= (wide >= float(info.min)) & (wide < float(info.max) + 1)
        if values.dtype.kind == "f":
            same |= np.isnan(values)  # (NaN is judged by the caller's check)
        bad = np.flatnonzero(~same)
        if bad.size:
            i = int(bad[0])
            raise InputError(
                f"{label}: {field} holds {values.dtype} values that {dtype} does not hold "
                f"exactly ({bad.size} in this block, e.g. {values.ravel()[i].item()!r} would be "
                f"stored as {cast.ravel()[i].item()!r}), and {self.where} stores {field} as "
                f"{dtype}. Fix: cast the input yourself where that rounding is acceptable "
                f"(e.g. adata.X = adata.X.astype({str(dtype)!r})), or rewrite the collection "
                "from all inputs (create_anndata_collection([...], overwrite=True)), which "
                "stores a dtype that holds every value.")

    def _whole(self, label: str, field: str, values: np.ndarray, dtype: np.dtype) -> None:
        frac = np.flatnonzero(values != np.trunc(values))
        if frac.size:
            raise InputError(
                f"{label}: {field} holds {values.dtype} values that are not whole numbers "
                f"({frac.size} in this block, e.g. {values.ravel()[frac[0]]}), and "
                f"{self.where} stores {field} as {dtype}, which would cut their fractions "
                "off. Fix: append counts only (e.g. adata.X = adata.layers['counts']), or "
                "rewrite the collection from all "
                "inputs (create_anndata_collection([...], overwrite=True)), which stores "
                f"{dtype} and {values.dtype} together as floats.")


def _stored_options(writer: dict[str, Any], where: str) -> dict[str, Any]:
    """The zarr layout and codec the collection was written with (the new shards match)."""
    compressor = writer.get("compressor", "raw")
    try:
        compressors = compressors_for(compressor, int(writer.get("zarr_format", 3)))
    except (InputError, ValueError, TypeError) as e:
        raise InputError(f"{where} was written with compressor {compressor!r}, which cannot be "
                         f"set up again here ({e}); append to it is not possible.") from e
    fmt = int(writer.get("zarr_format", 3))
    shard_elems = writer.get("zarr_shard_elems")
    return {"zarr_format": fmt, "chunk_elems": int(writer.get("zarr_chunk_elems") or 1 << 16),
            "shard_elems": int(shard_elems) if shard_elems and fmt == 3 else None,
            "compressors": compressors}


def _next_shard(manifest: Manifest) -> int:
    """The first free shard number after the collection's shards."""
    names = [s.path.rsplit("/", 1)[-1] for s in manifest.shards]  # g-<gen>/ on a store
    nums = [int(n[6:11]) for n in names if n.startswith("shard_") and n[6:11].isdigit()]
    return max(nums, default=-1) + 1


def _publish(root: Path, tmp: Path, manifest: Manifest, shards: list[ShardInfo],
             schema: Schema | None, sources: list[InputSource], seed: int) -> None:
    """Move the new shards in, then replace the manifest (atomically, last)."""
    import secrets

    generation = secrets.token_hex(8)
    shards = [dataclasses.replace(s, generation=generation) for s in shards]
    # the inputs' records first: one that vanished meanwhile is refused before any shard
    # is moved in
    records = [{**s.record(), "generation": generation} for s in sources]
    listed = {s.path for s in manifest.shards}
    for s in shards:
        target = root / s.path
        if s.path in listed:  # never replace a shard of the collection
            raise CollectionError(f"{target}: the new shard's name is taken; internal error.")
        if target.exists():  # left by an interrupted append: no manifest lists it
            shutil.rmtree(target)
        os.rename(tmp / s.path, target)
    sync_dir(root)
    fields = dict(manifest.fields)
    for f in schema.fields if schema is not None else ():
        if f.kind == "categorical":
            fields[f.key] = dataclasses.replace(fields[f.key], categories=tuple(f.categories),
                                                dtype=str(np.dtype(f.dtype)))
    appended = list(manifest.extra.get("appended") or [])
    appended.append({"generation": generation, "seed": seed, "n_obs": sum(s.n_obs for s in
                                                                            shards)})
    new = dataclasses.replace(
        manifest, n_obs=manifest.n_obs + sum(s.n_obs for s in shards),
        shards=[*manifest.shards, *shards], fields=fields,
        inputs=[*manifest.inputs, *records],
        extra={**manifest.extra, "appended": appended})
    write_manifest(root, new)
    with contextlib.suppress(OSError):
        sync_dir(root)
