"""Module-level helpers of ``tests/test_lightning.py``: they must be importable by name in
processes started with ``spawn`` (``ddp_spawn`` ranks, racing ``prepare_data`` calls)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

import annbatch_torch as abt


class Recorder(pl.LightningModule):
    """A linear model that writes the global row ids it sees per rank, epoch and stage.

    Files under ``out``: ``train_r{rank}_e{epoch}.npz`` (``index``, ``sizes``,
    ``worker_epoch``, ``worker_pid``), ``val_r{rank}_n{k}.npz`` (``index``, ``mask``) and
    ``fit_r{rank}.json`` (the DataModule's ``store_written``).
    """

    def __init__(self, out: str, n_vars: int) -> None:
        super().__init__()
        self.out = Path(out)
        self.layer = torch.nn.Linear(n_vars, 1)
        self._train: list[dict[str, np.ndarray]] = []
        self._val: list[dict[str, np.ndarray]] = []
        self._n_val = 0

    def on_fit_start(self) -> None:
        dm = self.trainer.datamodule
        info = {"store_written": getattr(dm, "store_written", None)}
        (self.out / f"fit_r{self.global_rank}.json").write_text(json.dumps(info))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._train.append({k: batch[k].cpu().numpy() for k in
                            ("index", "worker_epoch", "worker_pid")})
        return self.layer(batch["x"]).pow(2).mean()

    def on_train_epoch_end(self) -> None:
        b = self._train
        np.savez(
            self.out / f"train_r{self.global_rank}_e{self.current_epoch}.npz",
            index=np.concatenate([x["index"] for x in b]) if b else np.zeros(0, np.int64),
            sizes=np.array([len(x["index"]) for x in b], dtype=np.int64),
            worker_epoch=np.array([int(x["worker_epoch"]) for x in b], dtype=np.int64),
            worker_pid=np.array([int(x["worker_pid"]) for x in b], dtype=np.int64),
        )
        self._train = []

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        if not self.trainer.sanity_checking:
            self._val.append({"index": batch["index"].cpu().numpy(),
                              "mask": batch["mask"].cpu().numpy()})

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        b = self._val
        np.savez(
            self.out / f"val_r{self.global_rank}_n{self._n_val}.npz",
            index=np.concatenate([x["index"] for x in b]) if b else np.zeros(0, np.int64),
            mask=np.concatenate([x["mask"] for x in b]) if b else np.zeros(0, bool),
        )
        self._n_val += 1
        self._val = []

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        return {"index": batch["index"], "mask": batch["mask"], "y": self.layer(batch["x"])}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def race_prepare(paths: list[str], store: str, barrier: Any, queue: Any) -> None:
    """One of two processes that call ``prepare_data`` at the same moment.

    The write is slowed by a second so that the two calls overlap for sure.
    """
    import annbatch_torch.write.writer as writer

    real = writer.create_anndata_collection

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1.0)
        return real(*args, **kwargs)

    writer.create_anndata_collection = slow_write  # type: ignore[assignment]
    dm = abt.AnnBatchDataModule(paths, store, batch_size=64, collection_kwargs={
        "progress": False})
    barrier.wait()
    t0 = time.time()
    dm.prepare_data()
    queue.put({"pid": os.getpid(), "written": dm.store_written, "start": t0,
               "end": time.time()})


class EarlyLoaderRecorder(Recorder):
    """Reads ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` (as users of
    OneCycleLR do): Lightning then builds the train loader before it restores its loops."""

    def configure_optimizers(self) -> Any:
        self.total_steps = int(self.trainer.estimated_stepping_batches)  # builds the loader
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Preempted(Exception):
    """Raised right after a checkpoint: a job preempted there."""


class StepRecorder(pl.LightningModule):
    """A linear model that writes the row ids of every training batch it sees, with their
    epoch, to ``{out}/{tag}_r{rank}.npz`` when fit ends, or after ``stop_after`` batches: it
    saves the checkpoint ``ckpt`` there first, then raises :class:`Preempted`."""

    def __init__(self, out: str, tag: str, n_vars: int, stop_after: int | None = None,
                 ckpt: str | None = None) -> None:
        super().__init__()
        self.out, self.tag = Path(out), tag
        self.layer = torch.nn.Linear(n_vars, 1)
        self.stop_after, self.ckpt = stop_after, ckpt
        self._seen: list[tuple[int, np.ndarray]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._seen.append((self.current_epoch, batch["index"].cpu().numpy().copy()))
        return self.layer(batch["x"]).pow(2).mean()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.stop_after is not None and len(self._seen) == self.stop_after:
            assert self.ckpt is not None
            self.trainer.save_checkpoint(self.ckpt)
            self._dump()
            raise Preempted

    def on_train_end(self) -> None:
        self._dump()

    def _dump(self) -> None:
        seen = self._seen
        np.savez(self.out / f"{self.tag}_r{self.global_rank}.npz",
                 epoch=np.array([e for e, _ in seen], dtype=np.int64),
                 sizes=np.array([len(i) for _, i in seen], dtype=np.int64),
                 index=np.concatenate([i for _, i in seen]) if seen else np.zeros(0, np.int64),
                 len=len(self.trainer.train_dataloader) if self.trainer.train_dataloader
                 is not None else -1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)
