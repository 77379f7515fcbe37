"""How mixed an epoch's batches are: the figures of a shuffle-quality report.

Pure numpy, no torch, no I/O: the caller gives each row's class
(an integer code per row, ``0 .. n_classes - 1``) and the rows of each batch, as the plan
deals them. The reference is a *truly random* batch: as many rows drawn without
replacement from the epoch's rows (each class as often as the epoch holds it), so a ratio
of 1 means the batches are as mixed as a perfect shuffle of the same epoch could make them,
whatever the sampler chose to put in the epoch.

* :func:`batch_class_counts`: rows of each class in each batch, ``(n_batches, n_classes)``;
* :func:`entropy`: Shannon entropy (nats) of each row of counts;
* :func:`random_entropy`: mean entropy of random batches of a size (drawn, seeded);
* :func:`presence`: the probability that a random batch of a size holds each class (exact,
  hypergeometric); its sum is the expected number of distinct classes in such a batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["batch_class_counts", "entropy", "random_entropy", "presence", "TAG_DIVERSITY"]

#: Seed tag of the random reference batches: ``default_rng([seed, batch_size, TAG])``.
TAG_DIVERSITY = 0x44495645  # "DIVE"


def batch_class_counts(codes: np.ndarray, batches: Sequence[np.ndarray],
                       n_classes: int) -> np.ndarray:
    """Rows of each class in each batch.

    Parameters
    ----------
    codes
        One class code per row of the source, in ``[0, n_classes)``.
    batches
        Each batch's global row ids (duplicates count as often as they occur).
    n_classes
        Number of classes.

    Returns
    -------
    numpy.ndarray
        int64 ``(len(batches), n_classes)``.
    """
    if not batches:
        return np.zeros((0, n_classes), dtype=np.int64)
    sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
    rows = np.concatenate([np.asarray(b, dtype=np.int64) for b in batches])
    which = np.repeat(np.arange(len(batches), dtype=np.int64), sizes)
    flat = which * n_classes + codes[rows].astype(np.int64, copy=False)
    return np.bincount(flat, minlength=len(batches) * n_classes).reshape(len(batches),
                                                                         n_classes)


def entropy(counts: np.ndarray) -> np.ndarray:
    """Shannon entropy (nats) of each row of ``counts`` (0 for an empty row)."""
    counts = np.atleast_2d(np.asarray(counts, dtype=np.float64))
    totals = counts.sum(axis=1, keepdims=True)
    p = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    logs = np.log(p, out=np.zeros_like(p), where=p > 0)
    return np.maximum(-(p * logs).sum(axis=1), 0.0)  # never -0.0


def random_entropy(population: np.ndarray, batch_size: int, *, n_draws: int = 200,
                   seed: int = 0) -> float:
    """Mean entropy (nats) of ``n_draws`` random batches of ``batch_size`` rows drawn
    without replacement from a population of ``population[k]`` rows of class ``k``
    (seeded by ``(seed, batch_size)``)."""
    population = np.asarray(population, dtype=np.int64)
    total = int(population.sum())
    size = min(int(batch_size), total)
    if size <= 0:
        return 0.0
    rng = np.random.default_rng([int(seed), size, TAG_DIVERSITY])
    draws = rng.multivariate_hypergeometric(population, size, size=int(n_draws),
                                            method="marginals")
    return float(entropy(draws).mean())


def presence(population: np.ndarray, batch_size: int) -> np.ndarray:
    """Probability that a random batch of ``batch_size`` rows, drawn without replacement
    from ``population[k]`` rows of class ``k``, holds class ``k`` (float64, per class)."""
    population = np.asarray(population, dtype=np.int64)
    total = int(population.sum())
    size = min(int(batch_size), total)
    out = np.zeros(len(population), dtype=np.float64)
    base = math.lgamma(total - size + 1.0) - math.lgamma(total + 1.0)
    for k, n in enumerate(population.tolist()):
        rest = total - n  # rows of the other classes
        if n <= 0:
            continue
        if rest < size:  # every batch holds the class
            out[k] = 1.0
            continue
        # P(class k absent) = C(rest, size) / C(total, size)
        log_absent = math.lgamma(rest + 1.0) - math.lgamma(rest - size + 1.0) + base
        out[k] = -math.expm1(min(log_absent, 0.0))
    return out
