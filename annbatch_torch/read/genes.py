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

from ..errors import SchemaError
from .csr import csr_view

__all__ = ["GeneSelection"]


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

    def cut(self, value: Any) -> Any:
        """One gene-indexed value (CSR or dense rows x source genes) cut to the selection."""
        if sp.issparse(value):
            m = value if value.format == "csr" else value.tocsr()
            lo, hi = int(m.indptr[0]), int(m.indptr[-1])
            new_cols = self.lookup[m.indices[lo:hi]]
            keep = new_cols >= 0
            kept_before = np.concatenate([[0], np.cumsum(keep)])
            indptr = kept_before[m.indptr - lo].astype(m.indptr.dtype, copy=False)
            idx_dtype = m.indices.dtype if self.n_vars < np.iinfo(np.int32).max else np.int64
            # csr_view: the arrays are fresh and valid, scipy's checks would only copy them
            out = csr_view(m.data[lo:hi][keep], new_cols[keep].astype(idx_dtype), indptr,
                           (m.shape[0], self.n_vars))
            if self.reorders:
                out.sort_indices()
            return out
        return np.asarray(value)[:, self.columns]
