"""The collection's schema, resolved from the probes of every input.

One var order (``"inner"``: genes of the first input that every input has; ``"outer"``:
every gene, first-seen order; or a reference gene list given as ``var_names=``, to which
every input is aligned: genes it lacks are zeros, its other genes dropped), the fields to
carry (X, layers, obsm, obs columns) and, for each, what the writer stores: X and layers as
CSR, obsm dense, string obs columns as categoricals (their distinct values, sorted). Which
fields, their kinds, dtypes, global categories with each input's local-to-global code table
and ``ordered`` come from :func:`annbatch_torch.store.inputs.plan.plan_fields`, the rules in-
place reading follows too (:mod:`annbatch_torch.store.inputs.harmonize`): a field named in
``layers=`` / ``obsm=`` / ``obs_columns=`` (and X) must pass them (else :class:`InputError`,
before anything is written); any other field that does not is left out with a warning and
the reason in the manifest's ``unavailable``. Inputs without cells take no part (skipped
with a warning).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components

from ..errors import InputError
from ..store.collection import MAX_LABEL_CATEGORIES, too_many_categories
from ..store.inputs.plan import nonempty, plan_fields
from ..store.inputs.view import InputSource
from ..store.manifest import RAW_X
from .narrow import ValueRange, asked_dtype, stored_dtype, stored_index_dtype
from .varmeta import merge_var

__all__ = ["LOW_GENE_OVERLAP", "GeneAxis", "OutField", "Schema", "check_reference",
           "join_genes", "resolve_schema"]

logger = logging.getLogger(__name__)

#: an input sharing fewer genes with the other inputs than this fraction of the smaller gene
#: list (its own, or the others' together) is warned about: mismatched identifiers, mostly
LOW_GENE_OVERLAP = 0.10
#: what an Ensembl gene ID looks like (ENSG00000111640, ENSMUSG00000057666.15)
_ENSEMBL = r"^ENS[A-Z]*G\d{6,}(\.\d+)?$"


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
    #: float64 only because integer inputs meet float32 ones (``Harmonized.mixed``)
    mixed: bool = False
    #: the dtype readers deliver when not ``dtype`` (set after pass 1 by
    #: :meth:`Schema.settle_float32`; ``dtype`` stays what the pass-1 buckets hold)
    delivered: np.dtype | None = None

    @property
    def logical(self) -> np.dtype:
        """The dtype readers deliver: the collection's record of this field."""
        return self.dtype if self.delivered is None else self.delivered


@dataclass
class GeneAxis:
    """One gene axis of the collection (``var``, or ``raw``'s): its genes and, per input,
    its column -> the axis' column (-1: dropped; ``None``: the same genes in order)."""

    names: pd.Index
    maps: list[np.ndarray | None]
    sorted: list[bool]  # per input: its kept columns stay in increasing order


