"""`SCVIDataModule`: scvi-tools models trained and queried straight from a collection."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

import annbatch_torch as abt

from .batches import ScviBatchConverter, to_model
from .setup import MODELS, ScviSetup

try:
    import scvi
    from scvi.train import SemiSupervisedTrainingPlan
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "annbatch_torch.integrations.scvi needs scvi-tools: pip install "
        "'annbatch-torch[scvi]'."
    ) from e

__all__ = ["SCVIDataModule"]

#: AnnBatchDataset arguments this module sets itself
_OWN = ("selector", "batch_converter", "return_index", "densify", "device", "even_batches",
        "out_dtype")
#: AnnBatchDataModule arguments that may come in through ``**dataset_kwargs``
_MODULE_ARGS = ("chunk_size", "preload_nchunks")


class SCVIDataModule(abt.AnnBatchDataModule):
    """A :class:`~annbatch_torch.AnnBatchDataModule` in scvi-tools' custom-dataloader
    protocol: ``SCVI(registry=dm.registry)`` (SCANVI also needs the module for its labels:
    ``SCANVI(registry=dm.registry, datamodule=dm)``), ``model.train(datamodule=dm)``.

    Batches carry scvi-tools' keys (``X`` counts, ``batch``, ``labels``, covariates,
    ``size_factor``, ``ind_x``: the global row ids), built in the DataLoader workers;
    ``X`` travels as CSR and is densified on the training device. The category mappings
    come from the collection's global categories, so a code means the same category in
    every shard. After an append (categories only grow at the end) batch, covariate and
    SCVI label codes keep their meaning; SCANVI's swap of the unlabeled category to the
    last code (scvi-tools' rule) can move a label's code when categories were added.

    Parameters
    ----------
    source
        A collection (folder, URL or :class:`~annbatch_torch.Collection`) or AnnData inputs
        read in place, as :class:`~annbatch_torch.AnnBatchDataset` takes them.
    layer
        The layer holding raw counts; ``None``: ``X``.
    batch_key, labels_key
        Categorical obs columns of the batch (``n_batch`` categories) and of the cell labels.
    unlabeled_category
        With ``model_name="SCANVI"``: the label of cells to predict; cells with a missing
        label are unlabeled too.
    categorical_covariate_keys, continuous_covariate_keys
        Categorical / numeric obs columns passed to the model as covariates.
    size_factor_key
        A numeric obs column of size factors.
    model_name
        ``"SCVI"`` or ``"SCANVI"``: whose ``setup_anndata`` the registry follows (label
        mapping, setup arguments; ``load`` checks the name).
    batch_size, num_workers, seed, sampler
        As :class:`~annbatch_torch.AnnBatchDataModule` takes them (``sampler``: weighted,
        class-balanced or subset training).
    train_size, validation_size
        Fractions of the rows for training and validation, in whole chunks
        (``validation_size`` default: ``1 - train_size``); the chunks left over form the
        test split (a collection of a few chunks is split in smaller chunks, as
        :class:`~annbatch_torch.AnnBatchDataModule` describes). The
        default ``train_size=1.0`` has no validation split (scvi-tools' ``early_stopping``
        needs one).
    dataloader_kwargs
        Extra arguments of every DataLoader.
    check_counts
        Warn when the first rows of the registered X are not non-negative integers.
    **dataset_kwargs
        Extra arguments of :class:`~annbatch_torch.AnnBatchDataset` (``var_names`` to
        train on a gene subset, ``read_threads``, ``chunk_size``, ``preload_nchunks``...).
        Training drops the epoch's one partial batch (``drop_last=True``; a batch of one
        row breaks BatchNorm in training); pass ``drop_last=False`` to keep it.

    Attributes
    ----------
    registry
        The registry dict for ``registry=`` (``setup_method_name="setup_datamodule"``):
        ``SCVI(registry=dm.registry)``, ``SCANVI(registry=dm.registry, datamodule=dm)``.
    n_obs, n_vars, n_batch, n_labels, n_continuous_cov, n_cats_per_cov
        The data sizes scvi-tools reads.

    Examples
    --------
    >>> dm = SCVIDataModule("store/", batch_key="batch", batch_size=1024,  # doctest: +SKIP
    ...                     num_workers=4, train_size=0.9)
    >>> model = scvi.model.SCVI(registry=dm.registry)  # doctest: +SKIP
    >>> model.train(max_epochs=20, datamodule=dm)  # doctest: +SKIP
    >>> z = model.get_latent_representation(  # doctest: +SKIP
    ...     dataloader=dm.inference_dataloader())
    """

    def __init__(
        self,
        source: Any,
        *,
        layer: str | None = None,
        batch_key: str | None = None,
        labels_key: str | None = None,
        unlabeled_category: Any = "Unknown",
        categorical_covariate_keys: Sequence[str] | None = None,
        continuous_covariate_keys: Sequence[str] | None = None,
        size_factor_key: str | None = None,
        model_name: str = "SCVI",
        batch_size: int = 128,
        num_workers: int = 0,
        train_size: float = 1.0,
        validation_size: float | None = None,
        seed: int = 0,
        sampler: Any = None,
        dataloader_kwargs: Mapping[str, Any] | None = None,
        check_counts: bool = True,
        **dataset_kwargs: Any,
    ) -> None:
        own = sorted(set(dataset_kwargs) & set(_OWN))
        if own:
            raise ValueError(f"SCVIDataModule sets {own} itself (the batches must carry "
                             "scvi-tools' keys, as float32); remove them.")
        if model_name not in MODELS:
            raise ValueError(f"model_name must be one of {list(MODELS)}, got {model_name!r}.")
        val_fraction, test_fraction = _split_fractions(train_size, validation_size)
        src = abt.open_source(source)
        module_args = {k: dataset_kwargs.pop(k) for k in _MODULE_ARGS if k in dataset_kwargs}
        self.setup_fields = ScviSetup(
            src, model_name=model_name, layer=layer, batch_key=batch_key,
            labels_key=labels_key, unlabeled_category=unlabeled_category,
            categorical_covariate_keys=categorical_covariate_keys,
            continuous_covariate_keys=continuous_covariate_keys,
            size_factor_key=size_factor_key, var_names=dataset_kwargs.get("var_names"),
            check_counts=check_counts)
        fields = self.setup_fields
        converter = ScviBatchConverter(
            fields.labels.lut, fields.categorical_covariate_keys,
            fields.continuous_covariate_keys, size_factor_key is not None)
        if getattr(sampler, "draw_size", 1) != 1:
            raise abt.SamplerError(
                f"SCVIDataModule: {sampler!r} yields perturbed rows with control rows "
                "(control_ keys), which scvi-tools' models do not take; use a sampler of "
                "single rows (WeightedSampler, ClassBalancedSampler, SubsetSampler), or "
                "AnnBatchDataModule with a model of your own for pairs.")
        super().__init__(
            None, src, selector=fields.selector(), batch_size=batch_size,
            num_workers=num_workers, seed=seed, val_fraction=val_fraction,
            test_fraction=test_fraction, eval_even_batches="drop", sampler=sampler,
            dataloader_kwargs={"pin_memory": False, **(dataloader_kwargs or {})},
            # drop_last: a last batch of one row breaks BatchNorm in training (scvi-tools'
            # own splitter avoids remainders under 3 rows)
            dataset_kwargs={"drop_last": True, **dataset_kwargs,
                            "batch_converter": converter, "return_index": True},
            **module_args,
        )
        # the dataset arguments checked now, not at the first setup() (after the model)
        abt.AnnBatchDataset(src, selector=self.selector, batch_size=batch_size,
                            chunk_size=self.chunk_size, preload_nchunks=self.preload_nchunks,
                            seed=seed, sampler=None, **self.dataset_kwargs)
        self.model_name = model_name
        self.train_size = float(train_size)
        self.validation_size = val_fraction
        self._labels: pd.Categorical | None = None
        # read by scvi-tools' Trainer / LightningModule plumbing
        self._log_hyperparams = False
        self.allow_zero_length_dataloader_with_multiple_devices = False

    def _dataset_arg(self, key: str, value: Any) -> str | None:
        """Dataset arguments are this DataModule's own keywords; padding rows (``"pad"``)
        are not for scvi-tools' losses, which count every row."""
        return None if key == "even_batches" else f"{key}={value!r}"

    # -- the protocol scvi-tools reads -----------------------------------------------------
    @property
    def registry(self) -> dict[str, Any]:
        """The registry for ``SCVI(registry=...)`` / ``SCANVI(registry=..., datamodule=dm)``.

        SCANVI reads its labels from the DataModule when it is built: without
        ``datamodule=dm`` scvi-tools 1.4 fails inside ``SCANVI.__init__``
        (``'NoneType' object has no attribute 'data_registry'``).
        """
        return self.setup_fields.registry(scvi.__version__)

    @property
    def n_obs(self) -> int:
        """Cells of the source (all splits)."""
        return self.setup_fields.source.n_obs

    @property
    def n_vars(self) -> int:
        """Genes the model sees (``var_names``' length when given)."""
        return self.setup_fields.n_vars

    @property
    def var_names(self) -> pd.Index:
        """The genes the model sees, in its input order."""
        return pd.Index(self.setup_fields.column_names)

    @property
    def n_batch(self) -> int:
        """Categories of ``batch_key`` (1 without one)."""
        return self.setup_fields.n_batch

    @property
    def n_labels(self) -> int:
        """Label classes of the model: the label mapping's entries (1 without
        ``labels_key``), less the unlabeled category for SCANVI when cells carry it (as
        SCANVI builds its classifier; ``save`` / ``load`` read this)."""
        return self.setup_fields.n_labels - int(self.setup_fields.unlabeled_present)

    @property
    def n_samples(self) -> int:
        """0: sample keys (MrVI) are not supported."""
        return 0

    @property
    def n_continuous_cov(self) -> int:
        return len(self.setup_fields.continuous_covariate_keys)

    @property
    def n_cats_per_cov(self) -> list[int] | None:
        keys = self.setup_fields.categorical_covariate_keys
        return [len(self.setup_fields.categories[k]) for k in keys] or None

    @property
    def batch_labels(self) -> np.ndarray:
        """The batch categories (code ``i`` is ``batch_labels[i]``)."""
        return self.setup_fields.batch_mapping

    @property
    def label_keys(self) -> np.ndarray:
        """The label mapping (code ``i`` is ``label_keys[i]``)."""
        return self.setup_fields.labels.mapping

    @property
    def unlabeled_category(self) -> Any:
        return self.setup_fields.unlabeled_category

    @property
    def labels_(self) -> pd.Categorical:
        """Every cell's label in row order (SCANVI reads it; computed on first use)."""
        if self._labels is None:
            self._labels = self.setup_fields.label_values()
        return self._labels

    @property
    def n_train(self) -> int:
        """Cells of the training split."""
        return self._split_rows()[0]

    @property
    def n_val(self) -> int:
        """Cells of the validation split."""
        return self._split_rows()[1]

    def _split_rows(self) -> tuple[int, int]:
        n = self.n_obs
        cs, train, val, _ = self._split_of(n)  # the split setup() makes
        return abt.sampling.chunk_rows(n, cs, train), abt.sampling.chunk_rows(n, cs, val)

    # -- batches on the device -------------------------------------------------------------
    def _unlabeled_code(self) -> int | None:
        """The unlabeled code when a semi-supervised plan trains (its steps read pairs)."""
        plan = getattr(getattr(self, "trainer", None), "lightning_module", None)
        if isinstance(plan, SemiSupervisedTrainingPlan):
            return self.setup_fields.labels.unlabeled_code
        return None

    def transfer_batch_to_device(self, batch: Any, device: torch.device,
                                 dataloader_idx: int) -> Any:
        """Lightning hook: the batch on ``device`` with ``X`` dense (see
        ``batches.to_model``)."""
        return to_model(batch, device, self._unlabeled_code())

    def inference_dataloader(self, batch_size: int | None = None,
                             device: torch.device | str | None = None) -> _InferenceLoader:
        """Every cell once, in the source's row order (no shuffle, no drop, no padding),
        for ``get_latent_representation(dataloader=...)``, ``get_normalized_expression``,
        ``predict`` and friends.

        Row ``i`` of their results is cell ``i`` of the source: ``obs_names`` as
        ``collection.obs_names_at(np.arange(dm.n_obs))``. Each batch also holds its rows'
        ids under ``"ind_x"``.

        Parameters
        ----------
        batch_size
            Rows per batch (default: the module's ``batch_size``).
        device
            Where batches go, densified (default: CUDA when available, else the CPU).
        """
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        kwargs = {k: v for k, v in self.dataset_kwargs.items()
                  if k not in ("shuffle", "even_batches", "drop_last")}  # every cell, in order
        ds = abt.AnnBatchDataset(
            self.setup_fields.source, selector=self.selector,
            batch_size=batch_size or self.batch_size, chunk_size=self.chunk_size,
            preload_nchunks=self.preload_nchunks, shuffle=False, drop_last=False,
            rank=0, world_size=1, **kwargs)
        loader_kwargs: dict[str, Any] = {"num_workers": self.num_workers}
        loader_kwargs.update(self.dataloader_kwargs)
        loader_kwargs["persistent_workers"] = False
        return _InferenceLoader(abt.AnnBatchDataLoader(ds, **loader_kwargs), dev)


