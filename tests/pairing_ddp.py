"""Pairing in a real ``gloo`` group: ``torch.multiprocessing.spawn`` target of
``tests/test_pairing.py``. Each rank runs ``DataLoader(num_workers=2)`` (``fork`` or
``spawn`` workers) over a :class:`~annbatch_torch.PairedSampler` with
``even_batches="pad"`` and an ``all_reduce`` after every batch (a rank yielding more batches
than its peer would hang until the timeout), then saves its perturbed rows, their controls
and masks as ``rank{r}.npz``."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from annbatch_torch import A, AnnBatchDataset, PairedSampler

BATCH = 64
N_CONTROLS = 2


def dataset(store: str) -> AnnBatchDataset:
    return AnnBatchDataset(
        store, selector={"t": A.obs["target_gene"]}, batch_size=BATCH, return_index=True,
        seed=7, even_batches="pad",
        sampler=PairedSampler("target_gene", "non-targeting",
                              match=("cell_line", "gem_group"), n_controls=N_CONTROLS))


def entry(rank: int, world_size: int, port: int, store: str, out: str, context: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=150))
    try:
        ds = dataset(store)  # rank and world size from the group
        got: dict[str, list[np.ndarray]] = {k: [] for k in (
            "index", "control_index", "mask", "control_mask")}
        n = 0
        for batch in DataLoader(ds, batch_size=None, num_workers=2,
                                multiprocessing_context=context):
            for k, v in got.items():
                v.append(batch[k].numpy())
            n += 1
            dist.all_reduce(torch.ones(1))
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(counts, torch.tensor([n]))
        np.savez(Path(out) / f"rank{rank}.npz", n_batches=n, len=len(ds),
                 counts=torch.cat(counts).numpy(),
                 **{k: np.concatenate(v) for k, v in got.items()})
    finally:
        dist.destroy_process_group()
