"""Low-level I/O of the offline shuffle: routing rows to bucket files, and shard stores.

Pass 1 appends rows to the bucket of their destination shard. A bucket is one raw binary
file made of frames; each frame holds a block of rows as a header (magic, row count, byte
length of every segment) followed by the segments, in a fixed order given by
:func:`bucket_segments`::

    pos (int64, row's position inside the shard) | name_len (int32) | name_bytes (uint8)
    then per field: CSR -> row nnz (int32), column indices (int32), values (dtype)
                    obsm -> values (dtype, width per row); obs -> codes / values

A bucket holds the rows of one position block of one shard (see :func:`route_block`).
Pass 2 sizes a shard's arrays from its buckets' frame headers (:func:`bucket_totals`), then
loads each bucket with :func:`load_bucket` straight into preallocated arrays (no extra copy)
and appends it to the shard store (:class:`.shardstore.ShardStore`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from ..errors import CollectionError, InputError
from ..store.checks import check_csr, check_finite

if TYPE_CHECKING:
    from ..store.inputs import InputSource
    from .schema import Schema

__all__ = ["Segment", "bucket_segments", "BucketWriter", "load_bucket", "bucket_totals",
           "encode_names", "decode_names", "compressors_for", "iter_blocks", "route_block",
           "bucket_id", "release_memory", "check_int64", "route_rows", "write_shard_blocks"]

_MAGIC = 0x4142544F52434831  # frame marker


def _load_trim() -> Any:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _load_trim()


def release_memory() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``; no-op elsewhere).

    Blocks and shards are large, short-lived arrays: without this, glibc keeps freed
    memory mapped in its arenas and RSS creeps above the ``max_memory`` budget.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@dataclass(frozen=True)
class Segment:
    """One array of a bucket frame: ``per_row`` elements per row (0: variable length);
    ``matrix`` ones are 2-D (``(rows, per_row)``, even with one column)."""

    name: str
    dtype: np.dtype
    per_row: int
    matrix: bool = False


def bucket_segments(fields: list[Any]) -> list[Segment]:
    """Segments of a bucket frame for the output ``fields`` (``writer.OutField``)."""
    segs = [Segment("pos", np.dtype(np.int64), 1), Segment("name_len", np.dtype(np.int32), 1),
            Segment("name_bytes", np.dtype(np.uint8), 0)]
    for f in fields:
        if f.kind == "csr":
            segs += [Segment(f"{f.key}:len", np.dtype(np.int32), 1),
                     Segment(f"{f.key}:idx", np.dtype(np.int32), 0),
                     Segment(f"{f.key}:data", f.dtype, 0)]
        elif f.kind == "dense":
            segs.append(Segment(f.key, f.dtype, int(f.width), matrix=True))
        elif f.kind == "categorical":
            segs.append(Segment(f.key, np.dtype(np.int32), 1))
        else:
            segs.append(Segment(f.key, f.dtype, 1))
    return segs


def encode_names(names: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """UTF-8 encode obs names: ``(lengths int32, concatenated bytes uint8)``."""
    if len(names) == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.uint8)
    try:  # vectorised ASCII path
        fixed = np.asarray(names, dtype=str).astype("S")
        width = fixed.dtype.itemsize
        lens = np.char.str_len(fixed).astype(np.int32)
        grid = fixed.view(np.uint8).reshape(len(fixed), width)
        return lens, grid[np.arange(width)[None, :] < lens[:, None]]
    except UnicodeEncodeError:
        enc = [str(s).encode() for s in names]
        lens = np.fromiter((len(e) for e in enc), dtype=np.int32, count=len(enc))
        return lens, np.frombuffer(b"".join(enc), dtype=np.uint8)


def decode_names(lens: np.ndarray, data: np.ndarray) -> np.ndarray:
    n = len(lens)
    if n == 0:
        return np.zeros(0, dtype=object)
    offs = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=offs[1:])
    if not data.size or int(data.max()) < 128:  # ASCII: scatter into a fixed-width grid
        width = max(int(lens.max()), 1)
        grid = np.zeros((n, width), dtype=np.uint8)
        rows = np.repeat(np.arange(n), lens)
        cols = np.arange(len(data)) - np.repeat(offs[:-1], lens)
        grid[rows, cols] = data
        return grid.view(f"S{width}").ravel().astype(f"U{width}").astype(object)
    buf = data.tobytes()
    return np.array([buf[offs[i] : offs[i + 1]].decode() for i in range(n)], dtype=object)


def _write_all(f: Any, buf: memoryview) -> None:
    while len(buf):
        buf = buf[f.write(buf):]


class BucketWriter:
    """Append frames to bucket files ``folder/bucket_<i>.bin`` (unbuffered, LRU of fds)."""

    def __init__(self, folder: Path, segments: list[Segment], max_open: int = 256) -> None:
        self.folder, self.segments, self.max_open = Path(folder), segments, max_open
        self._files: OrderedDict[int, Any] = OrderedDict()
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, bucket: int) -> Path:
        return self.folder / f"bucket_{bucket:05d}.bin"

    def _file(self, bucket: int) -> Any:
        f = self._files.pop(bucket, None)
        if f is None:
            if len(self._files) >= self.max_open:
                self._files.popitem(last=False)[1].close()
            f = open(self.path(bucket), "ab", buffering=0)  # noqa: SIM115 - cached handle
        self._files[bucket] = f
        return f

    def append(self, bucket: int, n_rows: int, arrays: list[np.ndarray]) -> None:
        """Append one frame of ``n_rows`` rows; ``arrays`` follow :attr:`segments`."""
        arrays = [np.ascontiguousarray(a, dtype=s.dtype) for a, s in zip(arrays, self.segments)]
        header = np.array([_MAGIC, n_rows, *[a.nbytes for a in arrays]], dtype=np.int64)
        f = self._file(bucket)
        _write_all(f, memoryview(header.tobytes()))
        for a in arrays:
            if a.nbytes:
                _write_all(f, memoryview(a).cast("B"))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _frames(path: Path, f: Any, k: int) -> list[tuple[int, np.ndarray]]:
    """``(offset of the segments, byte length of each of the k segments)`` of every frame."""
    frames: list[tuple[int, np.ndarray]] = []
    size, off = os.fstat(f.fileno()).st_size, 0
    while off < size:
        f.seek(off)
        head = np.frombuffer(f.read(8 * (k + 2)), dtype=np.int64)
        if len(head) != k + 2 or head[0] != _MAGIC:
            raise CollectionError(f"{path}: damaged temporary bucket at byte {off}.")
        frames.append((off + 8 * (k + 2), head[2:].copy()))
        off += 8 * (k + 2) + int(head[2:].sum())
    return frames


def _bucket_paths(path: Path | Sequence[Path]) -> list[Path]:
    """The files of one bucket that exist (one per pass-1 task that wrote to it)."""
    paths = [path] if isinstance(path, Path) else list(path)
    return [p for p in paths if p.exists()]


def bucket_totals(path: Path | Sequence[Path], segments: list[Segment]) -> dict[str, int]:
    """Elements of every segment in a bucket (from its frame headers; nothing else read),
    held in one file or in several. A bucket that was never written holds nothing."""
    totals = np.zeros(len(segments), dtype=np.int64)
    for p in _bucket_paths(path):
        with open(p, "rb", buffering=0) as f:
            for _, lens in _frames(p, f, len(segments)):
                totals += lens
    return {s.name: int(t) // s.dtype.itemsize for t, s in zip(totals, segments)}


def load_bucket(path: Path | Sequence[Path], segments: list[Segment]) -> dict[str, np.ndarray]:
    """Read every frame of a bucket (one file or several) into one preallocated array per
    segment (a bucket that was never written: empty arrays)."""
    k = len(segments)
    files = []
    for p in _bucket_paths(path):
        with open(p, "rb", buffering=0) as f:
            files.append((p, _frames(p, f, k)))
    totals = np.zeros(k, dtype=np.int64)
    for _, frames in files:
        for _, lens in frames:
            totals += lens
    out = [np.empty(int(t) // s.dtype.itemsize, dtype=s.dtype) for t, s in zip(totals, segments)]
    cursor = [0] * k
    for p, frames in files:
        with open(p, "rb", buffering=0) as f:
            for start, lens in frames:
                f.seek(start)
                for j, n in enumerate(lens):
                    n = int(n)
                    view = memoryview(out[j].view(np.uint8))[cursor[j] : cursor[j] + n]
                    while len(view):
                        view = view[f.readinto(view):]
                    cursor[j] += n
    arrays = {}
    n_rows = out[0].size if out else 0  # the first segment is "pos": one per row
    for s, a in zip(segments, out):
        arrays[s.name] = a.reshape(n_rows, s.per_row) if s.matrix else a
    return arrays


def compressors_for(compressor: Any, zarr_format: int) -> Any:
    """zarr ``compressors`` for a codec name or codec objects.

    ``"raw"`` (default): no compression, a CRC-32C per chunk (zarr v3 ``crc32c`` codec);
    read directly by :mod:`annbatch_torch.store.rawzarr`, the fastest path, and corruption is
    detected. ``"lz4"`` / ``"zstd"``: Blosc, 3-5x smaller on disk, decoded by zarr or zarrs
    (slower reads), followed by a CRC-32C in zarr v3 (Blosc does not verify its payload; in
    zarr v2 a damaged chunk can decode to wrong values). ``"none"``: raw chunks without
    checksums.
    """
    if not isinstance(compressor, str):
        return compressor
    name = compressor.lower()
    if name in ("none", ""):
        return None
    if name == "raw":
        if zarr_format == 2:
            return None
        from zarr.codecs import Crc32cCodec

        return [Crc32cCodec()]
    if name not in ("lz4", "zstd", "lz4hc", "blosclz", "zlib"):
        raise InputError(
            f"compressor {compressor!r} unknown; use 'raw', 'lz4', 'zstd' or 'none'."
        )
    clevel = 3 if name == "zstd" else 5
    if zarr_format == 2:
        from numcodecs import Blosc

        return Blosc(cname=name, clevel=clevel, shuffle=Blosc.SHUFFLE)
    from zarr.codecs import BloscCodec, Crc32cCodec

    # Blosc does not verify its payload: a CRC-32C makes a damaged chunk an error (zarrs
    # validates it on the whole-chunk reads annbatch_torch makes, see store.zarrs.ChunkAligned)
    return [BloscCodec(cname=name, clevel=clevel, shuffle="shuffle"), Crc32cCodec()]


# -- pass 1: route rows to buckets -----------------------------------------------------
def _remap(m: Any, col_map: np.ndarray | None, is_sorted: bool, n_out: int,
           dtype: np.dtype) -> sp.csr_matrix:
    """Block rows in the collection's var order and dtype (sparse in, sparse out)."""
    if not sp.issparse(m):
        m = sp.csr_matrix(np.asarray(m, dtype=dtype))  # scipy has no float16: cast first
    # a copy when sorting in place below (the block may view an in-memory input's arrays);
    # else one only if the dtype changes (numpy 2's
    # copy=False would refuse that cast: inputs of different dtypes are promoted)
    data = np.array(m.data, dtype=dtype) if not is_sorted else np.asarray(m.data, dtype=dtype)
    indices, indptr = m.indices, m.indptr
    if col_map is not None:
        indices = col_map[indices]
        keep = indices >= 0
        if not keep.all():
            cs = np.zeros(len(keep) + 1, dtype=np.int64)
            np.cumsum(keep, out=cs[1:])
            indptr, indices, data = cs[indptr], indices[keep], data[keep]
    out = sp.csr_matrix((data, indices, indptr), shape=(m.shape[0], n_out))
    if not is_sorted:
        out.has_sorted_indices = False
        out.sort_indices()
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


