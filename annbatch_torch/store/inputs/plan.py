"""A list of inputs: the checks both paths make, and the fields to offer.

:func:`open_inputs`, :func:`nonempty`, :func:`warn_shared_obs_names` and
:func:`warn_repeated_obs_names` are the checks of a list of inputs (the same input twice,
inputs without cells, obs_names shared by inputs or repeated within one, from the names of
every input read once: :class:`InputNames`);
:func:`plan_fields` picks the fields to offer from the probes of all inputs and harmonises
each by the rules of :mod:`.harmonize` (:class:`FieldPlan`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ...errors import InputError
from ..manifest import field_name_problem
from .harmonize import (
    Harmonized,
    InputField,
    empty_input_reason,
    harmonize_field,
    missing_reason,
    name_reason,
    no_x_reason,
    note_strings,
)
from .open import (
    input_label,
    resolve_input,
)
from .view import InputSource

__all__ = ["FieldPlan", "InputNames", "nonempty", "open_inputs", "plan_fields",
           "warn_repeated_obs_names", "warn_shared_obs_names"]

logger = logging.getLogger(__name__)


# -- checks of a list of inputs (both paths) ---------------------------------------------
def _same_as(targets: list[Any]) -> tuple[int, int] | None:
    seen: dict[Any, int] = {}
    for j, t in enumerate(targets):
        if isinstance(t, Path):
            try:
                st = t.stat()
                key: Any = ("file", st.st_dev, st.st_ino)
            except OSError:
                key = ("path", str(t.resolve()))
        else:
            key = ("object", id(t))
        if key in seen:
            return seen[key], j
        seen[key] = j
    return None


def open_inputs(objs: Sequence[Any], *, chunk_cache: bool = False) -> list[InputSource]:
    """Open every input as an :class:`InputSource` (closed again if one fails).

    Raises
    ------
    InputError
        For an input that is not one, and for the same input passed twice (the same file,
        by any path or as a backed AnnData, or the same AnnData object): its cells would be
        read twice.
    """
    targets = [resolve_input(x, i) for i, x in enumerate(objs)]
    twice = _same_as(targets)
    if twice is not None:
        i, j = twice
        ti, tj = targets[i], targets[j]
        what = (f"the same file ({Path(tj).resolve()})" if isinstance(tj, Path)
                else "the same AnnData object")
        raise InputError(
            f"input #{i} ({input_label(i, ti if isinstance(ti, Path) else None)}) and input "
            f"#{j} ({input_label(j, tj if isinstance(tj, Path) else None)}) are {what}; its "
            "cells would be read twice. Fix: pass each input once."
        )
    sources: list[InputSource] = []
    try:
        for i, t in enumerate(targets):
            sources.append(InputSource(t, i, chunk_cache=chunk_cache))
    except BaseException:
        for s in sources:
            s.close()
        raise
    return sources


def nonempty(sources: Sequence[InputSource]) -> list[InputSource]:
    """The inputs that have cells; each one without is skipped with a warning.

    Raises
    ------
    InputError
        When no input has a cell.
    """
    kept = []
    for s in sources:
        if s.n_obs == 0:
            logger.warning("%s", empty_input_reason(s.label))
        else:
            kept.append(s)
    if not kept:
        raise InputError(f"{', '.join(s.label for s in sources)}: no input has cells "
                         "(n_obs == 0 in every one); pass inputs with cells.")
    return kept


#: rows of obs_names hashed at a time
NAME_BLOCK = 1 << 20
#: the fix a duplicate-name warning ends with (nothing is refused: rows are row ids)
NAMES_FIX = ("Nothing is refused: collections identify rows by row ids (the 'index' batches "
             "carry), not by obs_names; but these names do not tell the cells apart "
             "(obs_names_at, writing results back by name). Fix: make them unique before "
             "writing (adata.obs_names_make_unique(), or a prefix per input: "
             "adata.obs_names = 'batch1_' + adata.obs_names).")


def name_hashes(names: Any) -> np.ndarray:
    """64-bit hashes of obs_names (an array of str); equal names, equal hashes."""
    return pd.util.hash_array(np.asarray(names, dtype=object))


@dataclass
class InputNames:
    """The obs_names of a list of inputs, each input read once (:data:`NAME_BLOCK` names at
    a time) and hashed: per input, its distinct hashes (sorted, 8 bytes per distinct name)
    and, for names it holds more than once, their hashes and row counts. The duplicate-name
    checks share it; the rows of an example are found by reading that input again
    (:meth:`examples`), so nothing per row is kept beyond the hashes."""

    sources: Sequence[InputSource]
    unique: list[np.ndarray]
    repeated: list[tuple[np.ndarray, np.ndarray]]

    @classmethod
    def read(cls, sources: Sequence[InputSource], block: int = NAME_BLOCK) -> InputNames:
        unique, repeated = [], []
        for s in sources:
            u, n = np.unique(_hashes(s, block), return_counts=True)
            twice = n > 1
            unique.append(u)
            repeated.append((u[twice], n[twice]))
        return cls(sources, unique, repeated)

    def examples(self, i: int, hashes: np.ndarray, k: int = 3) -> list[str]:
        """The first ``k`` distinct obs_names of input ``i`` (in row order) whose hash is
        among ``hashes``; reads that input's names again, a block at a time, until it has them."""
        s, out = self.sources[i], []
        wanted = np.unique(np.asarray(hashes, dtype=np.uint64))
        need = min(k, wanted.size)  # stop there: one repeated name need not read it all
        if not need:
            return out
        for names in s.name_blocks(NAME_BLOCK):
            for j in np.flatnonzero(np.isin(name_hashes(names), wanted)):
                if str(names[j]) not in out:  # a repeated name once
                    out.append(str(names[j]))
                    if len(out) == need:
                        return out
        return out


