"""Offline shuffle of AnnData inputs into a collection: :func:`create_anndata_collection`.

Algorithm (out of core, exact global shuffle, every input read once, sequentially):

1. Open and probe every input (nothing is loaded), resolve one schema: the var order
   (``"inner"``: genes of the first input that all inputs have; ``"outer"``: every gene,
   in first-seen order; or a reference ``var_names`` list), the fields to carry, the global
   (union) categories, and the var columns every input agrees on (:mod:`.varmeta`).
2. Draw one permutation of all ``N`` rows from ``seed`` (identity with ``shuffle=False``):
   input row ``g`` goes to output position ``pos[g]``; shard ``s`` holds positions
   ``[s*S, (s+1)*S)``.
3. Pass 1 streams each input in row blocks sized from the memory budget, remaps sparse column
   indices to the collection's var order (never densifying), maps category codes to the
   global codes, and appends each row, with its position, to the temporary bucket file of
   its shard.
4. Pass 2, shard by shard: load the bucket, put rows in position order, write the shard as
   a standard AnnData zarr store (X and layers CSR, obsm dense, obs categoricals with the
   global categories, so stored codes are global codes), delete the bucket.
5. ``fsync`` every shard file and folder, write ``manifest.json`` last and rename the
   temporary folder into place (then ``fsync`` its parent): a power loss never leaves a
   manifest over shard files that did not reach the disk.

Memory: ``max_memory`` bounds the peak RSS of the whole process. Once the inputs are
opened and the schema resolved, the writer measures the RSS already in use (interpreter and
libraries, ~300 MB with torch; open inputs; anything the caller holds, in-memory AnnData
inputs included) and sizes its buffers from ``max_memory`` minus that, the permutation (4
bytes per cell, 8 above 2**32 cells) and a 48 MB reserve (zarr's thread pool, allocator
slack): pass-1 blocks take about half of this working memory, a CSC file input (it cannot
be read by rows, so it is loaded whole) at most a quarter, a pass-2 shard (its bucket, one
field's sorted copy and its obs_names) about 80% (see :mod:`.budget`). Under 64 MB
of working memory is an :class:`InputError` naming the measured baseline and the
``max_memory`` to pass. Freed memory is handed back to the OS after every block and shard
(glibc ``malloc_trim``), and h5py files are opened without chunk cache. Not bounded: an
explicit ``n_obs_per_shard`` (a pass-2 shard holds about twice its uncompressed size) and
the CSR copy of an in-memory CSC AnnData. Off Linux the RSS is read with ``psutil``;
without it the baseline counts as zero.

Disk: the temporary buckets take about the uncompressed size of the data (X, layers,
obsm, obs) next to the output; each bucket is deleted once its shard is written. An
interrupted write leaves ``<output>.tmp-<host>-<pid>-<hex>`` behind; the next write to the
same output removes it once that process is gone.

Defaults: ``max_memory=None`` (640 MB of buffers on top of the process' RSS);
``n_obs_per_shard`` derived from the working memory and the measured bytes per row, capped
at 2**20 and rounded down to a multiple of 1024; zarr format 3 (anndata 0.12 reads and
writes it); data/indices chunks of 2**16 elements (256 KiB of float32: small enough that a
random 512-row read fetches little it does not use, large enough to keep file counts and
per-chunk overhead low), obsm chunks of ``2**16 // width`` rows, obs columns 2**16 rows;
codec ``"raw"``: uncompressed chunks with a CRC-32C each, which
:mod:`annbatch_torch.store.rawzarr` reads straight into the pool buffers (2-3x the throughput of
zarr-python decoding Blosc lz4 here) while still detecting corrupted chunks. ``"lz4"`` is
~3.5x smaller on count data (``"zstd"`` ~5x) at the cost of slower reads. Every chunk is
written, including all-zero ones (the manifest says so, readers check it). All overridable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError, check_int
from ..store.collection import Collection, open_collection
from ..store.inputs.fingerprint import Fingerprints
from ..store.inputs.plan import (
    InputNames,
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
    write_manifest,
)
from ..store.remote.location import RemoteLocation, is_url
from . import budget as _budget
from .buckets import BucketWriter, bucket_id, bucket_segments
from .budget import parse_memory
from .grouping import check_group_by, class_codes, group_in_shards
from .narrow import check_dtype_options, dtype_options
from .parallel import run_parallel, start_cluster
from .passes import route_rows, write_shard_blocks
from .publish import (
    check_output,
    remove_stale_temporaries,
    sibling_path,
    start_writeback,
    swap_into_place,
    sync_dir,
    sync_tree,
    writer_lock,
)
from .schema import Schema, check_reference, resolve_schema
from .shardstore import compressors_for, stored_arrays

__all__ = ["create_anndata_collection", "parse_memory", "DEFAULT_MAX_MEMORY",
           "DEFAULT_CHUNK_ELEMS", "DEFAULT_SHARD_ELEMS", "VAR_JOINS"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_MEMORY = None  # 640 MB of buffers on top of what the process uses
DEFAULT_CHUNK_ELEMS = 1 << 16
DEFAULT_SHARD_ELEMS = 1 << 23
VAR_JOINS = ("inner", "outer")
def _as_list(v: Any) -> list[Any] | None:
    return None if v is None else [v] if isinstance(v, str) else list(v)


def shard_layout(n_total: int, shard_obs: int) -> str:
    """How ``n_total`` rows fill shards of ``shard_obs``: ``"3 shards of 1,024 rows (the
    last 652)"``, ``"1 shard of 700 rows"``."""
    n = -(-n_total // shard_obs)
    if n <= 1:
        return f"1 shard of {n_total:,} rows"
    last = n_total - (n - 1) * shard_obs
    return f"{n} shards of {shard_obs:,} rows" + (f" (the last {last:,})" if last != shard_obs
                                                  else "")


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="cells", unit_scale=True, disable=not enabled,
                dynamic_ncols=True, leave=False)


