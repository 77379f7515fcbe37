"""A subset or reordering of a source's genes, applied to each pool as it is read.

``AnnBatchDataset(..., var_names=[...])`` reads, say, 2,000 highly variable genes of a
30,000-gene collection, or the genes in the order a pretrained model expects, without
rewriting the collection. :class:`GeneSelection` maps the source's columns to the selected
ones once; :meth:`GeneSelection.apply` then cuts every gene-indexed field of a pool (``X``
and layers): a CSR pool keeps only the entries of selected genes, renumbered (one pass over
the pool's non-zeros, column indices sorted again within rows when the order changes); a
dense pool is column-indexed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from ..errors import ReadError, SchemaError
from .csr import csr_view

__all__ = ["GeneSelection", "MemberGenes"]


class GeneSelection:
    """Columns ``var_names`` of a source whose genes are ``source_var_names``.

    Parameters
    ----------
    source_var_names
        The source's genes, in its column order.
    var_names
        The genes to read, in the order wanted; each must be a gene of the source, once.
    where
        Names the source in error messages.
    attr
        The source's attribute holding ``source_var_names``, named in the fix
        (``"raw_var_names"`` for raw).

    Raises
    ------
    SchemaError
        A gene is not in the source, or is asked for twice.
    """

    def __init__(self, source_var_names: Sequence[str], var_names: Sequence[str],
                 where: str = "the source", attr: str = "var_names") -> None:
        wanted = pd.Index([str(v) for v in var_names]) if not isinstance(var_names, str) else None
        if wanted is None or len(wanted) == 0:
            raise SchemaError(f"var_names must be a non-empty list of gene names, got "
                              f"{var_names!r}.")
        dup = wanted[wanted.duplicated()].unique()
        if len(dup):
            raise SchemaError(f"var_names names {len(dup)} gene(s) more than once (e.g. "
                              f"{list(dup[:3])}); give each gene once.")
        src = pd.Index(source_var_names)
        cols = src.get_indexer(wanted)
        missing = wanted[cols < 0]
        if len(missing):
            raise SchemaError(
                f"{where}: {len(missing)} of the {len(wanted)} var_names are not among its "
                f"{len(src)} genes (e.g. {list(missing[:5])}). Read only genes it has "
                f"(e.g. [g for g in var_names if g in set(collection.{attr})]), or check "
                "that both use the same gene identifiers (symbols vs Ensembl IDs)."
            )
        #: the selected genes, in output order
        self.var_names = wanted
        #: source column of each output column
        self.columns = cols.astype(np.int64)
        lut = np.full(len(src), -1, dtype=np.int64)
        lut[self.columns] = np.arange(len(self.columns))
        #: output column of each source column (-1: not read)
        self.lookup = lut
        self.reorders = bool(np.any(np.diff(self.columns) < 0))
        self.identity = len(src) == len(wanted) and not self.reorders

    @property
    def n_vars(self) -> int:
        return len(self.columns)

    def cut(self, value: Any, rows: np.ndarray | None = None) -> Any:
        """One gene-indexed value (CSR or dense rows x source genes) cut to the selection
        (``rows``, the value's global row ids, are not needed)."""
        if sp.issparse(value):
            return _remap_csr(value, lambda m, lo, hi: self.lookup[m.indices[lo:hi]],
                              self.n_vars, self.reorders)
        return np.asarray(value)[:, self.columns]


def _remap_csr(value: Any, new_columns: Any, n_vars: int, reorders: bool) -> sp.csr_matrix:
    """``value`` (CSR) with each entry's column replaced by ``new_columns(m, lo, hi)`` (its
    new column, -1: dropped): one pass over the non-zeros, indices sorted again within
    rows when ``reorders``."""
    m = value if value.format == "csr" else value.tocsr()
    lo, hi = int(m.indptr[0]), int(m.indptr[-1])
    new_cols = new_columns(m, lo, hi)
    keep = new_cols >= 0
    kept_before = np.concatenate([[0], np.cumsum(keep)])
    # indices and indptr of one dtype, int32 at least: a pool's 16-bit indices
    # (``PoolReader(stored_dtypes=True)``) may not hold a mixture's union of genes, and
    # scipy (sorting them) and torch take int32 or int64
    wide = n_vars >= np.iinfo(np.int32).max or m.indptr.dtype == np.int64
    idx_dtype = np.int64 if wide else np.int32
    indptr = kept_before[m.indptr - lo].astype(idx_dtype, copy=False)
    # csr_view: the arrays are fresh and valid, scipy's checks would only copy them
    out = csr_view(m.data[lo:hi][keep], new_cols[keep].astype(idx_dtype), indptr,
                   (m.shape[0], n_vars))
    if reorders:
        out.sort_indices()
    return out


class MemberGenes:
    """The genes of a mixture of sources (``store/inputs/mixture.py``) in each pool: every
    row's member has its own columns, mapped to the output's by its own table.

    Parameters
    ----------
    offsets
        Each member's first global row, then the total.
    lookups
        Per member, the output column of each of its columns (``-1``: not read).
    n_vars
        Output columns.
    """

    def __init__(self, offsets: np.ndarray, lookups: Sequence[np.ndarray], n_vars: int) -> None:
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.n_vars = int(n_vars)
        sizes = [len(lut) for lut in lookups]
        #: where each member's table starts in :attr:`table`
        self.base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.table = (np.concatenate([np.asarray(t, dtype=np.int64) for t in lookups])
                      if sizes else np.zeros(0, np.int64))
        self.reorders = any(bool(np.any(np.diff(t[t >= 0]) < 0)) for t in lookups)
        #: each member's width: a column index beyond it is damage, never another's gene
        self.widths = np.asarray(sizes, dtype=np.int64)
        self.identity = all(len(t) == self.n_vars and np.array_equal(t, np.arange(self.n_vars))
                            for t in lookups)

    @classmethod
    def of(cls, offsets: np.ndarray, lookups: Sequence[np.ndarray],
           selection: GeneSelection | None, n_vars: int) -> MemberGenes:
        """The members' tables composed with ``selection`` of the mixture's genes."""
        if selection is None:
            return cls(offsets, lookups, n_vars)
        composed = [np.where(t >= 0, selection.lookup[np.maximum(t, 0)], -1) for t in lookups]
        return cls(offsets, composed, selection.n_vars)

    def cut(self, value: Any, rows: np.ndarray | None = None) -> Any:
        """A CSR value of rows ``rows`` (global row ids), each in its member's columns, in
        the output's columns."""
        if rows is None:
            raise ValueError("MemberGenes.cut needs the value's global row ids")
        member = np.searchsorted(self.offsets, np.asarray(rows), side="right") - 1
        if not sp.issparse(value):
            raise TypeError("a mixture's gene-indexed fields are read as CSR")

        def columns(m: sp.csr_matrix, lo: int, hi: int) -> np.ndarray:
            per_entry = np.repeat(member, np.diff(m.indptr))
            cols = m.indices[lo:hi]
            bad = cols >= self.widths[per_entry]
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ReadError(
                    f"column index {int(cols[i])} of a row of member {int(per_entry[i])} of "
                    f"the mixture lies outside its {int(self.widths[per_entry[i]])} genes; "
                    "that collection is damaged, rewrite it.")
            return self.table[self.base[per_entry] + cols]

        return _remap_csr(value, columns, self.n_vars, self.reorders)
