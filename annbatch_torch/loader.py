"""A ``DataLoader`` that advances the dataset's epoch the way samplers do, and resumes.

It is torchdata's ``StatefulDataLoader``: ``state_dict()`` after k batches and
``load_state_dict()`` on a fresh loader continue with exactly the remaining batches (the
dataset implements the ``Stateful`` protocol per worker); Lightning saves and restores that
state in mid-epoch checkpoints.

Lightning (and most training loops built for map-style datasets) call
``dataloader.sampler.set_epoch(epoch)`` before each epoch, but never touch an
``IterableDataset``. :class:`AnnBatchDataLoader` installs a sampler that forwards
``set_epoch`` to the :class:`~annbatch_torch.AnnBatchDataset`, whose epoch lives in
shared memory and so reaches persistent workers too.

When the epoch is read: a dataset copy reads it in ``__iter__``, i.e. when the loader's
iterator is created (with workers: when they start, or for persistent workers when they
are resumed). Lightning 2.x (measured with 2.6) creates the *first* epoch's iterator in
``FitLoop.setup_data`` before it calls ``sampler.set_epoch``; later epochs call
``set_epoch`` first. In a fresh run the first epoch is 0 either way, but after resuming
from a checkpoint it is not: :class:`~annbatch_torch.AnnBatchDataModule` sets the epoch
in ``train_dataloader()``; with your own ``LightningModule.train_dataloader`` call
``dataset.set_epoch(self.trainer.fit_loop.epoch_progress.current.processed)`` there (the
value Lightning passes to ``set_epoch``; ``trainer.current_epoch`` can lag it then).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from .dataset import AnnBatchDataset

__all__ = ["AnnBatchDataLoader", "EpochForwardingSampler"]


class EpochForwardingSampler(Sampler[None]):
    """The sampler of an iterable-style loader (yields ``None`` forever) whose
    ``set_epoch`` sets the dataset's epoch."""

    def __init__(self, dataset: AnnBatchDataset) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[None]:
        while True:
            yield None

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)


class AnnBatchDataLoader(StatefulDataLoader):
    """``DataLoader(dataset, batch_size=None, ...)`` whose ``sampler.set_epoch`` reaches the
    dataset. All keyword arguments go to :class:`torch.utils.data.DataLoader`."""

    def __init__(self, dataset: AnnBatchDataset, **kwargs: Any) -> None:
        if not isinstance(dataset, AnnBatchDataset):
            raise TypeError(f"AnnBatchDataLoader needs an AnnBatchDataset, got {type(dataset)}.")
        kwargs.setdefault("batch_size", None)
        if kwargs["batch_size"] is not None:
            raise ValueError(
                "AnnBatchDataset yields whole batches: leave DataLoader batch_size=None and set "
                "batch_size on the dataset."
            )
        super().__init__(dataset, **kwargs)
        # DataLoader forbids assigning `sampler` after __init__; iterable-style loaders only
        # use it as an infinite source of None, which this sampler still is.
        object.__setattr__(self, "sampler", EpochForwardingSampler(dataset))


def is_mid_epoch(state: dict[str, Any], n_batches: int) -> bool:
    """Whether a ``StatefulDataLoader`` state was taken inside an epoch (neither before
    its first batch nor after its last)."""
    snap = state.get("_snapshot")
    done = snap["_snapshot_step"] if snap is not None else state.get("_num_yielded", 0)
    return not state.get("_iterator_finished", False) and 0 < int(done) < n_batches
