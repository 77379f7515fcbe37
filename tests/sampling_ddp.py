"""Sampling mode in a real ``gloo`` group: ``torch.multiprocessing.spawn`` target of
``tests/test_sampling_mode.py``. For each ``(store, chunk_size)`` case in turn, in one
group (one start of the ranks for all), each rank runs ``DataLoader(num_workers=2)`` over a
:class:`~annbatch_torch.ClassBalancedSampler` and an ``all_reduce`` after every batch (a
rank yielding more batches than its peer would hang until the timeout), then saves the
rows and labels it saw as ``case{i}_rank{r}.npz``. ``chunk_size``: the sampler's (runs of
rows on a collection grouped by cell type)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from annbatch_torch import A, AnnBatchDataset, ClassBalancedSampler

BATCH = 200
SEED = 3
NUM_SAMPLES = 24_000


def dataset(store: str, chunk_size: int | str = "auto") -> AnnBatchDataset:
    return AnnBatchDataset(store, selector={"y": A.obs["cell_type"]}, batch_size=BATCH,
                           return_index=True, seed=SEED,
                           sampler=ClassBalancedSampler("cell_type", num_samples=NUM_SAMPLES,
                                                        chunk_size=chunk_size))


def entry(rank: int, world_size: int, port: int, cases: list[tuple[str, int | str]],
          out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=150))
    try:
        for i, (store, chunk_size) in enumerate(cases):
            ds = dataset(store, chunk_size)  # rank and world size from the group
            index, labels = [], []
            # fork, as under torchrun (a process started by torch.multiprocessing.spawn
            # defaults to "spawn", whose workers re-import torch and annbatch_torch, 3-4 s
            # each); spawned workers in a rank: tests/test_ddp.py ("before_spawn") and
            # tests/test_pairing_loader.py ([spawn])
            for batch in DataLoader(ds, batch_size=None, num_workers=2,
                                    multiprocessing_context=mp.get_context("fork")):
                index.append(batch["index"].numpy())
                labels.append(batch["y"].numpy())
                dist.all_reduce(torch.ones(1))
            counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
            dist.all_gather(counts, torch.tensor([len(index)]))
            np.savez(Path(out) / f"case{i}_rank{rank}.npz", index=np.concatenate(index),
                     labels=np.concatenate(labels), n_batches=len(index), len=len(ds),
                     rank=ds.rank, counts=torch.cat(counts).numpy())
    finally:
        dist.destroy_process_group()
