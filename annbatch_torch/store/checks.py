"""Value and structure checks of matrix blocks: what the writer refuses in its inputs and
the pool reader refuses in a pool."""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp

from ..errors import InputError

__all__ = ["check_finite", "check_csr", "bad_column"]


def check_finite(source: str, field: str, block: Any, first_row: int = 0) -> None:
    """Raise :class:`InputError` if a block of rows holds NaN or +-inf values.

    The writer's policy for matrix fields (X, layers, obsm): non-finite values are refused,
    negative values are allowed (log-normalised or scaled data, embeddings). ``block`` is
    rows ``[first_row, first_row + len(block))`` of ``field`` in input ``source``: a scipy
    sparse matrix or a dense array. Integer and bool blocks pass without a scan.
    """
    values = block.data if sp.issparse(block) else np.asarray(block)
    if values.dtype.kind not in "fc":
        return
    finite = np.isfinite(values)
    if finite.all():
        return
    pos = int(np.flatnonzero(~finite.ravel())[0])
    if sp.issparse(block):
        csr = block.tocsr() if block.format != "csr" else block
        if csr is not block:  # positions in block.data do not match csr.data then
            pos = int(np.flatnonzero(~np.isfinite(csr.data))[0])
        row = int(np.searchsorted(csr.indptr, pos, side="right")) - 1
        col = int(csr.indices[pos])
        bad = csr.data[pos]
    else:
        row, col = divmod(pos, int(np.prod(values.shape[1:])) or 1)
        bad = values.ravel()[pos]
    n_bad = int((~finite).sum())
    raise InputError(
        f"{source}: field {field!r} holds {n_bad} non-finite value(s) (NaN or inf), the "
        f"first ({bad}) at row {first_row + row}, column {col}. Matrices must be finite: fix "
        "the input (e.g. `m.data = np.nan_to_num(m.data)` for a sparse matrix, or drop the "
        "affected cells) and write it again."
    )


def bad_column(indices: np.ndarray, n_cols: int) -> int | None:
    """Position of the first column index outside ``[0, n_cols)``, else ``None``.

    One unsigned ``max()`` over the indices (negative values wrap to huge ones); the slow
    search runs only when something is wrong.
    """
    if not indices.size or int(indices.view(f"u{indices.dtype.itemsize}").max()) < n_cols:
        return None
    return int(np.flatnonzero((indices < 0) | (indices >= n_cols))[0])


def check_csr(source: str, field: str, block: Any, first_row: int = 0) -> None:
    """Raise :class:`InputError` if a sparse block's structure is invalid: column indices
    outside ``[0, n_cols)`` or a decreasing ``indptr``.

    scipy builds CSR matrices from stored arrays without these checks, so a damaged input
    would otherwise be written into the collection and only fail (or worse, densify
    out of bounds) when read. ``block`` is rows ``[first_row, first_row + n)`` of ``field``
    in input ``source``; dense blocks pass without a scan.
    """
    if not sp.issparse(block) or block.format != "csr":
        return
    ip, idx = np.asarray(block.indptr), np.asarray(block.indices)
    n_cols = int(block.shape[1])
    fix = ("the input file is damaged: rewrite it from its source (e.g. with anndata) "
           "and run create_anndata_collection again.")
    if len(ip) > 1 and (ip[0] != 0 or bool((ip[1:] < ip[:-1]).any()) or ip[-1] > len(idx)):
        bad = np.flatnonzero(ip[1:] < ip[:-1])
        where = f"row {first_row + int(bad[0])}" if bad.size else "its first or last entry"
        raise InputError(f"{source}: field {field!r} has an invalid indptr (at {where}); {fix}")
    used = idx[: int(ip[-1])] if len(ip) else idx[:0]
    pos = bad_column(used, n_cols)
    if pos is not None:
        row = int(np.searchsorted(ip, pos, side="right")) - 1
        raise InputError(
            f"{source}: field {field!r} holds column index {int(used[pos])} at row "
            f"{first_row + row}, outside [0, {n_cols}) (the input has {n_cols} columns); {fix}"
        )
