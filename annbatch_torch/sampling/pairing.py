"""Perturbation / control pairing: the stream of :class:`PairedSampler` (issue 34, first part).

Pure numpy, no torch, no I/O. A perturbation screen's rows are *perturbed* (the
perturbation column holds a perturbation) or *controls* (it holds one of the control
values, e.g. ``"non-targeting"``). Each epoch holds every perturbed row once, in a random
order of ``(seed, epoch)``, each followed by ``n_controls`` control rows drawn uniformly,
with replacement, from the controls of its *match group* (the rows sharing its values of the
``match`` columns, e.g. cell line and GEM group). The stream is laid out in *draws* of
``1 + n_controls`` positions, ``[perturbed, control_1, ..., control_n]``
(:attr:`PairedSampler.draw_size`), so a batch of ``b`` draws is ``b * draw_size``
consecutive positions and keeps each pair together.

With ``set_size=S`` the perturbed rows come in *sets* of ``S`` rows sharing their
perturbation and match values (cell-load's "cell sentences"): a group of ``m`` such rows
gives ``ceil(m / S)`` sets, its rows in a random order, the last set filled up with rows of
the same group drawn anew each epoch (so each row is drawn at least once, exactly once when
``S`` divides ``m``); the sets are in a random order.

:class:`~annbatch_torch.AnnBatchDataset` deals the stream in batches of ``batch_size``
draws (``sampling/sampled_plan.py``) and yields each batch's perturbed rows under the
selector's keys and their controls under the same keys prefixed ``control_``
(``batches.py``).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import SamplerError, check_int
from .samplers import ObsColumn, Sampler

__all__ = ["PairedSampler", "TAG_PAIR", "MissingControlWarning"]

#: Seed tag of a paired epoch: ``default_rng([seed, epoch, TAG_PAIR])``.
TAG_PAIR = 0x50414952  # "PAIR"
#: Rows per run of ``chunk_size="auto"`` (on a shuffled collection, batches are as mixed
#: as random ones; single rows read ~0.6x as fast, ``benchmarks/results/pairing.md``)
AUTO_RUN = 256


class MissingControlWarning(UserWarning):
    """Perturbed rows were left out: their match group has no control row
    (``on_missing_control="skip"``)."""


def _as_values(control: Any) -> list[Hashable]:
    """One value, or the values of any iterable (list, tuple, set, numpy array, Index)."""
    if isinstance(control, str | bytes) or not isinstance(control, Iterable):
        return [control]
    return [v.item() if isinstance(v, np.generic) else v for v in control]


class PairedSampler(Sampler):
    """Every perturbed row once per epoch, each with ``n_controls`` matched control rows.

    In :class:`~annbatch_torch.AnnBatchDataset` a batch holds ``batch_size`` perturbed
    rows under the selector's keys and their controls under the same keys prefixed
    ``control_`` (with ``return_index=True`` / ``even_batches="pad"``, ``control_index``
    and ``control_mask`` too), ``n_controls`` rows per
    perturbed row in order: rows ``i * n_controls`` to ``(i + 1) * n_controls - 1`` of
    ``control_X`` are the controls of row ``i`` of ``X``. Every perturbed row is drawn
    once per epoch across ranks and workers (a draw is never split between batches);
    controls uniformly, with replacement, from the rows sharing its ``match`` values.

    Parameters
    ----------
    perturbation
        A categorical obs column naming each row's perturbation (``"target_gene"``).
    control
        The value (or values) of ``perturbation`` that mark control rows
        (``"non-targeting"``). Rows with a missing value are neither.
    match
        Categorical obs columns a control must share with its perturbed row
        (``("cell_line", "gem_group")``); ``()``: any control.
    n_controls
        Control rows per perturbed row (drawn with replacement).
    set_size
        Perturbed rows per set (rows sharing their perturbation and match values, kept
        together in the stream); ``None``: single rows.
    chunk_size
        An integer: the perturbed rows of runs of ``chunk_size`` consecutive rows of the
        source, the runs in a random order and the draws mixed inside each pool (as
        chunked mode mixes rows): a pool reads its perturbed rows as runs, not one by one
        (the controls are drawn one by one). ``None``: the perturbed rows in a random
        order, each read on its own (slower). ``"auto"`` (default): runs of
        256 rows (``AUTO_RUN``), or single rows with ``set_size`` (sets and runs do not
        combine).
    num_samples
        Perturbed rows (draws) per epoch; ``None`` (default): every perturbed row once
        (with ``set_size``: every set once). Fewer: the first ``num_samples`` of the
        epoch's order, a new subsample each epoch; more: the epoch runs through the
        perturbed rows again, each pass in an order of its own. With ``set_size`` it must be
        a multiple of ``set_size``.
    on_missing_control
        ``"error"`` (default): a match group with perturbed rows but no control is an error
        naming it; ``"skip"``: its perturbed rows are left out, counted in a
        :class:`MissingControlWarning`.
    """

    #: a pure function of (seed, epoch), and prepare() applies ``allowed`` to its tables
    _pure = True
    _drops_allowed = True

    def __init__(self, perturbation: str, control: Hashable | Sequence[Hashable], *,
                 match: Sequence[str] = (), n_controls: int = 1, set_size: int | None = None,
                 chunk_size: int | str | None = "auto", num_samples: int | None = None,
                 on_missing_control: str = "error") -> None:
        for what, name in (("perturbation", perturbation),
                           *(("match", m) for m in _as_values(match))):
            if not isinstance(name, str) or not name:
                raise SamplerError(f"PairedSampler {what} must be an obs column name, got "
                                   f"{name!r}.")
        self.perturbation = perturbation
        self.control = _as_values(control)
        if not self.control:
            raise SamplerError("PairedSampler control: give the control value(s) of "
                               f"{perturbation!r}, e.g. 'non-targeting'.")
        self.match = tuple(_as_values(match))
        if perturbation in self.match or len(set(self.match)) != len(self.match):
            raise SamplerError(f"PairedSampler match={self.match!r}: name each column once, "
                               f"and not the perturbation column {perturbation!r}.")
        self.n_controls = check_int("PairedSampler n_controls", n_controls, 1,
                                    error=SamplerError)
        self.set_size = None if set_size is None else check_int(
            "PairedSampler set_size", set_size, 1, error=SamplerError, note=" (or None)")
        if chunk_size == "auto":
            chunk_size = None if self.set_size is not None else AUTO_RUN
        self.chunk_size = None if chunk_size is None else check_int(
            "PairedSampler chunk_size", chunk_size, 1, error=SamplerError,
            note=" (or None, or 'auto')")
        if self.chunk_size is not None and self.set_size is not None:
            raise SamplerError("PairedSampler: give set_size (sets of one perturbation, read "
                               "row by row) or chunk_size (runs of rows), not both.")
        #: runs of rows are mixed inside each pool, draw by draw
        self.mixes_in_pool = self.chunk_size is not None
        self.num_samples = None if num_samples is None else check_int(
            "PairedSampler num_samples", num_samples, 1, error=SamplerError, note=" (or None)")
        if self.num_samples is not None and self.set_size is not None and (
                self.num_samples % self.set_size):
            raise SamplerError(f"PairedSampler num_samples={self.num_samples} must be a "
                               f"multiple of set_size={self.set_size} (whole sets per epoch).")
        if on_missing_control not in ("error", "skip"):
            raise SamplerError(f"on_missing_control must be 'error' or 'skip', got "
                               f"{on_missing_control!r}.")
        self.on_missing_control = on_missing_control
        self.columns = (perturbation, *self.match)

    #: evaluation copy (:meth:`for_evaluation`): the pairs of epoch 0 in every epoch
    evaluation = False

    def for_evaluation(self) -> PairedSampler:
        """An unbound copy for held-out rows: every perturbed row once (no
        ``num_samples``) and the same pairs in every epoch (validation losses compare)."""
        out = copy.copy(self)
        out.num_samples = None
        out.evaluation = True
        out._n_obs = None
        return out

    @property
    def draw_size(self) -> int:
        """Stream positions per draw: the perturbed row and its controls."""
        return 1 + self.n_controls

    # -- tables ------------------------------------------------------------------------
    def prepare(self, n_obs: int, columns: Mapping[str, ObsColumn]) -> None:
        pert = columns[self.perturbation]
        cats = list(pert.categories)
        unknown = [c for c in self.control if c not in cats]
        if unknown:
            raise SamplerError(
                f"PairedSampler: control value(s) {unknown} are not categories of obs column "
                f"{self.perturbation!r} (its categories: {cats[:10]}"
                f"{'...' if len(cats) > 10 else ''}); give the value that marks control "
                "cells.")
        codes = self._restricted_codes(pert.codes).astype(np.int64)
        is_control = np.isin(codes, [cats.index(c) for c in self.control])
        is_pert = (codes >= 0) & ~is_control
        if self.allowed is not None:  # controls come from the allowed rows too
            keep = np.zeros(n_obs, dtype=bool)
            keep[self.allowed] = True
            is_control &= keep
        group = self._match_groups(n_obs, columns)
        controls = np.flatnonzero(is_control)
        order = np.argsort(group[controls], kind="stable")
        self._controls = controls[order]  # control rows, group by group
        n_groups = int(group.max()) + 1 if n_obs else 0
        counts = np.bincount(group[controls], minlength=n_groups)
        self._control_start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self._control_count = counts.astype(np.int64)
        perturbed = np.flatnonzero(is_pert)
        lacking = self._control_count[group[perturbed]] == 0
        if lacking.any():
            bad = np.unique(group[perturbed[lacking]])
            where = "; ".join(self._describe(columns, int(perturbed[lacking][np.flatnonzero(
                group[perturbed[lacking]] == g)[0]])) for g in bad[:3])
            what = (f"{int(lacking.sum())} perturbed rows in {len(bad)} match group(s) with no "
                    f"control ({where}{'; ...' if len(bad) > 3 else ''})")
            if self.on_missing_control == "error":
                raise SamplerError(
                    f"PairedSampler: {what}. Add controls there, match on fewer columns, or "
                    "pass on_missing_control='skip' to leave those rows out.")
            warnings.warn(f"PairedSampler: left out {what}.", MissingControlWarning,
                          stacklevel=2)
            perturbed = perturbed[~lacking]
        if not len(perturbed):
            raise SamplerError(f"PairedSampler: no perturbed row (obs column "
                               f"{self.perturbation!r} holds only controls {self.control} or "
                               "missing values among the rows it may draw).")
        self._perturbed = perturbed
        #: each perturbed row's match group (aligned with ``_perturbed``)
        self._pert_group = group[perturbed].astype(np.int64)
        self._set_keys = None
        if self.set_size is not None:  # sets: rows of one (perturbation, match group)
            key = codes[perturbed] * n_groups + self._pert_group
            self._set_keys = np.unique(key, return_inverse=True)[1].reshape(-1)
            sizes = np.bincount(self._set_keys)
            self._n_pass = int((-(-sizes // self.set_size)).sum()) * self.set_size
        else:
            self._n_pass = len(perturbed)
        self._n_draws = self._n_pass if self.num_samples is None else self.num_samples

    def _match_groups(self, n_obs: int, columns: Mapping[str, ObsColumn]) -> np.ndarray:
        """Each row's match group (0 .. k-1): its combination of the match columns' codes
        (a missing value is a value of its own)."""
        if not self.match:
            return np.zeros(n_obs, dtype=np.int64)
        key = np.zeros(n_obs, dtype=np.int64)  # one flat code (missing = a value: code + 1)
        for m in self.match:
            codes = np.asarray(columns[m].codes, dtype=np.int64) + 1
            width = int(codes.max(initial=0)) + 1
            if width and int(key.max(initial=0)) >= (2**62) // width:  # re-rank: no overflow
                key = np.unique(key, return_inverse=True)[1].reshape(-1).astype(np.int64)
            key = key * width + codes
        return np.unique(key, return_inverse=True)[1].reshape(-1).astype(np.int64)

    def _describe(self, columns: Mapping[str, ObsColumn], row: int) -> str:
        parts = []
        for m in self.match:
            code = int(columns[m].codes[row])
            parts.append(f"{m}={columns[m].categories[code]!r}" if code >= 0 else f"{m}=NaN")
        return ", ".join(parts) or "all rows"

    # -- the stream --------------------------------------------------------------------
    def __len__(self) -> int:
        return self._length(getattr(self, "_n_draws", None)) * self.draw_size

    def epoch_rows(self, seed: int, epoch: int) -> np.ndarray:
        if self.evaluation:  # the same pairs every epoch
            epoch = 0
        rng = np.random.default_rng([int(seed), int(epoch), TAG_PAIR])
        passes = [self._epoch_perturbed(rng) for _ in range(-(-self._n_draws // self._n_pass))]
        idx = (passes[0] if len(passes) == 1 else np.concatenate(passes))[:self._n_draws]
        pert, g = self._perturbed[idx], self._pert_group[idx]
        count, start = self._control_count[g], self._control_start[g]
        pick = (rng.random((len(pert), self.n_controls)) * count[:, None]).astype(np.int64)
        pick = np.minimum(pick, count[:, None] - 1)
        controls = self._controls[start[:, None] + pick]
        return np.concatenate([pert[:, None], controls], axis=1).reshape(-1)

    def _epoch_perturbed(self, rng: np.random.Generator) -> np.ndarray:
        """The epoch's perturbed rows in stream order (sets of ``set_size`` together), as
        positions in ``_perturbed``."""
        if self._set_keys is None and self.chunk_size is not None:  # runs, in a random order
            run = self._perturbed // self.chunk_size
            ids = np.unique(run)
            rank = np.empty(int(run[-1]) + 1, dtype=np.int64)
            rank[ids] = rng.permutation(len(ids))
            return np.argsort(rank[run], kind="stable")
        if self._set_keys is None:
            return rng.permutation(len(self._perturbed))
        s = self.set_size
        assert s is not None
        keys = self._set_keys
        order = np.lexsort((rng.random(len(keys)), keys))  # by set key, shuffled inside
        rows, k = order, keys[order]
        sizes = np.bincount(keys)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        n_sets = -(-sizes // s)
        fill = n_sets * s - sizes  # rows drawn anew to complete each key's last set
        extra = starts.repeat(fill) + (rng.random(int(fill.sum())) * sizes.repeat(fill)
                                       ).astype(np.int64)
        by_key = np.concatenate([rows, rows[extra]])
        key_of = np.concatenate([k, np.arange(len(sizes)).repeat(fill)])
        by_key = by_key[np.argsort(key_of, kind="stable")]  # each key's rows, then its fill
        sets = by_key.reshape(-1, s)
        return sets[rng.permutation(len(sets))].reshape(-1)

    def __repr__(self) -> str:
        extra = "" if self.set_size is None else f", set_size={self.set_size}"
        if self.chunk_size is not None:
            extra += f", chunk_size={self.chunk_size}"
        if self.num_samples is not None:
            extra += f", num_samples={self.num_samples}"
        if self.evaluation:
            extra += ", evaluation"
        return (f"PairedSampler({self.perturbation!r}, {self.control!r}, "
                f"match={self.match!r}, n_controls={self.n_controls}{extra})")
