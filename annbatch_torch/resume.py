"""Exact resume: the torchdata ``Stateful`` half of :class:`~annbatch_torch.AnnBatchDataset`.

Each copy of the dataset (one per DataLoader worker) counts the batches it yielded in the
current epoch (``self._progress``); :meth:`ResumeMixin.state_dict` returns that as JSON and
:meth:`ResumeMixin.load_state_dict` makes the next ``__iter__`` of the same epoch skip them
(:meth:`ResumeMixin._take_resume`). A state applies to its own epoch only.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from .sampling.worklist import state_ints

__all__ = ["ResumeMixin"]

logger = logging.getLogger("annbatch_torch.dataset")


class ResumeMixin:
    """``state_dict`` / ``load_state_dict`` of :class:`~annbatch_torch.AnnBatchDataset`."""

    seed: int
    _progress: dict[str, int]
    _resume: dict[str, int] | None
    _shared: Any

    @property
    def epoch(self) -> int:  # pragma: no cover - defined by the dataset
        raise NotImplementedError

    @property
    def world_size(self) -> int:  # pragma: no cover - defined by the dataset
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:  # pragma: no cover - defined by the dataset
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Small JSON-serialisable progress of this copy: seed, epoch, worker, batches done.

        Called by ``torchdata.stateful_dataloader.StatefulDataLoader`` in each worker. After
        :meth:`set_epoch` moved to another epoch than the last one iterated, the state is
        the start of that epoch.
        """
        progress = self._progress
        if progress["epoch"] != self.epoch:
            progress = {**progress, "epoch": self.epoch, "batches": 0}
        return {"version": 1, "seed": self.seed, "world_size": self.world_size, **progress}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration skips the batches done.

        The saved epoch becomes the dataset's epoch, unless a later epoch is set already:
        then the state is stale and that epoch runs from its start. A state saved after an
        epoch's last batch resumes that epoch with nothing left.
        """
        resume = state_ints(state_dict, ("seed", "epoch", "worker", "num_workers", "batches"),
                            "AnnBatchDataset.state_dict()")
        seed, epoch = resume.pop("seed"), resume["epoch"]
        if seed != self.seed:
            raise ValueError(
                f"load_state_dict: the state was saved with seed={seed} but this dataset has "
                f"seed={self.seed}; construct the dataset with seed={seed} to resume."
            )
        saved_world = state_dict.get("world_size")  # absent from states of 0.1.0
        if saved_world is not None and int(saved_world) != self.world_size:
            raise ValueError(
                f"load_state_dict: the state was saved with world_size={int(saved_world)} "
                f"but this dataset runs with world_size={self.world_size}: every rank's "
                "share of the epoch differs, so the batches done cannot be skipped. Resume "
                "with the same number of ranks (or start the epoch afresh without the state)."
            )
        self._resume = None
        if self.epoch > epoch:
            logger.info("AnnBatchDataset: epoch %d is set, later than the loaded state's "
                        "(%d); it runs from its start.", self.epoch, epoch)
            return
        self.set_epoch(epoch)
        self._shared[1] = -1  # resuming the same epoch is intended, not a forgotten set_epoch
        self._resume = resume

    def _take_resume(self, epoch: int, worker: int, num_workers: int) -> int:
        """Batches the loaded state says this copy already yielded of ``epoch`` (0 without
        one, or for another epoch); the state is used once."""
        resume, self._resume = self._resume, None
        if resume is None:
            return 0
        if resume["epoch"] != epoch:
            logger.warning(
                "AnnBatchDataset: the loaded state resumes epoch %d, but epoch %d was set "
                "since; epoch %d starts from its first batch.", resume["epoch"], epoch, epoch)
            return 0
        if resume["num_workers"] != num_workers or resume["worker"] != worker:
            raise ValueError(
                f"Cannot resume: the saved state comes from worker {resume['worker']} of "
                f"{resume['num_workers']} DataLoader workers, this is worker {worker} of "
                f"{num_workers}. Resume with the same num_workers."
            )
        return resume["batches"]
