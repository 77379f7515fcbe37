"""Samplers of sampling mode: which rows an epoch holds, as a stream of row ids.

Pure numpy (no torch, no I/O). A user configures a sampler; the dataset *binds* it to its
source (:meth:`Sampler.bind`, once, in the process that builds the dataset): the bound copy
knows the number of rows and the obs columns it asked for (:attr:`Sampler.columns`, as
global category codes) and gives the epoch's *stream*, global row ids that are a pure
function of ``(seed, epoch)``, identical in every process that holds a copy.

The built-in samplers draw the stream in blocks of :data:`BLOCK` positions, each from its
own generator ``default_rng([seed, epoch, block, TAG_SAMPLE])``: a DataLoader worker
computes only the blocks its batches come from, in ``O(BLOCK)`` memory, and never an array
over the whole epoch (:class:`SubsetSampler` and ``WeightedSampler(replacement=False)``
excepted: a permutation or a draw without replacement needs the whole epoch at once).
What a sampler holds after binding (its tables) is made once by :meth:`Sampler.bind`;
DataLoader workers forked from that process share it copy-on-write.

Memory of the tables at ``n_obs`` rows: per-row weights 8 bytes per row (a float64
cumulative sum); class-based draws (:class:`ClassBalancedSampler`,
:meth:`WeightedSampler.from_column`) 4 bytes per row below 2**31 rows (the rows sorted by
class, int32) plus ``O(n_classes)``; :class:`SubsetSampler` 8 bytes per subset row.
"""

from __future__ import annotations

import copy
import warnings
import zlib
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import SamplerError, check_int

__all__ = [
    "BLOCK",
    "TAG_SAMPLE",
    "ObsColumn",
    "Sampler",
    "WeightedSampler",
    "ClassBalancedSampler",
    "SubsetSampler",
]

#: Stream positions drawn from one generator by the built-in samplers.
BLOCK = 1 << 16
#: Seed tag of a block of the sample stream: ``default_rng([seed, epoch, block, TAG_SAMPLE])``.
TAG_SAMPLE = 0x53414D50  # "SAMP"
#: Most rows per run of a sampler over a source grouped by its column
#: (``chunk_size="auto"``): a pool of 16,384 rows mixes 256 runs, and each run is one read
AUTO_RUN = 64
#: Fewest rows per automatic run, and the pool the automatic length is made for: runs of
#: ``AUTO_POOL // n_classes`` rows (a power of two in [AUTO_MIN_RUN, AUTO_RUN]), so a
#: default pool holds a run of every class (500 classes: runs of 32; 8 classes: 64)
AUTO_MIN_RUN = 8
AUTO_POOL = 16384


