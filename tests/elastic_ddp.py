"""Elastic resume in real ``gloo`` groups: ``torch.multiprocessing.spawn`` targets of
``tests/test_elastic_runs.py``.

:func:`save_entry`: every rank runs ``AnnBatchDataLoader(num_workers=...)`` for ``stop``
batches of epoch 0 (an ``all_reduce`` after each, as DDP's backward pass), saves the rows it
yielded, and rank 0 writes its loader state as JSON (what Lightning checkpoints).
:func:`resume_entry`: every rank of another topology loads rank 0's state, yields the rest
of epoch 0, then epoch 1, and saves the rows of both. A rank yielding more batches than its
peers would hang until the timeout and fail the run.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from annbatch_torch import A, AnnBatchDataLoader, AnnBatchDataset

PLAN = {"batch_size": 16, "chunk_size": 8, "preload_nchunks": 3, "seed": 11}
TIMEOUT = datetime.timedelta(seconds=150)


def dataset(source: str, **kwargs: Any) -> AnnBatchDataset:
    return AnnBatchDataset(source, selector={"x": A.X}, return_index=True, **PLAN, **kwargs)


def _group(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=TIMEOUT)


def _loader(ds: AnnBatchDataset, num_workers: int) -> AnnBatchDataLoader:
    ctx = mp.get_context("fork") if num_workers else None
    return AnnBatchDataLoader(ds, num_workers=num_workers, multiprocessing_context=ctx)


def _epoch(loader: AnnBatchDataLoader, stop: int | None = None) -> list[np.ndarray]:
    out = []
    for batch in loader:
        out.append(batch["index"].numpy().copy())
        dist.all_reduce(torch.ones(1))  # hangs if the ranks' counts differ
        if stop is not None and len(out) == stop:
            break
    return out


def _flat(batches: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(batches) if batches else np.zeros(0, np.int64)


def save_entry(rank: int, world_size: int, port: int, source: str, num_workers: int,
               stop: int, out: str, kwargs: dict[str, Any]) -> None:
    _group(rank, world_size, port)
    try:
        ds = dataset(source, **kwargs)
        loader = _loader(ds, num_workers)
        head = _epoch(loader, stop)
        state = loader.state_dict()
        if rank == 0:
            Path(out, "state.json").write_text(json.dumps(state))
        np.savez(Path(out) / f"head{rank}.npz", index=_flat(head), n=len(head), len=len(ds))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def resume_entry(rank: int, world_size: int, port: int, source: str, num_workers: int,
                 out: str, tag: str, kwargs: dict[str, Any]) -> None:
    _group(rank, world_size, port)
    try:
        ds = dataset(source, **kwargs)
        loader = _loader(ds, num_workers)
        loader.load_state_dict(json.loads(Path(out, "state.json").read_text()))
        expected = len(ds)  # the resumed epoch's, counting the batches done before
        rest = _epoch(loader)
        ds.set_epoch(1)
        nxt = _epoch(loader)
        np.savez(Path(out) / f"{tag}{rank}.npz", index=_flat(rest), n=len(rest),
                 len=expected, next=_flat(nxt), next_n=len(nxt), next_len=len(ds))
        dist.barrier()
    finally:
        dist.destroy_process_group()
