"""`AnnBatchDataModule`: the collection and datasets behind ``Trainer.fit``.

* ``prepare_data`` (one process per node, guarded by a file lock beside the store) writes
  the collection if it is missing or its inputs changed (paths, sizes, mtimes recorded in
  the manifest); a current store is left untouched.
* ``setup`` opens it and builds rank-aware datasets: training shuffles and uses
  ``even_batches="drop"``; validation/test/predict read in order with
  ``even_batches="pad"`` and a boolean ``"mask"`` key so metrics can skip padded rows.
* Loaders are :class:`~annbatch_torch.loader.AnnBatchDataLoader`, so Lightning's
  per-epoch ``sampler.set_epoch`` advances the dataset's epoch (persistent workers too).

Needs the ``lightning`` extra (``pip install annbatch-torch[lightning]``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

try:
    import lightning.pytorch as pl
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "AnnBatchDataModule needs Lightning: pip install 'annbatch-torch[lightning]'."
    ) from e

from filelock import FileLock

from . import sampling
from .collection import Collection, open_collection
from .dataset import DEFAULT_CHUNK_SIZE, DEFAULT_PRELOAD_NCHUNKS, AnnBatchDataset
from .errors import CollectionError
from .fields import Field
from .loader import AnnBatchDataLoader
from .manifest import read_manifest

__all__ = ["AnnBatchDataModule", "store_is_current"]

logger = logging.getLogger(__name__)


def _input_signature(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path).resolve()
    st = p.stat()
    if p.is_dir():  # zarr store: newest mtime and total size of its files
        files = [f for f in p.rglob("*") if f.is_file()]
        return {
            "path": str(p),
            "size": sum(f.stat().st_size for f in files),
            "mtime": max([f.stat().st_mtime for f in files] + [st.st_mtime]),
        }
    return {"path": str(p), "size": st.st_size, "mtime": st.st_mtime}


def store_is_current(store_path: str | os.PathLike[str], adata_paths: Sequence[Any]) -> bool:
    """Whether ``store_path`` is a finished collection written from exactly these inputs,
    unchanged since (same resolved paths, sizes and modification times)."""
    try:
        manifest = read_manifest(store_path)
    except CollectionError:
        return False
    recorded = manifest.inputs
    if len(recorded) != len(adata_paths):
        return False
    for rec, path in zip(recorded, adata_paths):
        if not isinstance(path, str | os.PathLike) or not Path(path).exists():
            return False
        now = _input_signature(path)
        if rec.get("path") != now["path"] or rec.get("size") != now["size"]:
            return False
        if abs(float(rec.get("mtime") or 0) - now["mtime"]) > 1e-3:
            return False
    return True


class AnnBatchDataModule(pl.LightningDataModule):
    """Lightning DataModule over a shuffled collection written from ``adata_paths``.

    Parameters
    ----------
    adata_paths
        ``.h5ad`` / AnnData-zarr inputs of the collection.
    store_path
        Where the collection lives (written by ``prepare_data`` when missing or stale).
    selector, batch_size, chunk_size, preload_nchunks, densify
        Passed to :class:`~annbatch_torch.AnnBatchDataset`.
    num_workers
        DataLoader workers per rank.
    seed
        Seed of the offline shuffle, the train/validation split and the epoch orders.
    val_fraction
        Fraction of whole chunks held out for validation (0 disables validation).
    collection_kwargs
        Extra arguments of :func:`~annbatch_torch.create_anndata_collection`.
    dataloader_kwargs
        Extra arguments of the DataLoaders (``pin_memory``, ``persistent_workers``...).
    dataset_kwargs
        Extra arguments of every :class:`~annbatch_torch.AnnBatchDataset`.
    """

    def __init__(
        self,
        adata_paths: Sequence[str | os.PathLike[str]],
        store_path: str | os.PathLike[str],
        *,
        selector: Mapping[str, Field | str] | None = None,
        batch_size: int = 4096,
        num_workers: int = 0,
        seed: int = 0,
        val_fraction: float = 0.0,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        preload_nchunks: int = DEFAULT_PRELOAD_NCHUNKS,
        densify: bool = False,
        collection_kwargs: Mapping[str, Any] | None = None,
        dataloader_kwargs: Mapping[str, Any] | None = None,
        dataset_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= float(val_fraction) < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}.")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}.")
        self.adata_paths = [Path(p) for p in adata_paths]
        self.store_path = Path(store_path)
        self.selector = selector
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.val_fraction = float(val_fraction)
        self.chunk_size = chunk_size
        self.preload_nchunks = preload_nchunks
        self.densify = densify
        self.collection_kwargs = dict(collection_kwargs or {})
        self.dataloader_kwargs = dict(dataloader_kwargs or {})
        self.dataset_kwargs = dict(dataset_kwargs or {})
        self.collection: Collection | None = None
        self.train_dataset: AnnBatchDataset | None = None
        self.val_dataset: AnnBatchDataset | None = None
        self.test_dataset: AnnBatchDataset | None = None
        self._start_epoch = 0

    # -- data preparation --------------------------------------------------------------
    @property
    def lock_path(self) -> Path:
        return self.store_path.with_name(self.store_path.name + ".lock")

    def prepare_data(self) -> None:
        """Write the collection unless it is current (file-locked against races)."""
        from .writer import create_anndata_collection

        self.store_path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.lock_path)):
            if store_is_current(self.store_path, self.adata_paths):
                logger.info("%s is current; not rewriting it.", self.store_path)
                return
            logger.info("Writing collection %s from %d inputs.", self.store_path,
                        len(self.adata_paths))
            kwargs = {"seed": self.seed, **self.collection_kwargs}
            create_anndata_collection(self.adata_paths, self.store_path, overwrite=True, **kwargs)

    def _rank_world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return int(trainer.global_rank), int(trainer.world_size)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _dataset(self, chunk_ids: np.ndarray | None, train: bool) -> AnnBatchDataset:
        assert self.collection is not None
        rank, world = self._rank_world()
        kwargs: dict[str, Any] = dict(
            selector=self.selector, batch_size=self.batch_size, chunk_size=self.chunk_size,
            preload_nchunks=self.preload_nchunks, seed=self.seed, densify=self.densify,
            rank=rank, world_size=world, chunk_ids=chunk_ids,
        )
        if train:
            kwargs.update(shuffle=True, even_batches="drop")
        else:
            kwargs.update(shuffle=False, even_batches="pad", drop_last=False)
        kwargs.update(self.dataset_kwargs)
        return AnnBatchDataset(self.collection, **kwargs)

    def setup(self, stage: str | None = None) -> None:
        """Open the collection and build this rank's datasets."""
        self.collection = open_collection(self.store_path)
        n_obs = self.collection.n_obs
        train_ids, val_ids = sampling.split_chunks(
            n_obs, self.chunk_size, self.val_fraction, self.seed
        )
        if stage in (None, "fit", "validate"):
            self.train_dataset = self._dataset(train_ids, train=True)
            self.train_dataset.set_epoch(self._start_epoch)
            self.val_dataset = self._dataset(val_ids, train=False) if len(val_ids) else None
        if stage in (None, "test", "predict"):
            self.test_dataset = self._dataset(None, train=False)

    # -- loaders -----------------------------------------------------------------------
    def _loader(self, ds: AnnBatchDataset | None, name: str) -> AnnBatchDataLoader:
        if ds is None:
            raise RuntimeError(f"{name}: call setup() first (Trainer does this for you).")
        kwargs: dict[str, Any] = {
            "num_workers": self.num_workers,
            "pin_memory": bool(getattr(getattr(self, "trainer", None), "on_gpu", False)),
            "persistent_workers": self.num_workers > 0,
        }
        kwargs.update(self.dataloader_kwargs)
        return AnnBatchDataLoader(ds, **kwargs)

    def train_dataloader(self) -> AnnBatchDataLoader:
        return self._loader(self.train_dataset, "train_dataloader")

    def val_dataloader(self) -> AnnBatchDataLoader | list[Any]:
        if self.val_dataset is None:
            return []
        return self._loader(self.val_dataset, "val_dataloader")

    def test_dataloader(self) -> AnnBatchDataLoader:
        return self._loader(self.test_dataset, "test_dataloader")

    def predict_dataloader(self) -> AnnBatchDataLoader:
        return self._loader(self.test_dataset, "predict_dataloader")

    # -- checkpointing -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        epoch = self.train_dataset.epoch if self.train_dataset is not None else self._start_epoch
        return {"seed": self.seed, "epoch": epoch}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.seed = int(state_dict.get("seed", self.seed))
        self._start_epoch = int(state_dict.get("epoch", 0))
        if self.train_dataset is not None:
            self.train_dataset.seed = self.seed
            self.train_dataset.set_epoch(self._start_epoch)
