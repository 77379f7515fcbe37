"""Batches in scvi-tools' keys: built in the DataLoader workers, finished on the device.

:class:`ScviBatchConverter` is the ``batch_converter`` of the datasets: in the worker it
turns ``{selector key: numpy/scipy}`` into the tensors scvi-tools' modules read
(``REGISTRY_KEYS``): ``X`` (counts, float32; still a sparse CSR tensor when stored sparse),
``batch`` and ``labels`` (``(n, 1)`` int64 codes of the registry's mappings),
``extra_categorical_covs`` / ``extra_continuous_covs`` (``(n, k)``, ``None`` without
covariates: :func:`to_model` leaves those out), ``size_factor`` (``(n, 1)``, only with
a ``size_factor_key``) and ``ind_x`` (``(n, 1)`` global row ids). :func:`to_model` moves
a batch to the device and densifies ``X`` there (a CSR batch is a fraction of the dense
one's bytes) and, for semi-supervised training (SCANVI), pairs it with its labelled rows as
scvi-tools' own loaders do.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import annbatch_torch as abt

__all__ = ["SCVI_KEYS", "ScviBatchConverter", "to_model"]

#: fewer labelled rows than this in a batch add no classification loss (the classifier's
#: BatchNorm refuses one row in training)
MIN_LABELLED = 2
#: the first keys of every batch, in scvi-tools' order (its semi-supervised training step
#: reads a dict that starts with exactly these as "the labelled cells are all of them")
SCVI_KEYS = ("X", "batch", "labels", "extra_categorical_covs", "extra_continuous_covs")


class ScviBatchConverter:
    """``batch_converter`` from selector keys (:meth:`~.setup.ScviSetup.selector`) to
    scvi-tools' tensors (see the module doc). Picklable; runs in the workers.

    Parameters
    ----------
    label_lut
        ``label_lut[global_code + 1]`` is the scvi code of a label (``-1``: refused).
    categorical_keys, continuous_keys
        The covariates, in the registry's order.
    size_factor
        Whether the batches carry ``"size_factor"``.
    """

    def __init__(self, label_lut: np.ndarray, categorical_keys: tuple[str, ...],
                 continuous_keys: tuple[str, ...], size_factor: bool) -> None:
        self.label_lut = np.asarray(label_lut, dtype=np.int64)
        self.categorical_keys = tuple(categorical_keys)
        self.continuous_keys = tuple(continuous_keys)
        self.size_factor = bool(size_factor)

    @staticmethod
    def _column(values: np.ndarray, dtype: Any) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(values).reshape(-1, 1), dtype=dtype)

    def _codes(self, batch: dict[str, Any], key: str, name: str) -> np.ndarray:
        codes = np.asarray(batch[key], dtype=np.int64)
        if codes.size and codes.min() < 0:
            raise ValueError(f"{name}: {int((codes < 0).sum())} cell(s) of this batch have a "
                             "missing value; scvi-tools needs a category for every cell "
                             "(fill them in the inputs and rewrite the collection)")
        return codes

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        x = batch["X"]
        n = x.shape[0]
        out: dict[str, Any] = {"X": x}
        out["batch"] = (self._column(self._codes(batch, "batch", "batch_key"), np.int64)
                        if "batch" in batch else np.zeros((n, 1), np.int64))
        if "labels" in batch:
            labels = self.label_lut[np.asarray(batch["labels"], dtype=np.int64) + 1]
            if labels.size and labels.min() < 0:
                raise ValueError("labels_key: a cell of this batch has a missing label; "
                                 "fill it in the inputs, or train SCANVI "
                                 "(model_name='SCANVI'), which treats it as unlabeled")
            out["labels"] = self._column(labels, np.int64)
        else:
            out["labels"] = np.zeros((n, 1), np.int64)
        cats = [self._codes(batch, f"cat:{k}", f"categorical_covariate_keys {k!r}")
                for k in self.categorical_keys]
        out["extra_categorical_covs"] = np.stack(cats, axis=1) if cats else None
        conts = [np.asarray(batch[f"cont:{k}"], dtype=np.float32) for k in self.continuous_keys]
        if conts:
            cont = np.stack(conts, axis=1)
            if not np.isfinite(cont).all():
                bad = [k for k, c in zip(self.continuous_keys, conts, strict=True)
                       if not np.isfinite(c).all()]
                raise ValueError(f"continuous_covariate_keys {bad}: NaN or infinite values in "
                                 "this batch; fill them in the inputs and rewrite the "
                                 "collection")
            out["extra_continuous_covs"] = cont
        else:
            out["extra_continuous_covs"] = None
        if self.size_factor:
            out["size_factor"] = self._column(batch["size_factor"], np.float32)
        if "index" in batch:
            out["ind_x"] = self._column(batch["index"], np.int64)
        return abt.batch_dict_converter(out)


def _dense_on(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """``batch`` on ``device`` with ``X`` dense, in its own key order, without the keys of
    covariates the registry has none of (``None``: scvi-tools' modules read them with
    ``.get`` or test ``in``, and Lightning, inferring the batch size of what a step logs,
    counts a ``None`` as a second batch size and warns of an ambiguous collection)."""
    moved = abt.to_device(batch, device, densify=True)
    return {k: moved[k] for k in batch if moved[k] is not None}


def to_model(batch: dict[str, Any], device: torch.device | str,
             unlabeled_code: int | None = None) -> dict[str, Any] | list[dict[str, Any]]:
    """Move a batch of :class:`ScviBatchConverter` to ``device`` with ``X`` dense.

    With ``unlabeled_code`` (semi-supervised training), return ``[all rows, the rows whose
    label is not unlabeled]``, the pair scvi-tools' semi-supervised training and
    validation steps read; a batch with fewer than :data:`MIN_LABELLED` labelled rows is
    returned as one dict whose keys do not start with :data:`SCVI_KEYS` (so scvi-tools
    computes no classification loss from it, rather than a mean over zero rows or a
    BatchNorm over one).
    """
    full = _dense_on(batch, device)
    if unlabeled_code is None:
        return full
    known = full["labels"][:, 0] != unlabeled_code
    if bool(known.all()):
        return [full, full]
    if int(known.sum()) < MIN_LABELLED:
        keys = list(full)
        keys.remove("labels")
        return {**{k: full[k] for k in keys}, "labels": full["labels"]}
    labelled = {k: (v[known] if isinstance(v, torch.Tensor) else v) for k, v in full.items()}
    return [full, labelled]