def auto_run(n_classes: int) -> int:
    """Rows per run of ``chunk_size="auto"`` on a grouped source of ``n_classes`` classes
    (longer runs read faster; a pool holding fewer runs than classes mixes fewer classes
    into a batch: ``docs/guides/samplers.md`` has the measured trade-off)."""
    fit = max(1, AUTO_POOL // max(1, int(n_classes)))
    return int(min(AUTO_RUN, max(AUTO_MIN_RUN, 1 << (fit.bit_length() - 1))))
#: Rows per block of :class:`_ClassTable`'s counting sort (its temporaries: ~40 bytes a row).
_GROUP_BLOCK = 1 << 18


@dataclass(frozen=True)
class ObsColumn:
    """A categorical obs column as a sampler sees it: one global code per row (``-1``: a
    missing value), the categories the codes index, and whether the source stores each
    class's rows as contiguous runs (a collection written with ``group_by`` this
    column)."""

    codes: np.ndarray
    categories: tuple[Any, ...]
    grouped: bool = False


def _count(name: str, value: object, minimum: int = 1) -> int | None:
    if value is None:
        return None
    return check_int(name, value, minimum, error=SamplerError, note=" (or None)")


class Sampler:
    """Base class of samplers: which rows an epoch of a dataset in sampling mode holds.

    A sampler is a pure object: from the number of rows, the obs columns it asks for, and
    ``(seed, epoch)`` it gives the epoch's stream of global row ids (with or without
    repeats), the same in every process. The dataset cuts the stream into batches, deals
    them to ranks (equal counts) and workers, and reads their rows by random access.

    To write your own, subclass it and define:

    - ``columns``: the categorical obs columns :meth:`prepare` needs (default none);
    - :meth:`prepare` (optional): check the arguments against the source and build tables;
    - ``__len__``: the number of row ids an epoch holds (after :meth:`prepare`);
    - :meth:`epoch_rows`: the whole stream of an epoch, a function of ``(seed, epoch)``
      only (seed every generator from them, e.g. ``np.random.default_rng([seed, epoch])``).

    Override :meth:`rows` instead of :meth:`epoch_rows` to compute parts of the stream
    without the whole epoch (what the built-in samplers do).

    Examples
    --------
    >>> class FirstDonor(Sampler):
    ...     columns = ("donor",)
    ...     def prepare(self, n_obs, columns):
    ...         self.keep = np.flatnonzero(columns["donor"].codes == 0)
    ...     def __len__(self):
    ...         return len(self.keep)
    ...     def epoch_rows(self, seed, epoch):
    ...         return np.random.default_rng([seed, epoch]).permutation(self.keep)
    """

    #: categorical obs columns the sampler needs (given to :meth:`prepare` by name)
    columns: tuple[str, ...] = ()

    _n_obs: int | None = None
    _epoch_cache: tuple[tuple[int, int], np.ndarray] | None = None
    #: the rows the sampler may draw (sorted), ``None``: all (see :meth:`bind`)
    allowed: np.ndarray | None = None
    #: a stream known to be a function of (seed, epoch) only (not checked by bind)
    _pure = False
    #: prepare() builds ``allowed`` into the tables, so bind need not keep it
    _drops_allowed = False
    #: the stream is made of runs of rows to be mixed inside each pool after reading
    #: (``ClassBalancedSampler`` drawing chunks): the dataset then shuffles each pool, as
    #: chunked mode does, instead of yielding the stream's order
    mixes_in_pool: bool = False
    #: stream positions per draw: ``1`` (a row each); a sampler of draws of ``d`` rows
    #: (``PairedSampler``: a perturbed row and its controls) has batches of ``batch_size``
    #: draws, each draw's first row under the selector's keys and its other rows under
    #: ``control_`` keys
    draw_size: int = 1
    #: what identifies the bound sampler's streams (set by :meth:`bind`: its repr, epoch
    #: length and a checksum of the start of its ``(seed=0, epoch=0)`` stream and of
    #: ``allowed``); resume states record it
    signature: str = ""

    # -- binding ---------------------------------------------------------------------
    def bind(self, n_obs: int, columns: Mapping[str, ObsColumn],
             rows: np.ndarray | None = None) -> Sampler:
        """A copy of this sampler bound to a source of ``n_obs`` rows (this one is left as
        it is, so one sampler can serve several datasets).

        ``rows``: draw from these rows only (a training split; :attr:`allowed`). The
        built-in samplers then treat every other row as weight 0 (a subset keeps its rows
        among them); a stream of your own that holds another row is refused.
        """
        if isinstance(self.columns, str) or not all(isinstance(c, str) for c in self.columns):
            raise SamplerError(f"{type(self).__name__}.columns must be a tuple of obs column "
                               f"names, got {self.columns!r} (write ('cell_type',), not "
                               "'cell_type').")
        missing = [c for c in self.columns if c not in columns]
        if missing:
            raise SamplerError(f"{self!r}: bind() got no obs column {missing}.")
        bound = copy.copy(self)
        bound._n_obs = int(n_obs)
        bound._epoch_cache = None
        bound.allowed = None if rows is None else np.unique(np.asarray(rows, dtype=np.int64))
        bound.prepare(int(n_obs), {c: columns[c] for c in self.columns})
        n = len(bound)
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
            raise SamplerError(f"{self!r}: an epoch must hold at least one row, got {n!r}.")
        head = min(int(n), 4096)
        first = np.array(bound.rows(0, 0, 0, head), dtype=np.int64, copy=True)
        bound._epoch_cache = None
        # what a resume state records of the sampler: its arguments show in the stream
        bound.signature = (f"{bound!r}; {int(n)} rows per epoch; stream crc32 "
                           f"{zlib.crc32(first.tobytes()):08x}" + (
                               "" if bound.allowed is None else
                               f"; allowed crc32 {zlib.crc32(bound.allowed.tobytes()):08x}"))
        if not bound._pure:  # a sampler of the user's: every process must draw the same
            if not np.array_equal(first, bound.rows(0, 0, 0, head)):
                raise SamplerError(
                    f"{self!r} gives other rows when asked twice for the same (seed, epoch), "
                    "so DataLoader workers and ranks would disagree on the epoch: seed every "
                    "generator from (seed, epoch), e.g. np.random.default_rng([seed, epoch]).")
            bound._epoch_cache = None
        elif bound._drops_allowed:
            bound.allowed = None  # prepare() applied it to the tables
        return bound

    def prepare(self, n_obs: int, columns: Mapping[str, ObsColumn]) -> None:
        """Check the sampler against a source and build its tables (on the bound copy)."""

    def for_evaluation(self) -> Sampler:
        """The sampler of held-out rows (validation, test, predict) where a DataModule
        draws them too (a sampler of draws, ``draw_size > 1``); default: this one."""
        return self

    def pool_strata(self, start: int, stop: int) -> np.ndarray | None:
        """A label per stream position in ``[start, stop)`` when :attr:`mixes_in_pool`:
        a pool is then permuted within each label's positions (a mixture keeps every
        batch's rows per member); ``None`` (default): permuted freely."""
        return None

    @property
    def is_bound(self) -> bool:
        """Whether :meth:`bind` made this copy."""
        return self._n_obs is not None

    def __bool__(self) -> bool:
        """Always true, whatever :func:`len` says (``sampler or default`` keeps a sampler;
        a built-in sampler's length is known only once it is bound)."""
        return True

    def _length(self, n: int | None) -> int:
        """``n``, the epoch's length of a built-in sampler, known once it is bound."""
        if n is None or not self.is_bound:
            raise SamplerError(f"len() of {self!r}: known once the sampler is bound to a "
                               "source (pass it to a dataset; the dataset's len() gives its "
                               "batches).")
        return n

    @property
    def n_allowed(self) -> int:
        """Rows the sampler may draw: :attr:`allowed`'s, else all of the source's."""
        return self.n_obs if self.allowed is None else len(self.allowed)

    def _restricted_codes(self, codes: np.ndarray) -> np.ndarray:
        """``codes`` with every row outside :attr:`allowed` set to ``-1`` (never drawn)."""
        if self.allowed is None:
            return np.asarray(codes)
        out = np.full(len(codes), -1, dtype=np.asarray(codes).dtype)
        out[self.allowed] = np.asarray(codes)[self.allowed]
        return out

    @property
    def n_obs(self) -> int:
        """Rows of the source the sampler is bound to."""
        if self._n_obs is None:
            raise SamplerError(f"{self!r} is not bound to a source (pass it to a dataset).")
        return self._n_obs

    def __len__(self) -> int:
        """Row ids per epoch."""
        raise NotImplementedError(f"{type(self).__name__} must define __len__")

    # -- the stream ------------------------------------------------------------------
    def epoch_rows(self, seed: int, epoch: int) -> np.ndarray:
        """The epoch's whole stream of global row ids (``len(self)`` integers)."""
        raise NotImplementedError(f"{type(self).__name__} must define epoch_rows or rows")

    def rows(self, seed: int, epoch: int, start: int, stop: int) -> np.ndarray:
        """Positions ``[start, stop)`` of the epoch's stream (int64 global row ids)."""
        key = (int(seed), int(epoch))
        cached = self._epoch_cache
        if cached is None or cached[0] != key:
            cached = (key, self._checked(self.epoch_rows(*key)))
            self._epoch_cache = cached
        return cached[1][start:stop]

    def _checked(self, rows: Any) -> np.ndarray:
        """A user's stream, refused with the reason when it cannot be one."""
        arr = np.asarray(rows)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise SamplerError(f"{self!r}: epoch_rows must return a 1-D array of integer row "
                               f"ids, got {arr.dtype} of shape {arr.shape}.")
        if len(arr) != len(self):
            raise SamplerError(f"{self!r}: epoch_rows returned {len(arr)} row ids but "
                               f"len() says {len(self)}; make them agree.")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.n_obs):
            bad = int(arr[(arr < 0) | (arr >= self.n_obs)][0])
            raise SamplerError(f"{self!r}: epoch_rows returned row {bad}, outside "
                               f"[0, {self.n_obs}) (the source's rows).")
        if self.allowed is not None:
            out = ~np.isin(arr, self.allowed)
            if out.any():
                raise SamplerError(f"{self!r}: epoch_rows returned row {int(arr[out][0])}, "
                                   "which is not among the rows it may draw (the training "
                                   "split); draw from self.allowed.")
        return arr.astype(np.int64, copy=False)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_epoch_cache", None)  # recomputed where it is used
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _BlockSampler(Sampler):
    """A sampler whose stream is drawn block by block (:data:`BLOCK` positions each)."""

    _pure = True
    _drops_allowed = True

    _blocks: dict[tuple[int, int, int], np.ndarray] | None = None

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raise NotImplementedError

    def rows(self, seed: int, epoch: int, start: int, stop: int) -> np.ndarray:
        stop = min(int(stop), len(self))
        if stop <= start:
            return np.empty(0, dtype=np.int64)
        first, last = start // BLOCK, (stop - 1) // BLOCK
        parts = [self._block(seed, epoch, j) for j in range(first, last + 1)]
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return out[start - first * BLOCK : stop - first * BLOCK]

    def _block(self, seed: int, epoch: int, j: int) -> np.ndarray:
        key = (int(seed), int(epoch), j)
        blocks = self.__dict__.setdefault("_blocks", {})
        got = blocks.get(key)
        if got is None:
            n = min(BLOCK, len(self) - j * BLOCK)
            got = self._draw(np.random.default_rng([seed, epoch, j, TAG_SAMPLE]), n)
            got.flags.writeable = False
            if len(blocks) >= 4:  # the blocks of the fetch being read and of the next
                blocks.pop(next(iter(blocks)))
            blocks[key] = got
        return got

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_blocks", None)
        return state