def _hashes(s: InputSource, block: int) -> np.ndarray:
    """The name hashes of every row of ``s``, read ``block`` names at a time."""
    h = np.empty(s.n_obs, dtype=np.uint64)
    a = 0
    for names in s.name_blocks(block):
        h[a: a + len(names)] = name_hashes(names)
        a += len(names)
    return h


def warn_shared_obs_names(names: InputNames) -> int:
    """Warn when obs_names appear in more than one input (the count and an example);
    returns the count. Rows are identified by row ids, not by names, so nothing is refused.
    """
    sources = names.sources
    if len(sources) < 2:
        return 0
    all_h = np.concatenate(names.unique)  # each input's hashes once: a repeat is shared
    all_h.sort()
    dup = all_h[1:] == all_h[:-1]
    if not dup.any():
        return 0
    shared = all_h[1:][dup]
    del all_h, dup
    n_shared = int(np.unique(shared).size)
    h = shared[:1]
    holders = [i for i, u in enumerate(names.unique)
               if (j := int(np.searchsorted(u, h[0]))) < len(u) and u[j] == h[0]][:2]
    a, b = sources[holders[0]], sources[holders[1]]
    name = next(iter(names.examples(holders[0], h, k=1)), "?")  # "?": the file changed
    logger.warning(
        "%d obs_names appear in more than one input (e.g. %r in %s and %s). Nothing is "
        "refused: collections and in-place reading identify rows by row ids (the global row "
        "positions batches carry as 'index'), not by obs_names; but these names do not tell "
        "the cells apart. To make them unique, prefix them per input before writing (e.g. "
        "adata.obs_names = 'batch1_' + adata.obs_names) or concatenate with "
        "anndata.concat(..., index_unique='-').", n_shared, name, a.label, b.label)
    return n_shared


def warn_repeated_obs_names(names: InputNames) -> int:
    """Warn, per input, about obs_names it holds more than once (how many, the rows that
    share them and a few of them); returns the count over all inputs. Across inputs:
    :func:`warn_shared_obs_names`."""
    total = 0
    for i, s in enumerate(names.sources):
        hashes, counts = names.repeated[i]
        if not hashes.size:
            continue
        total += hashes.size
        logger.warning("%s: %d obs_names appear more than once in this input (%d rows share "
                       "them; e.g. %s). %s", s.label, hashes.size, int(counts.sum()),
                       ", ".join(map(repr, names.examples(i, hashes))), NAMES_FIX)
    return total


# -- which fields, harmonised (both paths) -----------------------------------------------
@dataclass
class FieldPlan:
    """The fields every input can offer, harmonised, and the others with the reason.

    Attributes
    ----------
    fields
        Field string -> :class:`~annbatch_torch.store.inputs.harmonize.Harmonized`, in the order
        X, layers, obsm, obs columns (each in first-seen order).
    unavailable
        Field string -> why it is not offered.
    """

    fields: dict[str, Harmonized] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)


