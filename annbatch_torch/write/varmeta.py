"""Gene metadata of the collection: the ``var`` columns the inputs agree on.

Every input's ``var`` dataframe (gene symbols, ``highly_variable``, ``feature_types``...) is
aligned to the collection's genes. A column is kept when every input has it and, for each
gene two inputs both hold, they hold the same value (missing equals missing); genes no input
holds (a reference list's extra genes) are missing. A column some input lacks, or on which
two inputs disagree (per-dataset statistics such as ``n_cells`` or ``means`` usually do), or
whose values no AnnData store can hold, is left out: the collection's ``unavailable`` says
why, and one WARNING lists them all. Nobody names var columns, so none is ever an error.

Kept columns keep their kind: numbers (an integer or boolean column with missing genes
becomes pandas' nullable ``Int64`` / ``boolean``; integers beside floats become float64,
floats keep their precision),
booleans, strings (missing genes: a categorical with missing values) and categoricals (the
union of the inputs' categories, first seen first).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["VarMeta", "merge_var"]

logger = logging.getLogger(__name__)


@dataclass
class VarMeta:
    """The merged ``var`` dataframe and the columns left out, with why."""

    frame: pd.DataFrame
    dropped: dict[str, str] = field(default_factory=dict)


def _kind(s: pd.Series) -> str | None:
    """``"category"``, ``"bool"``, ``"int"``, ``"float"``, ``"str"``, or ``None`` when no
    AnnData store can hold it as a column."""
    dt = s.dtype
    if isinstance(dt, pd.CategoricalDtype):
        return "category"
    if pd.api.types.is_bool_dtype(dt):
        return "bool"
    if pd.api.types.is_integer_dtype(dt):
        return "int"
    if pd.api.types.is_float_dtype(dt):
        return "float"
    if pd.api.types.is_string_dtype(dt) or getattr(dt, "kind", "") == "O":
        values = s.dropna()
        return "str" if all(isinstance(v, str) for v in values) else None
    return None


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise equality of two object arrays; missing equals missing."""
    na, nb = pd.isna(a), pd.isna(b)
    eq = np.zeros(len(a), dtype=bool)
    both = ~na & ~nb
    eq[both] = a[both] == b[both]
    return eq | (na & nb)


def _numpy_dtype(s: pd.Series) -> np.dtype:
    """A column's numpy dtype (pandas' nullable ``Int64`` / ``Float64`` / ``boolean``: the
    one they hold)."""
    dt = s.dtype
    return np.dtype(getattr(dt, "numpy_dtype", dt))


def _build(values: np.ndarray, missing: np.ndarray, kinds: list[str],
           columns: list[pd.Series]) -> Any:
    """The kept column's values in the collection's dtype (see the module docs), or a
    string: why it cannot be kept."""
    kind = kinds[0] if len(set(kinds)) == 1 else "category" if "category" in kinds else "float"
    if kind == "category":
        cats: dict[Any, None] = {}
        categorical = [c for c in columns if isinstance(c.dtype, pd.CategoricalDtype)]
        for c in categorical:
            cats.update(dict.fromkeys(c.cat.categories))
        cats.update(dict.fromkeys(sorted(set(values[~missing]) - set(cats))))
        orders = [list(c.cat.categories) for c in categorical]
        ordered = (len(categorical) == len(columns) and all(c.cat.ordered for c in categorical)
                   and all(o == orders[0] for o in orders))
        return pd.Categorical(values, categories=list(cats), ordered=ordered)
    if kind == "str":
        return pd.Categorical(values) if missing.any() else values.astype(str).astype(object)
    if kind == "bool":
        return pd.array(values, dtype="boolean") if missing.any() else values.astype(bool)
    if kind == "int":
        dtype = np.result_type(*[_numpy_dtype(c) for c in columns])
        if not missing.any() and not any(c.hasnans for c in columns):
            return values.astype(dtype)
        unsigned = dtype.kind == "u"
        present = values[~missing]
        if present.size and not unsigned and max(present) > np.iinfo(np.int64).max:
            return "its values do not fit int64 once missing genes are added"
        return pd.array(values, dtype="UInt64" if unsigned else "Int64")
    floats = [_numpy_dtype(c) for c in columns]
    dtype = np.result_type(*floats) if kinds == ["float"] * len(kinds) else np.dtype(np.float64)
    out = np.full(len(values), np.nan, dtype=dtype)
    out[~missing] = values[~missing].astype(dtype)
    return out


