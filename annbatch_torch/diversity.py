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
from .errors import SchemaError, check_int
from .read.reader import read_column
from .resume import MAX_EPOCH
from .sampling.diversity import count_batches, presence, random_entropy
from .sampling.plan import ChunkPlan
from .sampling.sampled_plan import SamplePlan
from .store.manifest import FieldInfo
from .store.source import Source

__all__ = ["diversity_report", "report_tables", "DiversityTables", "Classes",
           "column_values", "obs_classes", "report_batches", "MAX_CLASSES"]

logger = logging.getLogger(__name__)

#: what a report's rows are (:func:`diversity_report`'s ``per``)
Per = Literal["column", "batch", "class"]
PER_CHOICES = ("column", "batch", "class")
#: the label of the class of rows whose value is missing (``pandas.isna`` is true of it; no
#: category can be NaN)
MISSING = float("nan")
#: distinct values above which a column is refused (an identifier, not classes)
MAX_CLASSES = 1_000_000


@dataclass(frozen=True)
class Classes:
    """An obs column as classes: one code per row of the source in ``[0, len(labels))``
    (a missing value is a class of its own, labelled NaN, last)."""

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
    return key[4:], info, read_column(source, key).reshape(-1)


def _class_columns(source: Source) -> list[str]:
    return [k[4:] for k, v in source.fields.items() if k.startswith("obs/") and (
        v.kind in ("categorical", "bool") or np.dtype(v.dtype).kind in "iu")]


def obs_classes(source: Source, column: str) -> Classes:
    """Every row's class of obs ``column``, read once: a categorical, integer or bool
    column, or a float column holding whole numbers (a nullable integer column: its
    missing values are NaN).

    Raises
    ------
    SchemaError
        If ``column`` is not such an obs column of ``source`` (the message lists them), or
        holds more than :data:`MAX_CLASSES` distinct values.
    """
    name, info, values = column_values(source, column)
    missing = np.zeros(len(values), dtype=bool)
    if info.kind == "categorical":
        labels: list[Any] = list(source.categories(name))
        codes = values.astype(np.int64, copy=False)
        missing = codes < 0
    else:
        if values.dtype.kind == "f":
            missing = np.isnan(values)
            whole = values[~missing]
            if not np.array_equal(whole, np.round(whole)) or not np.isfinite(whole).all():
                raise SchemaError(
                    f"{source.describe()}: obs column {name!r} holds {info.dtype} values that "
                    "are not whole numbers, not classes (bin it into a categorical column "
                    "first); categorical, integer and bool obs columns are "
                    f"{_class_columns(source)}.")
            values = np.where(missing, 0, values)
        uniq, codes = np.unique(values[~missing] if missing.any() else values,
                                return_inverse=True)
        if missing.any():
            full = np.empty(len(values), dtype=np.int64)
            full[~missing] = codes
            codes = full
        labels = uniq.tolist()
    if len(labels) > MAX_CLASSES:
        raise SchemaError(
            f"{source.describe()}: obs column {name!r} holds {len(labels):,} distinct values, "
            f"more than the report takes ({MAX_CLASSES:,}): an identifier rather than "
            "classes. Report a column of classes (cell type, donor, batch).")
    codes = codes.astype(np.int64, copy=False).reshape(-1)
    if missing.any():
        codes = np.where(missing, len(labels), codes)
        labels.append(MISSING)
    return Classes(name, codes, tuple(labels))


