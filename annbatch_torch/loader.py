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

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Sampler, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from . import sampling
from .annbatch_dataset import AnnBatchDataset
from .convert import csr_tensor_to_dense

__all__ = ["AnnBatchDataLoader", "EpochForwardingSampler"]

# torchdata 0.11 calls torch.set_vital, which torch >= 2.9 deprecates, at every epoch
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning,
                        module=r"torchdata\.")


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


class _DeferDensify:
    """``worker_init_fn``: let the worker's dataset copy send CSR for the keys the main
    process densifies, then run the user's ``worker_init_fn`` (picklable for spawn)."""

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        if info is not None and isinstance(info.dataset, AnnBatchDataset):
            info.dataset._defer_densify = True
        if self.user_fn is not None:
            self.user_fn(worker_id)


class _Densifying:
    """Iterator over a loader's batches that densifies the deferred keys (scipy)."""

    def __init__(self, it: Iterator[Any], keys: frozenset[str]) -> None:
        self._it = it
        self._keys = keys

    def __iter__(self) -> _Densifying:
        return self

    def __next__(self) -> Any:
        batch = next(self._it)
        if isinstance(batch, dict):
            for k in self._keys:
                v = batch.get(k)
                if isinstance(v, torch.Tensor) and v.layout == torch.sparse_csr:
                    batch[k] = csr_tensor_to_dense(v)
        return batch

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


class AnnBatchDataLoader(StatefulDataLoader):
    """``DataLoader(dataset, batch_size=None, ...)`` whose ``sampler.set_epoch`` reaches the
    dataset, and that resumes mid-epoch. All keyword arguments go to
    :class:`torch.utils.data.DataLoader`.

    With ``densify=True`` on the dataset and ``num_workers > 0`` (and no ``pin_memory`` or
    ``collate_fn``),
    workers send sparse fields as CSR and the main process densifies them (scipy): moving
    dense batches between processes costs more than densifying them (measured 1.4x faster
    with 2 workers on 2 CPUs, and a worker needs far less memory). Sparse fields with a
    transform, or with a custom ``batch_converter``, are densified in the workers as usual.
    """

    def __init__(self, dataset: AnnBatchDataset, **kwargs: Any) -> None:
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
        keys: frozenset[str] = frozenset()
        if (kwargs.get("num_workers", 0) > 0 and not kwargs.get("pin_memory", False)
                and kwargs.get("collate_fn") is None):  # a collate_fn sees dense batches
            keys = frozenset(dataset.deferred_dense_keys())
        if keys:
            kwargs["worker_init_fn"] = _DeferDensify(kwargs.get("worker_init_fn"))
        super().__init__(dataset, **kwargs)
        # AnnBatchDataModule's loaders: a state saved after an epoch's last batch starts the
        # next epoch (Lightning applies it to the next epoch's iterator)
        self._finished_starts_next_epoch = False
        # DataLoader forbids assigning `sampler` after __init__; iterable-style loaders only
        # use it as an infinite source of None, which this sampler still is.
        object.__setattr__(self, "sampler", EpochForwardingSampler(dataset))
        object.__setattr__(self, "_deferred_keys", keys)

    def __iter__(self) -> Any:
        it = super().__iter__()
        return _Densifying(it, self._deferred_keys) if self._deferred_keys else it

    def state_dict(self) -> dict[str, Any]:
        """torchdata's state plus the dataset's epoch: with workers the dataset states
        are snapshots taken when batches were made, so a ``set_epoch`` after the last
        batch (a checkpoint between epochs) would otherwise be lost."""
        state = dict(super().state_dict())
        state[_EPOCH_KEY] = self.dataset.epoch
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (also plain ``StatefulDataLoader`` states).

        With workers, each worker's progress is recomputed for *this* rank from the number
        of batches the loader had yielded: ranks yield the same number of batches, but
        their workers need not (the last round of pools is split by batches), and Lightning
        checkpoints rank 0's state only.
        """
        state = dict(state_dict)
        epoch = state.pop(_EPOCH_KEY, None)
        if epoch is not None and int(epoch) > self.dataset.epoch:
            self.dataset.set_epoch(int(epoch))  # a later epoch than the snapshots' wins
        snap = state.get("_snapshot")
        multi = isinstance(snap, dict) and bool(snap.get("_worker_snapshots"))
        if self._finished_starts_next_epoch:
            epoch, step, workers = _progress_of(state)
            if (epoch is not None and step is not None
                    and step >= sum(self._worker_counts(epoch, workers))):
                # the epoch was done (Lightning: a checkpoint at its last step, applied to
                # the next epoch's iterator): start the next epoch afresh
                if epoch + 1 > self.dataset.epoch:
                    self.dataset.set_epoch(epoch + 1)
                super().load_state_dict({})
                return
        if multi:
            state["_snapshot"] = self._for_this_rank(snap)
        super().load_state_dict(state)

    def _worker_counts(self, epoch: int, num_workers: int) -> list[int]:
        return [sampling.total_batches(self.dataset.plan(epoch, w, num_workers))
                for w in range(num_workers)]

    def _for_this_rank(self, snap: dict[str, Any]) -> dict[str, Any]:
        """The snapshot with every worker's batch count (and the worker that yielded last)
        recomputed from the loader's step for this rank's plan."""
        epoch, step, _ = _progress_of({"_snapshot": snap})
        workers = snap["_worker_snapshots"]
        if epoch is None or step is None:
            return snap
        counts = self._worker_counts(epoch, len(workers))
        if not 0 <= step <= sum(counts):
            return snap  # not this dataset's state: load_state_dict will say why
        done = sampling.consumed_per_worker(counts, step)
        out = dict(snap)
        out["_worker_snapshots"] = {}
        for key, w in workers.items():
            w = dict(w)
            ds_state = w.get("dataset_state")
            wid = ds_state.get("worker") if isinstance(ds_state, dict) else None
            if isinstance(wid, int) and 0 <= wid < len(done):
                w["dataset_state"] = {**ds_state, "batches": done[wid]}
            out["_worker_snapshots"][key] = w
        if step > 0:
            out["_last_yielded_worker_id"] = sampling.dataloader_order(counts)[step - 1][0]
        return out


_EPOCH_KEY = "annbatch_torch_epoch"


def _progress_of(state: dict[str, Any]) -> tuple[int | None, int | None, int]:
    """``(epoch, batches yielded, workers)`` of a ``StatefulDataLoader`` state of an
    :class:`AnnBatchDataset` (``None`` where the state does not say)."""
    snap = state.get("_snapshot")
    if isinstance(snap, dict) and snap.get("_worker_snapshots"):
        ds_states = [w.get("dataset_state") for w in snap["_worker_snapshots"].values()
                     if isinstance(w, dict)]
        step, workers = snap.get("_snapshot_step"), len(snap["_worker_snapshots"])
    else:
        ds_states, step, workers = [state.get("dataset_state")], state.get("_num_yielded"), 1
    epoch = next((d["epoch"] for d in ds_states
                  if isinstance(d, dict) and isinstance(d.get("epoch"), int)), None)
    return epoch, step if isinstance(step, int) else None, workers


def is_mid_epoch(state: dict[str, Any], n_batches: int) -> bool:
    """Whether a ``StatefulDataLoader`` state was taken inside an epoch (neither before
    its first batch nor after its last)."""
    snap = state.get("_snapshot")
    done = snap["_snapshot_step"] if snap is not None else state.get("_num_yielded", 0)
    return not state.get("_iterator_finished", False) and 0 < int(done) < n_batches
