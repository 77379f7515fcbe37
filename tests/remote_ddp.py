"""One rank of a 2-rank ``gloo`` group reading a collection from the S3 server
(``tests/test_remote.py``): every batch followed by an ``all_reduce``, as DDP's backward
pass would be; the rank's row ids written to ``rank{r}.npy``."""

from __future__ import annotations

import datetime
import multiprocessing as mp
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import annbatch_torch as abt
from annbatch_torch import A


def entry(rank: int, world: int, init: str, url: str, options: dict[str, Any],
          cache: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=150))
    try:
        coll = abt.open_collection(url, storage_options=options, cache_dir=cache)
        ds = abt.AnnBatchDataset(coll, selector={"x": A.X}, batch_size=128, chunk_size=64,
                                 preload_nchunks=4, seed=3, return_index=True, densify=True)
        rows = []
        # fork, as under torchrun (a process started by torch.multiprocessing.spawn defaults
        # to "spawn", whose workers re-import torch and annbatch_torch); a remote collection
        # in spawned workers: test_workers_read_every_row_once_with_the_source_values[spawn]
        for b in DataLoader(ds, batch_size=None, num_workers=1,
                            multiprocessing_context=mp.get_context("fork")):
            rows.append(b["index"].numpy())
            t = torch.ones(1)
            dist.all_reduce(t)  # a rank with more batches than its peer would hang here
        np.save(f"{out}/rank{rank}.npy", np.concatenate(rows))
        np.save(f"{out}/batches{rank}.npy", np.array([len(rows)]))
    finally:
        dist.destroy_process_group()
