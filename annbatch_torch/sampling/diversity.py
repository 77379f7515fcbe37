"""How mixed an epoch's batches are: the figures of a shuffle-quality report.

Pure numpy, no torch, no I/O: the caller gives each row's class (an integer code per row,
``0 .. n_classes - 1``) and the rows of each batch, as the plan deals them. The reference
is a *truly random* batch: as many rows drawn without replacement from the epoch's rows
(each class as often as the epoch holds it), so a ratio of 1 means the batches are as
mixed as a perfect shuffle of the same epoch could make them, whatever the sampler chose
to put in the epoch.

Every figure costs time and memory in the rows counted and the classes, never their
product: a batch's classes are counted as (batch, class, rows) triples of the classes it
holds.

* :func:`count_batches` -> :class:`BatchCounts`: rows of each class in each batch, with
  per-batch entropy and distinct classes and per-class totals;
* :func:`entropy`: Shannon entropy (nats) of each row of a dense count matrix;
* :func:`random_entropy`: mean entropy of random batches of a size (drawn, seeded);
* :func:`presence`: the exact probability that a random batch of a size holds each class
  (hypergeometric); its sum is the expected number of distinct classes in such a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["BatchCounts", "count_batches", "entropy", "random_entropy", "presence",
           "TAG_DIVERSITY"]

#: Seed tag of the random reference batches: ``default_rng([seed, batch_size, TAG])``.
TAG_DIVERSITY = 0x44495645  # "DIVE"


def _sparse_entropy(group: np.ndarray, count: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Entropy (nats) of each group from its (group, count) entries; 0 for an empty group."""
    p = count / np.maximum(totals[group], 1)
    h = -np.bincount(group, weights=p * np.log(p), minlength=len(totals))
    return np.maximum(h, 0.0)  # never -0.0


@dataclass(frozen=True)
class BatchCounts:
    """Rows of each class in each batch, as the (batch, class, rows) entries of the classes
    a batch holds (``batch`` ascending, ``cls`` ascending inside a batch)."""

    batch: np.ndarray
    cls: np.ndarray
    count: np.ndarray
    #: rows of each batch
    sizes: np.ndarray
    n_classes: int

    @property
    def n_batches(self) -> int:
        return len(self.sizes)

    def entropy(self) -> np.ndarray:
        """Shannon entropy (nats) of each batch's classes."""
        return _sparse_entropy(self.batch, self.count, self.sizes)

    def distinct(self) -> np.ndarray:
        """Classes each batch holds."""
        return np.bincount(self.batch, minlength=self.n_batches)

    def class_rows(self) -> np.ndarray:
        """Rows of each class over all batches."""
        return np.bincount(self.cls, weights=self.count,
                           minlength=self.n_classes).astype(np.int64)

    def class_batches(self) -> np.ndarray:
        """Batches holding each class."""
        return np.bincount(self.cls, minlength=self.n_classes)

    def class_share_sd(self) -> np.ndarray:
        """Standard deviation over batches of each class's share of a batch's rows."""
        if not self.n_batches:
            return np.full(self.n_classes, np.nan)
        share = self.count / np.maximum(self.sizes[self.batch], 1)
        mean = np.bincount(self.cls, weights=share, minlength=self.n_classes) / self.n_batches
        sq = np.bincount(self.cls, weights=share**2, minlength=self.n_classes) / self.n_batches
        return np.sqrt(np.maximum(sq - mean**2, 0.0))

    def dense(self) -> np.ndarray:
        """The ``(n_batches, n_classes)`` int64 matrix (for small reports and tests)."""
        out = np.zeros((self.n_batches, self.n_classes), dtype=np.int64)
        out[self.batch, self.cls] = self.count
        return out