def _too_many_strings(where: str, name: str, limit: int) -> str:
    col = name.partition("/")[2]
    return (
        f"{where}: {name!r} holds strings with more than {limit} distinct values, more than "
        "a label may have (annbatch_torch.store.collection.MAX_LABEL_CATEGORIES); it looks "
        "like a per-cell identifier. Select a label column, or store integer ids in a "
        f"numeric column, e.g. adata.obs['{col}_id'] = adata.obs['{col}'].astype('category')"
        ".cat.codes, and select that."
    )


def plan_fields(sources: Sequence[InputSource], *, requested: Mapping[str, Any],
                omit: Mapping[str, str], warn: bool, matrix_width: int | None = None,
                raw_width: int | None = None, category_limit: int | None = None,
                too_many: Any = None) -> FieldPlan:
    """The fields to offer from ``sources`` (inputs with cells), each harmonised by the
    rules of :mod:`.harmonize`, the same way for the writer and in-place reading.

    Parameters
    ----------
    sources
        The opened inputs, without those that have no cells (:func:`nonempty`).
    requested
        ``{"X": bool, "layers": names | None, "obsm": names | None, "obs": names | None,
        "raw": bool | None}``: fields the user asked for (``None``: none named, take what
        every input has; ``"raw"``: ``True`` asks for ``raw/X``, ``False`` leaves it out). A
        field asked for must pass every rule (else :class:`InputError`); others that do
        not are left out with the reason in ``unavailable``. X is asked for when
        ``requested["X"]`` and any input has it; when no input has X it is left out.
    omit
        Per group (``"X"``, ``"layers"``, ``"obsm"``, ``"obs"``), how the user leaves a
        field out: the end of every fix.
    warn
        Log a warning for every field left out (the writer; in place the reason is given
        when the field is selected).
    matrix_width, raw_width
        The width X and layers get (the writer's joined genes), and raw/X (its joined raw
        genes), else each input's.
    category_limit, too_many
        In place: a categorical with more categories is not offered;
        ``too_many(where, field, n)`` says why.

    Raises
    ------
    InputError
        When a field asked for cannot be offered; the message names the input, the field
        and the fix.
    """
    plan = FieldPlan()
    labels = [s.label for s in sources]

    def leave_out(name: str, reason: str, asked: bool) -> None:
        if asked:
            raise InputError(reason)
        plan.unavailable[name] = reason
        if warn:
            logger.warning("%s is not carried: %s", name, reason)

    def take(name: str, key: Any, group: str, asked: bool) -> None:
        fld = name if isinstance(key, str) or group != "obs" else key
        why = field_name_problem(fld)
        having = [s.label for s in sources if s.has(group, key)]
        if why is not None:
            return leave_out(name, name_reason((having or labels)[0], fld, why, omit[group]),
                             asked)
        if len(having) < len(sources):
            lacking = [s.label for s in sources if not s.has(group, key)]
            return leave_out(name, missing_reason(name, lacking, having, omit[group],
                                                  have=sources[0].keys(group)), asked)
        described = [s.describe(name, column=key if group == "obs" else None)
                     for s in sources]
        width = raw_width if group == "raw" else matrix_width
        if width is not None and group in ("X", "layers", "raw"):
            described = [d if d.kind in ("unsupported", "damaged") else
                         InputField(d.where, d.kind, d.dtype, (width,))
                         for d in described]
        try:
            h = harmonize_field(name, described, omit[group],
                                string_categories=lambda i: _strings(sources[i], key))
        except InputError as e:
            return leave_out(name, str(e), asked)
        n_cats = len(h.info.categories or ())
        if category_limit is not None and h.code_tables is not None and n_cats > category_limit:
            strings = [d.where for d in described if d.kind == "string"]
            return leave_out(name, _too_many_strings(strings[0], name, category_limit) if strings
                             else too_many(", ".join(labels), name, n_cats), asked)
        plan.fields[name] = h

    def _strings(s: InputSource, key: Any) -> list[Any]:
        cats = s.string_categories(key, limit=category_limit)
        note_strings(s.label, key, len(cats), s.n_obs)
        return cats

    if any(s.has_x for s in sources):
        take("X", "X", "X", bool(requested.get("X")))
    else:
        plan.unavailable["X"] = no_x_reason(labels[0])
    for group in ("layers", "raw", "obsm", "obs"):
        asked = requested.get(group)
        if group == "raw":
            if asked is False:
                continue
            asked = ["X"] if asked else None
        keys = list(asked) if asked is not None else list(dict.fromkeys(
            k for s in sources for k in s.keys(group)))
        for key in keys:
            name = f"{group}/{key}"
            take(name, key, group, asked is not None)
    return plan
