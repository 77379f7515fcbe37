"""Weighted mixing of several sources: :class:`MixSampler`, the stream of a mixture.

Pure numpy. A mixture's rows are its members' rows one member after the other (member ``i``
holds global rows ``[offsets[i], offsets[i + 1])``). An epoch of ``N`` rows is cut into
batches of ``batch_size`` positions; every batch holds ``floor(B * w_i)`` or that plus one
rows of member ``i`` (``B`` its length, ``w_i`` the weight): the ``r`` rows left over by
the floors go to the ``r`` members furthest behind their share so far (largest deficit
first), so each member's rows in an epoch are within one of ``N * w_i``. Inside a batch a
member's rows sit in one run of positions (its *slots*); each pool is then permuted within
each member's slots (:meth:`MixSampler.pool_strata`), which mixes runs from all over the
pool while keeping every batch's counts.

A member's rows come in *runs* of ``chunk_size`` consecutive rows (its rows, or the rows it
may draw, cut in order), the runs in a random order of ``(seed, epoch, member, pass)``: a
member whose share exceeds its rows starts another pass (another order); one below it reads
the first runs of the order, a new subsample each epoch. A pool thus reads whole runs.

A member may draw with a sampler of its own instead (``member_samplers``, e.g.
class-balanced inside one collection): bound to the member's rows, its stream gives the
member's rows, pass ``p`` of an epoch being the sampler's stream of that epoch under a seed
derived from ``(seed, member, p)``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import SamplerError, check_int
from .samplers import ObsColumn, Sampler

__all__ = ["MixSampler", "TAG_MIX", "batch_quotas"]

#: Seed tag of a member's run order: ``default_rng([seed, epoch, member, pass, TAG_MIX])``.
TAG_MIX = 0x4D495853  # "MIXS"
#: run orders kept per process (a worker touches few passes of few members at a time)
_CACHE = 64


def batch_quotas(n: int, weights: np.ndarray) -> np.ndarray:
    """Rows of each member in one batch of ``n`` rows: ``floor(n * w)`` plus one for the
    members with the largest remainders (largest remainder method; ties to the first)."""
    exact = n * weights
    base = np.floor(exact).astype(np.int64)
    left = int(n - base.sum())
    if left:
        order = np.lexsort((np.arange(len(weights)), -(exact - base)))
        base[order[:left]] += 1
    return base


def _leftovers(weights: np.ndarray, floors: np.ndarray, left: np.ndarray,
               lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The batch and the member of each row left over by the floors ``floors`` (one row per
    batch, one column per member): batch ``j``'s ``left[j]`` rows go to the members furthest
    behind their share of the rows so far (``done * w - given``, largest first, ties to the
    first member). A plain Python loop over the batches (the deficits depend on every
    earlier batch), in Python floats: the same doubles as numpy's, at a fraction of the
    cost of numpy calls on a few members per batch."""
    k = len(weights)
    if not len(lengths):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    w = weights.tolist()
    full = floors[0].tolist()  # every batch but the last has the full length
    last = floors[-1].tolist()
    given = [0] * k
    done = 0
    n_batches = len(lengths)
    lens, lefts = lengths.tolist(), left.tolist()
    keys = range(k)
    out_batch: list[int] = []
    out_member: list[int] = []
    for j in range(n_batches):
        done += lens[j]
        add = full if j < n_batches - 1 else last
        for i in keys:
            given[i] += add[i]
        r = lefts[j]
        if r:
            deficit = [done * w[i] - given[i] for i in keys]
            for i in sorted(keys, key=lambda i: (-deficit[i], i))[:r]:
                given[i] += 1
                out_batch.append(j)
                out_member.append(i)
    return np.array(out_batch, dtype=np.int64), np.array(out_member, dtype=np.int64)