def bucket_id(shard: Any, block: Any, shard_obs: int, block_obs: int) -> Any:
    """Bucket of block ``block`` of shard ``shard`` (scalars or arrays)."""
    return shard * -(-shard_obs // block_obs) + block


def route_block(src: InputSource, schema: Schema, readers: dict[str, Any],
                 obs_readers: dict[str, Any], a: int, b: int, ips: dict[str, np.ndarray],
                 dest: np.ndarray, shard_obs: int, block_obs: int, buckets: BucketWriter,
                 value_check: Callable[[str, str, Any], None] | None) -> None:
    """Pass 1 for rows ``[a, b)`` of ``src``: read every field, align genes and category
    codes to the schema, and append the rows to the buckets of their position blocks.

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
                check_finite(src.label, f.key, block, first_row=a)  # NaN/inf refused
                check_csr(src.label, f.key, block, first_row=a)  # indices inside [0, n_cols)
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
                block = _remap(block, axis.maps[i], axis.sorted[i], int(f.width),
                               f.dtype)
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
            lut = f.luts[i] if f.luts else None  # type: ignore[index]
            if values.dtype.kind in "iu":
                values = lut[values.astype(np.int64)]  # code -1 hits the trailing -1
            else:
                values = pd.Index(f.categories).get_indexer(pd.Index(values, dtype=object))
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
               on_block: Callable[[int], Any] | None = None) -> bool:
    """Pass 1 for rows ``[start, stop)`` of ``src``: read in blocks that fit ``work`` and
    routed (:func:`route_block`) into ``buckets``.

    ``dest[i]`` is the output position of row ``start + i`` (``None``: in order, row ``r`` at
    ``offset + r``); ``layout`` is ``(shard_obs, block_obs)``. ``stop_if`` is asked before
    each block (``False`` is returned when it says stop); ``on_block`` gets each block's
    row count. Returns ``True`` when every row was routed.
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
                    value_check)
        del d, ips
        release_memory()
        if on_block is not None:
            on_block(b - a)
    return True


def write_shard_blocks(path: Path, n: int, bucket_paths: Sequence[Path | Sequence[Path]],
                       schema: Schema, layout: tuple[int, int], opts: dict[str, Any],
                       where: str, *, delete: bool = False,
                       on_block: Callable[[int], Any] | None = None) -> dict[str, str]:
    """Pass 2 for one shard of ``n`` rows: its blocks' buckets (``bucket_paths[j]``, one file
    or several) put in position order and written to a new shard store at ``path``
    (:class:`~.shardstore.ShardStore`); ``delete``: each block's bucket files once written.
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
                           schema.raw_var)
        for j, p in enumerate(bucket_paths):
            arrays = load_bucket(p, segments)
            store.append(arrays, j * block_obs)
            del arrays
            release_memory()
            if delete:
                for f in _bucket_paths(p):
                    os.remove(f)
            if on_block is not None:
                on_block(min(n, (j + 1) * block_obs) - j * block_obs)
        dtypes = store.close()
    del store
    release_memory()
    return dtypes