class _InferenceLoader:
    """Batches of a loader moved to a device, ``X`` dense: what scvi-tools' ``dataloader=``
    arguments iterate."""

    def __init__(self, loader: abt.AnnBatchDataLoader, device: torch.device) -> None:
        self.loader = loader
        self.device = device

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            out = to_model(batch, self.device)
            assert isinstance(out, dict)
            yield out

    def __len__(self) -> int:
        return len(self.loader)


def _split_fractions(train_size: float, validation_size: float | None) -> tuple[float, float]:
    """``(val_fraction, test_fraction)`` of scvi-tools' ``train_size`` /
    ``validation_size``."""
    for name, v in (("train_size", train_size), ("validation_size", validation_size)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            raise ValueError(f"{name} must be a number, got {v!r}.")
    if not 0.0 < float(train_size) <= 1.0:
        raise ValueError(f"train_size must be in (0, 1], got {train_size!r}.")
    val = 1.0 - float(train_size) if validation_size is None else float(validation_size)
    if val < 0 or float(train_size) + val > 1.0 + 1e-9:
        raise ValueError(f"train_size + validation_size must be <= 1, got {train_size!r} + "
                         f"{validation_size!r}.")
    test = max(0.0, 1.0 - float(train_size) - val)
    return val, (0.0 if test < 1e-9 else test)