@dataclass
class Schema:
    genes: GeneAxis  # of X and layers
    fields: list[OutField]
    unavailable: dict[str, str]  # fields in some inputs but not carried, and why
    #: fields not asked for that pass 1 found bad values in: not written, and why
    dropped: dict[str, str] = field(default_factory=dict)
    #: gene metadata: the var columns the inputs agree on (:mod:`.varmeta`)
    var: pd.DataFrame | None = None
    #: raw's genes and gene metadata, when raw/X is carried
    raw_genes: GeneAxis | None = None
    raw_var: pd.DataFrame | None = None
    #: what pass 1 saw of each CSR field's values, per shard of this write:
    #: ``{(field, shard): ValueRange}`` (:class:`.narrow.ValueRange`)
    ranges: dict[tuple[str, int], ValueRange] = field(default_factory=dict)
    #: the writer's ``data_dtype`` / ``index_dtype`` options (``None``: ``"auto"``; see
    #: :mod:`.narrow`), set before pass 1 (:meth:`use_storage`)
    storage: dict[str, Any] = field(default_factory=dict)

    def use_storage(self, opts: dict[str, Any]) -> None:
        """Store CSR fields as the writer's ``opts["data_dtype"]`` / ``opts["index_dtype"]``
        say: an explicit ``data_dtype`` is checked on every block pass 1 reads
        (:meth:`observe`), so a value it cannot hold is refused at once, not after the
        pass; :meth:`stored_in` applies them after it."""
        self.storage = {k: opts.get(k) for k in ("data_dtype", "index_dtype")}

    def observe(self, key: str, values: np.ndarray, indptr: np.ndarray, shards: np.ndarray,
                label: str) -> None:
        """Note the values of a block of CSR field ``key`` of input ``label`` (pass 1):
        ``values`` and ``indptr`` of its rows, ``shards[r]`` the shard row ``r`` goes to
        (rows of one shard together); :class:`InputError` at once when an explicit
        ``data_dtype`` (:meth:`use_storage`) cannot hold a value."""
        asked = asked_dtype(self.storage)
        cuts = np.flatnonzero(shards[1:] != shards[:-1]) + 1
        for r0, r1 in zip([0, *cuts.tolist()], [*cuts.tolist(), len(shards)]):
            part = values[int(indptr[r0]) : int(indptr[r1])]
            if not part.size:
                continue
            seen = self.ranges.setdefault((key, int(shards[r0])), ValueRange())
            seen.observe(part, label)
            if asked is not None:
                stored_dtype(key, values.dtype, seen, asked)  # raises if it cannot

    def settle_float32(self) -> None:
        """After pass 1: CSR fields that are float64 only because integer inputs met
        float32 ones (``OutField.mixed``: counts saved as int32 in some inputs, float32 in
        others) are delivered as float32 when pass 1 found every value exact in float32,
        as each input alone would be. Half the bytes of every batch, dense ones above
        all."""
        settled = []
        for f in self.kept:
            if f.kind != "csr" or not f.mixed:  # mixed: float64 from the inputs' dtypes
                continue
            seen = [r for (key, _), r in self.ranges.items() if key == f.key]
            if all(r.fits_float32 for r in seen):
                f.delivered = np.dtype(np.float32)
                settled.append(f.key)
        if settled:
            logger.info("%s: integer and float32 inputs, every value exact in float32: "
                        "delivered as float32 (np.result_type would say float64).", settled)

    def stored_in(self, shard: int) -> dict[str, tuple[np.dtype, np.dtype]]:
        """``{field: (values dtype, indices dtype)}`` of the CSR fields of shard ``shard``
        of this write: the narrowest that holds what pass 1 saw of that shard's values (an
        outlier widens its own shard only), or what the options ask."""
        out = {}
        for f in self.kept:
            if f.kind == "csr":
                out[f.key] = (
                    stored_dtype(f.key, f.logical, self.ranges.get((f.key, shard)),
                                 self.storage.get("data_dtype")),
                    stored_index_dtype(int(f.width), self.storage.get("index_dtype")))
        return out

    @property
    def var_names(self) -> pd.Index:
        return self.genes.names

    def axis(self, key: str) -> GeneAxis:
        """The gene axis of matrix field ``key`` (raw/X: raw's, else var's)."""
        if key == RAW_X:
            assert self.raw_genes is not None
            return self.raw_genes
        return self.genes

    def for_inputs(self, indices: Collection[int]) -> Schema:
        """A copy for a task that routes inputs ``indices`` only (none, as pass 2): its gene
        axes keep those inputs' column maps and an empty one for every other input (a task
        that used one would fail, not misplace genes). A Dask task's arguments are pickled
        one by one: every task would otherwise carry every input's map."""
        keep = set(indices)

        def slim(axis: GeneAxis | None) -> GeneAxis | None:
            if axis is None:
                return None
            maps = [m if k in keep else np.empty(0, dtype=np.int64)
                    for k, m in enumerate(axis.maps)]
            return dataclasses.replace(axis, maps=maps)

        return dataclasses.replace(self, genes=slim(self.genes), raw_genes=slim(self.raw_genes))

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


def _align_to_reference(used: list[tuple[str, pd.Index]], reference: pd.Index, what: str
                        ) -> pd.Index:
    """``reference``, after logging how each input's genes meet it; an input sharing none
    of its genes is an :class:`InputError` (its rows would be all zeros)."""
    for label, genes in used:
        have = int(genes.isin(reference).sum())
        if have == 0 and len(genes):
            raise InputError(
                f"{label}: none of its {len(genes)} {'' if what == 'var' else what + ' '}genes "
                f"(e.g. {list(genes[:3])}) is "
                f"in var_names (e.g. {list(reference[:3])}); its cells would be all zeros. "
                "Fix: use the same gene identifiers in both (symbols vs Ensembl IDs), or "
                "leave this input out."
            )
        missing, extra = len(reference) - have, len(genes) - have
        (logger.warning if have < len(reference) / 2 else logger.info)(
            "%s: %d of the %d reference genes present%s; %d missing (written as zeros), %d "
            "not in the reference (dropped).", label, have, len(reference),
            "" if what == "var" else f" in {what}", missing, extra)
    return reference


