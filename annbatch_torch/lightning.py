"""`AnnBatchDataModule`: the collection and datasets behind ``Trainer.fit``.

* ``prepare_data`` (Lightning runs it on one process per node) writes the collection if it
  is missing or stale: an input was added, removed or changed since (its resolved path,
  size or modification time differs from the manifest's record), an offline-shuffle
  setting given in ``collection_kwargs`` (``seed``, ``shuffle``, ``var_join``) differs from
  the recorded one, or a layer / obsm entry / obs column listed there is missing. Changing
  only the DataModule's ``seed`` (split and epoch orders) reuses the store: it is shuffled
  already. A current store is not touched. A file lock beside the store
  (``<store>.lock``) serialises processes that race, e.g. the local rank 0 of every node
  on a shared file system: the first writes, the others wait and then find it current.
* ``setup`` opens the collection and builds this rank's datasets; rank and world size
  come from the trainer. Training shuffles with ``even_batches="drop"``: every rank takes
  the same number of steps, and fewer than ``world_size`` batches are left out of an epoch
  (the last round of pools is split across ranks by batches). ``setup`` raises if a rank
  would get no batch (fewer training batches than ranks) and warns above a 10% drop.
  Validation, test and predict read in order with ``even_batches="pad"``: every row once,
  padding rows flagged ``False`` in the boolean ``"mask"`` key.
* The validation split holds out whole chunks (``val_fraction``), and so does an optional
  test split (``test_fraction``), chosen by :func:`~annbatch_torch.sampling.split_chunks3`
  from ``seed``; test reads the test split (the whole collection without one), predict
  the whole collection. Where whole chunks of ``chunk_size`` rows miss a fraction by more
  than 2x (a collection of a few chunks: 10% of 700 cells is not one 512-row chunk), the
  split takes chunks of ``chunk_size // 2``, ``// 4``, ... rows, the largest that meet
  every fraction within 2x (down to single rows), and the split's datasets read chunks of
  that size (``preload_nchunks`` scaled up to keep the pool's rows); a fraction that even
  single rows miss by 2x is warned about. Collections of more than 64 chunks (32,768 cells
  at the default ``chunk_size``) split whole chunks exactly as before, with the same
  warning when a part misses its fraction by more than 2x (a tiny fraction of many cells).
* Loaders are :class:`~annbatch_torch.loader.AnnBatchDataLoader`: Lightning calls
  ``dataloader.sampler.set_epoch(epoch)`` before every epoch but the first of a run (it
  never calls ``set_epoch`` on an ``IterableDataset``); that sampler forwards it to the
  dataset, whose epoch lives in shared memory, so the epoch advances with
  ``persistent_workers`` on or off. ``train_dataloader()`` sets the fit loop's epoch
  itself, which covers the first epoch after a resume.

Needs the ``lightning`` extra (``pip install 'annbatch-torch[lightning]'``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Sampler as TorchSampler

try:
    import lightning.pytorch as pl
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "AnnBatchDataModule needs Lightning: pip install 'annbatch-torch[lightning]'."
    ) from e

from . import sampling
from .annbatch_dataset import DEFAULT_CHUNK_SIZE, DEFAULT_PRELOAD_NCHUNKS, AnnBatchDataset
from .errors import SamplerError, check_int
from .fields import Field
from .loader import AnnBatchDataLoader
from .resume import is_mid_epoch, state_ints
from .sampling import Sampler
from .store.collection import open_collection
from .store.inputs.mixture import Mixture
from .store.manifest import read_manifest
from .store.source import Source
from .torch_sampler import bind_sampler
from .write.prepare import explicit_settings, write_if_stale
from .write.publish import lock_path
from .write.staleness import store_is_current, store_staleness

__all__ = ["AnnBatchDataModule", "store_is_current", "store_staleness"]

logger = logging.getLogger(__name__)

#: dataset arguments the DataModule sets itself (pass them to the DataModule instead)
_MANAGED = ("selector", "batch_size", "chunk_size", "preload_nchunks", "seed", "densify",
            "rank", "world_size", "chunk_ids", "sampler")
_STATE_VERSION = 1


class AnnBatchDataModule(pl.LightningDataModule):
    """Lightning DataModule over a shuffled collection written from ``adata_paths``.

    Parameters
    ----------
    adata_paths
        ``.h5ad`` / AnnData-zarr inputs of the collection. ``None`` (or empty): use an
        existing collection at ``store_path`` as it is and never write.
    store_path
        Where the collection lives (written by :meth:`prepare_data` when missing or stale),
        or its URL on an object store (read only). With ``adata_paths=None`` it may also be
        an opened :class:`~annbatch_torch.Source` (a :class:`~annbatch_torch.Collection`,
        or inputs read in place: :func:`~annbatch_torch.open_source`), read as it is, or a
        :func:`~annbatch_torch.mix` of collections: training draws by its weights from the
        training chunks' rows; validation, test and predict read their rows once each, in
        order (with the ``source`` key).
    selector, batch_size, chunk_size, preload_nchunks, densify
        Passed to every :class:`~annbatch_torch.AnnBatchDataset`.
    num_workers
        DataLoader workers per rank.
    seed
        Seed of the train/validation split and of the epoch orders, and of the offline
        shuffle when the store is written (unless ``collection_kwargs`` sets its own). A
        store written with another seed is reused, not rewritten: set
        ``collection_kwargs={"seed": ...}`` to demand a particular offline shuffle.
    val_fraction
        Fraction of the rows held out for validation, in whole chunks (of
        ``split_chunk_size`` rows), in ``[0, 1)``; 0 disables validation.
    test_fraction
        Fraction of the rows held out for :meth:`test_dataloader`, in whole chunks, in
        ``[0, 1)`` (``val_fraction + test_fraction < 1``). Default 0: no test split, and
        testing reads the whole collection.
    eval_even_batches
        How validation and test give every rank the same number of batches: ``"pad"``
        (default: every row once, padding rows flagged ``False`` under ``"mask"``) or
        ``"drop"`` (fewer than ``world_size`` batches left out, no padding rows; for models
        that cannot skip masked rows).
    collection_kwargs
        Extra arguments of :func:`~annbatch_torch.create_anndata_collection`
        (``var_join``, ``layers``, ``obsm``, ``obs_columns``, ``n_obs_per_shard``...).
    dataloader_kwargs
        Extra arguments of every DataLoader; they override the defaults
        ``num_workers=num_workers``, ``persistent_workers=num_workers > 0`` and
        ``pin_memory`` (on when the trainer runs on CUDA).
    dataset_kwargs
        Extra arguments of every :class:`~annbatch_torch.AnnBatchDataset`
        (``return_index``, ``batch_converter``, ``read_threads``...). ``shuffle``,
        ``even_batches`` and ``drop_last`` apply to training only: validation, test and
        predict always read in order with ``even_batches="pad"``.
    sampler
        Sampling mode for training (a :class:`~annbatch_torch.Sampler`): it draws from the
        training split's rows only (with ``val_fraction``, the rows of the held-out chunks
        never come up); validation, test and predict stay unweighted, in order. A
        :class:`~annbatch_torch.PairedSampler` pairs every split: validation, test and
        predict batches hold their own perturbed rows once, each with controls drawn from
        the same split's rows (and ``control_`` keys, as training's). Default ``None``:
        chunked mode.
    storage_options, cache_dir, cache_size
        For a ``store_path`` on an object store (``s3://bucket/prefix``): as
        :func:`~annbatch_torch.open_collection` takes them. Such a collection is read,
        never written (write it once with ``create_anndata_collection(inputs, url)``).

    Attributes
    ----------
    collection
        The opened :class:`~annbatch_torch.Collection` (after :meth:`setup`), or the
        :class:`~annbatch_torch.Source` given as ``store_path``.
    train_dataset, val_dataset, test_dataset, predict_dataset
        This rank's datasets (after :meth:`setup`); ``val_dataset`` is ``None`` without a
        validation split. Without a test split ``test_dataset`` is ``predict_dataset``.
    train_chunks, val_chunks, test_chunks
        Chunk ids of the split, in chunks of ``split_chunk_size`` rows (after
        :meth:`setup`; ``test_chunks`` is empty without a test split).
    split_chunk_size
        Rows per chunk of the split (after :meth:`setup`): ``chunk_size``, or a smaller
        size where whole ``chunk_size`` chunks would miss ``val_fraction`` /
        ``test_fraction`` by more than 2x. The split's datasets read chunks of this size.
    store_written
        After :meth:`prepare_data`: ``True`` if it wrote the store, ``False`` if the store
        was current (``None`` before).

    Examples
    --------
    >>> dm = AnnBatchDataModule(["a.h5ad", "b.h5ad"], "store/",  # doctest: +SKIP
    ...                         selector={"x": A.X, "y": A.obs["cell_type"]},
    ...                         batch_size=2048, num_workers=4, val_fraction=0.05)
    >>> pl.Trainer(devices=4, strategy="ddp").fit(model, datamodule=dm)  # doctest: +SKIP
    """

    def __init__(
        self,
        adata_paths: Sequence[str | os.PathLike[str]] | None,
        store_path: str | os.PathLike[str] | Source,
        *,
        selector: Mapping[str, Field | str] | None = None,
        batch_size: int = 4096,
        num_workers: int = 0,
        seed: int = 0,
        val_fraction: float = 0.0,
        test_fraction: float = 0.0,
        eval_even_batches: str = "pad",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        preload_nchunks: int = DEFAULT_PRELOAD_NCHUNKS,
        densify: bool = False,
        collection_kwargs: Mapping[str, Any] | None = None,
        dataloader_kwargs: Mapping[str, Any] | None = None,
        dataset_kwargs: Mapping[str, Any] | None = None,
        sampler: Sampler | TorchSampler | None = None,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_size: int | None = None,
    ) -> None:
        super().__init__()
        if sampler is not None and not isinstance(sampler, Sampler | TorchSampler):
            raise TypeError("sampler must be an annbatch_torch Sampler (WeightedSampler, "
                            "ClassBalancedSampler, SubsetSampler or a subclass of Sampler) or "
                            "a torch.utils.data.Sampler of row indices, got "
                            f"{type(sampler).__name__}.")
        for name, frac in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if isinstance(frac, bool) or not isinstance(frac, int | float) or not (
                0.0 <= float(frac) < 1.0
            ):
                raise ValueError(f"{name} must be a number in [0, 1), got {frac!r}.")
        if float(val_fraction) + float(test_fraction) >= 1.0:
            raise ValueError(f"val_fraction + test_fraction must be < 1 (training keeps the "
                             f"rest), got {val_fraction!r} + {test_fraction!r}.")
        if eval_even_batches not in ("pad", "drop"):
            raise ValueError("eval_even_batches must be 'pad' or 'drop', got "
                             f"{eval_even_batches!r}.")
        num_workers = check_int("num_workers", num_workers, 0)
        seed = check_int("seed", seed, 0)
        if isinstance(adata_paths, str | os.PathLike):
            adata_paths = [adata_paths]
        managed = sorted(set(dataset_kwargs or {}) & set(_MANAGED))
        if managed:
            raise ValueError(
                f"dataset_kwargs must not set {managed}: pass them to AnnBatchDataModule "
                "itself (rank and world size come from the trainer, chunk ids from the split)."
            )
        if dataloader_kwargs and "batch_size" in dataloader_kwargs:
            raise ValueError(
                "dataloader_kwargs must not set batch_size: the datasets yield whole batches; "
                "pass batch_size to AnnBatchDataModule."
            )
        self.adata_paths = [Path(p).expanduser() for p in (adata_paths or [])]
        from .store.remote.location import check_url, is_url

        if isinstance(store_path, Source) and self.adata_paths:
            raise ValueError(f"store_path is an opened source ({store_path.describe()}): "
                             "nothing is written to it; pass adata_paths=None.")
        #: a local folder, the URL of a collection on an object store, or an opened Source
        self.store_path: Path | str | Source = (
            store_path if isinstance(store_path, Source)
            else check_url(store_path, "store_path") if is_url(store_path)
            else Path(store_path))
        self.storage_options = storage_options
        self.cache_dir = cache_dir
        self.cache_size = cache_size
        if isinstance(self.store_path, str) and self.adata_paths:
            raise ValueError(
                f"store_path={self.store_path!r} is on an object store: prepare_data does not "
                "write there. Write the collection once with create_anndata_collection("
                "inputs, url), then pass only store_path.")
        self.selector = selector
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.val_fraction = float(val_fraction)
        self.test_fraction = float(test_fraction)
        self.eval_even_batches = eval_even_batches
        self.chunk_size = chunk_size
        self.preload_nchunks = preload_nchunks
        self.densify = densify
        self.collection_kwargs = dict(collection_kwargs or {})
        self.dataloader_kwargs = dict(dataloader_kwargs or {})
        self.dataset_kwargs = dict(dataset_kwargs or {})
        self.sampler = sampler
        self.collection: Source | None = None
        self.train_dataset: AnnBatchDataset | None = None
        self.val_dataset: AnnBatchDataset | None = None
        self.test_dataset: AnnBatchDataset | None = None
        self.predict_dataset: AnnBatchDataset | None = None
        self.train_chunks: np.ndarray | None = None
        self.val_chunks: np.ndarray | None = None
        self.test_chunks: np.ndarray | None = None
        self.split_chunk_size: int = chunk_size
        self.store_written: bool | None = None
        self._epoch = 0
        self._restored_epoch: int | None = None
        self._train_loader: AnnBatchDataLoader | None = None
        self._pending_loader_state: dict[str, Any] | None = None
        #: the trainer's reload_dataloaders_every_n_epochs while a reload is forced
        self._reload_setting: int | None = None

    # -- data preparation --------------------------------------------------------------
    def _open(self) -> Source:
        if isinstance(self.store_path, Source):
            return self.store_path
        if isinstance(self.store_path, str):
            return open_collection(self.store_path, storage_options=self.storage_options,
                                   cache_dir=self.cache_dir, cache_size=self.cache_size)
        return open_collection(self.store_path)

    @property
    def lock_path(self) -> Path:
        """The lock file beside the store that serialises :meth:`prepare_data` calls."""
        if isinstance(self.store_path, Source):
            raise ValueError(f"{self.store_path.describe()} is read as it is: nothing is "
                             "written, so there is no lock.")
        return lock_path(self.store_path)

    def prepare_data(self) -> None:
        """Write the collection unless it is current; safe against racing processes
        (:func:`~annbatch_torch.prepare_collection`).

        Lightning calls this on one process per node (``prepare_data_per_node``); calling it
        yourself is fine too. Sets ``store_written``. Only settings given explicitly
        in ``collection_kwargs`` are compared: a new DataModule ``seed`` alone reuses the
        store (it is shuffled already).

        Raises
        ------
        CollectionError
            Without ``adata_paths``, if ``store_path`` is not a finished collection; or if
            ``store_path`` exists but is not a collection (it is never overwritten).
        """
        if isinstance(self.store_path, Source):  # opened already: read as it is
            self.store_written = False
            return
        if isinstance(self.store_path, str):  # a URL: it must be a collection (never written)
            self._open()
            self.store_written = False
            return
        if not self.adata_paths:
            read_manifest(self.store_path)  # raises with the fix if it is not a collection
            self.store_written = False
            return
        self.store_written = write_if_stale(
            self.adata_paths, self.store_path, explicit_settings(self.collection_kwargs),
            {"seed": self.seed, **self.collection_kwargs},
        )

    # -- datasets ------------------------------------------------------------------------
    def _rank_world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return int(trainer.global_rank), int(trainer.world_size)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _dataset(self, chunk_ids: np.ndarray | None, train: bool,
                 split: str = "training") -> AnnBatchDataset:
        """A dataset of this rank over ``chunk_ids`` (chunks of ``split_chunk_size``
        rows) or, with ``None``, over the whole collection."""
        assert self.collection is not None
        rank, world = self._rank_world()
        chunk_size, preload = self.chunk_size, self.preload_nchunks
        if chunk_ids is not None and self.split_chunk_size != chunk_size:
            # the split's chunks, and as many rows per pool as chunk_size would give
            chunk_size = self.split_chunk_size
            preload = -(-self.chunk_size * self.preload_nchunks // chunk_size)
        kwargs: dict[str, Any] = {"shuffle": True, "even_batches": "drop", "drop_last": False}
        kwargs.update(self.dataset_kwargs)
        if not train:
            kwargs.update(shuffle=False, even_batches=self.eval_even_batches, drop_last=False)
        sampler = None
        # training draws from the training split's rows only; a sampler of draws (pairs of
        # a perturbed row and its controls) makes every split's batches, each from its rows
        paired = self.sampler is not None and getattr(self.sampler, "draw_size", 1) > 1
        if (train or paired) and self.sampler is not None:
            rows = None
            if chunk_ids is not None and (self.val_fraction > 0 or self.test_fraction > 0):
                rows = sampling.ChunkPlan(
                    n_obs=self.collection.n_obs, chunk_size=chunk_size,
                    preload_nchunks=preload, batch_size=self.batch_size,
                    seed=self.seed, chunk_ids=chunk_ids).rows()
            chosen = self.sampler if train else self.sampler.for_evaluation()
            try:
                sampler, chunk_ids = bind_sampler(self.collection, chosen, rows), None
            except SamplerError as e:
                if train:
                    raise
                raise SamplerError(
                    f"{self._where()}: the {split} split's pairs (held-out chunks of "
                    f"{self.split_chunk_size} rows, "
                    f"{self.collection.n_obs if rows is None else len(rows)} rows in all): {e} "
                    "Here: raise its fraction or chunk_size, or pass "
                    "on_missing_control='skip' to the PairedSampler.") from None
        source: Source = self.collection
        if not train and isinstance(source, Mixture) and source.weights is not None:
            source = source.without_weights()  # held-out rows: each once, in order
        return AnnBatchDataset(
            source, selector=self.selector, batch_size=self.batch_size,
            chunk_size=chunk_size, preload_nchunks=preload, seed=self.seed,
            densify=self.densify, rank=rank, world_size=world, chunk_ids=chunk_ids,
            sampler=sampler, **kwargs,
        )

    def setup(self, stage: str | None = None) -> None:
        """Open the collection and build this rank's datasets for ``stage``.

        ``"fit"`` / ``"validate"`` build the train and validation datasets, ``"test"`` the
        test split's (the whole collection without one), ``"predict"`` the whole
        collection's; ``None`` builds all.
        """
        self._epoch = self.epoch  # a rebuilt training dataset keeps the current epoch
        self.collection = self._open()
        split = self._split_of(self.collection.n_obs)
        self.split_chunk_size, self.train_chunks, self.val_chunks, self.test_chunks = split
        self._warn_split_fractions(self.collection.n_obs)
        rank, world = self._rank_world()
        if stage in (None, "fit", "validate"):
            self.train_dataset = self._dataset(self.train_chunks, train=True)
            self.train_dataset.set_epoch(self._epoch)
            self._check_train_drop(self.train_dataset, world)
            has_val = len(self.val_chunks) > 0
            self.val_dataset = (self._dataset(self.val_chunks, train=False, split="validation")
                                if has_val else None)
        if stage in (None, "test", "predict"):
            self.predict_dataset = self._dataset(None, train=False, split="predict")
            self.test_dataset = (self._dataset(self.test_chunks, train=False, split="test")
                                 if len(self.test_chunks) else self.predict_dataset)
        logger.info(
            "setup(%s) on rank %d/%d: %d train, %d validation, %d test chunks of %d rows.",
            stage, rank, world, len(self.train_chunks), len(self.val_chunks),
            len(self.test_chunks), self.split_chunk_size,
        )

    def _split_of(self, n_obs: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """``(split_chunk_size, train, val, test)`` of ``n_obs`` rows (see :func:`_split`);
        on a collection grouped by a column, stratified by its classes."""
        codes = None
        group_by = getattr(self.collection, "group_by", None)
        if group_by is not None and (self.val_fraction > 0 or self.test_fraction > 0):
            from .diversity import column_values

            codes = column_values(self.collection, group_by)[2]
        return _split(n_obs, self.chunk_size, self.val_fraction, self.test_fraction,
                      self.seed, codes)

    def _warn_split_fractions(self, n_obs: int) -> None:
        """Warn for each held-out part more than 2x off its fraction (after the split)."""
        for name, frac, ids in (("val_fraction", self.val_fraction, self.val_chunks),
                                ("test_fraction", self.test_fraction, self.test_chunks)):
            assert ids is not None
            rows = sampling.chunk_rows(n_obs, self.split_chunk_size, ids)
            if frac > 0 and _miss(n_obs, rows, frac) > _SPLIT_TOLERANCE:
                logger.warning(
                    "%s: %s=%g asks for %.3g of %d rows; the split holds out %d of %d rows "
                    "(fraction %.2g), more than %gx off: a held-out part is at least one row "
                    "and training keeps at least one. Pass a %s that %d rows can meet "
                    "(e.g. %g) or use more cells.", self._where(), name, frac, frac * n_obs,
                    n_obs, rows, n_obs, rows / max(n_obs, 1), _SPLIT_TOLERANCE, name, n_obs,
                    min(0.5, max(frac, 1.0 / max(n_obs, 1))))

    def _check_train_drop(self, ds: AnnBatchDataset, world: int) -> None:
        """Refuse a plan that trains on nothing; warn when it leaves out >10% per epoch,
        naming what leaves the rows out: ``drop_last`` (each rank's last partial batch)
        or ``even_batches="drop"`` (the batches some ranks have beyond the others; it
        matters only for tiny splits, and with fewer batches than ranks nothing is left to
        train on)."""
        assert self.collection is not None
        assert self.train_chunks is not None
        n_obs, cs = self.collection.n_obs, self.split_chunk_size
        # sampling mode: the draws an epoch holds (rows, or a perturbed row with controls)
        rows = (sampling.chunk_rows(n_obs, cs, self.train_chunks) if ds.sampler is None
                else len(ds.sampler) // ds.draw_size)
        if rows == 0 or (ds.even_batches != "drop" and not ds.drop_last):
            return
        kept = min(rows, len(ds) * ds.batch_size * world)
        if kept >= 0.9 * rows:
            return
        pool = ds.epoch_plan.pool // ds.draw_size
        causes = []
        fixes = [f"lower batch_size (e.g. batch_size={max(1, rows // (10 * world)):,})"]
        if ds.drop_last:
            causes.append("drop_last=True leaves out each rank's last partial batch")
            fixes.append(f"keep it with {self._dataset_arg('drop_last', False)}")
        if ds.even_batches == "drop" and (world > 1 or not ds.drop_last):
            causes.append("even_batches='drop' leaves out the batches some ranks have "
                          "beyond the others")
            hint = max(1, rows // (self.chunk_size * world * 4))  # the DataModule's units
            fixes.append(f"lower preload_nchunks (e.g. preload_nchunks={hint})")
            pad = self._dataset_arg("even_batches", "pad")
            if pad is not None:
                fixes.append(f"for a model that skips padding rows (flagged False under "
                             f"'mask'), pass {pad}")
        msg = (
            f"{self._where()}: the training split has {rows:,} rows ({rows / pool:.1f} pools "
            f"of {pool:,} rows) for {world} rank(s) at batch_size={ds.batch_size}; an epoch "
            f"uses only {kept:,} rows ({len(ds)} batches per rank): {'; '.join(causes)}. "
            f"Fix: {', or '.join(fixes)}."
        )
        if len(ds) == 0:
            raise ValueError(msg)
        logger.warning(msg)

    def _dataset_arg(self, key: str, value: Any) -> str | None:
        """How a user of this DataModule passes the dataset argument ``key=value``
        (``None``: this DataModule does not take it)."""
        return f"dataset_kwargs={{{key!r}: {value!r}}}"

    # -- loaders -----------------------------------------------------------------------
    def _loader(self, ds: AnnBatchDataset | None, name: str) -> AnnBatchDataLoader:
        if ds is None:
            raise RuntimeError(f"{name}: call setup() first (the Trainer does this for you).")
        trainer = getattr(self, "trainer", None)
        on_cuda = False
        if trainer is not None:
            on_cuda = getattr(trainer.strategy.root_device, "type", "cpu") == "cuda"
        dev = getattr(ds, "device", None)
        kwargs: dict[str, Any] = {
            "num_workers": self.num_workers,
            # batches of a dataset with device="cuda" are on the GPU already: not pinnable
            "pin_memory": on_cuda and (dev is None or dev.type != "cuda"),
            "persistent_workers": self.num_workers > 0,
        }
        kwargs.update(self.dataloader_kwargs)
        if not kwargs.get("num_workers"):
            kwargs["persistent_workers"] = False  # DataLoader refuses it without workers
        # Lightning applies a state saved at an epoch's last step to the next epoch
        return AnnBatchDataLoader(ds, finished_starts_next_epoch=True, **kwargs)

    def train_dataloader(self) -> AnnBatchDataLoader:
        """Shuffled training batches of this rank; Lightning advances the epoch.

        Lightning creates the first epoch's iterator (which starts the workers, and they
        read the epoch) *before* it calls ``sampler.set_epoch``; after a resume that first
        epoch is not 0. So the epoch the fit loop is about to run is set here already, or,
        while Lightning has not restored its loops yet (it builds the loader that early
        when ``configure_optimizers`` reads ``trainer.estimated_stepping_batches``), the
        epoch :meth:`load_state_dict` restored.
        """
        loader = self._train_loader_for_epoch()
        self._end_forced_reload()
        limit = getattr(getattr(self, "trainer", None), "limit_train_batches", None)
        if isinstance(limit, int | float) and not isinstance(limit, bool):
            loader.epoch_limit = limit  # a state at the limit is the epoch's end
        if self._pending_loader_state is not None:  # a mid-epoch checkpoint: exact resume
            loader.load_state_dict(self._pending_loader_state)
            self._pending_loader_state = None
            if loader.resumed_elsewhere:
                self._force_reload_after_this_epoch(loader)
        self._train_loader = loader
        return loader

    def _force_reload_after_this_epoch(self, loader: AnnBatchDataLoader) -> None:
        """An epoch resumed on another number of devices holds another number of batches
        per rank than the next ones (what was done before is counted in both). Lightning
        reads the epoch's length once, when it sets up the train loader, and stops an epoch
        there; so the train loader is set up again for the next epoch
        (``Trainer.reload_dataloaders_every_n_epochs`` is 1 for one epoch, then as it was)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None or not hasattr(trainer, "reload_dataloaders_every_n_epochs"):
            return
        self._reload_setting = trainer.reload_dataloaders_every_n_epochs
        trainer.reload_dataloaders_every_n_epochs = 1
        logger.info("AnnBatchDataModule: the resumed epoch runs on another number of devices "
                    "and yields %d batches per rank in all; the train loader is reloaded for "
                    "the next epoch.", len(loader))

    def _end_forced_reload(self) -> None:
        if self._reload_setting is not None:
            trainer = getattr(self, "trainer", None)
            if trainer is not None:
                trainer.reload_dataloaders_every_n_epochs = self._reload_setting
            self._reload_setting = None

    def _train_loader_for_epoch(self) -> AnnBatchDataLoader:
        epoch = self._fit_loop_epoch()
        if self.train_dataset is not None and epoch is not None:
            if self._restored_epoch is not None and epoch < self._restored_epoch:
                # Lightning builds the loader before it restores its loops when
                # configure_optimizers reads trainer.estimated_stepping_batches: the loop
                # still says 0 and the epoch restored by load_state_dict is the right one
                epoch = self._restored_epoch
            else:
                self._restored_epoch = None
            self.set_epoch(epoch)
        return self._loader(self.train_dataset, "train_dataloader")

    def _fit_loop_epoch(self) -> int | None:
        """The epoch Lightning's fit loop passes to ``set_epoch`` next (None off Lightning)."""
        loop = getattr(getattr(self, "trainer", None), "fit_loop", None)
        epoch = getattr(getattr(getattr(loop, "epoch_progress", None), "current", None),
                        "processed", None)
        return epoch if isinstance(epoch, int) else None

    def _where(self) -> str:
        """The store or source, as messages name it."""
        if isinstance(self.store_path, Source):
            return self.store_path.describe()
        return str(self.store_path)

    def val_dataloader(self) -> AnnBatchDataLoader | list[Any]:
        """Validation batches in order (``[]`` without a split); with
        ``eval_even_batches="pad"`` they carry a ``"mask"`` key."""
        if self.val_dataset is None:
            return []
        return self._loader(self.val_dataset, "val_dataloader")

    def test_dataloader(self) -> AnnBatchDataLoader:
        """The test split's rows (every row of the collection without one), in order; with
        ``eval_even_batches="pad"`` each once, with a ``"mask"`` key."""
        return self._loader(self.test_dataset, "test_dataloader")

    def predict_dataloader(self) -> AnnBatchDataLoader:
        """Every row of the collection, in order; with ``eval_even_batches="pad"`` each
        once, with a ``"mask"`` key."""
        return self._loader(self.predict_dataset, "predict_dataloader")

    # -- checkpointing -----------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the training dataset is set to."""
        return self.train_dataset.epoch if self.train_dataset is not None else self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Set the training epoch (Lightning does this itself through the sampler)."""
        epoch = check_int("epoch", epoch, 0)
        self._epoch = epoch
        if self.train_dataset is not None:
            self.train_dataset.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "seed", "epoch"}``; Lightning stores it in checkpoints.

        Under a fitting trainer ``epoch`` is the epoch a resumed run starts in (the fit
        loop's processed-epoch count, e.g. 1 in a checkpoint written at the end of epoch
        0); otherwise it is the epoch the training dataset is set to.
        """
        fitting = getattr(getattr(getattr(self, "trainer", None), "state", None), "fn", None)
        epoch = self._fit_loop_epoch() if fitting == "fit" else None
        out: dict[str, Any] = {"version": _STATE_VERSION, "seed": self.seed,
                               "epoch": self.epoch if epoch is None else epoch}
        loader = self._train_loader
        if loader is not None:
            # carried here too: when configure_optimizers reads
            # trainer.estimated_stepping_batches, Lightning builds the loader before it
            # restores its loops and never applies its own saved loader state
            state = loader.state_dict()
            if is_mid_epoch(state, self._epoch_batches(loader)):
                out["train_loader"] = state
        return out

    def _epoch_batches(self, loader: AnnBatchDataLoader) -> int:
        """Batches of a training epoch: the loader's, or fewer under the trainer's
        ``limit_train_batches`` (a state at that limit is an epoch's end, not its middle)."""
        n = len(loader)
        limit = getattr(getattr(self, "trainer", None), "num_training_batches", None)
        if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < n:
            return limit
        return n

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the seed (split and epoch orders) and the epoch of :meth:`state_dict`.

        Lightning calls this after :meth:`setup` when resuming from a checkpoint, and then
        sets the epoch from its own loop progress at every epoch start; datasets that exist
        are rebuilt when the seed changes (the split depends on it).
        """
        self._pending_loader_state = state_dict.get("train_loader")
        got = state_ints(state_dict, ("seed", "epoch"), "AnnBatchDataModule.state_dict()")
        seed, epoch = got["seed"], got["epoch"]
        if seed != self.seed:
            logger.info("Restoring seed %d (was %d).", seed, self.seed)
            self.seed = seed
            if self.collection is not None:
                stages = []
                if self.train_dataset is not None:
                    stages.append("fit")
                if self.predict_dataset is not None:
                    stages.append("test")
                for stage in stages:
                    self.setup(stage)
        self.set_epoch(epoch)
        self._restored_epoch = epoch


#: how far (a factor, either way) a held-out part's rows may miss its fraction of the rows
#: before the split takes smaller chunks (and, at single rows, warns)
_SPLIT_TOLERANCE = 2.0
#: collections of at most this many chunks may be split in smaller chunks than
#: ``chunk_size`` (few chunks cannot meet a fraction); larger ones always split whole chunks
FEW_CHUNKS = 64


def _miss(n_obs: int, rows: int, fraction: float) -> float:
    """By what factor ``rows`` of ``n_obs`` miss ``fraction`` (1.0: exactly, inf: none)."""
    if fraction <= 0 or n_obs <= 0:
        return 1.0
    got = rows / n_obs
    return float("inf") if got == 0 else max(got / fraction, fraction / got)


def _split(n_obs: int, chunk_size: int, val_fraction: float, test_fraction: float,
           seed: int, codes: np.ndarray | None = None
           ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """``(split_chunk_size, train_ids, val_ids, test_ids)``: the DataModule's split.

    Whole chunks of ``chunk_size`` rows (:func:`~annbatch_torch.sampling.split_chunks3`)
    for a collection of more than :data:`FEW_CHUNKS` chunks (so its split, and the
    checkpoints of runs on it, never change; a part more than 2x off its fraction is
    warned about), or when every held-out part is within :data:`_SPLIT_TOLERANCE` of its
    fraction of the rows; else chunks of ``chunk_size // 2``,
    ``// 4``, ... rows, the first size that is (at least a quarter of the smallest part's
    rows, or 1), or the size that misses least. Pure and deterministic: every rank and a
    resumed run compute the same split from the same ``n_obs``, fractions and ``seed``.
    """
    def strata(unit: int) -> np.ndarray | None:
        return None if codes is None else codes[np.arange(0, n_obs, unit)]

    if -(-n_obs // chunk_size) > FEW_CHUNKS:  # many chunks: whole ones, as always
        return (chunk_size, *sampling.split_chunks3(n_obs, chunk_size, val_fraction,
                                                    test_fraction, seed, strata(chunk_size)))
    fractions = [f for f in (val_fraction, test_fraction) if f > 0]
    lowest = max(1, int(min(fractions, default=0.0) * n_obs) // 4)
    best: tuple[float, int, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
    unit = chunk_size
    while True:
        parts = sampling.split_chunks3(n_obs, unit, val_fraction, test_fraction, seed,
                                       strata(unit))
        miss = max(_miss(n_obs, sampling.chunk_rows(n_obs, unit, ids), frac)
                   for frac, ids in ((val_fraction, parts[1]), (test_fraction, parts[2])))
        if best is None or miss < best[0]:
            best = (miss, unit, parts)
        if miss <= _SPLIT_TOLERANCE or unit <= lowest:
            break
        unit = max(lowest, unit // 2)
    _, unit, (train, val, test) = best
    return unit, train, val, test
