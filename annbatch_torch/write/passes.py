"""The two passes of the offline shuffle.

Pass 1 (:func:`route_rows`) reads a row range of an input block by block, puts its fields in
the collection's order and dtypes, and appends each row to the bucket of its destination
(a position block of one shard: :func:`route_block`; the bucket file format is
:mod:`.buckets`). Pass 2 (:func:`write_shard_blocks`) sizes a shard's arrays from its buckets'
frame headers (:func:`~.buckets.bucket_totals`), loads each bucket straight into preallocated
arrays (no extra copy), puts its rows in order and appends them to the shard store
(:class:`.shardstore.ShardStore`). The serial writer and the Dask tasks run the same two.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import scipy.sparse as sp

from ..errors import InputError
from ..store.checks import check_csr, check_finite
from .buckets import (
    BucketWriter,
    bucket_files,
    bucket_id,
    bucket_segments,
    bucket_totals,
    encode_names,
    load_bucket,
)
from .budget import release_memory
from .grouping import global_codes
from .remap import check_col_map, needs_compiled_remap, remap_rows, rows_increase

if TYPE_CHECKING:
    from ..store.inputs.view import InputSource
    from .schema import Schema

__all__ = ["check_int64", "iter_blocks", "route_block", "route_rows", "write_shard_blocks"]


# -- pass 1: route rows to buckets -----------------------------------------------------
def _remap(m: Any, col_map: np.ndarray | None, is_sorted: bool, n_out: int,
           dtype: np.dtype, order: np.ndarray | None, threads: int = 1) -> sp.csr_matrix:
    """Block rows ``order`` (``None``: all, in order) in the collection's var order and
    dtype (sparse in, sparse out); ``threads``: see :func:`remap_rows`."""
    compiled = increasing = False
    if col_map is not None and sp.issparse(m) and m.format == "csr":
        # a map that renumbers the genes in order, of rows that increase: a numpy gather
        # below, as fast, and numba's start spared where no other block needs the loop
        increasing = not needs_compiled_remap(col_map, is_sorted) and rows_increase(m)
        if not increasing:
            out = remap_rows(m, col_map, n_out, dtype, order, threads)  # one compiled pass
            if out is not None:
                return out
            compiled = True  # it met a row it could not leave sorted, or no loop for dtype
    if not sp.issparse(m):
        m = sp.csr_matrix(np.asarray(m, dtype=dtype))  # scipy has no float16: cast first
    # the genes keep their order and the rows are sorted (read above, or scipy checks
    # them; the compiled loop refused a row it could not leave sorted, whatever the
    # matrix's flag says)
    sort = compiled or not (is_sorted and (increasing or m.has_sorted_indices))
    # a copy when sorting in place below (the block may view an in-memory input's arrays);
    # else one only if the dtype changes (numpy 2's
    # copy=False would refuse that cast: inputs of different dtypes are promoted)
    data = np.array(m.data, dtype=dtype) if sort else np.asarray(m.data, dtype=dtype)
    indices, indptr = m.indices, m.indptr
    if col_map is not None:
        check_col_map(col_map, m.shape[1], n_out)  # (as the compiled loop does)
        indices = col_map[indices]
        keep = indices >= 0
        if not keep.all():
            cs = np.zeros(len(keep) + 1, dtype=np.int64)
            np.cumsum(keep, out=cs[1:])
            indptr, indices, data = cs[indptr], indices[keep], data[keep]
    elif sort:
        indices = indices.copy()
    out = sp.csr_matrix((data, indices, indptr), shape=(m.shape[0], n_out))
    if sort:
        out.has_sorted_indices = False
        out.sort_indices()
    return out if order is None else out[order]


def summed_duplicates(block: Any) -> Any:
    """``block`` with each column a row holds twice stored once, as their sum in the
    block's own dtype (scipy's value for such a cell, and what the value checks and the
    narrow dtypes must see); on copies, since the arrays may be an in-memory input's own.
    Anything else (canonical CSR, dense) is returned as it is."""
    if not (sp.issparse(block) and block.format == "csr") or block.has_canonical_format:
        return block
    out = sp.csr_matrix((block.data.copy(), block.indices.copy(), block.indptr.copy()),
                        shape=block.shape)
    out.sum_duplicates()
    return out


def _placeholder(f: Any, n: int) -> tuple[str, Any]:
    """Rows of a field left out (see ``Schema.drop``): empty, never written."""
    if f.kind == "csr":
        return "csr", sp.csr_matrix((n, int(f.width)), dtype=f.dtype)
    if f.kind == "dense":
        return "dense", np.zeros((n, int(f.width)), dtype=f.dtype)
    return "col", np.zeros(n, dtype=np.int32 if f.kind == "categorical" else f.dtype)


def check_int64(source: str, field: str, block: Any, first_row: int = 0) -> None:
    """Raise :class:`InputError` if a uint64 block holds a value above 2**63 - 1: the
    collection stores it as int64, what torch batches carry (torch has no uint64)."""
    values = block.data if sp.issparse(block) else np.asarray(block)
    if values.dtype != np.uint64 or not values.size or int(values.max()) < 2**63:
        return
    pos = int(np.flatnonzero(values >= 2**63)[0])
    if sp.issparse(block):
        row = int(np.searchsorted(block.tocsr().indptr, pos, side="right")) - 1
    else:
        row = pos // (int(np.prod(values.shape[1:])) or 1)
    raise InputError(
        f"{source}: field {field!r} holds {int(values.ravel()[pos])} (uint64) at row "
        f"{first_row + row}, above 2**63 - 1: batches carry it as int64 (torch has no "
        "uint64), where it would wrap to a negative number. Fix: store it as float64 "
        "(exact up to 2**53), e.g. m = m.astype('float64'), and write it again."
    )


def route_block(src: InputSource, schema: Schema, readers: dict[str, Any],
                 obs_readers: dict[str, Any], a: int, b: int, ips: dict[str, np.ndarray],
                 dest: np.ndarray, shard_obs: int, block_obs: int, buckets: BucketWriter,
                 value_check: Callable[[str, str, Any], None] | None, threads: int = 1
                 ) -> None:
    """Pass 1 for rows ``[a, b)`` of ``src``: read every field, align genes and category
    codes to the schema, and append the rows to the buckets of their position blocks
    (``threads``: for a CSR block's remap, :func:`remap_rows`).

    ``dest`` holds the rows' output positions; shard ``s`` gets ``[s*shard_obs, ...)``,
    written in blocks of ``block_obs`` positions: bucket :func:`bucket_id` ``(s, j)`` holds
    the rows of the shard's positions ``[j*block_obs, (j+1)*block_obs)``.
    """
    # rows in destination order: shard by shard, and sorted inside each frame, so pass 2
    # merges sorted runs (a cache-friendly gather) instead of fully random rows
    identity = bool(np.all(dest[1:] > dest[:-1]))
    order = None if identity else np.argsort(dest)

    def take(x: Any) -> Any:
        return x if order is None else x[order]

    dest = take(dest)
    shard = dest // shard_obs
    local = dest - shard * shard_obs
    bucket = bucket_id(shard, local // block_obs, shard_obs, block_obs)
    lens, raw = encode_names(take(src.names(a, b)))
    noff = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=noff[1:])
    parts: list[tuple[str, Any]] = []
    i = src.index
    for f in schema.fields:
        if f.key in schema.dropped:  # left out in an earlier block: a placeholder
            parts.append(_placeholder(f, b - a))
            continue
        if f.kind in ("csr", "dense"):
            try:
                block = src.named_read(f"{f.key} rows [{a}, {b})", lambda f=f: readers[
                    f.key].read(a, b, ips.get(f.key)))
                check_csr(src.label, f.key, block, first_row=a)  # indices inside [0, n_cols)
                block = summed_duplicates(block)  # a column twice in a row: one, the sum
                check_finite(src.label, f.key, block, first_row=a)  # NaN/inf refused
                check_int64(src.label, f.key, block, first_row=a)  # uint64 that fits int64
            except InputError as e:
                if f.requested:
                    raise
                schema.drop(f.key, str(e))  # a field nobody asked for: left out
                parts.append(_placeholder(f, b - a))
                continue
            if value_check is not None:
                value_check(src.label, f.key, block)
            if f.kind == "csr":
                axis = schema.axis(f.key)
                block = _remap(block, axis.maps[i], axis.sorted[i], int(f.width), f.dtype,
                               order, threads)
                # what each shard's values can be stored as (.narrow)
                schema.observe(f.key, block.data, block.indptr, shard, src.label)
                parts.append((f.kind, block))
            else:
                block = np.asarray(block.toarray() if sp.issparse(block) else block, f.dtype)
                parts.append((f.kind, take(block)))
            continue
        try:
            values = src.named_read(f"{f.key} rows [{a}, {b})",
                                    lambda f=f: obs_readers[f.key].read(a, b))
        except InputError as e:
            if f.requested:
                raise
            schema.drop(f.key, str(e))
            parts.append(_placeholder(f, b - a))
            continue
        if f.kind == "categorical":
            values = global_codes(f, np.asarray(values), i)
        parts.append(("col", take(np.asarray(values).astype(
            np.int32 if f.kind == "categorical" else f.dtype, copy=False))))
    bounds = np.flatnonzero(np.diff(bucket)) + 1
    starts = np.concatenate([[0], bounds])
    stops = np.concatenate([bounds, [len(bucket)]])
    for r0, r1 in zip(starts.tolist(), stops.tolist()):
        arrays: list[Any] = [local[r0:r1], lens[r0:r1], raw[noff[r0] : noff[r1]]]
        for kind, x in parts:
            if kind == "csr":
                ip = x.indptr
                lo, hi = int(ip[r0]), int(ip[r1])
                arrays += [np.diff(ip[r0 : r1 + 1]), x.indices[lo:hi], x.data[lo:hi]]
            else:
                arrays.append(x[r0:r1])
        buckets.append(int(bucket[r0]), r1 - r0, arrays)


def iter_blocks(src: InputSource, readers: dict[str, Any], budget: int, schema: Schema,
                start: int = 0, stop: int | None = None
                ) -> Iterator[tuple[int, int, dict[str, np.ndarray]]]:
    """Row blocks ``[a, b)`` of ``src`` (of its rows ``[start, stop)``, default all) whose
    in-memory working set fits ``budget``."""
    fixed = 400.0
    nnz_cost: dict[str, float] = {}
    for f in schema.fields:
        if f.kind in ("csr", "dense"):
            r = readers[f.key]
            if r.indptr(0, 0) is None:  # dense input: the block and its CSR copy
                fixed += 3.0 * r.n_cols * max(f.dtype.itemsize, 4)
            else:
                nnz_cost[f.key] = 8.0 + 3.0 * (4 + f.dtype.itemsize) + 8.0
        else:
            fixed += 24.0
    a, n = start, src.n_obs if stop is None else stop
    while a < n:
        b = min(n, a + max(1, min(1 << 20, int(budget // fixed))))
        ips = {k: src.named_read(f"{k}/indptr rows [{a}, {b}]",
                                 lambda k=k, a=a, b=b: readers[k].indptr(a, b))
               for k in nnz_cost}
        cost = fixed * np.arange(1, b - a + 1, dtype=np.float64)
        for k, ip in ips.items():
            cost += (ip[1:] - ip[0]) * nnz_cost[k]
        take = max(1, int(np.searchsorted(cost, budget, side="right")))
        yield a, a + take, {k: ip[: take + 1] for k, ip in ips.items()}
        a += take


def route_rows(src: InputSource, schema: Schema, rows: tuple[int, int],
               dest: np.ndarray | None, offset: int, layout: tuple[int, int], work: int,
               buckets: BucketWriter, value_check: Callable[[str, str, Any], None] | None, *,
               stop_if: Callable[[], bool] | None = None,
               on_block: Callable[[int], Any] | None = None, threads: int = 1) -> bool:
    """Pass 1 for rows ``[start, stop)`` of ``src``: read in blocks that fit ``work`` and
    routed (:func:`route_block`) into ``buckets``.

    ``dest[i]`` is the output position of row ``start + i`` (``None``: in order, row ``r`` at
    ``offset + r``); ``layout`` is ``(shard_obs, block_obs)``. ``stop_if`` is asked before
    each block (``False`` is returned when it says stop); ``on_block`` gets each block's
    row count; ``threads``: 2 lets a block's gene remap use a helper thread (the serial
    writer; a parallel writer's tasks keep to one). Returns ``True`` when every row was
    routed.
    """
    start, stop = rows
    shard_obs, block_obs = layout
    # a CSC input converted to CSR holds it twice: a quarter of the working memory each
    readers = {f.key: src.matrix_reader(f.key, work // 4)
               for f in schema.fields if f.kind in ("csr", "dense")}
    obs = {f.key: src.obs_reader(f.key[4:]) for f in schema.fields if f.key.startswith("obs/")}
    for a, b, ips in iter_blocks(src, readers, work // 2, schema, start, stop):
        if stop_if is not None and stop_if():
            return False
        d = (np.arange(offset + a, offset + b, dtype=np.int64) if dest is None
             else dest[a - start: b - start].astype(np.int64))
        route_block(src, schema, readers, obs, a, b, ips, d, shard_obs, block_obs, buckets,
                    value_check, threads)
        del d, ips
        release_memory()
        if on_block is not None:
            on_block(b - a)
    return True


def write_shard_blocks(path: Path, n: int, bucket_paths: Sequence[Path | Sequence[Path]],
                       schema: Schema, layout: tuple[int, int], opts: dict[str, Any],
                       where: str, *, stored: dict[str, tuple[np.dtype, np.dtype]],
                       delete: bool = False,
                       on_block: Callable[[int], Any] | None = None) -> dict[str, str]:
    """Pass 2 for one shard of ``n`` rows: its blocks' buckets (``bucket_paths[j]``, one file
    or several) put in position order and written to a new shard store at ``path``
    (:class:`~.shardstore.ShardStore`), its CSR fields stored as ``stored`` says
    (``Schema.stored_in``); ``delete``: each block's bucket files once written.
    Returns the stored dtypes. ``where`` names the shard in the error of a row count that
    does not add up."""
    import zarr

    from .shardstore import ShardStore

    block_obs = layout[1]
    segments = bucket_segments(schema.fields)
    totals = [bucket_totals(p, segments) for p in bucket_paths]
    got = sum(t["pos"] for t in totals)
    if got != n:
        raise InputError(f"{where} received {got} rows, expected {n}; an input changed while "
                         "being read?")
    nnz = {f.key: sum(t[f"{f.key}:idx"] for t in totals) for f in schema.kept
           if f.kind == "csr"}
    with zarr.config.set({"array.write_empty_chunks": True}):
        store = ShardStore(path, schema.kept, n, nnz, schema.var_names, opts, schema.var,
                           schema.raw_var, stored=stored)
        for j, p in enumerate(bucket_paths):
            arrays = load_bucket(p, segments)
            store.append(arrays, j * block_obs)
            del arrays
            release_memory()
            if delete:
                for f in bucket_files(p):
                    os.remove(f)
            if on_block is not None:
                on_block(min(n, (j + 1) * block_obs) - j * block_obs)
        dtypes = store.close()
    del store
    release_memory()
    return dtypes