def join_genes(used: list[tuple[str, pd.Index]], every: list[pd.Index | None], var_join: str,
               reference: pd.Index | None = None, what: str = "var") -> GeneAxis:
    """The genes of one axis from the inputs' (``used``: ``(label, genes)`` of the inputs
    with cells; ``every``: every input's genes, ``None`` where it has none), by
    ``var_join`` or aligned to ``reference``."""
    first = used[0][1]
    if reference is not None:
        names = _align_to_reference(used, reference, what)
    elif var_join == "inner":
        common = set(first)
        for _, genes in used[1:]:
            common.intersection_update(genes)
        names = pd.Index([v for v in first if v in common], dtype=object)
        if len(names) == 0 and any(len(g) for _, g in used):
            other = next((u for u in used[1:] if not set(first) & set(u[1])), used[-1])
            raise InputError(
                f"{used[0][0]} and {other[0]}: var_join='inner' leaves no "
                f"{_genes(what)} (e.g. {list(first[:3])} vs {list(other[1][:3])}): no gene "
                "identifier is in every input. "
                f"{_identifier_hints(used[0][0], first, other[0], pd.Index(other[1]))}"
                "Fix: make the inputs use the same gene identifiers (map symbols to Ensembl "
                "IDs or back, e.g. adata.var_names = adata.var['gene_ids']), or align every "
                "input to a reference gene list with var_names=[...] (genes an input lacks "
                "are written as zeros)."
            )
        _check_overlap(used, var_join, what, kept=len(names))
    else:
        coded = _gene_codes(used)  # the distinct genes in first-seen order: the outer join
        _check_overlap(used, var_join, what, coded=coded)
        names = pd.Index(coded[1], dtype=object)
    maps: list[np.ndarray | None] = []
    is_sorted = []
    for genes in every:
        if genes is None:
            maps.append(None)
            is_sorted.append(True)
            continue
        m = names.get_indexer(genes).astype(np.int32)
        if len(m) == len(names) and np.array_equal(m, np.arange(len(names))):
            maps.append(None)
            is_sorted.append(True)
        else:
            kept = m[m >= 0]
            maps.append(m)
            is_sorted.append(bool(np.all(np.diff(kept) > 0)))
    return GeneAxis(names, maps, is_sorted)


def _genes(what: str) -> str:
    return "genes" if what == "var" else f"{what} genes"


def _examples(genes: pd.Index, leave_out: pd.Index, k: int = 3) -> list[Any]:
    """The first ``k`` of ``genes`` not in ``leave_out`` (else the first ``k``)."""
    only = genes[~genes.isin(leave_out)]
    return list((only if len(only) else genes)[:k])


def _identifier_hints(a_label: str, a: pd.Index, b_label: str, b: pd.Index) -> str:
    """Why gene lists ``a`` and ``b`` may not meet, as sentences ending in a space (or
    ``""``): genes that match when case is ignored, Ensembl IDs in one and symbols in the
    other, Ensembl IDs whose version suffixes differ."""
    a, b = pd.Index(a.astype(str)), pd.Index(b.astype(str))
    hints = []
    exact = a.isin(b)
    lower_b = pd.Index(b.str.lower())
    folded = pd.Index(a.str.lower()).isin(lower_b) & ~exact
    if folded.any():
        g = a[folded][0]
        h = b[lower_b.get_loc(g.lower()) if lower_b.is_unique else
              int(np.flatnonzero(lower_b == g.lower())[0])]
        hints.append(f"{int(folded.sum())} genes match when case is ignored (e.g. {g!r} vs "
                     f"{h!r}): human symbols are upper case (GAPDH), mouse ones capitalised "
                     "(Gapdh); for one species, make the case agree (e.g. adata.var_names = "
                     "adata.var_names.str.upper()).")
    ens_a, ens_b = a.str.match(_ENSEMBL), b.str.match(_ENSEMBL)
    if (ens_a.mean() > 0.5) != (ens_b.mean() > 0.5):
        (el, eg), (sl, sg) = ((a_label, a), (b_label, b)) if ens_a.mean() > 0.5 else (
            (b_label, b), (a_label, a))
        hints.append(f"{el} names genes by Ensembl IDs (e.g. {eg[0]!r}) and {sl} by gene "
                     f"symbols (e.g. {sg[0]!r}): map one kind to the other (e.g. from a var "
                     "column holding both: adata.var_names = adata.var['gene_ids'] or "
                     "adata.var['gene_symbols']).")
    elif ens_a.mean() > 0.5:
        strip = r"\.\d+$"
        bare_a = pd.Index(a.str.replace(strip, "", regex=True))
        bare_b = pd.Index(b.str.replace(strip, "", regex=True))
        versioned = bare_a.isin(bare_b) & ~exact
        if versioned.any():
            g = a[versioned][0]
            h = b[int(np.flatnonzero(bare_b == bare_a[versioned][0])[0])]
            hints.append(f"{int(versioned.sum())} Ensembl IDs match once their version "
                         f"suffixes are dropped (e.g. {g!r} vs {h!r}): drop them (adata."
                         "var_names = adata.var_names.str.replace(r'\\.\\d+$', '', "
                         "regex=True)).")
    return "".join(h + " " for h in hints)


