"""Lightning, elastic: a mid-epoch checkpoint of ``Trainer(devices=2, strategy="ddp_spawn")``
resumed by ``Trainer(devices=1)``, and one of ``devices=1`` resumed on 2 devices.

How it is derived, not gathered: the checkpoint holds rank 0's loader state only. DDP ranks
yield equal batch counts and step together, so rank 0's count is every rank's; with the
saved world size and worker count it fixes which batches every old rank consumed
(:func:`annbatch_torch.sampling.replay.remaining_batches`). The resumed epoch yields the rest, dealt
to the new ranks; Lightning reads an epoch's length once, so the DataModule has its train
loader set up again for the next epoch, which is a fresh run's.
"""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

pl = pytest.importorskip("lightning.pytorch")

from lightning_helpers import Preempted, StepRecorder  # noqa: E402

import annbatch_torch as abt  # noqa: E402
from annbatch_torch import A  # noqa: E402
from annbatch_torch.lightning import AnnBatchDataModule  # noqa: E402
from annbatch_torch.sampling import replay  # noqa: E402

N_OBS, N_VARS = 1200, 8
STOP = 7  # batches per rank before the preemption


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("lelastic")
    rng = np.random.default_rng(4)
    x = sp.random(N_OBS, N_VARS, density=0.4, format="csr", dtype=np.float32, random_state=rng)
    a = ad.AnnData(x, obs=pd.DataFrame(index=[f"c{i}" for i in range(N_OBS)]),
                   var=pd.DataFrame(index=[f"g{i}" for i in range(N_VARS)]))
    a.write_h5ad(d / "in.h5ad")
    abt.create_anndata_collection([d / "in.h5ad"], d / "store", seed=0, progress=False)
    return d / "store"


def _dm(store: Path, num_workers: int) -> AnnBatchDataModule:
    # workers forked: in a ddp_spawn rank the default start method is "spawn", whose workers
    # re-import torch, Lightning and annbatch_torch (3-4 s each) for nothing this file
    # checks (the resume derivation is the ranks' own); Lightning's ddp_spawn with spawned
    # workers: tests/test_lightning.py::test_ddp_two_ranks
    loader = {"multiprocessing_context": "fork"} if num_workers else None
    return AnnBatchDataModule(None, store, selector={"x": A.X}, batch_size=20, chunk_size=10,
                              preload_nchunks=3, num_workers=num_workers, seed=2, densify=True,
                              dataset_kwargs={"return_index": True}, dataloader_kwargs=loader)


def _fit(store: Path, out: Path, tag: str, devices: int, num_workers: int,
         stop: int | None = None, ckpt_path: str | None = None) -> None:
    ckpt = str(out / "mid.ckpt")
    model = StepRecorder(str(out), tag, N_VARS, stop_after=stop, ckpt=ckpt)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=devices, logger=False,
                         strategy="ddp_spawn" if devices > 1 else "auto",
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    if stop is None:
        trainer.fit(model, datamodule=_dm(store, num_workers), ckpt_path=ckpt_path)
        return
    with pytest.raises(Exception) as err:  # noqa: PT011 (ddp_spawn wraps the exception)
        trainer.fit(model, datamodule=_dm(store, num_workers))
    assert "Preempted" in repr(err.value) or isinstance(err.value, Preempted)


def _rows(dm: AnnBatchDataModule, epoch: int, world: int, rank: int, workers: int,
          segments: list[replay.Segment]) -> list[int]:
    ds = dm.train_dataset
    assert ds is not None
    out: list[int] = []
    for w in range(max(1, workers)):
        for it in ds.plan(epoch, w, workers, rank=rank, world_size=world, segments=segments):
            for b in range(it.batch_start, it.batch_stop):
                lo, hi = it.bounds(b)
                out += it.rows[lo:hi].tolist()
    return out


def _load(out: Path, tag: str, rank: int) -> dict[str, np.ndarray]:
    with np.load(out / f"{tag}_r{rank}.npz") as z:
        rec = dict(z)
    split = np.split(rec["index"], np.cumsum(rec["sizes"])[:-1]) if len(rec["sizes"]) else []
    rec["per_epoch"] = {e: np.concatenate([b for b, be in zip(split, rec["epoch"]) if be == e])
                        for e in set(rec["epoch"].tolist())}
    return rec


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("before", "after"), [((2, 2), (1, 0)), ((1, 2), (2, 1))])
def test_a_checkpoint_resumes_on_another_number_of_devices(
        store: Path, tmp_path: Path, before: tuple[int, int], after: tuple[int, int]) -> None:
    (w1, n1), (w2, n2) = before, after
    _fit(store, tmp_path, "first", w1, n1, stop=STOP)
    _fit(store, tmp_path, "resumed", w2, n2, ckpt_path=str(tmp_path / "mid.ckpt"))
    dm = _dm(store, 0)
    dm.setup("fit")
    first = [_load(tmp_path, "first", r) for r in range(w1)]
    resumed = [_load(tmp_path, "resumed", r) for r in range(w2)]
    assert all(len(f["sizes"]) == STOP for f in first)
    segments = [replay.Segment(w1, max(1, n1), STOP)]
    counts = []
    for r, rec in enumerate(resumed):
        got0, got1 = rec["per_epoch"][0], rec["per_epoch"][1]
        counts.append((int((rec["epoch"] == 0).sum()), int((rec["epoch"] == 1).sum())))
        assert sorted(got0.tolist()) == sorted(_rows(dm, 0, w2, r, n2, segments))
        # the next epoch is whole: a fresh run's on this many devices
        assert sorted(got1.tolist()) == sorted(_rows(dm, 1, w2, r, n2, []))
    assert len(set(counts)) == 1, counts  # equal steps on every rank in both epochs
    epoch0 = np.concatenate([f["per_epoch"][0] for f in first]
                            + [rec["per_epoch"][0] for rec in resumed])
    assert len(np.unique(epoch0)) == len(epoch0)  # every cell at most once
    assert N_OBS - len(epoch0) < max(w1, w2) * 20  # the documented drop
