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

import logging
import warnings
from typing import Any

from torch.utils.data import Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from . import resume
from .annbatch_dataset import AnnBatchDataset
from .read.densify import Densifying

__all__ = ["AnnBatchDataLoader", "EpochForwardingSampler"]

logger = logging.getLogger(__name__)

# torchdata 0.11 calls torch.set_vital, which torch >= 2.9 deprecates, at every epoch
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning,
                        module=r"torchdata\.")


class EpochForwardingSampler(Sampler[None]):
    """The sampler of an iterable-style loader (yields ``None`` forever) whose
    ``set_epoch`` sets the dataset's epoch."""

    def __init__(self, dataset: AnnBatchDataset) -> None:
        self.dataset = dataset

    def __iter__(self) -> Any:
        while True:
            yield None

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)


class AnnBatchDataLoader(StatefulDataLoader):
    """``DataLoader(dataset, batch_size=None, ...)`` whose ``sampler.set_epoch`` reaches the
    dataset, and that resumes mid-epoch (a torchdata ``StatefulDataLoader``).

    With ``densify=True`` on the dataset and ``num_workers > 0`` (and no ``pin_memory`` or
    ``collate_fn``), workers send sparse fields as CSR and the main process densifies them
    (scipy): moving dense batches between processes costs more than densifying them, and a
    worker needs far less memory. Sparse fields with a transform, or with a custom
    ``batch_converter``, are densified in the workers as usual.

    Parameters
    ----------
    dataset
        The :class:`~annbatch_torch.AnnBatchDataset` to load (any other type is a
        ``TypeError``).
    finished_starts_next_epoch
        When ``True``, a loaded state saved after an epoch's last batch starts the next
        epoch afresh instead of resuming a finished one (Lightning applies a state saved at
        an epoch's last step to the next epoch's iterator;
        :class:`~annbatch_torch.AnnBatchDataModule`'s loaders set it).
    **kwargs
        Passed to :class:`torch.utils.data.DataLoader` (``num_workers``, ``pin_memory``,
        ``persistent_workers``, ``multiprocessing_context``...). ``batch_size`` must stay
        ``None`` (the dataset batches); ``pin_memory=True`` with a dataset whose pools are
        on a GPU is a ``ValueError``.
    """

    def __init__(self, dataset: AnnBatchDataset, *, finished_starts_next_epoch: bool = False,
                 **kwargs: Any) -> None:
        if not isinstance(dataset, AnnBatchDataset):
            raise TypeError(f"AnnBatchDataLoader needs an AnnBatchDataset, got {type(dataset)}.")
        kwargs.setdefault("batch_size", None)
        if kwargs["batch_size"] is not None:
            raise ValueError(
                "AnnBatchDataset yields whole batches: leave DataLoader batch_size=None and set "
                "batch_size on the dataset."
            )
        dev = getattr(dataset, "device", None)
        if kwargs.get("pin_memory") and dev is not None and dev.type == "cuda":
            raise ValueError(
                f"pin_memory=True: the dataset's batches are on {dev} already (device="
                f"{str(dev)!r}) and GPU tensors cannot be pinned; leave pin_memory off."
            )
        policy = dataset.densify_policy_for_workers(
            num_workers=kwargs.get("num_workers", 0),
            pin_memory=bool(kwargs.get("pin_memory", False)),
            collate_fn=kwargs.get("collate_fn"),  # a collate_fn sees dense batches
        )
        if policy.where == "main":
            kwargs["worker_init_fn"] = policy.installer(kwargs.get("worker_init_fn"))
        super().__init__(dataset, **kwargs)
        self.finished_starts_next_epoch = bool(finished_starts_next_epoch)
        #: whether the last :meth:`load_state_dict` resumed an epoch saved on another number
        #: of ranks or workers (its batches are dealt anew, and its ``len`` differs)
        self.resumed_elsewhere = False
        #: the batches an epoch is cut to (Lightning's ``limit_train_batches``: an int, or a
        #: fraction of the epoch), for ``finished_starts_next_epoch``; ``None``: all
        self.epoch_limit: int | float | None = None
        # DataLoader forbids assigning `sampler` after __init__; iterable-style loaders only
        # use it as an infinite source of None, which this sampler still is.
        object.__setattr__(self, "sampler", EpochForwardingSampler(dataset))
        #: where its workers' batches are densified (``"main"``: here, as they arrive)
        object.__setattr__(self, "densify_policy", policy)
        # dense arrays reused from one epoch to the next (fresh ones each epoch would fault
        # in ~0.7 GB again): the batch in use and the one being made, per densified key
        object.__setattr__(self, "_dense_arrays", policy.dense_arrays())

    def __iter__(self) -> Any:
        it = super().__iter__()
        if self.num_workers > 0:  # the workers took their copies (and a loaded state)
            self.dataset._resume_handed_to_workers(self.num_workers)
        if self.densify_policy.where == "main":
            return Densifying(it, self.densify_policy, getattr(self, "_dense_arrays", None))
        return it

    def state_dict(self) -> dict[str, Any]:
        """torchdata's state plus the dataset's epoch: with workers the dataset states
        are snapshots taken when batches were made, so a ``set_epoch`` after the last
        batch (a checkpoint between epochs) would otherwise be lost."""
        state = dict(super().state_dict())
        state[resume.EPOCH_KEY] = self.dataset.epoch
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (also plain ``StatefulDataLoader`` states), on
        any number of ranks and workers.

        Saved with as many ranks and workers: torchdata restores every worker's copy, each
        worker's progress recomputed for *this* rank from the number of batches the loader
        had yielded (ranks yield the same number of batches, but their workers need not,
        and Lightning checkpoints rank 0's state only). Saved with another number of ranks
        or workers: the batches every old rank had yielded follow from that number (ranks
        are in step); the rest of the epoch is dealt anew to this topology
        (``sampling.remaining_batches``). What happens is decided by ``resume.restore``.
        """
        self.resumed_elsewhere = False
        ds = self.dataset
        decision = resume.restore(
            state_dict, plan=ds.epoch_plan, epoch=ds.epoch, rank=ds.rank,
            world_size=ds.world_size, num_workers=self.num_workers,
            finished_starts_next_epoch=self.finished_starts_next_epoch,
            epoch_limit=self.epoch_limit)
        if decision.epoch is not None:
            ds.set_epoch(decision.epoch)
        if decision.kind == "fresh":
            logger.info("AnnBatchDataLoader: epoch %d is set, later than the loaded state's "
                        "(%d); it runs from its start.", ds.epoch, decision.saved_epoch)
        elif decision.kind == "ended":
            logger.info("AnnBatchDataLoader: the loaded state was taken after the last batch "
                        "of epoch %d; epoch %d runs from its start (call set_epoch for the "
                        "next one).", decision.saved_epoch, ds.epoch)
        if decision.dataset_state is not None:
            ds.load_state_dict(decision.dataset_state)
        self.resumed_elsewhere = decision.resumed_elsewhere
        super().load_state_dict(decision.loader_state)