def _gene_codes(used: Sequence[tuple[str, pd.Index]]) -> tuple[np.ndarray, np.ndarray]:
    """The genes of every input of ``used`` factorised together: the code of each (the
    lists concatenated) and the distinct genes, in first-seen order."""
    genes = [np.asarray(g, dtype=object) for _, g in used]
    codes, uniques = pd.factorize(np.concatenate(genes) if genes else np.empty(0, object),
                                  use_na_sentinel=False)
    return codes, np.asarray(uniques, dtype=object)


def _check_overlap(used: Sequence[tuple[str, pd.Index]], var_join: str, what: str,
                   kept: int | None = None,
                   coded: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Refuse an outer join of inputs that fall into groups sharing no gene (a block
    matrix); warn, for either join, when an input shares under :data:`LOW_GENE_OVERLAP` of
    the smaller gene list (its own or the other inputs') with the others. ``kept``: the
    genes an inner join keeps.

    One pass over every input's genes (factorised together, ``coded``: done already by
    :func:`_gene_codes`); the inputs and their genes as the nodes of one graph, whose
    connected components are the groups.
    """
    inputs = [(label, pd.Index(g)) for label, g in used if len(g)]
    if len(inputs) < 2 or all(g.equals(inputs[0][1]) for _, g in inputs[1:]):
        return
    sizes = np.array([len(g) for _, g in inputs], dtype=np.int64)
    codes, uniques = _gene_codes(inputs) if coded is None else coded  # (empty lists add none)
    n_in, n_genes = len(inputs), len(uniques)
    owner = np.repeat(np.arange(n_in), sizes)
    graph = sp.csr_matrix((np.ones(codes.size, dtype=np.int8), (owner, n_in + codes)),
                          shape=(n_in + n_genes, n_in + n_genes))
    _, group = connected_components(graph, directed=False)
    apart = np.flatnonzero(group[:n_in] != group[0])
    if apart.size and var_join == "outer":
        (la, a), (lb, b) = inputs[0], inputs[int(apart[0])]
        also = " (nor with any input that shares genes with it)" if n_in > 2 else ""
        raise InputError(
            f"{la} and {lb} share no {_genes(what)}{also} (e.g. {list(a[:3])} vs "
            f"{list(b[:3])}): var_join='outer' would write a block matrix, each input's "
            "cells zero on the other's genes, which is what gene identifiers of different "
            f"kinds look like (gene symbols vs Ensembl IDs, or letter case). "
            f"{_identifier_hints(la, a, lb, b)}Fix: map the inputs' var_names to one kind "
            "of identifier before writing (e.g. adata.var_names = adata.var['gene_ids']); if "
            "they do measure different genes, name every gene to keep with var_names=[...] "
            "(e.g. var_names=list(dict.fromkeys([*a.var_names, *b.var_names])))."
        )
    if apart.size:
        return  # an inner join of groups keeps no gene: refused by join_genes
    counts = np.bincount(codes, minlength=n_genes)
    starts = np.r_[0, np.cumsum(sizes)[:-1]]
    shared = np.add.reduceat((counts[codes] >= 2).astype(np.int64), starts)
    smaller = np.minimum(sizes, n_genes - sizes + shared)
    low = np.flatnonzero(shared < LOW_GENE_OVERLAP * smaller)
    if not low.size:
        return
    i = int(low[0])
    label, genes = inputs[i]
    mine = codes[starts[i] : starts[i] + sizes[i]]
    with_i = [-1 if k == i else int(np.isin(codes[starts[k] : starts[k] + sizes[k]], mine).sum())
              for k in range(n_in)]
    j = int(np.argmax(with_i))
    other_label, other = inputs[j]
    more = [inputs[int(k)][0] for k in low if int(k) not in (i, j)]
    result = (f"var_join='inner' keeps only {kept} {_genes(what)}." if kept is not None else
              "the collection is mostly a block matrix, each input's cells zero on the genes "
              "only the others have.")
    logger.warning(
        "var_join=%r: %s has %d %s in common with the other inputs (%s%s), %.1f%% of the "
        "smaller gene list (%d genes; e.g. %s in %s vs %s in %s): %s %s%sIf the identifiers "
        "differ, map them to one kind before writing; if the inputs do measure different "
        "genes, pass the genes to keep as var_names=[...] to say so.",
        var_join, label, int(shared[i]), _genes(what), other_label,
        f" and {n_in - 2} more" if n_in > 2 else "", 100 * shared[i] / smaller[i],
        int(smaller[i]), _examples(genes, other), label, _examples(other, genes), other_label,
        result, _identifier_hints(label, genes, other_label, other),
        f"Also under {LOW_GENE_OVERLAP:.0%}: {more[:3]}{' ...' if len(more) > 3 else ''}. "
        if more else "")


def _raw_axis(used: list[InputSource], sources: list[InputSource], var_join: str,
              reference: pd.Index | None, raw: bool | None) -> tuple[GeneAxis | None, str | None]:
    """raw's gene axis, or ``None`` and why it cannot be carried (``None`` when no input
    has raw, or ``raw=False``)."""
    if raw is False or not any(s.raw_var_names is not None for s in used):
        return None, None
    if any(s.raw_var_names is None for s in used):
        return None, None  # plan_fields says which input lacks it
    damaged = next((s.matrices[RAW_X] for s in used if s.matrices[RAW_X].kind == "damaged"),
                   None)
    if damaged is not None:  # e.g. raw.var_names that are not unique: no axis to join
        if raw:
            raise InputError(damaged.why + ".")
        return None, damaged.why
    try:
        axis = join_genes([(s.label, pd.Index(s.raw_var_names)) for s in used],
                          [None if s.raw_var_names is None else pd.Index(s.raw_var_names)
                           for s in sources], var_join, reference, "raw")
    except InputError as e:
        if raw:
            raise
        return None, str(e)
    return axis, None


#: how a writer's user leaves a field out, ending the fix of a refusal
_OMIT = {"X": "remove X from every input (del adata.X) to write a collection without X",
         "layers": "leave it out with layers=[...]", "obsm": "leave it out with obsm=[...]",
         "obs": "leave it out with obs_columns=[...]",
         "raw": "leave it out with raw=False"}


def resolve_schema(sources: list[InputSource], var_join: str, obs_columns: list[str] | None,
                   layers: list[str] | None, obsm: list[str] | None,
                   reference: pd.Index | None = None, raw: bool | None = None,
                   raw_reference: pd.Index | None = None,
                   omit: dict[str, str] | None = None) -> Schema:
    """The collection's var order (``reference``: that gene list), fields, global
    categories and raw (``raw``: asked for, left out, or carried when every input has it;
    its genes joined like X's, or aligned to ``raw_reference`` when given (an append: the
    collection's raw genes); see module docs). ``omit``: per field group, how the caller's
    user leaves a field out, ending the fix of a refusal (default: the writer's
    arguments)."""
    used = nonempty(sources)
    genes = join_genes([(s.label, pd.Index(s.var_names)) for s in used],
                       [pd.Index(s.var_names) for s in sources], var_join, reference)
    raw_genes, raw_why = _raw_axis(used, sources, var_join,
                                   reference if raw_reference is None else raw_reference, raw)
    requested = {"X": True, "layers": layers, "obsm": obsm, "obs": obs_columns,
                 "raw": raw if raw_why is None else False}
    # a categorical past the label limit is refused by every reader: not written either
    plan = plan_fields(used, requested=requested, omit=_OMIT if omit is None else omit,
                       warn=True,
                       matrix_width=len(genes.names),
                       raw_width=None if raw_genes is None else len(raw_genes.names),
                       category_limit=MAX_LABEL_CATEGORIES, too_many=too_many_categories)
    if raw_why is not None:
        plan.unavailable[RAW_X] = raw_why
        logger.warning("%s is not carried: %s", RAW_X, raw_why)
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
        asked = group == "X" or requested[group] not in (None, False)
        if info.kind in ("csr", "dense"):
            fields.append(OutField(name, info.kind, np.dtype(info.dtype),
                                   width=int(info.shape[1] or 0), requested=asked,
                                   mixed=h.mixed))
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
                    [genes.maps[by_index[s.index]] for s in used], genes.names)
    unavailable.update(var.dropped)
    schema = Schema(genes, fields, unavailable, var=var.frame)
    if RAW_X in plan.fields and raw_genes is not None:
        raw_var = merge_var([s.var_frame(raw=True) for s in used], [s.label for s in used],
                            [raw_genes.maps[by_index[s.index]] for s in used],
                            raw_genes.names, what="raw/var")
        unavailable.update(raw_var.dropped)
        schema.raw_genes, schema.raw_var = raw_genes, raw_var.frame
    return schema
