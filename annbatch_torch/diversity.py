"""The shuffle-quality report: how mixed a dataset's batches are, read from obs only.

:func:`diversity_report` asks the dataset's epoch plan which rows each batch holds (the
plan is pure integers: nothing of ``X`` is read), reads the obs columns asked for once,
and compares each batch with truly random batches of the same epoch
(:mod:`~annbatch_torch.sampling.diversity`). ``annbatch-torch diversity`` prints it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd

from .annbatch_dataset import AnnBatchDataset
from .errors import SchemaError
from .read.reader import PoolReader
from .sampling.diversity import batch_class_counts, entropy, presence, random_entropy
from .sampling.plan import ChunkPlan
from .sampling.sampled_plan import SamplePlan
from .store.manifest import FieldInfo
from .store.source import Source

__all__ = ["diversity_report", "Classes", "column_values", "obs_classes", "report_batches"]

logger = logging.getLogger(__name__)

#: what a report's rows are (:func:`diversity_report`'s ``per``)
Per = Literal["column", "batch", "class"]
PER_CHOICES = ("column", "batch", "class")
#: label of the class of rows whose value is missing
MISSING = "NaN"


@dataclass(frozen=True)
class Classes:
    """An obs column as classes: one code per row of the source in ``[0, len(labels))``
    (a missing value is a class of its own, labelled ``"NaN"``, last)."""

    column: str
    codes: np.ndarray
    labels: tuple[Any, ...]


def column_values(source: Source, column: str) -> tuple[str, FieldInfo, np.ndarray]:
    """``(name, schema, values)`` of obs ``column`` (``"cell_type"`` or
    ``"obs/cell_type"``), every row read once (a categorical's global codes, ``-1``:
    missing).

    Raises
    ------
    SchemaError
        If ``column`` is not an obs column of ``source`` (the message lists them).
    """
    if not isinstance(column, str) or not column:
        raise SchemaError(f"{source.describe()}: obs column names are strings, got "
                          f"{column!r}.")
    key = column if column.startswith("obs/") else f"obs/{column}"
    info = source.fields.get(key)
    if info is None:
        why = f" ({source.unavailable[key]})" if key in source.unavailable else ""
        known = [k[4:] for k in source.fields if k.startswith("obs/")]
        raise SchemaError(f"{source.describe()}: {key[4:]!r} is not an obs column{why}; "
                          f"obs columns are {known}.")
    reader = PoolReader(source, [key], threads=1)
    try:
        values = np.asarray(reader.read(np.array([[0, source.n_obs]], dtype=np.int64))[key])
    finally:
        reader.close()
    return key[4:], info, values.reshape(-1)


def _is_class_column(info: FieldInfo) -> bool:
    return info.kind in ("categorical", "bool") or np.dtype(info.dtype).kind in "iu"


def obs_classes(source: Source, column: str) -> Classes:
    """Every row's class of obs ``column`` (categorical, integer or bool), read once.

    Raises
    ------
    SchemaError
        If ``column`` is not such an obs column of ``source`` (the message lists them).
    """
    key = column if isinstance(column, str) and column.startswith("obs/") else f"obs/{column}"
    info = source.fields.get(key)
    if info is not None and not _is_class_column(info):
        usable = [k[4:] for k, v in source.fields.items()
                  if k.startswith("obs/") and _is_class_column(v)]
        raise SchemaError(f"{source.describe()}: obs column {key[4:]!r} holds {info.dtype} "
                          "values, not classes (bin it into a categorical column first); "
                          f"categorical, integer and bool obs columns are {usable}.")
    name, info, values = column_values(source, column)
    if info.kind == "categorical":
        labels: list[Any] = list(source.categories(name))
        codes = values.astype(np.int64, copy=False)
        if codes.size and int(codes.min()) < 0:
            codes = np.where(codes < 0, len(labels), codes)
            labels.append(MISSING)
    else:
        uniq, codes = np.unique(values, return_inverse=True)
        labels = uniq.tolist()
    return Classes(name, codes.astype(np.int64, copy=False).reshape(-1), tuple(labels))


def report_batches(dataset: AnnBatchDataset, n_batches: int | None,
                   epoch: int) -> list[np.ndarray]:
    """The global row ids of the first ``n_batches`` batches (``None``: all) the dataset's
    rank yields of ``epoch``, in plan order: those a loader with ``num_workers=0`` yields
    first (with workers the same batches arrive interleaved)."""
    items = dataset.epoch_plan.items(epoch, rank=dataset.rank, world_size=dataset.world_size)
    out: list[np.ndarray] = []
    for item in items:
        rows = item.rows
        for b in range(item.batch_start, item.batch_stop):
            if n_batches is not None and len(out) >= n_batches:
                return out
            lo, hi = item.bounds(b)
            out.append(rows[lo:hi])
    return out


def _epoch_rows(dataset: AnnBatchDataset, epoch: int,
                batches: list[np.ndarray]) -> np.ndarray:
    """Every row the epoch holds (a sampler's draws with their repeats)."""
    plan = dataset.epoch_plan
    if isinstance(plan, SamplePlan):
        return np.asarray(plan.sampler.rows(plan.seed, epoch, 0, len(plan.sampler)))
    if isinstance(plan, ChunkPlan):
        return plan.rows()
    return np.concatenate(batches) if batches else np.empty(0, dtype=np.int64)  # pragma: no cover


def _column_report(classes: Classes, batches: list[np.ndarray], epoch_rows: np.ndarray,
                   n_random: int, seed: int) -> tuple[dict[str, Any], pd.DataFrame,
                                                        pd.DataFrame]:
    k = len(classes.labels)
    codes = classes.codes
    counts = batch_class_counts(codes, batches, k)
    sizes = counts.sum(axis=1)
    collection = np.bincount(codes, minlength=k)
    population = np.bincount(codes[epoch_rows], minlength=k)
    h = entropy(counts)
    by_size = {int(s): (random_entropy(population, int(s), n_draws=n_random, seed=seed),
                        presence(population, int(s))) for s in np.unique(sizes)}
    h_random = np.array([by_size[int(s)][0] for s in sizes])
    present = np.array([by_size[int(s)][1] for s in sizes]).reshape(len(sizes), k)
    distinct = (counts > 0).sum(axis=1)
    distinct_random = present.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(h_random > 0, h / h_random, np.nan)
    per_batch = pd.DataFrame({
        "rows": sizes, "entropy": h, "random_entropy": h_random, "entropy_ratio": ratio,
        "distinct": distinct, "random_distinct": distinct_random,
    })
    n_b = len(batches)
    rows = int(sizes.sum())
    with np.errstate(divide="ignore", invalid="ignore"):
        shares = np.where(sizes[:, None] > 0, counts / sizes[:, None], 0.0)
        per_class = pd.DataFrame({
            "collection_cells": collection,
            "collection_share": collection / max(int(collection.sum()), 1),
            "epoch_share": population / max(int(population.sum()), 1),
            "batch_share": counts.sum(axis=0) / max(rows, 1),
            "batch_share_sd": shares.std(axis=0) if n_b else np.full(k, np.nan),
            "in_batches": (counts > 0).mean(axis=0) if n_b else np.full(k, np.nan),
            "random_in_batches": present.mean(axis=0) if n_b else np.full(k, np.nan),
        }, index=pd.Index(list(classes.labels), name="category", dtype=object))
    h_mean = float(h.mean()) if n_b else float("nan")
    hr_mean = float(h_random.mean()) if n_b else float("nan")
    d_mean = float(distinct.mean()) if n_b else float("nan")
    dr_mean = float(distinct_random.mean()) if n_b else float("nan")
    summary = {
        "batches": n_b, "rows": rows, "classes": int((population > 0).sum()),
        "entropy": h_mean, "random_entropy": hr_mean,
        "entropy_ratio": h_mean / hr_mean if hr_mean > 0 else float("nan"),
        "entropy_ratio_min": float(np.nanmin(ratio)) if n_b and np.isfinite(ratio).any()
        else float("nan"),
        "distinct": d_mean, "random_distinct": dr_mean,
        "distinct_ratio": d_mean / dr_mean if dr_mean > 0 else float("nan"),
        "share_error": float(np.abs(per_class["batch_share"] - per_class["epoch_share"]).sum()
                             / 2) if n_b else float("nan"),
    }
    return summary, per_batch, per_class


def diversity_report(dataset: AnnBatchDataset, column: str | Sequence[str],
                     n_batches: int | None = 200, *, epoch: int | None = None,
                     per: Per = "column", n_random: int = 200) -> pd.DataFrame:
    """How mixed the dataset's batches are in obs ``column``, against truly random batches.

    Reads the obs columns and the epoch plan only, never ``X``: the batches are those the
    dataset yields (the same rows; chunked or sampling mode, with its ``chunk_size``,
    ``preload_nchunks``, ``batch_size``, seed, split and sampler). A *random batch* holds
    as many rows drawn without replacement from the epoch's rows, so a ratio of 1 means the
    batches are as mixed as a perfect shuffle of the same epoch, whatever the sampler put
    in it; the class shares show what the sampler put in it.

    Parameters
    ----------
    dataset
        An :class:`~annbatch_torch.AnnBatchDataset`; its rank and world size are used.
    column
        A categorical (or integer or bool) obs column, e.g. ``"cell_type"``, or several
        (``["cell_type", "donor"]``): each is reported on the same batches. A missing value
        counts as a class of its own (``"NaN"``).
    n_batches
        The rank's first ``n_batches`` batches of the epoch in plan order (those a loader
        with ``num_workers=0`` yields first); ``None``: the whole epoch.
    epoch
        The epoch (default: the dataset's, :meth:`~annbatch_torch.AnnBatchDataset.set_epoch`).
    per
        What a row of the result is:

        * ``"column"`` (default): one row per column: ``batches``, ``rows``, ``classes``
          (classes the epoch holds), ``entropy`` and ``random_entropy`` (mean per-batch
          Shannon entropy, nats, of the batches and of random batches),
          ``entropy_ratio`` (their quotient: 1 is a perfect shuffle),
          ``entropy_ratio_min`` (the least mixed batch's), ``distinct`` and
          ``random_distinct`` (mean classes per batch, random: the exact expectation),
          ``distinct_ratio`` and ``share_error`` (total variation distance between the
          classes' shares in the batches and in the epoch: 0 when every class appears in
          the batches as often as in the epoch).
        * ``"batch"``: one row per (column, batch): ``rows``, ``entropy``,
          ``random_entropy``, ``entropy_ratio``, ``distinct``, ``random_distinct``.
        * ``"class"``: one row per (column, category): ``collection_cells``,
          ``collection_share``, ``epoch_share`` (share among the epoch's rows: what the
          sampler aims at), ``batch_share`` (among the report's batches),
          ``batch_share_sd`` (its spread over batches), ``in_batches`` (fraction of
          batches holding the class) and ``random_in_batches`` (the same for random
          batches, exact).
    n_random
        Random batches drawn per batch size for ``random_entropy`` (seeded by the
        dataset's seed: the report is reproducible).

    Returns
    -------
    pandas.DataFrame
        Indexed by ``column`` (``per="column"``), ``(column, batch)`` or
        ``(column, category)``.

    Raises
    ------
    SchemaError
        If a column is not a categorical, integer or bool obs column (the message lists
        those the source has).
    ValueError
        If ``per``, ``n_batches`` or ``n_random`` is not one the function takes.

    Examples
    --------
    >>> ds = abt.AnnBatchDataset("store/", batch_size=4096, chunk_size=256)  # doctest: +SKIP
    >>> abt.diversity_report(ds, "cell_type")["entropy_ratio"]  # doctest: +SKIP
    """
    if not isinstance(dataset, AnnBatchDataset):
        raise TypeError("diversity_report takes an AnnBatchDataset (build one over the "
                        f"collection with the settings to judge), got {type(dataset).__name__}.")
    if per not in PER_CHOICES:
        raise ValueError(f"per must be one of {list(PER_CHOICES)}, got {per!r}.")
    if n_batches is not None and (isinstance(n_batches, bool) or not isinstance(
            n_batches, int | np.integer) or n_batches < 1):
        raise ValueError(f"n_batches must be an integer >= 1 or None (the whole epoch), got "
                         f"{n_batches!r}.")
    if isinstance(n_random, bool) or not isinstance(n_random, int | np.integer) or n_random < 1:
        raise ValueError(f"n_random must be an integer >= 1, got {n_random!r}.")
    names = [column] if isinstance(column, str) else list(column)
    if not names:
        raise ValueError("column: give at least one obs column.")
    source = dataset.source
    classes = [obs_classes(source, name) for name in names]  # every name checked first
    ep = dataset.epoch if epoch is None else int(epoch)
    batches = report_batches(dataset, n_batches, ep)
    epoch_rows = _epoch_rows(dataset, ep, batches)
    logger.debug("diversity_report: %d batches of epoch %d, %d epoch rows", len(batches), ep,
                 len(epoch_rows))
    summaries, per_batch, per_class = {}, {}, {}
    for c in classes:
        summaries[c.column], per_batch[c.column], per_class[c.column] = _column_report(
            c, batches, epoch_rows, int(n_random), dataset.seed)
    if per == "column":
        return pd.DataFrame.from_dict(summaries, orient="index").rename_axis("column")
    parts = per_batch if per == "batch" else per_class
    out = pd.concat(parts, names=["column", "batch" if per == "batch" else "category"])
    return out
