"""What scvi-tools' ``setup_anndata`` would register, resolved against a collection.

:class:`ScviSetup` checks the keys a user gives (``layer``, ``batch_key``, ``labels_key``,
covariates, ``size_factor_key``) against a :class:`~annbatch_torch.Source`, builds the
category mappings from the source's global categories (codes are stable across shards, so
one table maps every shard's codes), the selector that reads those fields, and the
registry dict scvi-tools models take as ``registry=`` (``setup_method_name``
``"setup_datamodule"``). The mappings follow scvi-tools' own fields for the model named:
``"SCVI"`` registers labels as ``CategoricalObsField`` does (the categories as they are),
``"SCANVI"`` as ``LabelsWithUnlabeledObsField`` does (the unlabeled category swapped to
the last code, or appended).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

import annbatch_torch as abt
from annbatch_torch import A

__all__ = ["MODELS", "ScviSetup"]

logger = logging.getLogger(__name__)

#: the scvi-tools models whose registry flavour this module builds
MODELS = ("SCVI", "SCANVI")
#: rows read to check that the registered X holds counts
COUNTS_PROBE_ROWS = 2048


def _codes_of(batch: dict[str, Any]) -> dict[str, Any]:
    return batch


def read_codes(source: abt.Source, keys: Sequence[str]) -> dict[str, np.ndarray]:
    """Every row's global category code (``-1``: missing) of categorical obs ``keys``,
    in row order, read through an in-order :class:`~annbatch_torch.AnnBatchDataset`."""
    if not keys:
        return {}
    step = 2**16
    ds = abt.AnnBatchDataset(source, selector={k: A.obs[k] for k in keys}, batch_size=step,
                             chunk_size=step, preload_nchunks=1, shuffle=False, rank=0,
                             world_size=1, batch_converter=_codes_of, prefetch=False)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    for batch in ds:
        for k in keys:
            parts[k].append(np.asarray(batch[k]))
    return {k: (np.concatenate(v) if v else np.zeros(0, np.int64)) for k, v in parts.items()}


def _keys(value: Any, arg: str) -> tuple[str, ...]:
    """Covariate keys as a tuple; one column name alone counts as one key."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    keys = tuple(value)
    bad = [k for k in keys if not isinstance(k, str)]
    if bad:
        raise TypeError(f"{arg} must be obs column names, got {bad!r}.")
    return keys


@dataclass(frozen=True)
class LabelMapping:
    """scvi-tools' label codes: ``mapping[code]`` is the label; ``lut[global_code + 1]``
    the scvi code of a source code (``lut[0]``: of a missing value, ``-1`` if refused)."""

    mapping: np.ndarray
    lut: np.ndarray
    unlabeled_code: int | None


def label_mapping(categories: Sequence[Any], model_name: str, unlabeled_category: Any,
                  unlabeled_present: bool = True) -> LabelMapping:
    """The labels' mapping scvi-tools registers for ``model_name`` (see the module doc).

    ``unlabeled_present``: whether a cell carries ``unlabeled_category`` (or a missing
    label); as in scvi-tools, the unlabeled category is swapped with the last only then,
    kept where it is when it is a category no cell has, and appended when it is none.
    """
    cats = list(categories)
    if model_name == "SCANVI":
        order = list(range(len(cats)))
        if unlabeled_category in cats and unlabeled_present:  # scvi swaps it with the last
            i = cats.index(unlabeled_category)
            order[i], order[-1] = order[-1], order[i]
            mapping = [cats[j] for j in order]
        elif unlabeled_category in cats:
            mapping = list(cats)
        else:
            mapping = [*cats, unlabeled_category]
        unlabeled = mapping.index(unlabeled_category)
        position = {j: p for p, j in enumerate(order)}
        lut = np.array([unlabeled] + [position[j] for j in range(len(cats))], dtype=np.int64)
        return LabelMapping(np.array(mapping, dtype=object), lut, unlabeled)
    lut = np.array([-1, *range(len(cats))], dtype=np.int64)
    return LabelMapping(np.array(cats, dtype=object), lut, None)


