"""Lightning mid-epoch checkpoint resume: ``Trainer.fit(ckpt_path=...)`` from a checkpoint
saved in the middle of an epoch trains on exactly the remaining cells of that epoch, in the
uninterrupted run's order, then on an identical next epoch.

How Lightning 2.6 does it (``loops/fit_loop.py``, ``utilities/combined_loader.py``):
``FitLoop.on_save_checkpoint`` stores ``loader.state_dict()`` of every train DataLoader that
has ``state_dict`` *and* ``load_state_dict`` (``lightning.fabric.utilities.types._Stateful``);
on resume ``FitLoop.setup_data`` calls ``loader.load_state_dict(state)`` right after
``train_dataloader()`` and before it creates the iterator, and only when the checkpoint is
mid-epoch (``fit_loop.restarting``). torchdata's ``StatefulDataLoader`` has both methods: its
state holds, per worker, our dataset's ``state_dict()`` (seed, epoch, worker, batches done).
Lightning's ``_PrefetchDataFetcher`` does not prefetch when the loader has a length (ours
has), so the saved count is exactly the batches trained on.

Two things the DataModule does for this (``annbatch_torch/lightning.py``, ``loader.py``):

1. It builds the *train* loader on ``StatefulDataLoader`` (keeping the epoch-forwarding
   sampler). A plain ``torch.utils.data.DataLoader`` is not ``_Stateful``: Lightning warns
   and the resumed run replays the epoch from its first batch while counting it as the rest.
2. It carries the loader state in its own ``state_dict`` too and apply it in
   ``train_dataloader()``: when ``configure_optimizers`` reads
   ``trainer.estimated_stepping_batches`` (OneCycleLR and friends), Lightning builds the
   train loader before it restores the loops and then never applies the saved loader state
   (Lightning issue #20550): without this the resumed epoch silently restarts. Only a
   mid-epoch state is carried (an end-of-epoch state would make the next epoch empty);
   under ``limit_train_batches`` the epoch ends at the limit.
3. Its loaders treat a state saved at an epoch's last step (``every_n_train_steps``
   dividing the epoch) as the start of the next epoch: Lightning applies it to the next
   epoch's iterator, which would otherwise yield nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch

pl = pytest.importorskip("lightning.pytorch")
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

import annbatch_torch as abt  # noqa: E402
from annbatch_torch import A  # noqa: E402
from annbatch_torch.lightning import AnnBatchDataModule  # noqa: E402

N_VARS = 10
BATCH = 32


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("lresume")
    rng = np.random.default_rng(0)
    n = 1000
    x = sp.random(n, N_VARS, density=0.3, format="csr", dtype=np.float32, random_state=rng)
    a = ad.AnnData(x, obs=pd.DataFrame(index=[f"c{i}" for i in range(n)]),
                   var=pd.DataFrame(index=[f"g{i}" for i in range(N_VARS)]))
    p = d / "in.h5ad"
    a.write_h5ad(p)
    out = d / "store"
    abt.create_anndata_collection([p], out, seed=0, progress=False)
    return out


class _Preempted(Exception):
    pass


class Model(pl.LightningModule):
    def __init__(self, stop_after: int | None = None, ckpt: str | None = None,
                 schedule: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(N_VARS, 1)
        self.seen: list[tuple[int, np.ndarray]] = []
        self.stop_after, self.ckpt, self.schedule = stop_after, ckpt, schedule

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, batch["index"].numpy().copy()))
        return self.layer(batch["x"]).pow(2).mean()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.stop_after is not None and len(self.seen) == self.stop_after:
            assert self.ckpt is not None
            self.trainer.save_checkpoint(self.ckpt)
            raise _Preempted  # a preemption right after the checkpoint

    def on_train_epoch_end(self) -> None:
        if self.stop_after == -1:  # checkpoint at the end of epoch 0, then preempted
            assert self.ckpt is not None
            self.trainer.save_checkpoint(self.ckpt)
            raise _Preempted

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        if not self.schedule:
            return opt
        # OneCycleLR needs the total step count: asking for it makes Lightning build the
        # train loader before it restores the loops (Lightning issue #20550)
        total = self.trainer.estimated_stepping_batches
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _trainer(**kwargs: Any) -> Any:
    return pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def _dm(store: Path, num_workers: int) -> Any:
    return AnnBatchDataModule(
        None, store, selector={"x": A.X}, batch_size=BATCH, chunk_size=16, preload_nchunks=4,
        num_workers=num_workers, seed=3, densify=True, dataset_kwargs={"return_index": True},
    )


def _by_epoch(seen: list[tuple[int, np.ndarray]]) -> dict[int, list[np.ndarray]]:
    out: dict[int, list[np.ndarray]] = {}
    for e, idx in seen:
        out.setdefault(e, []).append(idx)
    return out


def _check_resume(make_dm: Any, tmp_path: Path, num_workers: int, where: str,
                  **trainer_kw: Any) -> None:
    schedule = where.endswith("onecycle")
    ref = Model(schedule=schedule)
    _trainer(**trainer_kw).fit(ref, datamodule=make_dm(num_workers))
    full = _by_epoch(ref.seen)
    n = len(full[0])
    # "end": a checkpoint at the epoch's last step (e.g. every_n_train_steps dividing it)
    k = {"one": 1, "mid": n // 2, "last": n - 1, "end": n,
         "epoch_end": -1}[where.split("-")[0]]

    ckpt = str(tmp_path / "mid.ckpt")
    first = Model(stop_after=k, ckpt=ckpt, schedule=schedule)
    with pytest.raises(_Preempted):
        _trainer(**trainer_kw).fit(first, datamodule=make_dm(num_workers))

    resumed = Model(schedule=schedule)
    _trainer(**trainer_kw).fit(resumed, datamodule=make_dm(num_workers), ckpt_path=ckpt)
    got = _by_epoch(first.seen + resumed.seen)
    assert [len(got[e]) for e in (0, 1)] == [len(full[e]) for e in (0, 1)]
    for e in (0, 1):
        for a, b in zip(got[e], full[e]):
            np.testing.assert_array_equal(a, b)
    rows = np.sort(np.concatenate(got[0]))  # every cell of epoch 0 exactly once
    assert len(np.unique(rows)) == len(rows)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("where", ["one", "mid", "last", "end", "mid-onecycle", "epoch_end"])
def test_fit_resumes_mid_epoch_with_the_remaining_cells(
    store: Path, tmp_path: Path, num_workers: int, where: str
) -> None:
    _check_resume(lambda nw: _dm(store, nw), tmp_path, num_workers, where)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("where", ["mid", "epoch_end"])
def test_fit_resumes_under_limit_train_batches(
    store: Path, tmp_path: Path, num_workers: int, where: str
) -> None:
    """An epoch cut by limit_train_batches ends at the limit: its end-of-epoch state is not
    a mid-epoch one, and the next epoch after the resume is the uninterrupted run's."""
    _check_resume(lambda nw: _dm(store, nw), tmp_path, num_workers, where,
                  limit_train_batches=5)


@pytest.mark.timeout(300)
def test_annbatch_datamodule_resumes_mid_epoch(store: Path, tmp_path: Path) -> None:
    def make(nw: int) -> Any:
        return abt.AnnBatchDataModule(
            None, store, selector={"x": A.X}, batch_size=BATCH, chunk_size=16,
            preload_nchunks=4, num_workers=nw, seed=3, densify=True,
            dataset_kwargs={"return_index": True},
        )

    from lightning.fabric.utilities.types import _Stateful

    dm = make(0)
    dm.setup("fit")
    assert isinstance(dm.train_dataloader(), _Stateful)
    _check_resume(make, tmp_path, 2, "mid-onecycle")


def test_train_loader_is_stateful_for_lightning(store: Path) -> None:
    """What Lightning checks (``lightning.fabric.utilities.types._Stateful``)."""
    from lightning.fabric.utilities.types import _Stateful

    dm = _dm(store, 0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader, _Stateful)
    assert isinstance(loader, StatefulDataLoader)
    assert len(loader) > 0  # a length: Lightning then does not prefetch (exact counts)
