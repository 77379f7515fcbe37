"""``group_by``: the rows of each class of an obs column contiguous inside every shard.

The shuffle still spreads every input's rows uniformly over all shards (the same shards
hold the same rows as without ``group_by``); only the order inside a shard changes: its rows
sorted by the column's global code (missing values last), in their shuffled order within a
class. Chunked mode then reads chunks of mostly one class (a pool of chunks from random
places still mixes classes), and a :class:`~annbatch_torch.ClassBalancedSampler` over that
column draws runs of rows of one class, each a single read (sampling mode's
``chunk_size``), instead of one read per drawn row.

Costs: the column of every input is read once before pass 1 (4 bytes per cell), and the
destinations are regrouped shard by shard: the row at each position and the new
destinations, 4 bytes per cell each below 2**32 cells (8 above), beside the permutation
(the same again) while they are made; the codes and the row table are freed before pass 1,
the new destinations replace the permutation. With ``shuffle=False`` the destinations are
an array (4 bytes per cell) where they are otherwise implicit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from ..errors import InputError
from ..store.inputs.view import InputSource
from .schema import OutField, Schema

__all__ = ["check_group_by", "class_codes", "group_in_shards", "global_codes"]

logger = logging.getLogger(__name__)


def check_group_by(schema: Schema, column: str | None, where: str) -> OutField | None:
    """The collection's categorical obs field ``column`` (``None``: no grouping), or an
    :class:`InputError` naming the column and the categorical columns there are."""
    if column is None:
        return None
    if not isinstance(column, str) or not column:
        raise InputError(f"group_by must be an obs column name (or None), got {column!r}.")
    key = column if column.startswith("obs/") else f"obs/{column}"
    fields = {f.key: f for f in schema.fields}
    f = fields.get(key)
    if f is None or f.kind != "categorical":
        cats = [k[4:] for k, v in fields.items() if k.startswith("obs/")
                and v.kind == "categorical"]
        what = "not carried into the collection" if f is None else f"a {f.kind} column"
        raise InputError(f"{where}: group_by={column!r}: the obs column is {what}; group by a "
                         f"categorical obs column of the inputs (carried: {cats}; pass it in "
                         "obs_columns too if you list them).")
    return f


def global_codes(f: OutField, values: np.ndarray, index: int) -> np.ndarray:
    """Input ``index``'s values of categorical field ``f`` (its codes or strings) as the
    collection's global codes (``-1``: missing)."""
    import pandas as pd

    if values.dtype.kind in "iu":
        lut = f.luts[index] if f.luts else None
        if lut is None:
            return values.astype(np.int64)
        return lut[values.astype(np.int64)]  # code -1 hits the table's trailing -1
    return pd.Index(f.categories).get_indexer(pd.Index(values, dtype=object))


def class_codes(sources: Sequence[InputSource], f: OutField) -> np.ndarray:
    """Every input row's global code of ``f`` (int32, inputs in order, ``-1``: missing)."""
    out = np.empty(sum(s.n_obs for s in sources), dtype=np.int32)
    at = 0
    for s in sources:
        if s.n_obs:
            el = s.obs_reader(f.key[4:])
            values = s.named_read(f"{f.key} rows [0, {s.n_obs})",
                                  lambda el=el, n=s.n_obs: el.read(0, n))
            out[at: at + s.n_obs] = global_codes(f, np.asarray(values), s.index)
        at += s.n_obs
    return out


def group_in_shards(dest: np.ndarray | None, codes: np.ndarray, shard_obs: int) -> np.ndarray:
    """Destinations with each shard's positions reassigned so that its rows are sorted by
    ``codes`` (missing, ``-1``, last), keeping their order inside a class.

    Parameters
    ----------
    dest
        ``dest[g]``: the output position of input row ``g`` (``None``: row ``g`` at ``g``).
    codes
        Every input row's class code.
    shard_obs
        Rows per shard (shard ``s`` holds positions ``[s * shard_obs, (s + 1) * shard_obs)``).
    """
    n = len(codes)
    dtype = np.uint32 if n < 2**32 else np.int64
    if dest is None:
        at = np.arange(n, dtype=dtype)  # the row at each position
    else:
        at = np.empty(n, dtype=dtype)
        at[dest] = np.arange(n, dtype=dtype)
    out = np.empty(n, dtype=dtype)
    top = np.iinfo(np.int32).max
    for a in range(0, n, shard_obs):  # one shard's sort key at a time
        b = min(n, a + shard_obs)
        rows = at[a:b]
        key = codes[rows].astype(np.int32)
        key[key < 0] = top  # missing values last
        out[rows[np.argsort(key, kind="stable")]] = np.arange(a, b, dtype=dtype)
    return out