def count_batches(codes: np.ndarray, batches: Sequence[np.ndarray],
                  n_classes: int) -> BatchCounts:
    """Rows of each class in each batch.

    Parameters
    ----------
    codes
        One class code per row of the source, in ``[0, n_classes)``.
    batches
        Each batch's global row ids (duplicates count as often as they occur).
    n_classes
        Number of classes.
    """
    sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
    if not int(sizes.sum()):
        empty = np.zeros(0, dtype=np.int64)
        return BatchCounts(empty, empty, empty, sizes, int(n_classes))
    rows = np.concatenate([np.asarray(b, dtype=np.int64) for b in batches])
    which = np.repeat(np.arange(len(batches), dtype=np.int64), sizes)
    keys, count = np.unique(which * n_classes + codes[rows].astype(np.int64, copy=False),
                            return_counts=True)
    return BatchCounts(keys // n_classes, keys % n_classes, count.astype(np.int64), sizes,
                       int(n_classes))


def entropy(counts: np.ndarray) -> np.ndarray:
    """Shannon entropy (nats) of each row of the dense matrix ``counts`` (0 for an empty
    row)."""
    counts = np.atleast_2d(np.asarray(counts, dtype=np.float64))
    totals = counts.sum(axis=1, keepdims=True)
    p = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    logs = np.log(p, out=np.zeros_like(p), where=p > 0)
    return np.maximum(-(p * logs).sum(axis=1), 0.0)  # never -0.0


def random_entropy(population: np.ndarray, batch_size: int, *, n_draws: int = 200,
                   seed: int = 0) -> float:
    """Mean entropy (nats) of ``n_draws`` random batches of ``batch_size`` rows drawn
    without replacement from a population of ``population[k]`` rows of class ``k``
    (seeded by ``(seed, batch_size)``; the rows drawn, then their classes looked up:
    the cost is in the rows drawn, not the classes)."""
    population = np.asarray(population, dtype=np.int64)
    total = int(population.sum())
    size = min(int(batch_size), total)
    if size <= 0:
        return 0.0
    rng = np.random.default_rng([int(seed), size, TAG_DIVERSITY])
    ends = np.cumsum(population)
    k = len(population)
    keys = np.concatenate([
        d * k + np.searchsorted(ends, rng.choice(total, size, replace=False), side="right")
        for d in range(int(n_draws))])
    keys, count = np.unique(keys, return_counts=True)
    totals = np.full(int(n_draws), size, dtype=np.int64)
    return float(_sparse_entropy(keys // k, count, totals).mean())


def presence(population: np.ndarray, batch_size: int) -> np.ndarray:
    """Probability that a random batch of ``batch_size`` rows, drawn without replacement
    from ``population[k]`` rows of class ``k``, holds class ``k`` (float64, per class).

    ``P(absent) = C(N - n, B) / C(N, B) = prod_{i < n} (1 - B / (N - i))`` (or the same with
    ``n`` and ``B`` swapped), summed as logarithms over ``min(n, B)`` terms: exact to float
    precision at any ``N``."""
    population = np.asarray(population, dtype=np.int64)
    total = int(population.sum())
    size = min(int(batch_size), total)
    out = np.zeros(len(population), dtype=np.float64)
    if size <= 0:
        return out
    i = np.arange(size, dtype=np.float64)
    left = (total - i).astype(np.float64)  # N - i, i < B
    with np.errstate(divide="ignore", invalid="ignore"):
        # classes of n <= B: prod_{i < n} (1 - B / (N - i)), a prefix of one cumulative sum
        terms = np.log1p(-np.minimum(size / left, 1.0))
    prefix = np.concatenate([[0.0], np.cumsum(terms)])
    small = (population > 0) & (population <= size)
    log_absent = np.zeros(len(population))
    log_absent[small] = prefix[population[small]]
    for k in np.flatnonzero(population > size).tolist():  # n > B: prod_{i < B} (1 - n/(N-i))
        with np.errstate(divide="ignore", invalid="ignore"):
            log_absent[k] = np.log1p(-np.minimum(population[k] / left, 1.0)).sum()
    present = population > 0
    out[present] = -np.expm1(log_absent[present])
    return out