def report_batches(dataset: AnnBatchDataset, n_batches: int | None,
                   epoch: int) -> list[np.ndarray]:
    """The global row ids of the first ``n_batches`` batches (``None``: all) the dataset's
    rank yields of a fresh ``epoch``, in plan order: those a loader with ``num_workers=0``
    yields first (with workers the same batches arrive interleaved). Padding batches
    (``even_batches="pad"``: masked repeats of the epoch's first rows) are left out."""
    items = dataset.epoch_plan.items(epoch, rank=dataset.rank, world_size=dataset.world_size)
    d = dataset.draw_size  # a batch of draws: its first rows (the perturbed rows) counted
    out: list[np.ndarray] = []
    for item in items:
        if item.padding:
            continue
        rows = item.rows
        for b in range(item.batch_start, item.batch_stop):
            if n_batches is not None and len(out) >= n_batches:
                return out
            lo, hi = item.bounds(b)
            out.append(rows[lo:lo + (hi - lo) // d])
    return out


def _epoch_rows(dataset: AnnBatchDataset, epoch: int,
                batches: list[np.ndarray]) -> np.ndarray:
    """Every row the epoch holds (a sampler's draws with their repeats)."""
    plan = dataset.epoch_plan
    if isinstance(plan, SamplePlan):  # (of draws: their first rows)
        return np.asarray(plan.sampler.rows(plan.seed, epoch, 0, len(plan.sampler))
                          )[::dataset.draw_size]
    if isinstance(plan, ChunkPlan):
        return plan.rows()
    return np.concatenate(batches) if batches else np.empty(0, dtype=np.int64)  # pragma: no cover


@dataclass(frozen=True)
class DiversityTables:
    """The three tables of one report (see :func:`diversity_report`'s ``per``)."""

    summary: pd.DataFrame
    batches: pd.DataFrame
    classes: pd.DataFrame


def _column_report(classes: Classes, batches: list[np.ndarray], epoch_rows: np.ndarray,
                   n_random: int, seed: int) -> tuple[dict[str, Any], pd.DataFrame,
                                                        pd.DataFrame]:
    k = len(classes.labels)
    codes = classes.codes
    counts = count_batches(codes, batches, k)
    sizes = counts.sizes
    collection = np.bincount(codes, minlength=k)
    population = np.bincount(codes[epoch_rows], minlength=k)
    h = counts.entropy()
    distinct = counts.distinct()
    by_size = {}
    for s in np.unique(sizes).tolist():
        present = presence(population, s)
        by_size[s] = (random_entropy(population, s, n_draws=n_random, seed=seed),
                      float(present.sum()), present)
    h_random = np.array([by_size[s][0] for s in sizes.tolist()])
    distinct_random = np.array([by_size[s][1] for s in sizes.tolist()])
    n_b = counts.n_batches
    in_random = (sum(by_size[s][2] * int((sizes == s).sum()) for s in by_size) / n_b
                 if n_b else np.full(k, np.nan))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(h_random > 0, h / h_random, np.nan)
    per_batch = pd.DataFrame({
        "rows": sizes, "entropy": h, "random_entropy": h_random, "entropy_ratio": ratio,
        "distinct": distinct, "random_distinct": distinct_random,
    })
    rows = int(sizes.sum())
    per_class = pd.DataFrame({
        "collection_cells": collection,
        "collection_share": collection / max(int(collection.sum()), 1),
        "epoch_share": population / max(int(population.sum()), 1),
        "batch_share": counts.class_rows() / max(rows, 1),
        "batch_share_sd": counts.class_share_sd(),
        "in_batches": counts.class_batches() / n_b if n_b else np.full(k, np.nan),
        "random_in_batches": in_random,
    }, index=pd.Index(list(classes.labels), name="category", dtype=object))
    nan = float("nan")
    h_mean = float(h.mean()) if n_b else nan
    hr_mean = float(h_random.mean()) if n_b else nan
    d_mean = float(distinct.mean()) if n_b else nan
    dr_mean = float(distinct_random.mean()) if n_b else nan
    finite = ratio[np.isfinite(ratio)]
    summary = {
        "batches": n_b, "rows": rows, "classes": int((population > 0).sum()),
        "collection_classes": int((collection > 0).sum()),
        "entropy": h_mean, "random_entropy": hr_mean,
        "entropy_ratio": h_mean / hr_mean if hr_mean > 0 else nan,
        "entropy_ratio_min": float(finite.min()) if finite.size else nan,
        "distinct": d_mean, "random_distinct": dr_mean,
        "distinct_ratio": d_mean / dr_mean if dr_mean > 0 else nan,
        "share_error": float(np.abs(per_class["batch_share"] - per_class["epoch_share"]).sum()
                             / 2) if n_b else nan,
    }
    return summary, per_batch, per_class


def report_tables(dataset: AnnBatchDataset, column: str | Sequence[str],
                  n_batches: int | None = 200, *, epoch: int | None = None,
                  n_random: int = 200) -> DiversityTables:
    """The three tables of :func:`diversity_report` from one pass (the obs columns read,
    the batches planned and the random batches drawn once)."""
    if not isinstance(dataset, AnnBatchDataset):
        raise TypeError("diversity_report takes an AnnBatchDataset (build one over the "
                        f"collection with the settings to judge), got {type(dataset).__name__}.")
    if n_batches is not None:
        n_batches = check_int("n_batches", n_batches, 1, note=" or None (the whole epoch)")
    n_random = check_int("n_random", n_random, 1)
    names = [column] if isinstance(column, str) else list(column)
    if not names:
        raise ValueError("column: give at least one obs column.")
    ep = dataset.epoch if epoch is None else check_int(
        "epoch", epoch, 0, maximum=MAX_EPOCH, maximum_text="2**63 - 1 (an int64)")
    source = dataset.source
    classes = [obs_classes(source, name) for name in names]  # every name checked first
    batches = report_batches(dataset, n_batches, ep)
    epoch_rows = _epoch_rows(dataset, ep, batches)
    logger.debug("diversity report: %d batches of epoch %d, %d epoch rows", len(batches), ep,
                 len(epoch_rows))
    summaries, per_batch, per_class = {}, {}, {}
    for c in classes:
        summaries[c.column], per_batch[c.column], per_class[c.column] = _column_report(
            c, batches, epoch_rows, int(n_random), dataset.seed)
    return DiversityTables(
        pd.DataFrame.from_dict(summaries, orient="index").rename_axis("column"),
        pd.concat(per_batch, names=["column", "batch"]),
        pd.concat(per_class, names=["column", "category"]))


def diversity_report(dataset: AnnBatchDataset, column: str | Sequence[str],
                     n_batches: int | None = 200, *, epoch: int | None = None,
                     per: Per = "column", n_random: int = 200) -> pd.DataFrame:
    """How mixed the dataset's batches are in obs ``column``, against truly random batches.

    Reads the obs columns and the epoch plan only, never ``X``: the batches are those the
    dataset yields (the same rows; chunked or sampling mode, with its ``chunk_size``,
    ``preload_nchunks``, ``batch_size``, seed, split and sampler). A *random batch* holds
    as many rows drawn without replacement from the epoch's rows, so a ratio of 1 means the
    batches are as mixed as a perfect shuffle of the same epoch, whatever the sampler put
    in it; the class shares show what the sampler put in it. With a
    :class:`~annbatch_torch.PairedSampler` the perturbed rows of each batch are counted
    (not their controls).

    Parameters
    ----------
    dataset
        An :class:`~annbatch_torch.AnnBatchDataset`; its rank and world size are used.
    column
        An obs column of classes, e.g. ``"cell_type"``: categorical, integer or bool (or
        float holding whole numbers, as a nullable integer column is stored), or several
        (``["cell_type", "donor"]``), each reported on the same batches. A missing value
        counts as a class of its own (labelled NaN: ``pandas.isna(label)``).
    n_batches
        The rank's first ``n_batches`` batches of the epoch in plan order (those a loader
        with ``num_workers=0`` yields first; with workers the same batches arrive
        interleaved); ``None``: the whole epoch. Always a fresh epoch: a resume state loaded
        into the dataset is not applied. Padding batches (``even_batches="pad"``) are left
        out.
    epoch
        The epoch (default: the dataset's, :meth:`~annbatch_torch.AnnBatchDataset.set_epoch`).
    per
        What a row of the result is:

        * ``"column"`` (default): one row per column: ``batches``, ``rows``, ``classes``
          (classes the epoch holds; a sampler may leave some out), ``collection_classes``
          (those the collection holds), ``entropy`` and ``random_entropy`` (mean per-batch
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
        If a column is not an obs column of classes (the message lists those the source
        has), or holds more than a million distinct values (an identifier).
    ValueError
        If ``per``, ``n_batches``, ``epoch`` or ``n_random`` is not one the function takes.

    Examples
    --------
    >>> ds = abt.AnnBatchDataset("store/", batch_size=4096, chunk_size=256)  # doctest: +SKIP
    >>> abt.diversity_report(ds, "cell_type")["entropy_ratio"]  # doctest: +SKIP
    """
    if per not in PER_CHOICES:
        raise ValueError(f"per must be one of {list(PER_CHOICES)}, got {per!r}.")
    tables = report_tables(dataset, column, n_batches, epoch=epoch, n_random=n_random)
    return {"column": tables.summary, "batch": tables.batches, "class": tables.classes}[per]