#: kinds that merge into one column: numbers into float64, strings into a categorical
_COMPATIBLE = ({"int", "float"}, {"category", "str"})


def merge_var(frames: Sequence[pd.DataFrame], labels: Sequence[str],
              maps: Sequence[np.ndarray | None], var_names: pd.Index, what: str = "var"
              ) -> VarMeta:
    """The ``var`` columns ``frames`` agree on, aligned to ``var_names``.

    Parameters
    ----------
    frames
        Each input's ``var`` dataframe (rows in its gene order).
    labels
        The inputs' labels, for the reasons.
    maps
        Per input, its gene ``i`` -> the collection's gene ``maps[i]`` (-1: dropped);
        ``None``: the same genes in the same order.
    var_names
        The collection's genes.
    what
        The dataframe's name in reasons and field keys (``"var"``, ``"raw/var"``).
    """
    n = len(var_names)
    out = pd.DataFrame(index=pd.Index(var_names, dtype=object))
    dropped: dict[str, str] = {}
    if not frames:
        return VarMeta(out)
    names = list(frames[0].columns)
    for k, f in enumerate(frames[1:], 1):
        for c in f.columns:
            if c not in names and f"{what}/{c}" not in dropped:
                dropped[f"{what}/{c}"] = f"not in {labels[0]}'s {what}"
        for c in list(names):
            if c not in f.columns:
                names.remove(c)
                dropped[f"{what}/{c}"] = f"not in {labels[k]}'s {what}"
    for c in names:
        key = f"{what}/{c}"
        if not isinstance(c, str) or c in ("", "_index") or "/" in c:
            dropped[key] = f"the column name {c!r} cannot name an AnnData column"
            continue
        columns = [f[c] for f in frames]
        kinds = [_kind(s) for s in columns]
        bad = next((k for k, kd in enumerate(kinds) if kd is None), None)
        if bad is not None:
            dropped[key] = (f"{labels[bad]} stores it as {columns[bad].dtype} with values that "
                            "are no strings, numbers or booleans")
            continue
        if len(set(kinds)) > 1 and not any(set(kinds) <= ok for ok in _COMPATIBLE):
            other = next(k for k, kd in enumerate(kinds) if kd != kinds[0])
            dropped[key] = (f"{labels[0]} stores it as {kinds[0]}, {labels[other]} as "
                            f"{kinds[other]}")
            continue
        values = np.empty(n, dtype=object)
        missing = np.ones(n, dtype=bool)
        owner = np.full(n, -1, dtype=np.int64)
        why = None
        for k, (s, m) in enumerate(zip(columns, maps)):
            src = s.to_numpy(dtype=object)
            m = np.arange(len(src)) if m is None else np.asarray(m)
            keep = m >= 0
            dest, vals = m[keep], src[keep]
            seen = owner[dest] >= 0
            if seen.any():
                same = _same(values[dest[seen]], vals[seen])
                if not same.all():
                    j = int(np.flatnonzero(~same)[0])
                    g = int(dest[seen][j])
                    why = (f"{labels[int(owner[g])]} and {labels[k]} disagree on gene "
                           f"{var_names[g]!r} ({values[g]!r} vs {vals[seen][j]!r})")
                    break
            fresh = ~seen
            values[dest[fresh]] = vals[fresh]
            owner[dest[fresh]] = k
            missing[dest[fresh]] = pd.isna(vals[fresh])
        if why is not None:
            dropped[key] = why
            continue
        missing |= owner < 0
        values[missing] = np.nan
        built = _build(values, missing, [kd for kd in kinds if kd is not None], columns)
        if isinstance(built, str):
            dropped[key] = built
            continue
        out[c] = built
    if dropped:
        logger.warning("%s columns not carried: %s", what,
                       "; ".join(f"{k[len(what) + 1:]} ({v})" for k, v in dropped.items()))
    return VarMeta(out, dropped)