def create_anndata_collection(
    adata_paths: Sequence[str | os.PathLike[str] | Any] | str | os.PathLike[str] | Any,
    output_path: str | os.PathLike[str],
    *,
    shuffle: bool = True,
    seed: int | None = 0,
    var_join: str = "inner",
    var_names: Sequence[str] | None = None,
    obs_columns: Sequence[str] | None = None,
    layers: Sequence[str] | None = None,
    obsm: Sequence[str] | None = None,
    raw: bool | None = None,
    n_obs_per_shard: int | None = None,
    max_memory: int | str | None = DEFAULT_MAX_MEMORY,
    overwrite: bool = False,
    progress: bool = True,
    zarr_format: int = 3,
    zarr_chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    zarr_shard_elems: int | None = DEFAULT_SHARD_ELEMS,
    compressor: Any = "raw",
    data_dtype: Any = "auto",
    index_dtype: Any = "auto",
    value_check: Callable[[str, str, Any], None] | None = None,
    scheduler: Any = None,
    n_workers: int | None = None,
    storage_options: dict[str, Any] | None = None,
    group_by: str | None = None,
) -> Collection:
    """Shuffle AnnData inputs into a collection of zarr shards, out of core.

    Parameters
    ----------
    adata_paths
        Inputs, mixed freely: ``.h5ad`` paths, AnnData zarr store paths, ``AnnData``
        objects (in memory or backed), legacy ``.h5ad`` files (anndata < 0.7) included.
        X may be CSR, CSC, dense or absent (X is None in every input: a collection
        without X).
    output_path
        The collection folder to create, or a URL on an object store
        (``s3://bucket/prefix``...): the collection is then written to a local staging
        folder (``TMPDIR``) and uploaded, its manifest last (see
        ``write/upload.py``).
    shuffle
        Spread rows of all inputs uniformly over all shards (exact global shuffle). With
        False, rows keep input order.
    seed
        Seed of the shuffle: the same seed gives the same store, another seed another
        order. ``None`` draws one (recorded in the manifest).
    var_join
        ``"inner"``: genes present in every input; ``"outer"``: every gene, absent genes
        are implicit zeros. Order: first-seen across inputs. Not used with ``var_names``.
    var_names
        A reference gene list (e.g. a foundation model's vocabulary): the collection's genes
        are exactly these, in this order; genes an input lacks are zeros for its cells,
        genes not in the list are dropped (each input's counts are logged; a WARNING when
        an input has under half of them). The manifest records ``var_join="reference"``.
    obs_columns
        obs columns to carry; ``None``: every column present in all inputs (categorical,
        numeric, bool; strings become categorical, which is logged).
    layers, obsm
        Layers / obsm entries to carry; ``None``: those present (and readable) in all
        inputs, others left out with a warning. An explicit name missing from an input,
        or failing a rule, is an :class:`InputError`.
    raw
        AnnData's ``raw`` (``raw.X`` and its genes, often all genes beside X's highly
        variable ones): ``None`` carries it as field ``raw/X`` when every input has it
        (else it is left out with a warning), ``True`` requires it, ``False`` leaves it
        out. Its genes are joined like X's (``var_join``, ``var_names``) and kept apart
        (:attr:`Collection.raw_var_names <annbatch_torch.Source.raw_var_names>`); each
        shard stores it as AnnData does.
    n_obs_per_shard
        Rows per shard; default 2**17 (halved while what a shard holds until it is written,
        its obs names and columns, would take over 40% of the working memory). Any value
        fits ``max_memory``: pass 2 writes a shard in blocks of rows sized from the memory
        (``n_obs_per_block`` in the manifest).
    max_memory
        Memory budget in bytes or as a string (``"1GB"``, ``"512MiB"``): the peak RSS of
        the whole process, the memory already in use when the writer starts included
        (~300 MB for the interpreter and libraries, plus what the caller holds). The
        writer's buffers get what is left after that, the permutation (4 bytes per cell)
        and a 48 MB reserve; under 64 MB left raises :class:`InputError` (see the module
        docs). Default ``None``: 640 MB of buffers on top of what the process already
        uses (~1 GB peak from a fresh interpreter; never refused, also inside a big
        training process).
    overwrite
        Replace an existing collection at ``output_path`` (atomically: the old one is
        deleted only once the new one is complete). Without it an existing output is an
        error. A non-empty folder that is not a collection is never deleted.
    progress
        Show tqdm progress bars (cells/s) on stderr.
    zarr_format, zarr_chunk_elems, zarr_shard_elems, compressor
        Storage of the shards: zarr format (3 or 2), elements per chunk of 1-D arrays
        (obsm chunks hold ``zarr_chunk_elems // width`` rows), elements per zarr v3 shard
        file of X, layers and obsm (default 2**23: 32 MiB of float32, a few files per
        collection shard; lowered when ``max_memory`` is tight; ``None`` or 0: one file per
        chunk; ignored by zarr format 2), and the codec: ``"raw"`` (default:
        uncompressed + CRC-32C), ``"lz4"`` (Blosc lz4, byte shuffle), ``"zstd"`` (Blosc
        zstd level 3), ``"none"`` (uncompressed, no checksum), or zarr codec objects.
        lz4 and zstd are followed by a CRC-32C in zarr v3 (Blosc does not verify its
        payload); in zarr v2 they carry no checksum (see docs/format.md).
    data_dtype
        How the values of X, the layers and raw/X are stored. ``"auto"`` (default): the
        narrowest dtype that holds every value exactly, found while pass 1 reads them:
        ``uint8`` / ``uint16`` / ``uint32`` for whole numbers (``int8`` / ``int16`` /
        ``int32`` with negatives), else float32 when it holds them exactly, else the
        field's dtype. ``"field"``: each field's own dtype. A numpy dtype (``"float32"``,
        ``"uint16"``...) stores that one; a value it cannot hold exactly is an
        :class:`InputError` naming the input, raised at the first block that holds it.
        Readers deliver the field's dtype either way (float32 for float32 inputs): the
        stored values are widened as they are read.
    index_dtype
        How the column indices of X, the layers and raw/X are stored: ``"auto"``
        (default): ``uint16`` for matrices of at most 65,536 genes, else int32;
        ``"int32"``: always int32. ``data_dtype="field", index_dtype="int32"`` writes the
        layout of collections written before these options (format version 1, which
        earlier annbatch_torch versions read).
    value_check
        Hook called as ``value_check(input_label, field, block)`` on every block of X,
        layers and obsm read (CSR matrix or array); raise to reject an input (e.g. NaN or
        negative counts). With a ``scheduler`` it runs in the workers: it must pickle; and
        a field nobody asked for that one block drops for bad values is still checked in the
        blocks of other tasks (the serial writer checks it no more once dropped).
    scheduler
        Where the two passes run. ``None`` (default): this process, one task after the
        other. ``"processes"``: a local Dask cluster of ``n_workers`` processes started for
        this write; ``"threads"``: one process of ``n_workers`` threads (in-memory AnnData
        inputs need it or ``None``). A ``dask.distributed.Client``: its cluster, whose
        workers must see the inputs and the output folder at the same paths (shared
        storage). The shards are the same whatever the scheduler (the same rows at the same
        positions); ``max_memory`` bounds each worker. Needs the ``dask`` extra.
    n_workers
        Workers of a local ``scheduler`` (default: the usable CPUs).
    storage_options
        For a URL ``output_path``: the fsspec filesystem's options (for S3: key,
        secret, endpoint_url...; see :func:`~annbatch_torch.open_collection`).
    group_by
        A categorical obs column (``"cell_type"``): inside every shard, its rows are sorted
        by this column (each class one contiguous run, its rows in shuffled order; missing
        values last). The shards hold the same cells as without it. A
        :class:`~annbatch_torch.ClassBalancedSampler` over the column then reads runs of
        rows of one class instead of single rows (its ``chunk_size``); chunked mode reads
        chunks of mostly one class, mixed by the pool. Recorded in the manifest
        (:attr:`~annbatch_torch.Collection.group_by`); appends group their new shards the
        same way. Default ``None``: rows in shuffled order.

    Returns
    -------
    Collection
        The written collection, opened.

    Raises
    ------
    InputError
        A missing, damaged or non-AnnData input, the same input twice, duplicate var_names
        in an input, an inner join with no genes, X in some inputs but not in others, a
        input sharing no gene with ``var_names`` (or a ``var_names`` that is not a list
        of unique gene names), a field named in ``layers`` / ``obsm`` / ``obs_columns``
        that the inputs cannot
        agree on or that holds bad values (NaN / inf, complex numbers, dates, labels that
        are no strings / numbers / booleans, uint64 above int64; see
        ``store/inputs/harmonize.py``), an unknown ``var_join``, an existing output
        without ``overwrite``, a ``max_memory`` that leaves under 64 MB once the process'
        RSS is subtracted. Nothing is left behind then. Fields *not* named that fail a rule
        are left out with a warning and the reason in the manifest's ``unavailable``, as
        are var columns some input lacks or two inputs disagree on (others are kept:
        :attr:`Collection.var`);
        inputs without cells are skipped with a warning; inputs whose X is None give a
        collection without X; obs_names shared by inputs, or repeated within one, are a
        warning (rows are identified by row ids).
    """
    if var_join not in VAR_JOINS:
        raise InputError(f"var_join={var_join!r} is unknown; use 'inner' (genes in every "
                         "input) or 'outer' (all genes, absent ones are zeros).")
    if raw not in (None, True, False):
        raise InputError(f"raw={raw!r} must be None (carry raw when every input has it), "
                         "True (require it) or False (leave it out).")
    reference = None if var_names is None else check_reference(var_names)
    if reference is not None:
        var_join = "reference"
    budget = None if max_memory is None else parse_memory(max_memory)
    if n_obs_per_shard is not None and (int(n_obs_per_shard) != n_obs_per_shard
                                        or n_obs_per_shard < 1):
        raise InputError(f"n_obs_per_shard={n_obs_per_shard!r} must be a positive integer.")
    if n_workers is not None and scheduler is None:
        raise InputError(f"n_workers={n_workers!r} needs a scheduler (scheduler='processes' or "
                         "'threads'); without one the writer runs in this process.")
    if zarr_format not in (2, 3):
        raise InputError(f"zarr_format={zarr_format!r} must be 2 or 3.")
    zarr_chunk_elems = check_int("zarr_chunk_elems", zarr_chunk_elems, 1, error=InputError,
                                 note=f" (default {DEFAULT_CHUNK_ELEMS})")
    if seed is not None:
        seed = check_int("seed", seed, 0, error=InputError,
                         note=" (or None for a fresh random seed)")
    if isinstance(n_obs_per_shard, bool):
        raise InputError(f"n_obs_per_shard={n_obs_per_shard!r} must be a positive integer.")
    if zarr_shard_elems is not None:
        zarr_shard_elems = check_int(
            "zarr_shard_elems", zarr_shard_elems, 0, error=InputError,
            note=f" (0 or None: one file per chunk; default {DEFAULT_SHARD_ELEMS})")
    stored_data, stored_index = check_dtype_options(data_dtype, index_dtype)
    opts = {"zarr_format": zarr_format, "chunk_elems": int(zarr_chunk_elems),
            "shard_elems": int(zarr_shard_elems) if zarr_shard_elems and zarr_format == 3
            else None,
            "compressors": compressors_for(compressor, zarr_format),
            "data_dtype": stored_data, "index_dtype": stored_index, "group_by": group_by}
    if group_by is not None and (not isinstance(group_by, str) or not group_by.removeprefix(
            "obs/")):
        raise InputError(f"group_by must be an obs column name (or None), got {group_by!r}.")
    if group_by is not None:
        opts["group_by"] = group_by.removeprefix("obs/")  # recorded as the column's name
    if isinstance(adata_paths, str | os.PathLike) or not isinstance(adata_paths, Sequence):
        adata_paths = [adata_paths]
    if not adata_paths:
        raise InputError("adata_paths is empty; pass at least one .h5ad / zarr / AnnData.")
    remote, staging = None, None
    if is_url(output_path):
        from .upload import check_remote_output

        remote = RemoteLocation(str(output_path), storage_options)
        check_remote_output(remote, overwrite)  # refused before the work, not after
        staging = Path(tempfile.mkdtemp(prefix="annbatch-upload-"))
        output_path = staging / "collection"
    elif storage_options is not None:
        raise InputError(f"{output_path}: storage_options are for an output on an object "
                         "store (a URL such as s3://bucket/prefix).")
    try:
        out = _write_local(adata_paths, Path(output_path), overwrite, seed, var_join,
                           reference, obs_columns, layers, obsm, raw, n_obs_per_shard, budget,
                           shuffle, opts, progress, value_check, scheduler, n_workers,
                           compressor)
        if remote is None:
            return open_collection(out)
        from .upload import upload_collection

        upload_collection(out, remote, overwrite, progress)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return open_collection(remote.url, storage_options=storage_options)


