"""The collection's schema, resolved from the probes of every input.

One var order (``"inner"``: genes of the first input that every input has; ``"outer"``:
every gene, first-seen order), the fields to carry (X, layers, obsm, obs columns) and, for
each, what the writer stores: X and layers as CSR, obsm dense, string obs columns as
categoricals (their distinct values, sorted). Kinds, dtypes, global categories with each
input's local-to-global code table and ``ordered`` follow the rules that in-place reading
follows too (:mod:`annbatch_torch.store.harmonize`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from ..errors import InputError
from ..store.harmonize import InputField, column_kind, harmonize_field
from ..store.inputs import InputSource
from ..store.manifest import field_name_problem

__all__ = ["OutField", "Schema", "resolve_schema"]

logger = logging.getLogger(__name__)


@dataclass
class OutField:
    """One field of the collection being written, and how each input maps into it."""

    key: str
    kind: str  # csr | dense | categorical | numeric | bool
    dtype: np.dtype
    width: int | None = None
    categories: list[Any] | None = None
    ordered: bool = False
    luts: list[np.ndarray | None] | None = None  # local -> global codes, per input


@dataclass
class Schema:
    var_names: pd.Index
    col_maps: list[np.ndarray | None]  # input column -> output column (-1: dropped)
    col_sorted: list[bool]
    fields: list[OutField]
    unavailable: dict[str, str]  # fields in some inputs but not carried, and why


def _select(sources: list[InputSource], attr: str, prefix: str, wanted: list[str] | None,
            what: str, unavailable: dict[str, str]) -> list[str]:
    """Keys ``prefix/k`` to carry: all usable ones common to every input, or ``wanted``.

    With ``wanted=None``, keys left out are recorded in ``unavailable`` with the reason.
    """
    if wanted is None:
        keys = dict.fromkeys(k for s in sources for k in getattr(s, attr)
                             if not isinstance(k, str) or k.startswith(prefix))
        out = []
        for k in keys:
            field = k if prefix else f"obs/{k}"
            why = field_name_problem(field if isinstance(k, str) else k)
            if why is not None:  # e.g. an obs column "CD4/CD8": it would name a sub-folder
                unavailable[str(field)] = f"its name cannot be stored ({why})"
                logger.warning("%s %r is not carried: its name cannot be stored (%s); "
                               "rename it to carry it.", what, k, why)
                continue
            probes = [getattr(s, attr).get(k) for s in sources]
            if any(p is None for p in probes):
                lacking = sources[probes.index(None)].label
                unavailable[field] = f"{lacking} does not have it (only fields in every input " \
                    "are carried)"
                logger.info("%s %r is not in every input (%s lacks it); not carried.", what, k,
                            lacking)
            elif any(p.kind == "unsupported" for p in probes):
                bad = next(i for i, p in enumerate(probes) if p.kind == "unsupported")
                unavailable[field] = f"{sources[bad].label} stores it as {probes[bad].why}"
                logger.warning("%s %r has an unsupported type in %s (%s); not carried.", what,
                               k, sources[bad].label, probes[bad].why)
            else:
                out.append(k)
        return out
    out = []
    for name in wanted:
        k = f"{prefix}{name}"
        why = field_name_problem(k if prefix else f"obs/{name}")
        if why is not None:
            raise InputError(
                f"{sources[0].label}: {what} {name!r} cannot be stored: {why}. Fix: rename it "
                "in the inputs (e.g. adata.obs.rename(columns={old: new})) or drop it from "
                "the list."
            )
        for s in sources:
            p = getattr(s, attr).get(k)
            if p is None:
                have = [x[len(prefix):] for x in getattr(s, attr) if x.startswith(prefix)]
                raise InputError(
                    f"{s.label}: has no {what} {name!r} (it has {have}); every input needs "
                    f"each requested {what}. Fix: drop {name!r} from the list or add it there."
                )
            if p.kind == "unsupported":
                raise InputError(f"{s.label}: {what} {name!r} cannot be carried ({p.why}); "
                                 "store it as a numeric array or drop it from the list.")
        out.append(k)
    return out


def _resolve_vars(sources: list[InputSource], var_join: str) -> tuple[pd.Index, list, list]:
    first = pd.Index(sources[0].var_names)
    if var_join == "inner":
        common = set(first)
        for s in sources[1:]:
            common.intersection_update(s.var_names)
        names = pd.Index([v for v in first if v in common], dtype=object)
        if len(names) == 0:
            other = next(s for s in sources[1:] if not set(first) & set(s.var_names)) \
                if len(sources) > 1 else sources[0]
            raise InputError(
                f"{sources[0].label} and {other.label}: var_join='inner' leaves no genes "
                f"(e.g. {list(first[:3])} vs {list(other.var_names[:3])}). Fix: make the "
                "inputs use the same gene identifiers (symbols vs Ensembl IDs), or pass "
                "var_join='outer'."
            )
    else:
        names = pd.Index(list(dict.fromkeys(v for s in sources for v in s.var_names)),
                         dtype=object)
    maps, is_sorted = [], []
    for s in sources:
        m = names.get_indexer(pd.Index(s.var_names)).astype(np.int32)
        if len(m) == len(names) and np.array_equal(m, np.arange(len(names))):
            maps.append(None)
            is_sorted.append(True)
        else:
            kept = m[m >= 0]
            maps.append(m)
            is_sorted.append(bool(np.all(np.diff(kept) > 0)))
    return names, maps, is_sorted


#: how a writer's user leaves a field out, ending the fix of a refusal
_OMIT = {"layers": "leave it out with layers=[...]", "obsm": "leave it out with obsm=[...]",
         "obs": "leave it out with obs_columns=[...]"}


def _string_categories(s: InputSource, c: str) -> tuple[Any, ...]:
    cats = s.string_categories(c)
    logger.info("%s: obs column %r holds strings; stored as categorical (%d categories).",
                s.label, c, len(cats))
    if len(cats) > 10_000 and len(cats) > s.n_obs // 2:
        logger.warning("%s: obs column %r looks like per-cell IDs (%d distinct values); "
                       "consider obs_columns=[...] without it.", s.label, c, len(cats))
    return tuple(cats)


def _resolve_obs(sources: list[InputSource], columns: list[str]) -> list[OutField]:
    fields = []
    for c in columns:
        probes = [s.obs[c] for s in sources]
        described = [InputField(s.label, "categorical" if p.kind == "string" else p.kind,
                                p.dtype, categories=p.categories, ordered=p.ordered)
                     for s, p in zip(sources, probes)]
        if column_kind(c, described, _OMIT["obs"]) == "categorical":
            # strings are scanned for their values only once the kinds agree
            described = [replace(d, categories=_string_categories(s, c)) if p.kind == "string"
                         else d for s, p, d in zip(sources, probes, described)]
        h = harmonize_field(f"obs/{c}", described, _OMIT["obs"])
        info = h.info
        cats = None if info.categories is None else list(info.categories)
        fields.append(OutField(f"obs/{c}", info.kind, np.dtype(info.dtype), categories=cats,
                               ordered=info.ordered, luts=h.code_tables))
    return fields


def resolve_schema(sources: list[InputSource], var_join: str, obs_columns: list[str] | None,
                   layers: list[str] | None, obsm: list[str] | None) -> Schema:
    """The collection's var order, fields and global categories (see module docs)."""
    var_names, maps, is_sorted = _resolve_vars(sources, var_join)
    fields, unavailable = [], {}
    for key in ["X", *_select(sources, "matrices", "layers/", layers, "layer", unavailable)]:
        probes = [s.matrices[key] for s in sources]
        for s, p in zip(sources, probes):
            if p.kind == "unsupported":
                raise InputError(f"{s.label}: {key} cannot be read ({p.why}); store it as a "
                                 "CSR/CSC sparse matrix or a dense numeric array.")
            if p.shape != (s.n_obs, len(s.var_names)):
                raise InputError(f"{s.label}: {key} has shape {p.shape} but the AnnData is "
                                 f"{s.n_obs} x {len(s.var_names)}; the file is damaged.")
        # every input's rows become CSR rows over the collection's var order
        described = [InputField(s.label, "csr", p.dtype, (len(var_names),)) for s, p in
                     zip(sources, probes)]
        info = harmonize_field(key, described, _OMIT["layers"]).info
        fields.append(OutField(key, "csr", np.dtype(info.dtype), width=len(var_names)))
    for key in _select(sources, "obsm", "obsm/", obsm, "obsm entry", unavailable):
        described = [InputField(s.label, "dense", s.obsm[key].dtype, s.obsm[key].shape[1:])
                     for s in sources]
        info = harmonize_field(key, described, _OMIT["obsm"]).info
        fields.append(OutField(key, "dense", np.dtype(info.dtype), width=int(info.shape[1])))
    cols = _select(sources, "obs", "", obs_columns, "obs column", unavailable)
    fields += _resolve_obs(sources, cols)
    return Schema(var_names, maps, is_sorted, fields, unavailable)
