"""Writing one shard of a collection: a standard AnnData zarr store filled block by block.

Pass 2 of the offline shuffle hands a shard over in position blocks (the rows of positions
``[0, P)``, then ``[P, 2P)``...), so a shard may hold far more rows than fit in memory and a
collection is few files. :class:`ShardStore` creates every array at its final shape up
front (the row count and the non-zeros of each sparse field are known from the buckets),
then appends each block; an :class:`Appender` writes a 1-D or 2-D array front to back in
whole zarr shards (or chunks, unsharded), so no stored shard is ever read back and
rewritten. Only the arrays' tails (under one zarr shard each) wait in memory.

The result is what ``anndata.io.write_elem`` writes: X and layers as ``csr_matrix`` groups
(``data`` and ``indices`` in the stored dtypes :mod:`.narrow` chose, ``indptr`` int64),
obsm as ``array``, obs as a dataframe with the global categories (stored codes are global
codes), var and raw as AnnData has them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..errors import CollectionError, InputError
from ..store.inputs.plan import name_hashes
from ..store.manifest import RAW_X
from ..store.metadata import NAME_HASHES

__all__ = ["Appender", "ShardStore", "array_kwargs", "carry_bytes", "compressors_for",
           "gather_rows", "stored_arrays"]

_EMPTY_GROUPS = ("layers", "obsm", "obsp", "varm", "varp", "uns")
_GATHER_ROWS = 4096  # rows of a CSR field put in order at a time
#: non-zeros per row from which rows are gathered slice by slice (a Python step per row)
#: rather than through an element index (crossover measured near 100)
_SLICE_NNZ = 128


def array_kwargs(opts: dict[str, Any], chunks: tuple[int, ...], shape: tuple[int, ...],
                 sharded: bool = True) -> dict[str, Any]:
    """zarr array options: ``chunks`` clipped to ``shape``, the codecs, and zarr v3 shards of
    about ``opts["shard_elems"]`` elements (whole chunks along axis 0) when set."""
    chunks = tuple(max(1, min(c, s)) for c, s in zip(chunks, shape))
    kw: dict[str, Any] = {"chunks": chunks, "compressors": opts["compressors"]}
    if opts["zarr_format"] == 3:
        kw["shards"] = None
        elems = opts.get("shard_elems")
        if sharded and elems:
            inner = int(np.prod(chunks))
            per = max(1, int(elems) // inner)
            rows = min(chunks[0] * per, max(shape[0], 1))
            rows = -(-rows // chunks[0]) * chunks[0]  # whole chunks
            kw["shards"] = (rows, *chunks[1:])
    return kw


def _unit(kw: dict[str, Any]) -> int:
    """Rows of one stored unit (a zarr shard, else a chunk): the appender's write size."""
    return int((kw.get("shards") or kw["chunks"])[0])