def _write_local(adata_paths: Sequence[Any], output_path: Path, overwrite: bool,
                 seed: int | None, var_join: str, reference: Any, obs_columns: Any,
                 layers: Any, obsm: Any, raw: bool | None, n_obs_per_shard: int | None,
                 budget: int | None, shuffle: bool, opts: dict[str, Any], progress: bool,
                 value_check: Callable[[str, str, Any], None] | None, scheduler: Any,
                 n_workers: int | None, compressor: Any) -> Path:
    """The write of :func:`create_anndata_collection` into a local folder (its arguments
    checked); returns the folder."""
    out = Path(output_path).expanduser().absolute()
    disk = [Path(p).expanduser().resolve() for p in adata_paths if isinstance(p, str | os.PathLike)]
    check_output(out, overwrite, disk)
    remove_stale_temporaries(out)
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % (2**63))
    sources: list[InputSource] = []
    tmp: Path | None = None
    # a local cluster starts while the inputs are opened and read (its workers' start-up
    # would otherwise come after all that, on its own)
    early = start_cluster(scheduler, n_workers)
    prints: Fingerprints | None = None
    names_check: ThreadPoolExecutor | None = None
    checked: Future[None] | None = None
    try:
        sources = open_inputs(adata_paths)  # the same input twice is refused
        # the manifest's content fingerprints, read while the write goes on
        prints = Fingerprints([s.path for s in sources if s.path is not None])
        schema = resolve_schema(sources, var_join, _as_list(obs_columns), _as_list(layers),
                                _as_list(obsm), reference, raw)
        check_group_by(schema, opts.get("group_by"), str(out))  # before any work
        with_cells = [s for s in sources if s.n_obs]
        parallel = scheduler is not None  # a local cluster or the caller's Client
        if not parallel:  # done (and its 8 bytes a cell freed) before the budget is measured
            warn_obs_names(with_cells)
        n_total = sum(s.n_obs for s in sources)
        work = _budget.working_memory(budget, n_total if shuffle else 0)
        shard_obs = _budget.fit_layout(sources, schema, work, n_obs_per_shard, opts)
        shard_obs = min(shard_obs, max(n_total, 1))  # more rows than cells: one shard
        block_obs = _budget.block_size(sources, schema, work, shuffle, shard_obs, opts)
        logger.info("Writing %d cells x %d genes (%s join) from %d input(s) into %s at %s "
                    "(written in blocks of %d rows).", n_total, len(schema.var_names),
                    var_join, len(sources), shard_layout(n_total, shard_obs), out, block_obs)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = sibling_path(out, "tmp")
        tmp.mkdir()
        if parallel:  # while this process waits on its workers (after the budget and the
            # layout are set, which its names' memory must not sway)
            names_check = ThreadPoolExecutor(1, thread_name_prefix="annbatch-names")
            checked = names_check.submit(warn_obs_names, with_cells)
        shards, dtypes = write_shards(sources, schema, tmp, n_total, (shard_obs, block_obs),
                                      shuffle, seed, work, opts, progress, value_check,
                                      early or scheduler)
        if checked is not None:
            checked.result()  # (it only warns; an error reading the names is raised here)
        sync_tree(tmp)  # the shards reach the disk before a manifest can vouch for them
        _write_collection_manifest(tmp, sources, schema, shards, dtypes, seed, shuffle,
                                   var_join, (shard_obs, block_obs), budget, opts, compressor,
                                   prints)
        sync_dir(tmp)  # the manifest's own rename
        # a collection replaced: not while an append writes into it
        with writer_lock(out) if out.exists() else contextlib.nullcontext():
            swap_into_place(tmp, out, overwrite)
        sync_dir(out.parent)  # the rename of the collection into place
        tmp = None
    finally:
        if names_check is not None:
            names_check.shutdown(wait=True)  # before the inputs it reads are closed
        if prints is not None:
            prints.close()
        if early is not None:
            early.close()
        for s in sources:
            s.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def warn_obs_names(sources: list[InputSource]) -> None:
    """Warn about obs_names shared between ``sources`` or repeated within one (their hashes,
    8 bytes a cell, held while it runs)."""
    names = InputNames.read(sources)
    warn_shared_obs_names(names)
    warn_repeated_obs_names(names)


