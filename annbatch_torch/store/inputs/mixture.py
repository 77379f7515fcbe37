"""Several sources as one, mixed in chosen proportions: :func:`mix` and :class:`Mixture`.

A :class:`Mixture` is a :class:`~annbatch_torch.Source` whose rows are its members' rows,
member after member (member ``i``'s rows are ``[offsets[i], offsets[i + 1])``), each member a
collection (or anything :func:`~annbatch_torch.open_source` opens). Its shards are the
members' shards, read through the members' own elements (so each member's fast readers and
checks apply), and its schema is what every member offers alike:

* genes: ``var_names`` (the reference list: required when the members' genes differ);
  each member's gene-indexed fields (``X``, layers) are read in the member's columns and
  mapped to the reference's by :meth:`Mixture.gene_map` (genes of the reference a member
  lacks are zeros in its rows, counted in ``Mixture.missing_genes``);
* categorical obs columns: one code space per column, the categories of all members
  (in first-seen order), each member's codes mapped on read (:meth:`Mixture.code_map`);
* numeric and bool obs columns, obsm entries of one width: as the members store them;
* ``obs/source``: a categorical column of each row's member name.

A field some member lacks, or stores another way, is left out (:attr:`Source.unavailable`
says why). ``raw/X`` is offered when every member has the same raw genes.

``weights`` (one per member) make :class:`~annbatch_torch.AnnBatchDataset` draw the
mixture's rows in those proportions (``sampling/mixing.py``); a mixture without weights is
read as one source, each row once (chunked mode).
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from ...errors import SchemaError, check_int
from ..elements import CategoricalElement, Element
from ..manifest import RAW_X, FieldInfo, var_names_digest
from ..source import Source
from .inplace import open_source

__all__ = ["Mixture", "mix", "SOURCE_COLUMN"]

#: The obs column naming each row's member.
SOURCE_COLUMN = "source"
_SOURCE_FIELD = f"obs/{SOURCE_COLUMN}"


def _gene_field(field: str) -> bool:
    return field == "X" or field.startswith("layers/")


class Mixture(Source):
    """Sources read as one (see the module docstring); made by :func:`mix`.

    Parameters
    ----------
    members
        ``{name: source}`` in row order (opened sources).
    weights
        ``{name: share}`` summing to 1, or ``None`` (no mixing).
    var_names
        The reference genes (``None``: the members', which must then agree).
    num_samples, chunk_size, samplers
        As :func:`mix` takes them.

    Attributes
    ----------
    names
        The members' names, in row order.
    members
        The members (:class:`~annbatch_torch.Source`).
    weights
        Each member's share of an epoch's rows (summing to 1), or ``None``: no mixing,
        every row once.
    num_samples
        Rows per epoch when mixing (``None``: the members' rows in all).
    chunk_size
        Consecutive rows of a member read together when mixing (``None``: the dataset's).
    missing_genes
        ``{member name: genes of var_names it lacks}`` (zeros in its rows).
    """

    PART = "shard"

    def __init__(self, members: Mapping[str, Source], weights: Mapping[str, float] | None,
                 var_names: Sequence[str] | None, num_samples: int | None,
                 chunk_size: int | None, samplers: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.names = list(members)
        self.members = [members[n] for n in self.names]
        self.weights = None if weights is None else [float(weights[n]) for n in self.names]
        self.num_samples = num_samples
        self.chunk_size = chunk_size
        #: per member, the sampler drawing its rows (``None``: runs of its rows)
        self.samplers = [(samplers or {}).get(n) for n in self.names]
        self.shard_sizes = [int(s) for m in self.members for s in m.shard_sizes]
        #: each mixture shard's (member, member shard)
        self._shards = [(i, j) for i, m in enumerate(self.members)
                        for j in range(len(m.shard_sizes))]
        self.member_offsets = np.concatenate(
            [[0], np.cumsum([m.n_obs for m in self.members], dtype=np.int64)])
        self.var_names = self._genes(var_names)
        self._lookups = [self._lookup(m.var_names) for m in self.members]
        self.missing_genes = {
            n: [str(g) for g in self.var_names[np.setdiff1d(
                np.arange(len(self.var_names)), lut[lut >= 0])]]
            for n, lut in zip(self.names, self._lookups, strict=True)}
        self.missing_genes = {n: g for n, g in self.missing_genes.items() if g}
        self.raw_var_names = self._raw_genes()
        self._unavailable: dict[str, str] = {}
        self._code_maps: dict[tuple[int, str], np.ndarray | None] = {}
        self.fields = self._schema()

    # -- schema ------------------------------------------------------------------------
    def _genes(self, var_names: Sequence[str] | None) -> pd.Index:
        first = pd.Index(self.members[0].var_names)
        if var_names is None:
            for name, m in zip(self.names[1:], self.members[1:], strict=True):
                if not pd.Index(m.var_names).equals(first):
                    raise SchemaError(
                        f"mix: the genes of {name!r} ({len(m.var_names)}) differ from those "
                        f"of {self.names[0]!r} ({len(first)}); pass var_names=, the genes "
                        "of the batches in their order (e.g. the genes all members share: "
                        "sorted(set.intersection(*(set(c.var_names) for c in members))), "
                        "or a model's gene list: genes a member lacks read as zeros).")
            return pd.Index(first, name="var_names")
        if isinstance(var_names, str) or len(var_names) == 0:
            raise SchemaError(f"mix: var_names must be a non-empty list of gene names, got "
                              f"{var_names!r}.")
        wanted = pd.Index([str(v) for v in var_names], name="var_names")
        dup = wanted[wanted.duplicated()].unique()
        if len(dup):
            raise SchemaError(f"mix: var_names names {len(dup)} gene(s) more than once (e.g. "
                              f"{list(dup[:3])}); give each gene once.")
        wanted_set = set(wanted)
        for name, m in zip(self.names, self.members, strict=True):
            if not wanted_set.intersection(map(str, m.var_names)):
                raise SchemaError(
                    f"mix: none of the {len(wanted)} var_names is a gene of {name!r} (it has "
                    f"e.g. {list(map(str, m.var_names[:3]))}; var_names e.g. "
                    f"{list(wanted[:3])}): its rows would read as zeros. Check that both use "
                    "the same gene identifiers (symbols vs Ensembl IDs), or leave it out.")
        return wanted

    def _lookup(self, member_genes: Sequence[str]) -> np.ndarray:
        """Mixture column of each of a member's columns (-1: not among var_names)."""
        return pd.Index(self.var_names).get_indexer(pd.Index(map(str, member_genes))
                                                    ).astype(np.int64)

    def _raw_genes(self) -> pd.Index | None:
        raws = [m.raw_var_names for m in self.members]
        if any(r is None for r in raws) or not all(pd.Index(r).equals(pd.Index(raws[0]))
                                                   for r in raws):
            return None
        return pd.Index(raws[0], name="raw_var_names")

    def _schema(self) -> dict[str, FieldInfo]:
        """The fields every member offers alike; the others recorded as unavailable."""
        out: dict[str, FieldInfo] = {}
        keys = list(dict.fromkeys(k for m in self.members for k in m.fields))
        for key in keys:
            infos = [m.fields.get(key) for m in self.members]
            lacking = [n for n, i in zip(self.names, infos, strict=True) if i is None]
            if lacking:
                self._unavailable[key] = (f"member(s) {lacking} of the mixture do not offer "
                                          "it; select fields every member has")
                continue
            kinds = {i.kind for i in infos if i is not None}
            if len(kinds) > 1:
                self._unavailable[key] = (f"the members store it differently ({sorted(kinds)})"
                                          "; rewrite them alike or leave it out")
                continue
            first = infos[0]
            assert first is not None
            dtype = np.result_type(*(np.dtype(i.dtype) for i in infos if i is not None))
            if first.kind == "categorical":
                cats = list(dict.fromkeys(c for i in infos if i is not None
                                          for c in (i.categories or ())))
                code = np.int32 if len(cats) < 2**31 else np.int64
                out[key] = FieldInfo("categorical", np.dtype(code).name, (None,), tuple(cats),
                                     ordered=False)
            elif _gene_field(key):
                out[key] = replace(first, dtype=dtype.name, shape=(None, len(self.var_names)))
            elif key == RAW_X:
                if self.raw_var_names is None:
                    self._unavailable[key] = ("the members' raw genes differ (or a member has "
                                              "no raw); mix reads raw/X when every member "
                                              "has the same raw genes")
                    continue
                out[key] = replace(first, dtype=dtype.name)
            else:
                widths = {tuple(i.shape[1:]) for i in infos if i is not None}
                if len(widths) > 1:
                    self._unavailable[key] = (f"the members store it with different widths "
                                              f"({sorted(widths)}); leave it out")
                    continue
                out[key] = replace(first, dtype=dtype.name)
        if _SOURCE_FIELD in out or _SOURCE_FIELD in self._unavailable:
            out.pop(_SOURCE_FIELD, None)  # the members' own column: replaced by the mixture's
            self._unavailable.pop(_SOURCE_FIELD, None)
        out[_SOURCE_FIELD] = FieldInfo("categorical", "int32", (None,), tuple(self.names))
        return out

    # -- what the mixture is ----------------------------------------------------------
    def describe(self) -> str:
        weights = self.weights or [None] * len(self.names)
        return "mix(" + ", ".join(
            f"{n}={m.describe()}" + ("" if w is None else f" x {w:.4g}")
            for n, m, w in zip(self.names, self.members, weights, strict=True)) + ")"

    def shard_name(self, shard: int) -> str:
        i, j = self._shards[shard]
        return f"{self.names[i]!r}: {self.members[i].shard_name(j)}"

    def member_of(self, rows: np.ndarray) -> np.ndarray:
        """The member index of each global row id."""
        return np.searchsorted(self.member_offsets, np.asarray(rows), side="right") - 1

    def identity(self) -> str:
        """What identifies the mixture's rows and draws for a resume state: each member's
        identity (``None`` if a member has none), names, weights, genes."""
        doc = {"mix": 1, "names": self.names, "n_obs": [int(m.n_obs) for m in self.members],
               "members": [m.identity() for m in self.members], "weights": self.weights,
               "num_samples": self.num_samples,
               "samplers": [None if s is None else repr(s) for s in self.samplers],
               "var_names": var_names_digest(list(self.var_names))}
        text = json.dumps(doc, sort_keys=True, default=str)
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]

    def without_weights(self) -> Mixture:
        """The same members read as one source, every row once (chunked mode)."""
        out = object.__new__(Mixture)
        out.__dict__.update(self.__getstate__())
        out.weights = None
        return out

    # -- reading: the members' elements -----------------------------------------------
    def check_current(self) -> None:
        for m in self.members:
            m.check_current()

    def close(self) -> None:
        for m in self.members:
            m.close()
        super().close()

    @property
    def has_open_handles(self) -> bool:
        return any(m.has_open_handles for m in self.members)

    def _open_shard(self, shard: int) -> Any:
        i, j = self._shards[shard]
        return self.members[i].shard_group(j)

    def element(self, shard: int, field: str) -> Element:
        if field == _SOURCE_FIELD:
            self._check_pid()
            key = (shard, field)
            el = self._elements.get(key)
            if el is None:
                i = self._shards[shard][0]
                # one value broadcast: no memory per row
                codes = np.broadcast_to(np.int32(i), (self.shard_sizes[shard],))
                el = CategoricalElement(codes, list(self.names), name=self.shard_name(shard))
                self._elements[key] = el
            return el
        i, j = self._shards[shard]
        return self.members[i].element(j, field)

    def code_map(self, shard: int, field: str) -> np.ndarray | None:
        if field == _SOURCE_FIELD:
            return None
        key = (shard, field)
        if key not in self._code_maps:
            i, j = self._shards[shard]
            member = self.members[i]
            inner = member.code_map(j, field)
            cats = member.fields[field].categories or ()
            unified = {c: k for k, c in enumerate(self.fields[field].categories or ())}
            outer = np.array([unified[c] for c in cats] + [-1], dtype=np.int64)
            table = outer if inner is None else outer[inner]
            identity = inner is None and np.array_equal(outer[:-1], np.arange(len(cats)))
            self._code_maps[key] = None if identity else table
        return self._code_maps[key]

    def stored_value_dtypes(self, field: str) -> list[np.dtype]:
        return [d for m in self.members for d in m.stored_value_dtypes(field)]

    def _read_obs_names(self, shard: int) -> np.ndarray:
        i, j = self._shards[shard]
        return self.members[i]._shard_obs_names(j)

    def gene_map(self, field: str) -> list[np.ndarray]:
        """Per member, the mixture column of each of its columns of gene-indexed ``field``
        (``X``, a layer: ``var_names``; ``raw/X``: identity), ``-1`` for a gene left out."""
        if field == RAW_X:
            n = len(self.raw_var_names or ())
            return [np.arange(n, dtype=np.int64) for _ in self.members]
        return list(self._lookups)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_code_maps"] = dict(self._code_maps)  # small tables, no handles
        return state

    def __repr__(self) -> str:
        share = ("" if self.weights is None else ", weights={" + ", ".join(
            f"{n!r}: {w:.3g}" for n, w in zip(self.names, self.weights, strict=True)) + "}")
        return (f"Mixture({', '.join(f'{n!r}: {m.n_obs} rows' for n, m in zip(self.names, self.members, strict=True))}"  # noqa: E501
                f"{share}, n_vars={self.n_vars})")


def mix(sources: Mapping[str, Any], weights: Mapping[str, float] | None = None, *,
        var_names: Sequence[str] | None = None, num_samples: int | None = None,
        chunk_size: int | None = None, samplers: Mapping[str, Any] | None = None) -> Mixture:
    """Several collections read as one source, their rows drawn in chosen proportions.

    Pass the result as ``source`` to :class:`~annbatch_torch.AnnBatchDataset` or as
    ``store_path`` to :class:`~annbatch_torch.AnnBatchDataModule`: with ``weights`` each
    batch holds ``weights[name] * batch_size`` rows of each collection (to within one
    row), read in runs of ``chunk_size`` consecutive rows and mixed inside each pool;
    every batch has a ``source`` key naming each row's collection (``obs/source``:
    categorical, the names in order; a collection's own ``source`` column is not read).

    Parameters
    ----------
    sources
        ``{name: collection}``: :class:`~annbatch_torch.Collection` objects, collection
        folders or URLs, or AnnData inputs read in place (anything
        :func:`~annbatch_torch.open_source` opens). Names are what ``source`` holds.
    weights
        ``{name: weight}`` (non-negative numbers, normalised to sum to 1; a name left out
        weighs 0). ``None``: the collections read as one source, every row once per epoch
        in chunked mode (each collection's share of a batch is then its share of the
        rows on average, not a quota), with a ``sampler=`` of the dataset's if wanted.
    var_names
        The genes of X and layers in the batches, in order (the reference list). Required
        when the collections' genes differ; a gene a collection lacks reads as zeros in
        its rows (listed in ``Mixture.missing_genes``). ``None``: the collections'
        genes, which must then be the same, in the same order.
    num_samples
        Rows per epoch (with ``weights``); ``None``: the rows of the collections of
        positive weight, in all. A collection whose share of an epoch exceeds its rows is
        read again (another order each pass); one below it gives a new subsample of its
        runs each epoch.
    chunk_size
        Consecutive rows of a collection read together; ``None``: the dataset's
        ``chunk_size``. The pool (``chunk_size * preload_nchunks`` of the dataset) should
        hold many runs of each collection, or batches mix few runs.
    samplers
        ``{name: sampler}`` (with ``weights``): a collection whose rows a
        :class:`~annbatch_torch.Sampler` draws (e.g. ``ClassBalancedSampler("cell_type")``:
        class-balanced inside that collection, its share of each batch unchanged); its obs
        columns are read in the mixture's code space, and row ids (a ``SubsetSampler``'s)
        are the mixture's (a collection's rows follow those of the collections before it:
        ``Mixture.member_offsets``). Others: runs of their rows.

    Returns
    -------
    Mixture
        A :class:`~annbatch_torch.Source`: categorical obs columns share one code space
        (the union of the categories), fields a collection lacks are left out (see
        ``Source.unavailable``).

    Raises
    ------
    SchemaError
        Genes that differ without ``var_names``, a collection sharing no gene with
        ``var_names``, a weight that is negative or not a number, a weight or sampler
        naming no collection, or no collection with weight.

    Notes
    -----
    A DataModule's held-out chunks (``val_fraction``) are chunks of the rows of all the
    collections, read once each without weights: each collection is held out in
    proportion to its rows.
    """
    if not isinstance(sources, Mapping) or not sources:
        raise TypeError("mix() takes a non-empty {name: collection} dict, got "
                        f"{type(sources).__name__}.")
    for name in sources:
        if not isinstance(name, str) or not name:
            raise SchemaError(f"mix: collection names must be non-empty strings, got {name!r}.")
    members = {name: open_source(src) for name, src in sources.items()}
    empty = [n for n, m in members.items() if m.n_obs == 0]
    if empty:
        raise SchemaError(f"mix: collection(s) {empty} hold no rows; leave them out.")
    w = None
    if weights is not None:
        if not isinstance(weights, Mapping):
            raise TypeError(f"mix: weights must be a {{name: weight}} dict (or None), got "
                            f"{type(weights).__name__}.")
        unknown = [k for k in weights if k not in members]
        if unknown:
            raise SchemaError(f"mix: weights name {unknown}, which are not among the "
                              f"collections {list(members)}.")
        w = {}
        for n in members:
            v = weights.get(n, 0.0)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) \
                    or v < 0:
                raise SchemaError(f"mix: the weight of {n!r} must be a finite number >= 0, "
                                  f"got {v!r}.")
            w[n] = float(v)
        total = sum(w.values())
        if total <= 0:
            raise SchemaError("mix: every weight is 0; give at least one collection a "
                              "positive weight.")
        w = {n: v / total for n, v in w.items()}
    elif samplers or num_samples is not None:
        raise SchemaError("mix: samplers= and num_samples= shape a weighted mixture; give "
                          "weights= too (e.g. each collection's share of the rows).")
    if num_samples is not None:
        num_samples = check_int("mix num_samples", num_samples, 1, error=SchemaError,
                                note=" (or None)")
    if chunk_size is not None:
        chunk_size = check_int("mix chunk_size", chunk_size, 1, error=SchemaError,
                               note=" (or None)")
    unknown = [k for k in (samplers or {}) if k not in members]
    if unknown:
        raise SchemaError(f"mix: samplers name {unknown}, which are not among the "
                          f"collections {list(members)}.")
    return Mixture(members, w, var_names, num_samples, chunk_size, samplers)
