"""The collection's schema, resolved from the probes of every input.

One var order (``"inner"``: genes of the first input that every input has; ``"outer"``:
every gene, first-seen order; or a reference gene list given as ``var_names=``, to which
every input is aligned: genes it lacks are zeros, its other genes dropped), the fields to
carry (X, layers, obsm, obs columns) and, for each, what the writer stores: X and layers as
CSR, obsm dense, string obs columns as categoricals (their distinct values, sorted). Which
fields, their kinds, dtypes, global categories with each input's local-to-global code table
and ``ordered`` come from :func:`annbatch_torch.store.inputs.plan_fields`, the rules in-
place reading follows too (:mod:`annbatch_torch.store.harmonize`): a field named in
``layers=`` / ``obsm=`` / ``obs_columns=`` (and X) must pass them (else :class:`InputError`,
before anything is written); any other field that does not is left out with a warning and
the reason in the manifest's ``unavailable``. Inputs without cells take no part (skipped
with a warning).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..errors import InputError
from ..store.inputs import InputSource, nonempty, plan_fields
from .varmeta import merge_var

__all__ = ["OutField", "Schema", "check_reference", "resolve_schema"]

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
    requested: bool = True  # named by the user (or X): a bad value is an error


@dataclass
class Schema:
    var_names: pd.Index
    col_maps: list[np.ndarray | None]  # input column -> output column (-1: dropped)
    col_sorted: list[bool]
    fields: list[OutField]
    unavailable: dict[str, str]  # fields in some inputs but not carried, and why
    #: fields not asked for that pass 1 found bad values in: not written, and why
    dropped: dict[str, str] = field(default_factory=dict)
    #: gene metadata: the var columns the inputs agree on (:mod:`.varmeta`)
    var: pd.DataFrame | None = None

    def drop(self, key: str, reason: str) -> None:
        """Leave out ``key`` (a field nobody asked for) once pass 1 found ``reason``."""
        if key not in self.dropped:
            logger.warning("%s is not carried: %s", key, reason)
            self.dropped[key] = reason
            self.unavailable[key] = reason

    @property
    def kept(self) -> list[OutField]:
        """The fields that are written."""
        return [f for f in self.fields if f.key not in self.dropped]


def check_reference(var_names: Any) -> pd.Index:
    """``var_names=`` of the writer as an index of unique gene names, or
    :class:`InputError` saying what is wrong with it."""
    if isinstance(var_names, str | bytes) or not hasattr(var_names, "__iter__"):
        raise InputError(f"var_names={var_names!r} must be a list of gene names (e.g. "
                         "var_names=list(reference.var_names)), not a single value.")
    names = pd.Index(list(var_names), dtype=object)
    if len(names) == 0:
        raise InputError("var_names=[] names no gene; pass the reference gene list, or "
                         "var_names=None to join the inputs' genes with var_join.")
    bad = [v for v in names[:100_000] if not isinstance(v, str) or not v]
    if bad:
        raise InputError(f"var_names holds {bad[0]!r}, not a gene name (non-empty str); "
                         "pass gene names as strings.")
    if not names.is_unique:
        dup = names[names.duplicated()].unique()
        raise InputError(f"var_names names {len(dup)} gene(s) more than once (e.g. "
                         f"{list(dup[:3])}); pass each gene once (e.g. "
                         "list(dict.fromkeys(names))).")
    return names


def _align_to_reference(used: list[InputSource], reference: pd.Index) -> pd.Index:
    """``reference``, after logging how each input's genes meet it; an input sharing none
    of its genes is an :class:`InputError` (its rows would be all zeros)."""
    for s in used:
        have = int(pd.Index(s.var_names).isin(reference).sum())
        if have == 0 and len(s.var_names):
            raise InputError(
                f"{s.label}: none of its {len(s.var_names)} genes (e.g. "
                f"{list(s.var_names[:3])}) is in var_names (e.g. {list(reference[:3])}); its "
                "cells would be all zeros. Fix: use the same gene identifiers in both "
                "(symbols vs Ensembl IDs), or leave this input out."
            )
        missing, extra = len(reference) - have, len(s.var_names) - have
        (logger.warning if have < len(reference) / 2 else logger.info)(
            "%s: %d of the %d reference genes present; %d missing (written as zeros), %d "
            "not in the reference (dropped).", s.label, have, len(reference), missing, extra)
    return reference


def _resolve_vars(used: list[InputSource], sources: list[InputSource], var_join: str,
                  reference: pd.Index | None = None) -> tuple[pd.Index, list, list]:
    first = pd.Index(used[0].var_names)
    if reference is not None:
        names = _align_to_reference(used, reference)
    elif var_join == "inner":
        common = set(first)
        for s in used[1:]:
            common.intersection_update(s.var_names)
        names = pd.Index([v for v in first if v in common], dtype=object)
        if len(names) == 0 and any(len(s.var_names) for s in used):
            other = next((s for s in used[1:] if not set(first) & set(s.var_names)),
                         used[-1])
            raise InputError(
                f"{used[0].label} and {other.label}: var_join='inner' leaves no genes "
                f"(e.g. {list(first[:3])} vs {list(other.var_names[:3])}). Fix: make the "
                "inputs use the same gene identifiers (symbols vs Ensembl IDs), or pass "
                "var_join='outer'."
            )
    else:
        names = pd.Index(list(dict.fromkeys(v for s in used for v in s.var_names)),
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
_OMIT = {"X": "remove X from every input (del adata.X) to write a collection without X",
         "layers": "leave it out with layers=[...]", "obsm": "leave it out with obsm=[...]",
         "obs": "leave it out with obs_columns=[...]"}


def resolve_schema(sources: list[InputSource], var_join: str, obs_columns: list[str] | None,
                   layers: list[str] | None, obsm: list[str] | None,
                   reference: pd.Index | None = None) -> Schema:
    """The collection's var order (``reference``: that gene list), fields and global
    categories (see module docs)."""
    used = nonempty(sources)
    var_names, maps, is_sorted = _resolve_vars(used, sources, var_join, reference)
    requested = {"X": True, "layers": layers, "obsm": obsm, "obs": obs_columns}
    plan = plan_fields(used, requested=requested, omit=_OMIT, warn=True,
                       matrix_width=len(var_names))
    if not plan.fields:
        raise InputError(
            f"{', '.join(s.label for s in used)}: nothing to carry (no X, and no layer, obsm "
            f"entry or obs column every input can offer: {plan.unavailable}). Fix: pass "
            "inputs with X, or name the fields to carry with layers=, obsm=, obs_columns=."
        )
    position = {s.index: k for k, s in enumerate(used)}
    fields = []
    for name, h in plan.fields.items():
        info = h.info
        group = name.partition("/")[0] if name != "X" else "X"
        asked = group == "X" or requested[group] is not None
        if info.kind in ("csr", "dense"):
            fields.append(OutField(name, info.kind, np.dtype(info.dtype),
                                   width=int(info.shape[1] or 0), requested=asked))
            continue
        luts = None
        if h.code_tables is not None:
            luts = [h.code_tables[position[s.index]] if s.index in position else None
                    for s in sources]
        fields.append(OutField(name, info.kind, np.dtype(info.dtype),
                               categories=None if info.categories is None
                               else list(info.categories),
                               ordered=info.ordered, luts=luts, requested=asked))
    unavailable = dict(plan.unavailable)
    by_index = {s.index: k for k, s in enumerate(sources)}
    var = merge_var([s.var_frame() for s in used], [s.label for s in used],
                    [maps[by_index[s.index]] for s in used], var_names)
    unavailable.update(var.dropped)
    return Schema(var_names, maps, is_sorted, fields, unavailable, var=var.frame)