def permutation(n_total: int, shuffle: bool, seed: int) -> np.ndarray | None:
    """``dest[g]``: the output position of global input row ``g`` (``None``: in order)."""
    if not shuffle:
        return None
    dest = np.arange(n_total, dtype=np.uint32 if n_total < 2**32 else np.int64)
    np.random.default_rng(seed).shuffle(dest)
    return dest


def destinations(sources: list[InputSource], schema: Schema, n_total: int,
                 layout: tuple[int, int], shuffle: bool, seed: int,
                 opts: dict[str, Any]) -> np.ndarray | None:
    """``dest[g]``, the output position of global input row ``g`` (``None``: in order):
    :func:`permutation`, its rows grouped by class inside each shard with ``group_by``
    (:mod:`.grouping`)."""
    dest = permutation(n_total, shuffle, seed)
    f = check_group_by(schema, opts.get("group_by"), "the write")
    if f is None or not n_total:
        return dest
    return group_in_shards(dest, class_codes(sources, f), layout[0])


def write_shards(sources: list[InputSource], schema: Schema, tmp: Path, n_total: int,
                 layout: tuple[int, int], shuffle: bool, seed: int, work: int,
                 opts: dict[str, Any], progress: bool, value_check: Any, scheduler: Any,
                 first_shard: int = 0) -> tuple[list[ShardInfo], dict[str, str]]:
    """Both passes, in this process (``scheduler=None``) or on Dask (:mod:`.parallel`: a
    :class:`~.parallel.ClusterStart` or a caller's ``Client``): the shards in ``tmp`` and
    the stored dtypes."""
    if scheduler is None:
        return run_serial(sources, schema, tmp, n_total, layout, shuffle, seed, work, opts,
                          progress, value_check, first_shard)
    return run_parallel(sources, schema, tmp, n_total, layout,
                        destinations(sources, schema, n_total, layout, shuffle, seed, opts),
                        work, opts, progress, value_check, scheduler, first_shard)