class _ClassTable:
    """Rows grouped by class, to draw a class and then a row of it in ``O(1)``.

    Built by a counting sort over blocks of :data:`_GROUP_BLOCK` rows: it holds 4 bytes per
    row (8 from 2**31 rows) and needs only a block's temporaries beyond them, where an
    ``argsort`` of the whole column would hold 8 bytes per row more while it runs.
    """

    def __init__(self, codes: np.ndarray, n_classes: int) -> None:
        codes = np.asarray(codes)
        index = np.int32 if len(codes) < 2**31 else np.int64
        counts = np.zeros(n_classes, dtype=np.int64)
        for a in range(0, len(codes), _GROUP_BLOCK):
            block = codes[a: a + _GROUP_BLOCK]
            counts += np.bincount(block[block >= 0], minlength=n_classes)[:n_classes]
        self.counts = counts
        self.starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        # rows of class 0 in row order, then class 1, ... (what a stable argsort gives)
        self.rows = np.empty(int(counts.sum()), dtype=index)
        fill = self.starts.copy()
        for a in range(0, len(codes), _GROUP_BLOCK):
            block = codes[a: a + _GROUP_BLOCK]
            order = np.argsort(block, kind="stable")
            order = order[block[order] >= 0]
            cls = block[order].astype(np.int64)
            here = np.bincount(cls, minlength=n_classes)[:n_classes]
            rank = np.arange(len(cls)) - (np.cumsum(here) - here)[cls]
            self.rows[fill[cls] + rank] = order + a
            fill += here
            del order, cls, rank  # one block's temporaries alive at a time

    def draw(self, rng: np.random.Generator, class_cdf: np.ndarray, n: int) -> np.ndarray:
        """``n`` rows: a class from ``class_cdf``, then a row of it uniformly."""
        cls = np.searchsorted(class_cdf, rng.random(n), side="right")
        pos = self.starts[cls] + (rng.random(n) * self.counts[cls]).astype(np.int64)
        return self.rows[np.minimum(pos, self.starts[cls] + self.counts[cls] - 1)].astype(
            np.int64)

    def draw_runs(self, rng: np.random.Generator, classes: np.ndarray, n: int,
                  run: int) -> np.ndarray:
        """``n`` rows in runs of ``run``: the runs' classes in rounds (each round a random
        order of ``classes``, so every class gets as many runs to within one), then
        :meth:`run_rows`."""
        k = -(-n // run)
        rounds = -(-k // len(classes))
        cls = classes[rng.permuted(np.tile(np.arange(len(classes)), (rounds, 1)),
                                   axis=1).reshape(-1)[:k]]
        return self.run_rows(rng, cls, n, run)

    def draw_weighted_runs(self, rng: np.random.Generator, class_cdf: np.ndarray, n: int,
                           run: int) -> np.ndarray:
        """``n`` rows in runs of ``run``: the runs' classes allotted by ``class_cdf``
        systematically (run ``j`` at ``(j + u) / k`` of the cumulative weights, so each class
        gets its share of the runs to within one), in a random order, then
        :meth:`run_rows`."""
        k = -(-n // run)
        at = (np.arange(k) + rng.random()) / k
        cls = rng.permutation(np.searchsorted(class_cdf, at, side="right"))
        return self.run_rows(rng, np.minimum(cls, len(class_cdf) - 1), n, run)

    def run_rows(self, rng: np.random.Generator, cls: np.ndarray, n: int,
                 run: int) -> np.ndarray:
        """Run ``j``: ``run`` consecutive rows of class ``cls[j]``'s row list from a uniform
        start (wrapping at its end, so every row of the class is as likely); the last run
        cut at ``n`` rows in all."""
        count = self.counts[cls]
        first = np.minimum((rng.random(len(cls)) * count).astype(np.int64), count - 1)
        pos = (first[:, None] + np.arange(run, dtype=np.int64)) % count[:, None]
        return self.rows[(self.starts[cls][:, None] + pos).reshape(-1)[:n]].astype(np.int64)


def _warn_few_runs(sampler: Sampler, n: int, n_classes: int) -> None:
    """Warn when an epoch of ``n`` draws in runs of ``sampler.run`` rows holds fewer runs
    than there are classes to draw (some then get none in an epoch)."""
    run = getattr(sampler, "run", 1)
    if run > 1 and -(-n // run) < n_classes:
        warnings.warn(
            f"{sampler!r}: an epoch of {n} draws holds {-(-n // run)} runs of {run} rows, "
            f"fewer than its {n_classes} classes, so some classes get no run in an epoch; "
            "lower chunk_size (1: single rows) or raise num_samples.", UserWarning,
            stacklevel=4)


def _cdf(weights: np.ndarray) -> np.ndarray:
    """Cumulative weights normalised to end at exactly 1.0."""
    weights = np.asarray(weights, dtype=np.float64)
    cdf = np.cumsum(weights / weights.max())  # scaled first: a sum of huge weights is finite
    return cdf / cdf[-1]


def _check_weights(weights: Any, what: str) -> np.ndarray:
    arr = np.asarray(weights)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iufb":
        raise SamplerError(f"{what} must be a non-empty 1-D array of numbers, got "
                           f"{arr.dtype} of shape {arr.shape}.")
    arr = arr.astype(np.float64)
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise SamplerError(f"{what} must be finite and >= 0; position {i} holds {arr[i]!r}.")
    if not arr.any():
        raise SamplerError(f"{what} are all zero: give some row a positive weight.")
    return arr


class WeightedSampler(_BlockSampler):
    """Rows drawn with probability proportional to their weight.

    Parameters
    ----------
    weights
        One weight per row of the source (``n_obs`` numbers >= 0, not all zero); rows of
        weight 0 are never drawn. For weights per category of an obs column use
        :meth:`from_column`.
    num_samples
        Row ids per epoch (default ``n_obs``).
    replacement
        Draw with replacement (default). ``False``: each row at most once per epoch, in
        weighted order (the successive-sampling order of Efraimidis and Spirakis); then
        ``num_samples`` may not exceed the rows of positive weight.
    """

    def __init__(self, weights: Sequence[float] | np.ndarray, *, num_samples: int | None = None,
                 replacement: bool = True) -> None:
        self.weights: np.ndarray | None = _check_weights(weights, "WeightedSampler weights")
        self._init(num_samples, replacement)

    def _init(self, num_samples: int | None, replacement: bool) -> None:
        self.num_samples = _count("WeightedSampler num_samples", num_samples)
        if not isinstance(replacement, bool | np.bool_):
            raise SamplerError(f"replacement must be True or False, got {replacement!r}.")
        self.replacement = bool(replacement)
        self.column: str | None = None
        self.category_weights: dict[Hashable, float] | None = None
        self.default: float | None = None
        self.columns = ()
        self.chunk_size: int | str | None = None  # from_column's
        self.run = 1

    @classmethod
    def from_column(cls, column: str, weights: Mapping[Hashable, float], *,
                    default: float | None = None, num_samples: int | None = None,
                    replacement: bool = True,
                    chunk_size: int | str | None = "auto") -> WeightedSampler:
        """Weights per category of a categorical obs column: each row weighs its
        category's weight.

        Parameters
        ----------
        column
            A categorical obs column of the source (``"cell_type"``).
        weights
            ``{category: weight >= 0}``. Every category must be a category of the column.
        default
            Weight of the categories ``weights`` leaves out; ``None`` (default): every
            category must be given. Rows with a missing value are never drawn.
        num_samples, replacement
            As for :class:`WeightedSampler`.
        chunk_size
            With replacement: draw runs of this many rows of one category (each category
            gets its weight's share of the runs, a run starts uniformly in the category's
            rows) and mix them in the pools after reading, as
            :class:`ClassBalancedSampler` does: ``"auto"`` (default) on a collection written
            with ``group_by=column`` (runs of 8-64 rows as there, each one read), single
            rows otherwise; ``1`` or ``None``: single rows; an integer: runs on any source.
        """
        if not isinstance(column, str) or not column:
            raise SamplerError(f"column must be an obs column name, got {column!r}.")
        if chunk_size != "auto":
            chunk_size = _count("WeightedSampler.from_column chunk_size", chunk_size)
            if chunk_size not in (None, 1) and not replacement:
                raise SamplerError(
                    f"WeightedSampler.from_column({column!r}, chunk_size={chunk_size}): runs "
                    "of rows are drawn with replacement; pass replacement=True (or "
                    "chunk_size=1).")
        if not isinstance(weights, Mapping) or not weights:
            raise SamplerError("weights must be a non-empty mapping {category: weight}, got "
                               f"{weights!r}.")
        for cat, w in [*weights.items(), *([] if default is None else [("default", default)])]:
            if isinstance(w, bool) or not isinstance(w, int | float | np.integer | np.floating
                                                     ) or not np.isfinite(w) or w < 0:
                what = "default" if cat == "default" and default is not None else (
                    f"the weight of category {cat!r}")
                raise SamplerError(f"WeightedSampler.from_column({column!r}): {what} must be "
                                   f"a finite number >= 0, got {w!r}.")
        values = _check_weights(list(weights.values()) + ([] if default is None else [default]),
                                "WeightedSampler.from_column weights")
        self = cls.__new__(cls)
        self.weights = None
        self._init(num_samples, replacement)
        self.column = column
        self.columns = (column,)
        self.chunk_size = chunk_size
        self.category_weights = dict(zip(weights, values[: len(weights)].tolist()))
        self.default = None if default is None else float(values[-1])
        return self

    def prepare(self, n_obs: int, columns: Mapping[str, ObsColumn]) -> None:
        if self.column is None:
            assert self.weights is not None
            if len(self.weights) != n_obs:
                raise SamplerError(f"WeightedSampler weights hold {len(self.weights)} numbers "
                                   f"but the source has {n_obs} rows: give one weight per row.")
            row_w = self.weights
            if self.allowed is not None:
                row_w = np.zeros(n_obs)
                row_w[self.allowed] = self.weights[self.allowed]
                if not row_w.any():
                    raise SamplerError("WeightedSampler weights are 0 on every row it may "
                                       "draw (the training split); give some of them weight.")
        else:
            col = columns[self.column]
            cats = list(col.categories)
            assert self.category_weights is not None
            unknown = [c for c in self.category_weights if c not in cats]
            if unknown:
                raise SamplerError(
                    f"WeightedSampler.from_column({self.column!r}): {unknown[:5]} "
                    f"{'is not a category' if len(unknown) == 1 else 'are not categories'} "
                    f"of obs column {self.column!r} (its categories: {cats[:10]}"
                    f"{'...' if len(cats) > 10 else ''}); fix the mapping's keys.")
            left = [c for c in cats if c not in self.category_weights]
            if left and self.default is None:
                raise SamplerError(
                    f"WeightedSampler.from_column({self.column!r}): no weight for categories "
                    f"{left[:5]}{'...' if len(left) > 5 else ''}; give them a weight or pass "
                    "default=<weight> for the categories not listed.")
            class_w = np.array([self.category_weights.get(c, self.default) for c in cats],
                               dtype=np.float64)
            codes = self._restricted_codes(col.codes)
            self._table = _ClassTable(codes, len(cats))
            mass = class_w * self._table.counts
            if not mass.any():
                raise SamplerError(
                    f"WeightedSampler.from_column({self.column!r}): every row of obs column "
                    f"{self.column!r} has weight 0 (or a missing value); give a category "
                    "with rows a positive weight.")
            row_w = np.where(codes >= 0, class_w[np.maximum(codes, 0)], 0.0) if (
                not self.replacement) else None
            self._class_cdf = _cdf(mass)
            if self.replacement:
                self.run = ((auto_run(int(np.count_nonzero(mass))) if col.grouped else 1)
                            if self.chunk_size == "auto" else int(self.chunk_size or 1))
                self.mixes_in_pool = self.run > 1
                _warn_few_runs(self, self.n_allowed if self.num_samples is None
                               else self.num_samples, int(np.count_nonzero(mass)))
        self._len = self.n_allowed if self.num_samples is None else self.num_samples
        if not self.replacement:
            assert row_w is not None
            n_pos = int(np.count_nonzero(row_w))
            if self._len > n_pos:
                raise SamplerError(
                    f"WeightedSampler(replacement=False) draws each row at most once, but "
                    f"num_samples={self._len} exceeds the {n_pos} rows of positive weight; "
                    "lower num_samples or use replacement=True.")
            self._row_w = row_w
        elif self.column is None:
            self._row_cdf = _cdf(row_w)
        self.weights = None  # what is drawn from lives in the tables now

    def __len__(self) -> int:
        return self._length(getattr(self, "_len", None))

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.column is not None and self.run > 1:
            return self._table.draw_weighted_runs(rng, self._class_cdf, n, self.run)
        if self.column is not None:
            return self._table.draw(rng, self._class_cdf, n)
        return np.searchsorted(self._row_cdf, rng.random(n), side="right").astype(np.int64)

    def rows(self, seed: int, epoch: int, start: int, stop: int) -> np.ndarray:
        if self.replacement:
            return super().rows(seed, epoch, start, stop)
        return Sampler.rows(self, seed, epoch, start, stop)

    def epoch_rows(self, seed: int, epoch: int) -> np.ndarray:
        # without replacement: the num_samples largest keys u ** (1 / w), in decreasing
        # order, are a draw of successive weighted sampling (Efraimidis and Spirakis 2006);
        # ranked by log w - log(-log u) (the same order; finite for tiny w, -inf for w == 0)
        rng = np.random.default_rng([seed, epoch, 0, TAG_SAMPLE])
        with np.errstate(divide="ignore"):
            keys = np.log(self._row_w) - np.log(-np.log(rng.random(len(self._row_w))))
        top = np.argpartition(-keys, self._len - 1)[: self._len]
        return top[np.argsort(-keys[top], kind="stable")].astype(np.int64)

    def __repr__(self) -> str:  # single rows: as before chunk_size (resume states match)
        what = (f"from_column({self.column!r})" if self.column is not None
                else f"({self.n_obs if self._n_obs is not None else '?'} weights)")
        runs = ("" if self.run == 1 and self.chunk_size in ("auto", None, 1) else
                f", chunk_size={self.chunk_size!r}, runs of {self.run} rows")
        # (kept as written before chunk_size: a resume state records the repr)
        return (f"WeightedSampler{what}(num_samples={self.num_samples}, "
                f"replacement={self.replacement}{runs})")


class ClassBalancedSampler(_BlockSampler):
    """Every category of an obs column equally often: a category uniformly, then one of
    its rows uniformly (with replacement).

    Categories with no rows in the source, and rows with a missing value, are never drawn.

    Parameters
    ----------
    column
        A categorical obs column of the source (``"cell_type"``).
    num_samples
        Row ids per epoch (default ``n_obs``).
    chunk_size
        Draw runs of this many rows of one category (the categories in rounds, each round
        a random order of all of them, so every category gets as many runs to within one;
        then a run of its rows from a uniform start) and mix the runs inside each pool
        after reading,
        as chunked mode mixes chunks: on a collection written with
        ``group_by=column`` a run is one contiguous read instead of one read per row.
        Each row of a category is still drawn equally often, but rows of a run come
        together (rows stored next to each other). ``"auto"`` (default): runs of
        8-64 rows when the source is grouped by ``column`` (64 for up to 256 categories,
        fewer for more, so that a default pool of 16,384 rows holds a run of each)
        (:attr:`~annbatch_torch.Collection.group_by`), single rows otherwise; ``1`` or
        ``None``: single rows; an integer: runs of that many rows on any source (e.g.
        inputs read in place that are sorted by the column).
    """

    def __init__(self, column: str, *, num_samples: int | None = None,
                 chunk_size: int | str | None = "auto") -> None:
        if not isinstance(column, str) or not column:
            raise SamplerError(f"column must be an obs column name, got {column!r}.")
        self.column = column
        self.columns = (column,)
        self.num_samples = _count("ClassBalancedSampler num_samples", num_samples)
        if chunk_size != "auto":
            chunk_size = _count("ClassBalancedSampler chunk_size", chunk_size)
        self.chunk_size = chunk_size
        self.run = 1

    def prepare(self, n_obs: int, columns: Mapping[str, ObsColumn]) -> None:
        col = columns[self.column]
        self._table = _ClassTable(self._restricted_codes(col.codes), len(col.categories))
        present = self._table.counts > 0
        if not present.any():
            raise SamplerError(f"ClassBalancedSampler({self.column!r}): obs column "
                               f"{self.column!r} has no row with a value; choose a column "
                               "with labelled rows.")
        self._class_cdf = _cdf(present.astype(np.float64))
        self._present = np.flatnonzero(present)
        self.n_classes = int(present.sum())
        self._len = self.n_allowed if self.num_samples is None else self.num_samples
        self.run = (auto_run(self.n_classes) if col.grouped else 1) if (
            self.chunk_size == "auto") else int(self.chunk_size or 1)
        self.mixes_in_pool = self.run > 1
        _warn_few_runs(self, self._len, self.n_classes)

    def __len__(self) -> int:
        return self._length(getattr(self, "_len", None))

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.run > 1:
            return self._table.draw_runs(rng, self._present, n, self.run)
        return self._table.draw(rng, self._class_cdf, n)

    def __repr__(self) -> str:  # single rows: as before chunk_size (resume states match)
        if self.run == 1 and self.chunk_size in ("auto", None, 1):
            return f"ClassBalancedSampler({self.column!r}, num_samples={self.num_samples})"
        return (f"ClassBalancedSampler({self.column!r}, num_samples={self.num_samples}, "
                f"chunk_size={self.chunk_size!r}, runs of {self.run} rows)")


class SubsetSampler(Sampler):
    """Exactly these rows once per epoch, without replacement.

    Parameters
    ----------
    rows
        Global row ids (positions in the source), each at most once.
    shuffle
        A new order every epoch, seeded by ``(seed, epoch)`` (default). ``False``: the
        order given.
    """

    _pure = True
    _drops_allowed = True

    def __init__(self, rows: Sequence[int] | np.ndarray, *, shuffle: bool = True) -> None:
        arr = np.asarray(rows)
        if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
            raise SamplerError("SubsetSampler rows must be a non-empty 1-D array of integer "
                               f"row ids, got {arr.dtype} of shape {arr.shape}.")
        arr = arr.astype(np.int64)
        uniq, counts = np.unique(arr, return_counts=True)
        if (counts > 1).any():
            dup = int(uniq[counts > 1][0])
            raise SamplerError(f"SubsetSampler rows hold row {dup} {int(counts.max())} times "
                               "(each row at most once); drop the duplicates, e.g. "
                               "np.unique(rows).")
        if not isinstance(shuffle, bool | np.bool_):
            raise SamplerError(f"shuffle must be True or False, got {shuffle!r}.")
        self.subset = arr
        self.shuffle = bool(shuffle)

    def prepare(self, n_obs: int, columns: Mapping[str, ObsColumn]) -> None:
        bad = (self.subset < 0) | (self.subset >= n_obs)
        if bad.any():
            raise SamplerError(f"SubsetSampler rows hold row {int(self.subset[bad][0])}, "
                               f"outside [0, {n_obs}) (the source's rows).")
        if self.allowed is not None:  # the subset's rows in the training split
            self.subset = self.subset[np.isin(self.subset, self.allowed)]
            if not len(self.subset):
                raise SamplerError("SubsetSampler: none of its rows is in the training split; "
                                   "choose rows of it (or no validation split).")

    def __len__(self) -> int:
        return len(self.subset)

    def epoch_rows(self, seed: int, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return self.subset
        return np.random.default_rng([seed, epoch, 0, TAG_SAMPLE]).permutation(self.subset)

    def __repr__(self) -> str:
        return f"SubsetSampler({len(self.subset)} rows, shuffle={self.shuffle})"