def carry_bytes(fields: list[Any], opts: dict[str, Any], nnz_per_row: dict[str, float],
                n_rows: int) -> int:
    """Memory the appenders of one shard hold at most: per array, one stored unit of tail
    and one being encoded (``fields``: ``writer.OutField``; ``nnz_per_row`` of CSR ones)."""
    chunk = int(opts["chunk_elems"])
    total = 0
    for f in fields:
        if f.kind == "csr":
            nnz = max(int(nnz_per_row.get(f.key, 0) * n_rows * 1.2), 1)
            unit = _unit(array_kwargs(opts, (chunk,), (nnz,)))
            total += 2 * unit * (4 + f.dtype.itemsize)
        elif f.kind == "dense":
            width = max(int(f.width), 1)
            kw = array_kwargs(opts, (max(1, chunk // width), width), (max(n_rows, 1), width))
            total += 2 * _unit(kw) * width * f.dtype.itemsize
    return total


def gather_rows(lens: np.ndarray, starts: np.ndarray, idx: np.ndarray, data: np.ndarray,
                rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``rows`` (in that order) of a CSR piece given as row lengths ``lens``, their
    ``starts`` (``starts[r]``: offset of row ``r`` in ``idx`` / ``data``): ``(lens, idx,
    data)`` of the gathered rows."""
    n = lens[rows].astype(np.int64)
    if len(rows) and int(n.sum()) >= _SLICE_NNZ * len(rows):
        # long rows: copying each row's slice beats an element index (which costs 8 bytes
        # per non-zero written and read, and their page faults)
        first = starts[rows].tolist()
        last = (starts[rows] + n).tolist()
        return (n, np.concatenate([idx[s:e] for s, e in zip(first, last)]),
                np.concatenate([data[s:e] for s, e in zip(first, last)]))
    ends = np.cumsum(n)
    # element j of the piece comes from starts[row] + (j - its row's first j)
    take = np.repeat(starts[rows] - (ends - n), n) + np.arange(int(ends[-1]) if len(ends)
                                                               else 0, dtype=np.int64)
    return n, idx[take], data[take]


class Appender:
    """Write a zarr array along axis 0 in order, whole stored units at a time.

    :meth:`append` takes the next rows; full units go straight from the caller's array to
    zarr, a tail under one unit is copied into a buffer of one unit and completed by the
    next call. :meth:`close` writes the last, partial unit and checks the array is full.
    """

    def __init__(self, array: Any, unit: int) -> None:
        self.array, self.unit = array, max(int(unit), 1)
        self.pos = 0  # rows written to zarr
        self._buf: np.ndarray | None = None
        self._n = 0  # rows waiting in _buf

    def _write(self, rows: np.ndarray) -> None:
        if len(rows):
            self.array[self.pos: self.pos + len(rows)] = rows
            self.pos += len(rows)

    def append(self, rows: np.ndarray) -> None:
        """Append ``rows`` (same trailing shape as the array; cast to its dtype, which the
        caller made sure holds every value: see :mod:`.narrow`)."""
        rows = np.asarray(rows).astype(self.array.dtype, copy=False)
        i = 0
        if self._n:  # complete the waiting unit first
            assert self._buf is not None
            i = min(len(rows), self.unit - self._n)
            self._buf[self._n: self._n + i] = rows[:i]
            self._n += i
            if self._n < self.unit:
                return
            self._write(self._buf)
            self._n = 0
        whole = (len(rows) - i) // self.unit * self.unit
        self._write(rows[i: i + whole])
        rest = rows[i + whole:]
        if len(rest):
            if self._buf is None:
                self._buf = np.empty((self.unit, *self.array.shape[1:]), dtype=self.array.dtype)
            self._buf[: len(rest)] = rest
            self._n = len(rest)

    def close(self, where: str) -> None:
        """Write the tail; the array must now be full (else an internal error on ``where``)."""
        if self._n:
            assert self._buf is not None
            self._write(self._buf[: self._n])
            self._n = 0
        self._buf = None
        if self.pos != self.array.shape[0]:
            raise CollectionError(f"{where}: {self.pos} of {self.array.shape[0]} rows written; "
                                  "internal error.")


class _CSRField:
    """The three arrays of one CSR field and their appenders."""

    def __init__(self, parent: Any, name: str, n_rows: int, n_cols: int, nnz: int,
                 dtype: np.dtype, index_dtype: np.dtype, opts: dict[str, Any]) -> None:
        group = parent.create_group(name)
        group.attrs.update({"shape": [n_rows, n_cols], "encoding-type": "csr_matrix",
                            "encoding-version": "0.1.0"})
        chunk = int(opts["chunk_elems"])
        self.data, self.indices = (
            Appender(group.create_array(key, shape=(nnz,), dtype=dt, fill_value=0, **kw),
                     _unit(kw))
            for key, dt, kw in (("data", dtype, array_kwargs(opts, (chunk,), (max(nnz, 1),))),
                                ("indices", np.dtype(index_dtype),
                                 array_kwargs(opts, (chunk,), (max(nnz, 1),))))
        )
        kw = array_kwargs(opts, (chunk,), (n_rows + 1,))
        self.indptr = Appender(group.create_array("indptr", shape=(n_rows + 1,),
                                                  dtype=np.int64, fill_value=0, **kw), _unit(kw))
        self.indptr.append(np.zeros(1, dtype=np.int64))
        self.nnz = 0

    def append(self, lens: np.ndarray, idx: np.ndarray, data: np.ndarray,
               order: np.ndarray | None) -> None:
        """Append a block's rows (``lens``, ``idx``, ``data`` as routed) in ``order``.

        Rows are gathered :data:`_GATHER_ROWS` at a time, so the block is held once, not
        twice.
        """
        if order is None:
            self._append(lens, idx, data)
            return
        starts = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=starts[1:])
        for a in range(0, len(order), _GATHER_ROWS):
            self._append(*gather_rows(lens, starts, idx, data, order[a: a + _GATHER_ROWS]))

    def _append(self, lens: np.ndarray, idx: np.ndarray, data: np.ndarray) -> None:
        ends = np.cumsum(lens, dtype=np.int64)
        ends += self.nnz
        self.nnz = int(ends[-1]) if len(ends) else self.nnz
        self.indptr.append(ends)
        self.indices.append(idx)
        self.data.append(data)

    def close(self, where: str) -> None:
        for a in (self.indptr, self.indices, self.data):
            a.close(where)


class ShardStore:
    """One shard store being written: created at its final shape, filled block by block.

    Parameters
    ----------
    path
        The shard's zarr folder (created).
    fields
        The collection's fields (``writer.OutField``), in the order buckets carry them.
    n_rows
        Rows of the shard.
    nnz
        Non-zeros of every CSR field in the shard.
    var_names, var, raw_var
        Gene names and the var / raw var frames written with the shard.
    stored
        ``{field: (values dtype, indices dtype)}`` of the CSR fields (``Schema.stored_in``;
        absent: the field's dtype and int32).
    opts
        Storage options of the writer (zarr format, chunk and shard elements, codecs).
    """

    def __init__(self, path: Path, fields: list[Any], n_rows: int, nnz: dict[str, int],
                 var_names: pd.Index, opts: dict[str, Any], var: pd.DataFrame | None = None,
                 raw_var: pd.DataFrame | None = None,
                 stored: dict[str, tuple[np.dtype, np.dtype]] | None = None) -> None:
        import zarr
        from anndata.io import write_elem

        self.path, self.fields, self.n_rows, self.opts = path, fields, n_rows, opts
        chunk = int(opts["chunk_elems"])
        g = self.group = zarr.open_group(str(path), mode="w", zarr_format=opts["zarr_format"])
        g.attrs.update({"encoding-type": "anndata", "encoding-version": "0.1.0"})
        write_elem(g, "var", var if var is not None else pd.DataFrame(index=var_names),
                   dataset_kwargs=array_kwargs(opts, (chunk,), (max(len(var_names), 1),),
                                               sharded=False))
        for group in _EMPTY_GROUPS:
            write_elem(g, group, {})
        if any(f.key == RAW_X for f in fields):  # AnnData's raw: X, var, varm
            assert raw_var is not None
            raw = g.create_group("raw")
            raw.attrs.update({"encoding-type": "raw", "encoding-version": "0.1.0"})
            write_elem(raw, "var", raw_var, dataset_kwargs=array_kwargs(
                opts, (chunk,), (max(len(raw_var), 1),), sharded=False))
            write_elem(raw, "varm", {})
        self._csr: dict[str, _CSRField] = {}
        self._dense: dict[str, Appender] = {}
        self._obs: dict[str, list[np.ndarray]] = {}
        self._names: list[np.ndarray] = []
        for f in fields:
            parent, _, name = f.key.rpartition("/")
            dest = g if f.key.startswith("obs/") else g[parent] if parent else g
            if f.kind == "csr":
                data_dtype, index_dtype = (stored or {}).get(f.key, (f.dtype, np.int32))
                self._csr[f.key] = _CSRField(dest, name, n_rows, int(f.width),
                                             int(nnz[f.key]), data_dtype, index_dtype, opts)
            elif f.kind == "dense":
                width = int(f.width)
                kw = array_kwargs(opts, (max(1, chunk // max(width, 1)), width),
                                  (max(n_rows, 1), width))
                arr = dest.create_array(name, shape=(n_rows, width), dtype=f.dtype,
                                        fill_value=0, **kw)
                arr.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
                self._dense[f.key] = Appender(arr, _unit(kw))
            else:
                self._obs[f.key] = []
        self.rows = 0

    def append(self, arrays: dict[str, np.ndarray], first: int) -> None:
        """Append the block of positions ``[first, first + n)`` of the shard: ``arrays`` is
        its loaded bucket (consumed: entries are dropped once written)."""
        from .buckets import decode_names

        pos = arrays.pop("pos")
        n = len(pos)
        local = pos - first
        if n and (first != self.rows or local.min() < 0 or local.max() >= n):
            raise CollectionError(f"{self.path}: rows of positions [{first}, {first + n}) "
                                  "out of place; internal error.")
        order = np.full(n, -1, dtype=np.int64)
        order[local] = np.arange(n)
        if n and order.min() < 0:
            raise CollectionError(f"{self.path}: some rows of positions [{first}, "
                                  f"{first + n}) are missing; internal error.")
        del pos, local
        sorted_ = n < 2 or bool(np.all(order[1:] > order[:-1]))  # shuffle=False
        take = None if sorted_ else order
        names = decode_names(arrays.pop("name_len"), arrays.pop("name_bytes"))
        self._names.append(names if take is None else names[take])
        for f in self.fields:
            if f.kind == "csr":
                self._csr[f.key].append(arrays.pop(f"{f.key}:len"), arrays.pop(f"{f.key}:idx"),
                                        arrays.pop(f"{f.key}:data"), take)
            elif f.kind == "dense":
                block = arrays.pop(f.key)
                self._dense[f.key].append(block if take is None else block[take])
            else:
                col = arrays.pop(f.key)
                self._obs[f.key].append(col if take is None else col[take])
        self.rows += n

    def close(self) -> dict[str, str]:
        """Write obs and the arrays' tails; returns the dtype of every field (what readers
        deliver) and the stored dtypes of each CSR field's arrays (keys ``"<field>/data"``
        and ``"<field>/indices"``, which never name a field: see
        :func:`stored_arrays`)."""
        from anndata.io import write_elem

        where = str(self.path)
        if self.rows != self.n_rows:
            raise CollectionError(f"{where}: {self.rows} of {self.n_rows} rows received; "
                                  "internal error.")
        for csr in self._csr.values():
            csr.close(where)
        for app in self._dense.values():
            app.close(where)
        obs: dict[str, Any] = {}
        for f in self.fields:
            if f.key in self._obs:
                parts = self._obs.pop(f.key)
                col = np.concatenate(parts) if parts else np.zeros(0, np.int32)
                if f.kind == "categorical":
                    col = _categorical(col, f, where)
                else:
                    col = col.astype(f.dtype, copy=False)
                obs[f.key[4:]] = col
        names = np.concatenate(self._names) if self._names else np.zeros(0, dtype=object)
        self._names = []
        chunk = int(self.opts["chunk_elems"])
        write_elem(self.group, "obs", pd.DataFrame(obs, index=pd.Index(names, dtype=object)),
                   dataset_kwargs=array_kwargs(self.opts, (chunk,), (max(self.n_rows, 1),),
                                               sharded=False))
        # the names' hashes, for an append's check of its names against the collection's
        hashes = np.unique(name_hashes(names))
        del names
        arr = self.group["uns"].create_array(
            NAME_HASHES, shape=hashes.shape, dtype=np.uint64, fill_value=0,
            **array_kwargs(self.opts, (chunk,), (max(hashes.size, 1),), sharded=False))
        arr.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
        if hashes.size:
            arr[...] = hashes
        dtypes: dict[str, str] = {}
        for f in self.fields:
            if f.kind in ("csr", "dense"):
                dtypes[f.key] = str(f.logical)
                if f.kind == "csr":
                    csr = self._csr[f.key]
                    dtypes[f"{f.key}/data"] = str(csr.data.array.dtype)
                    dtypes[f"{f.key}/indices"] = str(csr.indices.array.dtype)
            else:
                node = self.group["obs"][f.key[4:]]
                dtypes[f.key] = str(node["codes"].dtype if f.kind == "categorical"
                                    else node.dtype)
        return dtypes


def stored_arrays(dtypes: dict[str, str], fields: Any) -> dict[str, str]:
    """The stored dtypes of the CSR fields' arrays among ``dtypes`` (as
    :meth:`ShardStore.close` returns them), for ``ShardInfo.stored``."""
    keys = {f"{f.key}/{a}" for f in fields if f.kind == "csr" for a in ("data", "indices")}
    return {k: v for k, v in dtypes.items() if k in keys}


def _categorical(codes: np.ndarray, f: Any, where: str) -> pd.Categorical:
    """A categorical obs column from pass 1's global codes (int32), stored with the codes
    pandas gives ``f.categories`` (never narrowed to ``f.dtype`` first: a code past its
    range would wrap, to another category or to -1, missing)."""
    n = len(f.categories or ())
    if codes.size and (int(codes.min()) < -1 or int(codes.max()) >= n):
        raise CollectionError(f"{where}: {f.key} has codes in [{int(codes.min())}, "
                              f"{int(codes.max())}], outside [-1, {n}); internal error.")
    return pd.Categorical.from_codes(codes.astype(np.int32, copy=False),
                                     categories=f.categories, ordered=f.ordered,
                                     validate=False)


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