def run_serial(sources: list[InputSource], schema: Schema, tmp: Path, n_total: int,
               layout: tuple[int, int], shuffle: bool, seed: int, work: int,
               opts: dict[str, Any], progress: bool, value_check: Any,
               first_shard: int = 0) -> tuple[list[ShardInfo], dict[str, str]]:
    """Both passes in this process: the shards (named from ``shard_<first_shard>``) in
    ``tmp`` and the stored dtypes."""
    shard_obs, block_obs = layout
    dest = destinations(sources, schema, n_total, layout, shuffle, seed, opts)
    schema.use_storage(opts)
    buckets = BucketWriter(tmp / ".buckets", bucket_segments(schema.fields))
    offset = 0
    try:
        with _progress(n_total, "shuffle 1/2: bucket", progress) as bar:
            for src in sources:
                if src.n_obs:  # one without takes no part (it may lack others' fields)
                    route_rows(src, schema, (0, src.n_obs), None if dest is None
                               else dest[offset: offset + src.n_obs], offset, layout, work,
                               buckets, value_check, on_block=bar.update, threads=2)
                offset += src.n_obs
    finally:
        buckets.close()
    del dest
    schema.settle_float32()
    shards, dtypes = [], {}
    with _progress(n_total, "shuffle 2/2: write", progress) as bar:
        for s in range(-(-n_total // shard_obs)):
            name = f"shard_{first_shard + s:05d}.zarr"
            n = min(n_total, (s + 1) * shard_obs) - s * shard_obs
            paths = [buckets.path(bucket_id(s, j, shard_obs, block_obs))
                     for j in range(-(-n // block_obs))]
            dtypes = write_shard_blocks(tmp / name, n, paths, schema, layout, opts,
                                        f"{tmp}: shard {s}", stored=schema.stored_in(s),
                                        delete=True,
                                        on_block=bar.update)
            start_writeback(tmp / name)  # on the disk while the next shard is written
            shards.append(ShardInfo(name, n, stored=stored_arrays(dtypes, schema.kept)))
    shutil.rmtree(tmp / ".buckets", ignore_errors=True)
    return shards, dtypes


def _write_collection_manifest(tmp: Path, sources: list[InputSource], schema: Schema,
                               shards: list[ShardInfo], dtypes: dict[str, str], seed: int,
                               shuffle: bool, var_join: str, layout: tuple[int, int],
                               budget: int, opts: dict[str, Any], compressor: Any,
                               prints: Fingerprints) -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        created_by = f"annbatch_torch {version('annbatch-torch')}"
    except PackageNotFoundError:
        created_by = "annbatch_torch"
    fields = {}
    for f in schema.kept:
        shape = (None, int(f.width)) if f.kind in ("csr", "dense") else (None,)
        fields[f.key] = FieldInfo(
            kind=f.kind, dtype=dtypes.get(f.key, str(f.logical)), shape=shape,
            categories=tuple(f.categories) if f.kind == "categorical" else None,
            ordered=f.ordered,
        )
    writer = {"n_obs_per_shard": layout[0], "n_obs_per_block": layout[1],
              "max_memory": budget,
              "zarr_format": opts["zarr_format"], "zarr_chunk_elems": opts["chunk_elems"],
              "zarr_shard_elems": opts["shard_elems"],
              "compressor": compressor if isinstance(compressor, str) else repr(compressor),
              **dtype_options(opts), "group_by": opts.get("group_by")}
    generation = secrets.token_hex(8)  # this write's shards, told apart from a rewrite's
    shards = [dataclasses.replace(s, generation=generation, grouped_by=opts.get("group_by"))
              for s in shards]
    manifest = Manifest(
        n_obs=sum(s.n_obs for s in shards), n_vars=len(schema.var_names), shards=shards,
        fields=fields, var_names=[str(v) for v in schema.var_names], seed=seed,
        shuffle=shuffle, var_join=var_join,
        inputs=[{**s.record(None if s.path is None else prints.get(s.path)),
                 "generation": generation} for s in sources],
        created_by=created_by, all_chunks_written=True,
        extra={"writer": writer, **({"unavailable": schema.unavailable}
                                    if schema.unavailable else {})},
        raw_var_names=None if schema.raw_genes is None or RAW_X not in fields
        else [str(v) for v in schema.raw_genes.names],
    )
    write_manifest(tmp, manifest)