@dataclass
class ScviSetup:
    """The fields of one scvi-tools setup over ``source`` (see the module doc).

    Raises :class:`~annbatch_torch.SchemaError` naming the argument, the field and the fix
    for a key that is missing or of the wrong kind, and for missing values in
    ``batch_key`` or a categorical covariate (scvi-tools refuses them too).
    """

    source: abt.Source
    model_name: str = "SCVI"
    layer: str | None = None
    batch_key: str | None = None
    labels_key: str | None = None
    unlabeled_category: Any = "Unknown"
    categorical_covariate_keys: tuple[str, ...] = ()
    continuous_covariate_keys: tuple[str, ...] = ()
    size_factor_key: str | None = None
    var_names: Sequence[str] | None = None
    check_counts: bool = True
    categories: dict[str, list[Any]] = field(init=False, default_factory=dict)
    labels: LabelMapping = field(init=False)
    #: SCANVI: every cell's global label code (read once at construction)
    label_codes: np.ndarray | None = field(init=False, default=None)
    #: whether a cell is unlabeled (SCANVI's classifier then has one class fewer)
    unlabeled_present: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.model_name not in MODELS:
            raise ValueError(f"model_name must be one of {list(MODELS)}, got "
                             f"{self.model_name!r}.")
        if self.model_name == "SCANVI" and self.labels_key is None:
            raise ValueError("model_name='SCANVI' needs labels_key: the obs column of cell "
                             f"labels, with {self.unlabeled_category!r} (unlabeled_category) "
                             "or a missing value for the cells to label.")
        self.categorical_covariate_keys = _keys(self.categorical_covariate_keys,
                                                "categorical_covariate_keys")
        self.continuous_covariate_keys = _keys(self.continuous_covariate_keys,
                                               "continuous_covariate_keys")
        where = self.source.describe()
        x_field = self.x_field
        info = self._field(x_field, "layer" if self.layer is not None else "X")
        if info.kind not in ("csr", "dense"):
            raise abt.SchemaError(f"{where}: {x_field!r} is not a matrix ({info.kind}).")
        for arg, key in self._categorical_args():
            self.categories[key] = self._categories(arg, key)
        for arg, key in self._numeric_args():
            kind = self._field(f"obs/{key}", arg).kind
            if kind not in ("numeric", "bool"):
                raise abt.SchemaError(
                    f"{where}: {arg}={key!r} must name a numeric obs column, but {key!r} is "
                    f"{kind}; pass it as a categorical_covariate_keys entry instead, or "
                    "write the collection with the numeric column.")
        present = True
        # one pass over the rows for every categorical key (labels and the missing checks)
        codes = read_codes(self.source, list(dict.fromkeys(k for _, k in
                                                           self._categorical_args())))
        if self.model_name == "SCANVI" and self.labels_key is not None:
            self.label_codes = codes[self.labels_key]
            cats = self.categories[self.labels_key]
            code = cats.index(self.unlabeled_category) if (
                self.unlabeled_category in cats) else None
            present = bool((self.label_codes < 0).any()) or (
                code is not None and bool((self.label_codes == code).any()))
        self.labels = label_mapping(self.categories.get(self.labels_key, [0]) if
                                    self.labels_key else [0], self.model_name,
                                    self.unlabeled_category, present)
        self.unlabeled_present = present and self.model_name == "SCANVI"
        self._check_missing(codes)
        del codes
        if self.check_counts:
            self._check_counts()

    # -- resolving -----------------------------------------------------------------------
    @property
    def x_field(self) -> str:
        return "X" if self.layer is None else f"layers/{self.layer}"

    def _field(self, name: str, arg: str) -> Any:
        try:
            return self.source.check_field(name)
        except abt.SchemaError as e:
            what = f"layer={self.layer!r}" if name.startswith("layers/") else (
                f"{arg}={name.partition('/')[2]!r}" if name.startswith("obs/") else arg)
            fix = ("write the collection with that layer (create_anndata_collection(..., "
                   "layers=[...]))" if name.startswith("layers/") else
                   "write the collection with that obs column (obs_columns=[...]) or choose "
                   "another")
            raise abt.SchemaError(f"{what}: {e} Fix: {fix}.") from None

    def _categorical_args(self) -> list[tuple[str, str]]:
        out = [(a, k) for a, k in (("batch_key", self.batch_key),
                                   ("labels_key", self.labels_key)) if k is not None]
        out += [("categorical_covariate_keys", k) for k in self.categorical_covariate_keys]
        return out

    def _numeric_args(self) -> list[tuple[str, str]]:
        out = [("continuous_covariate_keys", k) for k in self.continuous_covariate_keys]
        if self.size_factor_key is not None:
            out.append(("size_factor_key", self.size_factor_key))
        return out

    def _categories(self, arg: str, key: str) -> list[Any]:
        info = self._field(f"obs/{key}", arg)
        if info.kind != "categorical":
            raise abt.SchemaError(
                f"{self.source.describe()}: {arg}={key!r} must name a categorical obs column, "
                f"but {key!r} is {info.kind}; make it categorical in the inputs "
                "(adata.obs[key] = adata.obs[key].astype('category')) and rewrite the "
                "collection, or pass a numeric column as continuous_covariate_keys.")
        return list(self.source.categories(key))

    def _check_missing(self, all_codes: dict[str, np.ndarray]) -> None:
        """Refuse missing values of every categorical key (``all_codes``: each key's codes)
        but SCANVI's labels, where a missing label means unlabeled."""
        keys = [k for a, k in self._categorical_args()
                if not (a == "labels_key" and self.model_name == "SCANVI")]
        for key in dict.fromkeys(keys):
            codes = all_codes[key]
            n_missing = int((codes < 0).sum())
            if n_missing:
                arg = "batch_key" if key == self.batch_key else (
                    "labels_key" if key == self.labels_key else "categorical_covariate_keys")
                rows = np.flatnonzero(codes < 0)[:5].tolist()
                raise abt.SchemaError(
                    f"{self.source.describe()}: {arg}={key!r} has {n_missing} cell(s) with a "
                    f"missing value (rows {rows}...); scvi-tools needs a category for every "
                    "cell. Fill them in the inputs (e.g. adata.obs[key] = adata.obs[key]"
                    ".cat.add_categories('unknown').fillna('unknown'); then rewrite the "
                    "collection, if it is one)" + (
                        ", or train SCANVI, which treats them as unlabeled."
                        if arg == "labels_key" else "."))

    def _check_counts(self) -> None:
        n = min(self.source.n_obs, COUNTS_PROBE_ROWS)
        if n == 0:
            return
        ds = abt.AnnBatchDataset(self.source, selector={"X": self.x_field}, batch_size=n,
                                 chunk_size=n, preload_nchunks=1, shuffle=False, rank=0,
                                 world_size=1, batch_converter=_codes_of, prefetch=False)
        x = next(iter(ds))["X"]
        values = np.asarray(x.data if hasattr(x, "data") and not isinstance(x, np.ndarray)
                            else x)
        if values.size and (np.any(values < 0) or np.any(values != np.round(values))):
            warnings.warn(
                f"{self.source.describe()}: {self.x_field!r} does not look like raw counts (its "
                f"first {n} rows hold negative or non-integer values); scvi-tools models "
                "expect unnormalised counts. Pass layer= naming the counts layer.",
                UserWarning, stacklevel=4)

    # -- what scvi-tools reads -------------------------------------------------------------
    @property
    def n_vars(self) -> int:
        return len(self.var_names) if self.var_names is not None else self.source.n_vars

    @property
    def column_names(self) -> np.ndarray:
        names = self.var_names if self.var_names is not None else self.source.var_names
        return np.asarray([str(v) for v in names], dtype=object)

    @property
    def n_batch(self) -> int:
        return len(self.categories[self.batch_key]) if self.batch_key else 1

    @property
    def n_labels(self) -> int:
        return len(self.labels.mapping)

    @property
    def batch_mapping(self) -> np.ndarray:
        if self.batch_key is None:
            return np.array([0])
        return np.array(self.categories[self.batch_key], dtype=object)

    def selector(self) -> dict[str, Any]:
        """The fields the batches read, keyed as :class:`~.batches.ScviBatchConverter`
        expects them."""
        sel: dict[str, Any] = {"X": self.x_field}
        if self.batch_key is not None:
            sel["batch"] = A.obs[self.batch_key]
        if self.labels_key is not None:
            sel["labels"] = A.obs[self.labels_key]
        for k in self.categorical_covariate_keys:
            sel[f"cat:{k}"] = A.obs[k]
        for k in self.continuous_covariate_keys:
            sel[f"cont:{k}"] = A.obs[k]
        if self.size_factor_key is not None:
            sel["size_factor"] = A.obs[self.size_factor_key]
        return sel

    def label_values(self) -> pd.Categorical:
        """Every cell's label, as scvi-tools' mapping names it (SCANVI reads them as
        ``datamodule.labels_``); codes only, so 10^8 cells cost 10^8 small ints."""
        if self.labels_key is None:
            return pd.Categorical.from_codes(np.zeros(self.source.n_obs, np.int8),
                                             categories=self.labels.mapping)
        codes = self.label_codes
        if codes is None:
            codes = read_codes(self.source, [self.labels_key])[self.labels_key]
        small = np.int16 if len(self.labels.lut) < 2**15 else np.int32
        lut = self.labels.lut.astype(small)
        scvi_codes = lut[codes.astype(small, copy=False) + small(1)]  # 2-4 bytes per cell
        return pd.Categorical.from_codes(scvi_codes, categories=pd.Index(self.labels.mapping))

    def registry(self, scvi_version: str) -> dict[str, Any]:
        """The registry dict a model takes as ``registry=`` (``setup_datamodule``)."""
        n_obs, n_vars = self.source.n_obs, self.n_vars
        labels_state: dict[str, Any] = {
            "categorical_mapping": self.labels.mapping,
            "original_key": self.labels_key or "_scvi_labels",
        }
        setup_args: dict[str, Any] = {
            "layer": self.layer,
            "batch_key": self.batch_key,
            "labels_key": self.labels_key,
            "size_factor_key": self.size_factor_key,
            "categorical_covariate_keys": list(self.categorical_covariate_keys) or None,
            "continuous_covariate_keys": list(self.continuous_covariate_keys) or None,
        }
        if self.model_name == "SCANVI":
            labels_state["unlabeled_category"] = self.unlabeled_category
            setup_args["unlabeled_category"] = self.unlabeled_category
        cat_keys, cont_keys = self.categorical_covariate_keys, self.continuous_covariate_keys
        return {
            "scvi_version": scvi_version,
            "model_name": self.model_name,
            "setup_args": setup_args,
            "field_registries": {
                "X": {
                    "data_registry": {"attr_name": "X" if self.layer is None else "layers",
                                      "attr_key": self.layer},
                    "state_registry": {"n_obs": n_obs, "n_vars": n_vars,
                                       "column_names": self.column_names},
                    "summary_stats": {"n_vars": n_vars, "n_cells": n_obs},
                },
                "batch": {
                    "data_registry": {"attr_name": "obs", "attr_key": "_scvi_batch"},
                    "state_registry": {"categorical_mapping": self.batch_mapping,
                                       "original_key": self.batch_key or "_scvi_batch"},
                    "summary_stats": {"n_batch": self.n_batch},
                },
                "labels": {
                    "data_registry": {"attr_name": "obs", "attr_key": "_scvi_labels"},
                    "state_registry": labels_state,
                    "summary_stats": {"n_labels": self.n_labels},
                },
                "size_factor": (
                    {"data_registry": {"attr_name": "obs", "attr_key": self.size_factor_key},
                     "state_registry": {}, "summary_stats": {}}
                    if self.size_factor_key else
                    {"data_registry": {}, "state_registry": {}, "summary_stats": {}}),
                "extra_categorical_covs": (
                    {"data_registry": {"attr_name": "obsm",
                                       "attr_key": "_scvi_extra_categorical_covs"},
                     "state_registry": {
                         "field_keys": list(cat_keys),
                         "mappings": {k: np.array(self.categories[k], dtype=object)
                                      for k in cat_keys},
                         "n_cats_per_key": [len(self.categories[k]) for k in cat_keys]},
                     "summary_stats": {"n_extra_categorical_covs": len(cat_keys)}}
                    if cat_keys else
                    {"data_registry": {}, "state_registry": {},
                     "summary_stats": {"n_extra_categorical_covs": 0}}),
                "extra_continuous_covs": (
                    {"data_registry": {"attr_name": "obsm",
                                       "attr_key": "_scvi_extra_continuous_covs"},
                     "state_registry": {"columns": np.array(cont_keys, dtype=object)},
                     "summary_stats": {"n_extra_continuous_covs": len(cont_keys)}}
                    if cont_keys else
                    {"data_registry": {}, "state_registry": {},
                     "summary_stats": {"n_extra_continuous_covs": 0}}),
            },
            "setup_method_name": "setup_datamodule",
        }