class MixSampler(Sampler):
    """The stream of a weighted mixture of sources (see the module docstring).

    Parameters
    ----------
    offsets
        Each member's first global row, then the total (``n_members + 1`` integers).
    weights
        Each member's share (non-negative, summing to 1).
    batch_size
        Rows per batch (the quotas are per batch).
    chunk_size
        Rows per run of a member.
    num_samples
        Rows per epoch; ``None``: the rows the members of positive weight may draw, in
        all.
    names
        The members' names (for messages and the signature).
    member_samplers
        Per member, a :class:`~annbatch_torch.Sampler` drawing its rows (bound here to the
        member's rows), or ``None``: runs of its rows.
    """

    mixes_in_pool = True
    _pure = True
    _drops_allowed = True

    def __init__(self, offsets: Sequence[int], weights: Sequence[float], *, batch_size: int,
                 chunk_size: int, num_samples: int | None = None,
                 names: Sequence[str] = (),
                 member_samplers: Sequence[Sampler | None] = ()) -> None:
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.weights = np.asarray(weights, dtype=np.float64)
        if self.offsets.ndim != 1 or len(self.offsets) != len(self.weights) + 1:
            raise SamplerError("MixSampler: give one weight per member and its row offsets.")
        self.batch_size = check_int("batch_size", batch_size, 1, error=SamplerError)
        self.chunk_size = check_int("chunk_size", chunk_size, 1, error=SamplerError)
        self.num_samples = None if num_samples is None else check_int(
            "num_samples", num_samples, 1, error=SamplerError, note=" (or None)")
        self.names = list(names) or [f"member {i}" for i in range(len(self.weights))]
        self.member_samplers = list(member_samplers) or [None] * len(self.weights)
        if len(self.member_samplers) != len(self.weights):
            raise SamplerError("MixSampler: give one sampler (or None) per member.")
        for name, ms in zip(self.names, self.member_samplers, strict=True):
            if ms is not None and (not isinstance(ms, Sampler) or ms.draw_size != 1
                                   or ms.is_bound):
                raise SamplerError(
                    f"mix: the sampler of {name!r} must be an unbound annbatch_torch Sampler "
                    f"drawing single rows (WeightedSampler, ClassBalancedSampler, "
                    f"SubsetSampler...), got {ms!r}.")
        #: the obs columns the members' samplers ask for
        self.columns = tuple(dict.fromkeys(c for ms in self.member_samplers if ms is not None
                                           for c in ms.columns))

    # -- tables ------------------------------------------------------------------------
    def prepare(self, n_obs: int, columns: Mapping[str, ObsColumn]) -> None:
        if int(self.offsets[-1]) != n_obs:
            raise SamplerError(f"{self!r}: the members hold {int(self.offsets[-1])} rows, the "
                               f"source {n_obs}.")
        k = len(self.weights)
        if self.allowed is None:
            self._rows: list[np.ndarray | None] = [None] * k
            sizes = np.diff(self.offsets)
        else:  # a split: each member draws from its allowed rows
            cut = np.searchsorted(self.allowed, self.offsets)
            self._rows = [self.allowed[cut[i]:cut[i + 1]] for i in range(k)]
            sizes = np.array([len(r) for r in self._rows], dtype=np.int64)
        #: per member, its sampler bound to its rows (None: runs of its rows)
        self._bound: list[Sampler | None] = [None] * k
        for i, ms in enumerate(self.member_samplers):
            if ms is None or sizes[i] == 0 or self.weights[i] == 0:
                continue
            rows = self._rows[i]
            own = np.arange(self.offsets[i], self.offsets[i + 1]) if rows is None else rows
            try:
                self._bound[i] = ms.bind(n_obs, {c: columns[c] for c in ms.columns}, own)
            except SamplerError as e:
                raise SamplerError(f"mix: the sampler of {self.names[i]!r}: {e}") from None
            sizes[i] = len(self._bound[i])
        self._sizes = sizes.astype(np.int64)
        empty = [self.names[i] for i in range(k) if self.weights[i] > 0 and sizes[i] == 0]
        if empty:
            raise SamplerError(f"{self!r}: member(s) {empty} have weight but no row to draw "
                               "(in this split); give them weight 0 or more rows.")
        n = int(self.num_samples if self.num_samples is not None
                else sizes[self.weights > 0].sum())
        self._n = n
        b = self.batch_size
        full, rest = divmod(n, b)
        lengths = np.full(full + (1 if rest else 0), b, dtype=np.int64)
        if rest:
            lengths[-1] = rest
        # floor(L * w) each, and the rows left over to the members furthest behind their
        # share of the rows so far (so the epoch's totals are within one of n * w: exactly
        # n * w where that is an integer, e.g. a member read once)
        counts = np.floor(lengths[:, None] * self.weights).astype(np.int64)
        left = lengths - counts.sum(axis=1)
        at_batch, at_member = _leftovers(self.weights, counts, left, lengths)
        np.add.at(counts, (at_batch, at_member), 1)
        #: rows of each member in each batch, and before each batch (cumulated)
        self._counts = counts
        self._before = np.vstack([np.zeros((1, k), dtype=np.int64),
                                  np.cumsum(counts, axis=0)])
        self._orders: OrderedDict[tuple[int, int, int, int], tuple[np.ndarray, np.ndarray]] = \
            OrderedDict()

    def member_rows(self) -> np.ndarray:
        """Rows of each member in an epoch."""
        return self._before[-1].copy()

    def __len__(self) -> int:
        return self._length(getattr(self, "_n", None))

    # -- the stream --------------------------------------------------------------------
    def _slots(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each position's member and its index among that member's rows of the epoch."""
        b = positions // self.batch_size
        s = positions % self.batch_size
        counts = self._counts[b]
        starts = np.cumsum(counts, axis=1) - counts
        member = (s[:, None] >= starts + counts).sum(axis=1)
        rank = s - starts[np.arange(len(s)), member]
        return member, self._before[b, member] + rank

    def pool_strata(self, start: int, stop: int) -> np.ndarray:
        """The member of each stream position in ``[start, stop)``: a pool is permuted
        within each member's positions (every batch keeps its counts)."""
        return self._slots(np.arange(start, stop, dtype=np.int64))[0]

    def rows(self, seed: int, epoch: int, start: int, stop: int) -> np.ndarray:
        member, index = self._slots(np.arange(start, stop, dtype=np.int64))
        out = np.empty(len(member), dtype=np.int64)
        for m in np.unique(member):
            at = member == m
            out[at] = self._member_rows(int(seed), int(epoch), int(m), index[at])
        return out

    def _member_rows(self, seed: int, epoch: int, m: int, index: np.ndarray) -> np.ndarray:
        """Rows ``index`` (0, 1, ... of the epoch) of member ``m``'s stream of runs."""
        size = int(self._sizes[m])
        passes, t = np.divmod(index, size)
        bound = self._bound[m]
        if bound is not None:  # the member's sampler: pass p under a seed of its own
            out = np.empty(len(index), dtype=np.int64)
            for p in np.unique(passes):
                at = passes == p
                lo, hi = int(t[at].min()), int(t[at].max()) + 1
                sub = int(np.random.SeedSequence([seed, m, int(p), TAG_MIX]).generate_state(
                    1, np.uint64)[0] >> 1)
                out[at] = np.asarray(bound.rows(sub, epoch, lo, hi))[t[at] - lo]
            return out
        local = np.empty(len(index), dtype=np.int64)
        for p in np.unique(passes):
            at = passes == p
            order, ends = self._order(seed, epoch, m, int(p))
            k = np.searchsorted(ends, t[at], side="right")
            local[at] = order[k] * self.chunk_size + t[at] - (ends[k] - self._run_len(
                m, order[k]))
        rows = self._rows[m]
        return self.offsets[m] + local if rows is None else rows[local]

    def _run_len(self, m: int, run: np.ndarray) -> np.ndarray:
        size = int(self._sizes[m])
        return np.minimum(self.chunk_size, size - run * self.chunk_size)

    def _order(self, seed: int, epoch: int, m: int, p: int) -> tuple[np.ndarray, np.ndarray]:
        """Member ``m``'s runs in the order of pass ``p``, and their cumulated lengths."""
        key = (seed, epoch, m, p)
        hit = self._orders.get(key)
        if hit is None:
            n_runs = -(-int(self._sizes[m]) // self.chunk_size)
            order = np.random.default_rng([seed, epoch, m, p, TAG_MIX]).permutation(n_runs)
            hit = (order, np.cumsum(self._run_len(m, order)))
            self._orders[key] = hit
            while len(self._orders) > _CACHE:
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(key)
        return hit

    def __getstate__(self) -> dict[str, object]:
        state = super().__getstate__()
        state["_orders"] = OrderedDict()
        return state

    def __repr__(self) -> str:
        shares = ", ".join(f"{n!r}: {w:.4g}" for n, w in zip(self.names, self.weights,
                                                              strict=True))
        extra = "" if self.num_samples is None else f", num_samples={self.num_samples}"
        inner = {n: ms for n, ms in zip(self.names, self.member_samplers, strict=True)
                 if ms is not None}
        if inner:
            extra += ", samplers={" + ", ".join(f"{n!r}: {ms!r}" for n, ms in inner.items()) \
                + "}"
        return (f"MixSampler({{{shares}}}, batch_size={self.batch_size}, "
                f"chunk_size={self.chunk_size}{extra})")
