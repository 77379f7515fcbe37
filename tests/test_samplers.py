"""Samplers and sampling mode's plan, pure (no I/O): streams, dealing, statistics, errors."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from annbatch_torch import (
    ClassBalancedSampler,
    Sampler,
    SamplerError,
    SubsetSampler,
    WeightedSampler,
    sampling,
)
from annbatch_torch.sampling import BLOCK, ObsColumn
from annbatch_torch.sampling.mixing import MixSampler
from annbatch_torch.torch_sampler import TorchIndexSampler


def _column(codes: np.ndarray, n_classes: int | None = None) -> ObsColumn:
    n = int(codes.max()) + 1 if n_classes is None else n_classes
    return ObsColumn(np.asarray(codes), tuple(f"c{k}" for k in range(n)))


def _zipf_codes(n_obs: int, n_classes: int, seed: int = 0, a: float = 2.5) -> np.ndarray:
    """Shuffled codes of Zipf-sized classes (class k has about n / (k + 1) ** a rows)."""
    sizes = 1.0 / np.arange(1, n_classes + 1) ** a
    counts = np.maximum(1, np.round(sizes / sizes.sum() * n_obs)).astype(int)
    counts[0] += n_obs - counts.sum()
    codes = np.repeat(np.arange(n_classes), counts)
    return np.random.default_rng(seed).permutation(codes)


def _batches(sampler: Sampler, batch_size: int, pool: int, *, seed: int = 0, epoch: int = 0,
             world_size: int = 1, num_workers: int = 1, drop_last: bool = False,
             even_batches: str = "drop") -> list[list[list[int]]]:
    """Per rank, the batches' row ids (each worker's in turn; a padding batch as [-1])."""
    out = []
    for rank in range(world_size):
        items = sampling.sample_rank_items(sampler, batch_size, pool, seed=seed, epoch=epoch,
                                           rank=rank, world_size=world_size,
                                           drop_last=drop_last, even_batches=even_batches)
        rank_batches = []
        for w in range(num_workers):
            for it in sampling.worker_items(items, w, num_workers):
                rows = it.rows
                for b in range(it.batch_start, it.batch_stop):
                    lo, hi = it.bounds(b)
                    rank_batches.append([-1] if it.padding else rows[lo:hi].tolist())
        out.append(rank_batches)
    return out


# -- the stream ------------------------------------------------------------------------

@st.composite
def _plans(draw: st.DrawFn) -> dict:
    n_obs = draw(st.integers(1, 400))
    kind = draw(st.sampled_from(["subset", "weighted", "balanced", "norepl"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if kind == "subset":
        m = draw(st.integers(1, n_obs))
        sampler: Sampler = SubsetSampler(rng.choice(n_obs, m, replace=False),
                                         shuffle=draw(st.booleans()))
    elif kind == "weighted":
        sampler = WeightedSampler(rng.random(n_obs) + 0.01,
                                  num_samples=draw(st.integers(1, 500)))
    elif kind == "norepl":
        sampler = WeightedSampler(rng.random(n_obs) + 0.01, replacement=False,
                                  num_samples=draw(st.integers(1, n_obs)))
    else:
        sampler = ClassBalancedSampler("c", num_samples=draw(st.integers(1, 500)))
    codes = rng.integers(0, 4, n_obs)
    bound = sampler.bind(n_obs, {"c": _column(codes, 4)})
    batch_size = draw(st.integers(1, 40))
    return dict(sampler=bound, batch_size=batch_size,
                pool=batch_size * draw(st.integers(1, 4)),
                world_size=draw(st.integers(1, 4)), drop_last=draw(st.booleans()),
                even_batches=draw(st.sampled_from(["drop", "pad"])),
                epoch=draw(st.integers(0, 3)))


@settings(max_examples=150, deadline=None)
@given(_plans(), st.integers(2, 5))
def test_ranks_yield_equal_counts_and_workers_change_only_the_interleaving(
        plan: dict, num_workers: int) -> None:
    one = _batches(**plan, num_workers=1)
    many = _batches(**plan, num_workers=num_workers)
    expect = sampling.sample_batches_per_rank(
        plan["sampler"], plan["batch_size"], plan["pool"], world_size=plan["world_size"],
        drop_last=plan["drop_last"], even_batches=plan["even_batches"])
    assert [len(r) for r in one] == [expect] * plan["world_size"]
    for a, b in zip(one, many):  # the same batches, whatever the number of workers
        assert sorted(map(tuple, a)) == sorted(map(tuple, b))
    assert _batches(**plan, num_workers=1) == one  # deterministic
    stream = plan["sampler"].rows(0, plan["epoch"], 0, len(plan["sampler"])).tolist()
    real = [r for rank in one for batch in rank if batch != [-1] for r in batch]
    assert Counter(real) <= Counter(stream)  # only rows of the stream, at most as often
    missing = len(stream) - len(real)
    if plan["even_batches"] == "pad" and not plan["drop_last"]:
        assert missing == 0
    else:  # fewer than world_size batches dropped (and the partial one under drop_last)
        assert 0 <= missing < (plan["world_size"] + 1) * plan["batch_size"]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 300), st.integers(1, 30), st.integers(1, 4), st.integers(1, 4),
       st.integers(0, 2**16))
def test_a_subset_is_covered_exactly_once_across_ranks_and_workers(
        n_obs: int, batch_size: int, world_size: int, num_workers: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = rng.choice(n_obs, rng.integers(1, n_obs + 1), replace=False)
    bound = SubsetSampler(rows).bind(n_obs, {})
    ranks = _batches(bound, batch_size, batch_size * 2, world_size=world_size,
                     num_workers=num_workers, even_batches="pad", seed=seed)
    real = [r for rank in ranks for batch in rank if batch != [-1] for r in batch]
    assert sorted(real) == sorted(rows.tolist())
    assert len({len(r) for r in ranks}) == 1


def test_the_stream_computed_in_pieces_equals_the_whole() -> None:
    bound = WeightedSampler(np.arange(1, 1001, dtype=float),
                            num_samples=3 * BLOCK + 17).bind(1000, {})
    whole = bound.rows(4, 2, 0, len(bound))
    assert len(whole) == 3 * BLOCK + 17
    cuts = [0, 5, BLOCK - 1, BLOCK + 3, 2 * BLOCK, 3 * BLOCK + 17]
    parts = [bound.rows(4, 2, a, b) for a, b in itertools.pairwise(cuts)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    # another copy (as a worker holds) gives the same; another epoch or seed does not
    other = WeightedSampler(np.arange(1, 1001, dtype=float),
                            num_samples=3 * BLOCK + 17).bind(1000, {})
    np.testing.assert_array_equal(other.rows(4, 2, BLOCK, 2 * BLOCK), whole[BLOCK:2 * BLOCK])
    assert not np.array_equal(bound.rows(4, 3, 0, 100), whole[:100])
    assert not np.array_equal(bound.rows(5, 2, 0, 100), whole[:100])


def test_a_bound_copy_leaves_the_sampler_reusable() -> None:
    s = ClassBalancedSampler("c")
    a = s.bind(100, {"c": _column(np.arange(100) % 2)})
    b = s.bind(50, {"c": _column(np.arange(50) % 5)})
    assert len(a) == 100
    assert len(b) == 50
    assert set(b.rows(0, 0, 0, 50).tolist()) <= set(range(50))
    with pytest.raises(SamplerError, match="not bound"):
        _ = s.n_obs


# -- statistics --------------------------------------------------------------------------

def test_class_balanced_draws_every_class_equally_often() -> None:
    codes = _zipf_codes(20_000, 10)
    assert np.bincount(codes).min() / len(codes) <= 0.005
    bound = ClassBalancedSampler("c").bind(len(codes), {"c": _column(codes)})
    share = np.bincount(codes[bound.rows(0, 0, 0, len(bound))], minlength=10) / len(bound)
    np.testing.assert_allclose(share, 0.1, rtol=0.1)
    # rows of a class are drawn uniformly: the smallest class's rows all come up
    small = np.flatnonzero(codes == 9)
    drawn = bound.rows(0, 0, 0, len(bound))
    assert set(drawn[codes[drawn] == 9].tolist()) == set(small.tolist())


def _chi2_pvalues(weights: np.ndarray, truth: np.ndarray, n: int = 5000) -> list[float]:
    out = []
    for seed in range(20):
        bound = WeightedSampler(weights, num_samples=n).bind(len(weights), {})
        counts = np.bincount(bound.rows(seed, 0, 0, n), minlength=len(weights))
        out.append(stats.chisquare(counts, truth / truth.sum() * n).pvalue)
    return out


def test_weighted_frequencies_match_the_weights() -> None:
    w = np.random.default_rng(3).random(40) ** 2 + 0.05
    assert min(_chi2_pvalues(w, w)) > 0.001
    # the same test fails when the weights are shuffled (it can tell)
    assert min(_chi2_pvalues(np.random.default_rng(4).permutation(w), w)) < 0.001


def test_weights_by_category() -> None:
    codes = np.repeat([0, 1, 2], [100, 300, 600])
    cats = ObsColumn(codes, ("a", "b", "c"))
    bound = WeightedSampler.from_column("ct", {"a": 6.0, "b": 1.0}, default=0.0,
                                        num_samples=60_000).bind(1000, {"ct": cats})
    share = np.bincount(codes[bound.rows(1, 0, 0, 60_000)], minlength=3) / 60_000
    np.testing.assert_allclose(share, [600 / 900, 300 / 900, 0.0], atol=0.01)


def test_without_replacement_draws_each_row_at_most_once_by_weight() -> None:
    w = np.zeros(1000)
    w[:500] = 1.0
    w[:50] = 100.0  # heavy rows come first
    bound = WeightedSampler(w, num_samples=400, replacement=False).bind(1000, {})
    rows = bound.rows(0, 0, 0, 400)
    assert len(np.unique(rows)) == 400
    assert rows.max() < 500
    assert np.isin(np.arange(50), rows[:100]).mean() > 0.9
    with pytest.raises(SamplerError, match="exceeds the 500 rows of positive weight"):
        WeightedSampler(w, num_samples=501, replacement=False).bind(1000, {})


# -- bad input ---------------------------------------------------------------------------

@pytest.mark.parametrize(("make", "match"), [
    (lambda: WeightedSampler([1.0, -1.0]), "finite and >= 0; position 1"),
    (lambda: WeightedSampler([1.0, np.nan]), "finite and >= 0; position 1"),
    (lambda: WeightedSampler([0.0, 0.0]), "all zero"),
    (lambda: WeightedSampler([]), "non-empty 1-D"),
    (lambda: WeightedSampler(["a"]), "non-empty 1-D array of numbers"),
    (lambda: WeightedSampler([1.0], num_samples=0), "num_samples must be an integer >= 1"),
    (lambda: WeightedSampler([1.0], replacement="no"), "replacement must be True or False"),
    (lambda: WeightedSampler.from_column("ct", {}), "non-empty mapping"),
    (lambda: WeightedSampler.from_column("ct", {"a": -2.0}), "category 'a' must be a finite"),
    (lambda: ClassBalancedSampler(""), "obs column name"),
    (lambda: ClassBalancedSampler("ct", num_samples=-3), "num_samples"),
    (lambda: SubsetSampler([1, 2, 2]), "row 2 2 times"),
    (lambda: SubsetSampler([]), "non-empty"),
    (lambda: SubsetSampler([0.5]), "integer row ids"),
])
def test_bad_sampler_arguments_are_refused_with_the_fix(make, match: str) -> None:
    with pytest.raises(SamplerError, match=match):
        make()


@pytest.mark.parametrize(("sampler", "match"), [
    (WeightedSampler([1.0, 2.0]), "hold 2 numbers but the source has 3 rows"),
    (WeightedSampler.from_column("ct", {"x": 1.0}), r"\['x'\] is not a category"),
    (WeightedSampler.from_column("ct", {"a": 1.0}), r"no weight for categories \['b'\]"),
    (WeightedSampler.from_column("ct", {"a": 1.0}, default=0.0, replacement=False,
                                 num_samples=3), "exceeds the 2 rows"),
    (SubsetSampler([0, 3]), r"row 3, outside \[0, 3\)"),
    (WeightedSampler([1.0, 1.0, 0.0], replacement=False), "exceeds the 2 rows"),
])
def test_samplers_that_do_not_fit_the_source_are_refused(sampler: Sampler, match: str) -> None:
    column = ObsColumn(np.array([0, 0, 1]), ("a", "b"))
    with pytest.raises(SamplerError, match=match):
        sampler.bind(3, {"ct": column})


def test_a_class_column_without_values_is_refused() -> None:
    with pytest.raises(SamplerError, match="no row with a value"):
        ClassBalancedSampler("ct").bind(3, {"ct": ObsColumn(np.full(3, -1), ("a",))})
    # weight only on a category without rows (missing values are never drawn)
    column = ObsColumn(np.array([0, 0, -1]), ("a", "b"))
    with pytest.raises(SamplerError, match="every row of obs column 'ct' has weight 0"):
        WeightedSampler.from_column("ct", {"a": 0.0, "b": 1.0}).bind(3, {"ct": column})


class _Bad(Sampler):
    def __init__(self, rows: object, n: int) -> None:
        self.out, self.n = rows, n

    def __len__(self) -> int:
        return self.n

    def epoch_rows(self, seed: int, epoch: int) -> object:
        return self.out


@pytest.mark.parametrize(("rows", "n", "match"), [
    (np.array([0, 5]), 2, r"row 5, outside \[0, 4\)"),
    (np.array([0, 1]), 3, "returned 2 row ids but len"),
    (np.array([0.0, 1.0]), 2, "1-D array of integer row ids"),
    (np.array([], dtype=int), 0, "at least one row"),
])
def test_a_users_sampler_that_breaks_the_protocol_is_named(rows: object, n: int,
                                                          match: str) -> None:
    with pytest.raises(SamplerError, match=match):
        _Bad(rows, n).bind(4, {}).rows(0, 0, 0, 2)


def test_a_users_sampler_gives_its_stream() -> None:
    class Evens(Sampler):
        columns = ("ct",)

        def prepare(self, n_obs, columns):
            self.keep = np.flatnonzero(columns["ct"].codes == 0)

        def __len__(self):
            return len(self.keep)

        def epoch_rows(self, seed, epoch):
            return np.random.default_rng([seed, epoch]).permutation(self.keep)

    bound = Evens().bind(6, {"ct": ObsColumn(np.array([0, 1, 0, 1, 0, 1]), ("a", "b"))})
    got = _batches(bound, 2, 2, world_size=1)[0]
    assert sorted(r for b in got for r in b) == [0, 2, 4]


def test_a_sampler_bound_to_some_rows_draws_from_them_only() -> None:
    codes = np.arange(1000) % 4
    column = {"c": _column(codes, 4)}
    rows = np.flatnonzero(np.arange(1000) % 3 == 0)  # a training split
    for s in (ClassBalancedSampler("c"), WeightedSampler(np.ones(1000)),
              WeightedSampler.from_column("c", {"c0": 1.0}, default=2.0),
              WeightedSampler(np.ones(1000), replacement=False, num_samples=300),
              SubsetSampler(np.arange(0, 1000, 2))):
        bound = s.bind(1000, column, rows=rows)
        drawn = bound.rows(0, 0, 0, len(bound))
        assert set(drawn.tolist()) <= set(rows.tolist()), s
    assert len(ClassBalancedSampler("c").bind(1000, column, rows=rows)) == len(rows)
    sub = SubsetSampler(np.arange(0, 1000, 2)).bind(1000, {}, rows=rows)
    assert sorted(sub.rows(0, 0, 0, len(sub)).tolist()) == list(range(0, 1000, 6))
    with pytest.raises(SamplerError, match="none of its rows is in the training split"):
        SubsetSampler([1, 2]).bind(1000, {}, rows=rows)
    with pytest.raises(SamplerError, match="not among the rows it may draw"):
        _Bad(np.array([0, 1]), 2).bind(1000, {}, rows=rows).rows(0, 0, 0, 2)
    w = np.zeros(1000)
    w[1] = 1.0
    with pytest.raises(SamplerError, match="weights are 0 on every row it may draw"):
        WeightedSampler(w).bind(1000, {}, rows=rows)


def test_huge_and_tiny_weights_draw_by_weight() -> None:
    big = WeightedSampler(np.full(100, 1e308), num_samples=5000).bind(100, {})
    assert len(np.unique(big.rows(0, 0, 0, 5000))) > 90  # not one row (an inf total)
    w = np.zeros(1000)
    w[:5] = 1e-310  # subnormal: log(u) / w would overflow to -inf, like the zero weights
    rows = WeightedSampler(w, num_samples=5, replacement=False).bind(1000, {}).rows(0, 0, 0, 5)
    assert sorted(rows.tolist()) == [0, 1, 2, 3, 4]


def test_a_users_sampler_that_is_not_a_function_of_seed_and_epoch_is_refused() -> None:
    class Unseeded(Sampler):
        def __len__(self) -> int:
            return 50

        def epoch_rows(self, seed: int, epoch: int) -> np.ndarray:
            return np.random.permutation(50)  # noqa: NPY002 - unseeded on purpose

    with pytest.raises(SamplerError, match="gives other rows when asked twice"):
        Unseeded().bind(50, {})


def test_a_users_rows_override_is_held_to_the_training_split() -> None:
    class Everything(Sampler):
        def __len__(self) -> int:
            return 10

        def rows(self, seed: int, epoch: int, start: int, stop: int) -> np.ndarray:
            return np.arange(start, stop)

    bound = Everything().bind(10, {}, rows=np.arange(5))
    with pytest.raises(SamplerError, match="row 5, which is not among the rows it may draw"):
        sampling.sample_rank_items(bound, 10, 10, seed=0, epoch=0)[0]


@pytest.mark.parametrize(("make", "match"), [
    (lambda: WeightedSampler.from_column("ct", {"a": -1.0}),
     "the weight of category 'a' must be a finite number >= 0"),
    (lambda: WeightedSampler.from_column("ct", {"a": 1.0}, default=float("nan")),
     "default must be a finite number >= 0"),
])
def test_bad_category_weights_are_named(make, match: str) -> None:
    with pytest.raises(SamplerError, match=match):
        make()


def test_columns_given_as_a_string_is_refused() -> None:
    class OneColumn(Sampler):
        columns = "cell_type"  # type: ignore[assignment]

        def __len__(self) -> int:
            return 1

    with pytest.raises(SamplerError, match=r"write \('cell_type',\), not 'cell_type'"):
        OneColumn().bind(3, {})


@pytest.mark.parametrize("make", [
    lambda: ClassBalancedSampler("c"),
    lambda: WeightedSampler.from_column("c", {"c0": 1.0, "c1": 3.0}),
    lambda: sampling.PairedSampler("c", "c0"),
    lambda: TorchIndexSampler(torch.utils.data.SequentialSampler(range(8))),
    lambda: MixSampler([0, 4, 8], [0.5, 0.5], batch_size=4, chunk_size=2),
], ids=["class_balanced", "weighted", "paired", "torch", "mix"])
def test_an_unbound_sampler_is_true_and_its_len_says_why_it_is_unknown(make) -> None:  # type: ignore[no-untyped-def]
    """``sampler or default`` keeps the sampler (truth does not ask len()), len() before
    binding names the fix, and the bound copy has its length."""
    s = make()
    assert bool(s)
    assert (s or None) is s
    with pytest.raises(SamplerError, match=r"len\(\) of .*known once the sampler is bound "
                       r"to a source \(pass it to a dataset"):
        len(s)
    bound = s.bind(8, {"c": _column(np.array([0, 1, 0, 1, 0, 1, 0, 1]), 2)})
    assert len(bound) == 8  # (paired: 4 perturbed rows, each drawn with a control)
