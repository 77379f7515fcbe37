"""Row-range access to AnnData elements, whatever holds them.

One small interface over the three places AnnData elements live: an h5py group (h5ad),
a zarr group (AnnData zarr store, also our shards) and in-memory objects (numpy arrays,
scipy sparse matrices, pandas columns). Everything reads *row ranges* ``[start, stop)``;
nothing here ever loads a whole on-disk matrix except a CSC matrix, which cannot be
sliced by rows (see :class:`CSCElement`).

The writer uses it to stream inputs block by block; the dataset uses it to read pools.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from ..errors import InputError
from .rawzarr import IndexOutOfRange
from .rowoffsets import RowOffsets

__all__ = [
    "CSRElement",
    "CSCElement",
    "DenseElement",
    "DenseAsCSRElement",
    "SparseAsDenseElement",
    "CategoricalElement",
    "StringElement",
    "StringCodesElement",
    "NullableStringElement",
    "Element",
    "open_element",
    "element_from_memory",
    "encoding_type",
    "read_index",
    "index_key",
    "GROUP_MEMBERS",
    "DEFAULT_CSC_LIMIT",
]

DEFAULT_CSC_LIMIT = 2 << 30  # bytes; a CSC matrix bigger than this on disk is refused

#: the group encodings :func:`open_element` reads, with the member arrays each must hold
GROUP_MEMBERS: dict[str, tuple[str, ...]] = {
    "csr_matrix": ("data", "indices", "indptr"),
    "csc_matrix": ("data", "indices", "indptr"),
    "categorical": ("codes", "categories"),
    "nullable-integer": ("values", "mask"),
    "nullable-boolean": ("values", "mask"),
    "nullable-string-array": ("values", "mask"),
}


def encoding_type(node: Any) -> str | None:
    """The AnnData ``encoding-type`` attribute of an h5py/zarr node, or ``None``."""
    attrs = getattr(node, "attrs", None)
    if attrs is None:
        return None
    enc = attrs.get("encoding-type")
    if isinstance(enc, bytes):
        enc = enc.decode()
    return enc


def is_group(node: Any) -> bool:
    return hasattr(node, "keys") and not hasattr(node, "dtype")


def _decode_strings(values: np.ndarray) -> np.ndarray:
    if values.dtype.kind in ("S", "O"):
        out = np.array([v.decode() if isinstance(v, bytes) else str(v) for v in values], object)
        return out
    if values.dtype.kind in ("U", "T"):
        return values.astype(object)
    return values


class Element:
    """Base class: something with ``n_rows`` whose row ranges can be read."""

    n_rows: int
    kind: str
    dtype: np.dtype
    name: str

    def read(self, start: int, stop: int) -> Any:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass
class CSRElement(Element):
    """A CSR matrix: ``data``, ``indices`` and ``indptr`` arrays supporting slicing.

    ``indptr`` is read once, checked, and kept as a :class:`~.rowoffsets.RowOffsets`
    (``n_rows + 1`` offsets in about 2-4 bytes a row, read like an ``int64`` array); row
    ranges then map to one contiguous slice of ``data`` and of ``indices``.
    """

    data: Any
    indices: Any
    indptr: Any
    shape: tuple[int, int]
    name: str = "X"
    kind: str = "csr"
    source: str = "<memory>"

    def __post_init__(self) -> None:
        where = f"{self.source}: field {self.name!r}"
        ip = np.asarray(self.indptr[...], dtype=np.int64)
        self.shape = (int(self.shape[0]), int(self.shape[1]))
        self.n_rows = self.shape[0]
        self.dtype = np.dtype(self.data.dtype)
        #: indices chunks whose every value was checked inside [0, n_cols): {chunk: CRC}
        self.checked_chunks: dict[int, int] = {}
        fix = "the sparse matrix is damaged; rewrite it (or the collection) from its inputs."
        if ip.ndim != 1 or ip.shape[0] != self.n_rows + 1:
            raise InputError(
                f"{where}: indptr has {ip.shape[0] if ip.ndim else 0} entries "
                f"but the shape attribute says {self.n_rows} rows (expected "
                f"{self.n_rows + 1}); {fix}"
            )
        # indptr is read whole anyway: checking it is cheap, and a damaged one would
        # otherwise slice the wrong values silently
        n_data, n_indices = int(self.data.shape[0]), int(self.indices.shape[0])
        if ip[0] != 0 or ip[-1] > min(n_data, n_indices):
            raise InputError(
                f"{where}: indptr runs from {int(ip[0])} to {int(ip[-1])} but "
                f"data holds {n_data} values and indices {n_indices}; {fix}"
            )
        if self.n_rows and bool((ip[1:] < ip[:-1]).any()):
            row = int(np.flatnonzero(ip[1:] < ip[:-1])[0])
            raise InputError(f"{where}: indptr decreases at row {row}; {fix}")
        self.indptr = RowOffsets(ip)

    @property
    def n_cols(self) -> int:
        return int(self.shape[1])

    def nnz_range(self, start: int, stop: int) -> tuple[int, int]:
        return int(self.indptr[start]), int(self.indptr[stop])

    def read_raw(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows ``[start, stop)`` as ``(data, indices, row_lengths)``."""
        lo, hi = self.nnz_range(start, stop)
        data = np.asarray(self.data[lo:hi])
        indices = np.asarray(self.indices[lo:hi])
        lengths = self.indptr.lengths(start, stop)
        return data, indices, lengths

    def read_into(
        self, start: int, stop: int, data_out: np.ndarray, indices_out: np.ndarray
    ) -> np.ndarray:
        """Copy rows ``[start, stop)``' values and column indices into the given buffers
        (sized ``indptr[stop] - indptr[start]``), straight from the chunk files when the
        arrays support it (:mod:`annbatch_torch.store.rawzarr`); returns the row lengths."""
        lo, hi = self.nnz_range(start, stop)
        for src, out in ((self.data, data_out), (self.indices, indices_out)):
            if hasattr(src, "read_into"):
                src.read_into(lo, hi, out)
            else:
                out[...] = np.asarray(src[lo:hi])
        return self.indptr.lengths(start, stop)

    @property
    def can_scatter(self) -> bool:
        """Whether :meth:`read_rows_scatter` reads straight from chunk files."""
        return hasattr(self.data, "read_runs") and hasattr(self.indices, "read_runs")

    @property
    def reads_compiled(self) -> bool:
        """Whether drawn rows of chunks verified before are read by compiled loops (no
        Python step, nor the GIL, per row: worth spreading over read threads)."""
        return all(getattr(a, "reads_compiled", False) for a in (self.data, self.indices))

    def read_rows_scatter(
        self, start: int, stop: int, data_out: np.ndarray, indices_out: np.ndarray,
        dests: np.ndarray, offsets: np.ndarray | None = None,
    ) -> dict[int, int] | None:
        """Copy row ``start + i``'s values and column indices to ``data_out[dests[i]:]``
        and ``indices_out[dests[i]:]`` for ``i < stop - start`` (rows land wherever the
        caller wants them, e.g. at their shuffled positions in a pool).

        Returns ``{chunk: CRC-32C}`` of the indices chunks read when they carry checksums
        (else ``None``). Their parts read but not delivered were checked inside
        ``[0, n_cols)`` already; a caller that checks the delivered indices may record the
        chunks with :meth:`mark_checked` and skip its check when
        :meth:`all_checked` says every chunk of a later read is one it checked before.
        ``offsets``: ``indptr[start : stop + 1]`` when the caller has it already.
        """
        if stop <= start:
            return {}
        if offsets is None:
            offsets = self.indptr[start : stop + 1]
        runs, end = offsets[:-1], int(offsets[-1])
        crcs: dict[int, int] | None = None
        for src, out in ((self.data, data_out), (self.indices, indices_out)):
            if hasattr(src, "read_runs"):
                is_indices = src is self.indices
                got = src.read_runs(runs, end, dests, out,
                                    below=self.n_cols if is_indices else None)
                if is_indices and getattr(src, "crc", False):
                    crcs = got
            else:
                values = np.asarray(src[int(runs[0]) : end])
                lengths = np.diff(offsets)
                pos = np.repeat(dests - (runs - runs[0]), lengths) + np.arange(values.size)
                out[pos] = values
        return crcs

    def _runs(self, rows: np.ndarray, dests: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The element runs ``[starts, ends)`` of rows ``rows`` (ascending, distinct) and
        where each lands (``dests``): rows that continue each other here and in the output
        are one run."""
        rows = np.asarray(rows, dtype=np.int64)
        starts, ends = self.indptr[rows], self.indptr[rows + 1]
        dests = np.asarray(dests, dtype=np.int64)
        if len(rows) > 1:
            cont = (starts[1:] == ends[:-1]) & (dests[1:] == dests[:-1] + (ends[:-1]
                                                                        - starts[:-1]))
            if cont.any():
                first = np.flatnonzero(np.concatenate([[True], ~cont]))
                last = np.append(first[1:] - 1, len(rows) - 1)
                starts, ends, dests = starts[first], ends[last], dests[first]
        return starts, ends, dests

    def read_rows_gather(
        self, rows: np.ndarray, data_out: np.ndarray, indices_out: np.ndarray,
        dests: np.ndarray, trust_verified: bool = False,
    ) -> dict[int, int] | None:
        """Copy rows ``rows`` (ascending, distinct)' values and column indices to
        ``data_out[dests[i]:]`` and ``indices_out[dests[i]:]``: :meth:`read_rows_scatter`
        for rows anywhere in the matrix, one call for all of them. Needs
        :attr:`can_scatter`; returns the indices chunks' CRCs likewise (those read and
        verified whole). ``trust_verified``: see ``RawZarrArray.read_runs`` (rows a
        sampler drew)."""
        starts, ends, dests = self._runs(rows, dests)
        crcs: dict[int, int] | None = None
        for src, out in ((self.data, data_out), (self.indices, indices_out)):
            is_indices = src is self.indices
            got = src.read_runs(starts, 0, dests, out, below=self.n_cols if is_indices else None,
                                ends=ends, trust_verified=trust_verified)
            if is_indices and getattr(src, "crc", False):
                crcs = got
        return crcs

    def read_rows_cast(self, rows: np.ndarray, data_out: np.ndarray,
                       indices_out: np.ndarray, dests: np.ndarray) -> bool:
        """Rows a sampler drew, :meth:`read_rows_gather`'s way, cast to the buffers' dtypes
        on the way from the page cache (no scratch pass): when both arrays read them so
        (``RawZarrArray.plan_cast``: chunks verified before, local shard files). Returns
        ``False``, having read nothing, otherwise. The column indices are checked inside
        ``[0, n_cols)`` as they are read (a ``ChunkError`` names the shard file otherwise):
        the caller need not check them again."""
        if not (hasattr(self.data, "plan_cast") and hasattr(self.indices, "plan_cast")):
            return False
        row_dests = np.asarray(dests, dtype=np.int64)
        starts, ends, dests = self._runs(rows, row_dests)
        plans = [src.plan_cast(starts, ends, dests,
                               below=self.n_cols if src is self.indices else None)
                 for src in (self.data, self.indices)]
        if plans[0] is None or plans[1] is None:
            return False
        self.data.read_cast(plans[0], data_out)
        try:
            self.indices.read_cast(plans[1], indices_out)
        except IndexOutOfRange as e:  # name the row holding it
            lens = self.indptr[rows + 1] - self.indptr[rows]
            hit = np.flatnonzero((row_dests <= e.item) & (e.item < row_dests + lens))
            if not hit.size:
                raise
            raise e.in_row(int(rows[hit[0]])) from e
        return True

    def all_checked(self, crcs: dict[int, int] | None) -> bool:
        """Whether every indices chunk in ``crcs`` (from :meth:`read_rows_scatter`) holds
        exactly the values checked before (same CRC-32C)."""
        if crcs is None:
            return False
        known = self.checked_chunks
        return all(known.get(c) == crc for c, crc in crcs.items())

    def mark_checked(self, crcs: dict[int, int] | None) -> None:
        """Record that the indices chunks in ``crcs`` hold only valid column indices."""
        if crcs:
            self.checked_chunks.update(crcs)

    def read(self, start: int, stop: int) -> sp.csr_matrix:
        data, indices, lengths = self.read_raw(start, stop)
        indptr = np.zeros(stop - start + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])
        return sp.csr_matrix((data, indices, indptr), shape=(stop - start, self.n_cols))


class CSCElement(Element):
    """A CSC matrix on disk. Rows of CSC cannot be read without reading everything, so
    the whole matrix is loaded once (and converted to CSR) if it is below ``limit``
    bytes, and refused otherwise with the fix spelled out."""

    kind = "csr"

    def __init__(self, group: Any, name: str, source: str, limit: int | None = None,
                 fix: str | None = None):
        limit = DEFAULT_CSC_LIMIT if limit is None else limit
        shape = tuple(int(s) for s in group.attrs["shape"])
        nbytes = int(np.prod(group["data"].shape)) * (
            group["data"].dtype.itemsize + group["indices"].dtype.itemsize
        )
        if nbytes > limit:
            raise InputError(
                f"{source}: field {name!r} is stored as CSC ({nbytes / 2**30:.2f} GiB of "
                f"values and indices, above the {limit / 2**30:.2f} GiB that may be loaded "
                "whole), which cannot be read by rows out of core. Convert it to CSR, e.g. "
                "`adata.X = adata.X.tocsr(); adata.write_h5ad(...)`, "
                + (fix or "or write a collection with create_anndata_collection (it accepts "
                   "CSC inputs that fit its max_memory).")
            )
        csc = sp.csc_matrix(
            (group["data"][...], group["indices"][...], group["indptr"][...]), shape=shape
        )
        self._csr = csc.tocsr()
        self._csr.sort_indices()
        self.n_rows = shape[0]
        self.shape = shape
        self.dtype = self._csr.dtype
        self.name = name
        self.source = source
        self._as_csr: CSRElement | None = None

    @property
    def n_cols(self) -> int:
        return int(self.shape[1])

    def read(self, start: int, stop: int) -> sp.csr_matrix:
        return self._csr[start:stop]

    def as_csr_element(self) -> CSRElement:
        if self._as_csr is None:
            c = self._csr
            self._as_csr = CSRElement(
                c.data, c.indices, c.indptr, self.shape, name=self.name, source=self.source
            )
        return self._as_csr


@dataclass
class DenseElement(Element):
    """A dense 1-D or 2-D array (numeric or bool) read by row slices."""

    array: Any
    name: str = "X"
    kind: str = "dense"

    def __post_init__(self) -> None:
        self.n_rows = int(self.array.shape[0])
        self.dtype = np.dtype(self.array.dtype)
        self.shape = tuple(int(s) for s in self.array.shape)

    def read(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.array[start:stop])


class CategoricalElement(Element):
    """A categorical obs column: integer ``codes`` plus its ``categories``.

    ``categories`` may be given as a function that reads them: they are then read on first
    use. A loader reading a collection's codes never uses a shard's own categories (every
    shard's codes index the manifest's), so opening a shard for it need not read them.
    """

    kind = "categorical"

    def __init__(self, codes: Any, categories: list[Any] | Callable[[], list[Any]],
                 ordered: bool = False, name: str = "obs") -> None:
        self.codes = codes
        self._categories = categories
        self.ordered = ordered
        self.name = name
        self.n_rows = int(codes.shape[0])
        self.dtype = np.dtype(codes.dtype)

    @property
    def categories(self) -> list[Any]:
        if callable(self._categories):
            self._categories = self._categories()
        return self._categories

    def read(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.codes[start:stop])


@dataclass
class StringElement(Element):
    """A column of strings (e.g. obs_names or a non-categorical string column)."""

    array: Any
    name: str = "obs"
    kind: str = "strings"

    def __post_init__(self) -> None:
        self.n_rows = int(self.array.shape[0])
        self.dtype = np.dtype(object)

    def read(self, start: int, stop: int) -> np.ndarray:
        return _decode_strings(np.asarray(self.array[start:stop]))


class NullableStringElement(Element):
    """A nullable string column (``nullable-string-array``): strings, ``None`` where
    missing."""

    kind = "strings"

    def __init__(self, node: Any, name: str) -> None:
        self.values, self.mask = StringElement(node["values"], name), node["mask"]
        self.n_rows, self.name, self.dtype = self.values.n_rows, name, np.dtype(object)

    def read(self, start: int, stop: int) -> np.ndarray:
        out = self.values.read(start, stop)
        out[np.asarray(self.mask[start:stop], dtype=bool)] = None
        return out


class StringCodesElement(CategoricalElement):
    """A string obs column read as the codes of ``categories`` (its distinct values,
    sorted: how the writer stores a string column); a value not among them (a missing
    one) is code -1."""

    def __init__(self, strings: Element, categories: list[Any], name: str) -> None:
        self.strings = strings
        self.codes = None  # codes are computed from the strings on read
        self._categories = list(categories)
        self._index = pd.Index(self._categories, dtype=object)
        self.ordered = False
        self.name = name
        self.kind = "categorical"
        self.n_rows = strings.n_rows
        self.dtype = np.dtype(np.int32)

    def read(self, start: int, stop: int) -> np.ndarray:
        values = pd.Index(self.strings.read(start, stop), dtype=object)
        return self._index.get_indexer(values).astype(np.int32)


class _FlatRows:
    """A row-major 2-D array seen as the 1-D ``data`` of a CSR matrix storing every entry:
    ``[lo, hi)`` must cover whole rows."""

    def __init__(self, array: Any) -> None:
        self.array, self.width = array, int(array.shape[1])
        self.shape = (int(array.shape[0]) * self.width,)
        self.dtype = np.dtype(array.dtype)

    def __getitem__(self, key: slice) -> np.ndarray:
        lo, hi = int(key.start or 0), int(self.shape[0] if key.stop is None else key.stop)
        if lo % max(self.width, 1) or hi % max(self.width, 1):
            raise ValueError(f"a dense matrix is read by whole rows; got entries [{lo}, {hi})")
        w = max(self.width, 1)
        return np.asarray(self.array[lo // w : hi // w]).reshape(-1)


class _TiledColumns:
    """The column indices of a CSR matrix storing every entry: 0..width-1 per row."""

    def __init__(self, n_rows: int, width: int) -> None:
        self.width = width
        self.shape = (n_rows * width,)
        self.dtype = np.dtype(np.int32 if width < 2**31 else np.int64)

    def __getitem__(self, key: slice) -> np.ndarray:
        lo, hi = int(key.start or 0), int(self.shape[0] if key.stop is None else key.stop)
        w = max(self.width, 1)
        return np.tile(np.arange(self.width, dtype=self.dtype), (hi - lo) // w)


class DenseAsCSRElement(CSRElement):
    """A dense 2-D matrix presented as CSR, every entry stored (zeros included).

    In-place reading presents a dense X / layer as CSR, the kind a collection stores it
    as. Dropping its zeros would need its nonzero count per row, which means reading the
    whole matrix when the input is opened; so every entry is kept: values are the same,
    a pool of it takes the dense bytes plus a column index per entry."""

    def __init__(self, array: Any, name: str, source: str = "<memory>") -> None:
        n, w = int(array.shape[0]), int(array.shape[1])
        super().__init__(_FlatRows(array), _TiledColumns(n, w),
                         np.arange(n + 1, dtype=np.int64) * w, (n, w), name=name,
                         source=source)


class SparseAsDenseElement(Element):
    """A sparse (CSR / CSC) matrix presented as a dense 2-D array, read by row blocks
    (how a collection stores an obsm entry)."""

    kind = "dense"

    def __init__(self, sparse: CSRElement | CSCElement, name: str) -> None:
        self.sparse, self.name = sparse, name
        self.n_rows = sparse.n_rows
        self.shape = (int(sparse.shape[0]), int(sparse.shape[1]))
        self.dtype = np.dtype(sparse.dtype)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.sparse.read(start, stop).toarray()


def _nullable(node: Any, name: str) -> DenseElement:
    values = np.asarray(node["values"][...])
    mask = np.asarray(node["mask"][...], dtype=bool)
    if mask.any():
        values = values.astype(np.float64)
        values[mask] = np.nan
    return DenseElement(values, name=name)


def open_element(node: Any, name: str, source: str = "<memory>") -> Element:
    """Wrap an h5py/zarr node (array or encoded group) as an :class:`Element`.

    Parameters
    ----------
    node
        The h5py/zarr array or group holding the element.
    name
        The field string (``"X"``, ``"obs/cell_type"``...) used in messages.
    source
        The file the node lives in, used in messages.
    """
    enc = encoding_type(node)
    if is_group(node):
        missing = [m for m in GROUP_MEMBERS.get(enc or "", ()) if m not in node]
        if enc in ("csr_matrix", "csc_matrix") and "shape" not in node.attrs:
            missing.append("the 'shape' attribute")
        if missing:
            raise InputError(
                f"{source}: field {name!r} (encoding {enc!r}) lacks {', '.join(missing)}; the "
                "file is damaged or was written incompletely. Rewrite it (an input: from its "
                "source; a collection: with create_anndata_collection(..., overwrite=True))."
            )
        if enc == "csr_matrix":
            shape = tuple(int(s) for s in node.attrs["shape"])
            return CSRElement(
                node["data"], node["indices"], node["indptr"], shape, name=name, source=source
            )
        if enc == "csc_matrix":
            return CSCElement(node, name, source)
        if enc == "categorical":
            return CategoricalElement(  # categories opened on first use too
                node["codes"],
                lambda: _decode_strings(np.asarray(node["categories"][...])).tolist(),
                bool(node.attrs.get("ordered", False)), name=name
            )
        if enc in ("nullable-integer", "nullable-boolean"):
            return _nullable(node, name)
        if enc == "nullable-string-array":
            return NullableStringElement(node, name)
        raise InputError(
            f"{source}: field {name!r} has encoding {enc!r}, which annbatch_torch cannot read "
            "by rows; store it as a CSR matrix, a dense array or a categorical."
        )
    dtype = np.dtype(node.dtype)
    if enc == "string-array" or dtype.kind in ("S", "U", "O", "T"):
        return StringElement(node, name=name)
    return DenseElement(node, name=name)


def element_from_memory(value: Any, name: str) -> Element:
    """Wrap an in-memory value (numpy, scipy sparse, pandas Series) as an Element."""
    if sp.issparse(value):
        if value.format != "csr":
            value = value.tocsr()
        return CSRElement(
            value.data, value.indices, value.indptr, value.shape, name=name, source="<memory>"
        )
    if isinstance(value, pd.Series | pd.Index):
        if isinstance(value.dtype, pd.CategoricalDtype):
            cat = value.array if isinstance(value, pd.Series) else value.values
            return CategoricalElement(
                np.asarray(cat.codes), list(cat.categories), bool(cat.ordered), name=name
            )
        if pd.api.types.is_bool_dtype(value.dtype) or pd.api.types.is_numeric_dtype(value.dtype):
            arr = value.to_numpy(dtype=np.float64 if value.hasnans else None)
            return DenseElement(np.asarray(arr), name=name)
        return StringElement(np.asarray(value.astype(str), dtype=object), name=name)
    if isinstance(value, pd.DataFrame):
        return DenseElement(value.to_numpy(), name=name)
    arr = np.asarray(value)
    if arr.dtype.kind in ("S", "U", "O", "T"):
        return StringElement(arr, name=name)
    return DenseElement(arr, name=name)


def index_key(group: Any) -> str:
    """The name of the array holding an AnnData dataframe group's index (its ``_index``
    attribute; ``"_index"`` by default)."""
    key = group.attrs.get("_index", "_index")
    return key.decode() if isinstance(key, bytes) else str(key)


def read_index(group: Any, interned: bool = False) -> np.ndarray:
    """Read the index (obs_names / var_names) of an AnnData dataframe group as strings;
    ``interned``: each name as the one str object of that name (:func:`interned_names`)."""
    values = np.asarray(group[index_key(group)][...])
    if values.dtype.kind in "iufb":  # a numeric index: its names as anndata reads them
        values = values.astype(str).astype(object)
    return interned_names(values) if interned else _decode_strings(values)


#: names seen by :func:`interned_names`, as stored -> the str (cleared when it grows past
#: :data:`_NAMES_MAX`: distinct gene names of the inputs being written are far fewer)
_NAMES: dict[Any, str] = {}
_NAMES_MAX = 1 << 20
_NAMES_LOCK = threading.Lock()


def interned_names(values: np.ndarray) -> np.ndarray:
    """Strings (an object array; numbers pass through) in which equal names are one str
    object: the inputs of an atlas share most genes, and an input's names stay open for
    the whole write (a hundred inputs of 25,000 genes hold 2.5 million names; interned,
    one str per distinct gene). Decoding and interning are one dict lookup per stored
    name (bytes or str) once a name was seen."""
    if values.dtype.kind == "U" or values.dtype.kind == "T":
        values = values.astype(object)
    if values.dtype.kind not in ("S", "O"):
        return values
    with _NAMES_LOCK:
        if len(_NAMES) > _NAMES_MAX:
            _NAMES.clear()
        names, get = _NAMES, _NAMES.get
        out = []
        for v in values:
            t = type(v)
            if t is not bytes and t is not str:  # (a missing value, a number): as decoded
                out.append(str(v))
                continue
            s = get(v)
            if s is None:
                s = names[v] = sys.intern(v.decode() if t is bytes else v)
            out.append(s)
    return np.array(out, dtype=object) if out else np.empty(0, dtype=object)
