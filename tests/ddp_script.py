"""Per-rank DDP checks of AnnBatchDataset in a real ``gloo`` process group.

Two ways in, both writing one ``rank{r}.npz`` per rank that the tests read:

* :func:`spawn_entry` for ``torch.multiprocessing.spawn`` (``tests/test_ddp.py``);
* a plain script for ``torchrun`` (``python -m torch.distributed.run --nproc_per_node=2
  tests/ddp_script.py --out DIR INPUT.h5ad ...``), which takes rank, world size and the
  rendezvous from the ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``
  environment variables.

Every batch is followed by an ``all_reduce``, as a DDP backward pass would be: if the ranks
yielded different numbers of batches, a rank would wait for its peer until the group's
timeout and the run would fail instead of passing.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from annbatch_torch import A, AnnBatchDataset

#: small pools so that a ~1.5k-row input has many pools and a ragged tail
PLAN = {"batch_size": 32, "chunk_size": 16, "preload_nchunks": 4}
SEED = 5
TIMEOUT = datetime.timedelta(seconds=150)  # generous: a loaded 2-core CI machine is slow


def _dataset(paths: list[str], **kwargs: Any) -> AnnBatchDataset:
    kw: dict[str, Any] = dict(PLAN, selector={"x": A.X}, return_index=True, seed=SEED)
    kw.update(kwargs)
    return AnnBatchDataset(paths, **kw)


def _run_epoch(
    ds: AnnBatchDataset, epoch: int, num_workers: int, context: str | None = None
) -> dict[str, Any]:
    """One epoch through ``DataLoader(num_workers=...)`` with a collective per batch."""
    ds.set_epoch(epoch)
    ctx = mp.get_context(context) if (context and num_workers) else None
    loader = DataLoader(ds, batch_size=None, num_workers=num_workers, multiprocessing_context=ctx)
    index, mask, sizes = [], [], []
    for batch in loader:
        idx = batch["index"].numpy()
        index.append(idx)
        sizes.append(len(idx))
        mask.append(batch["mask"].numpy() if "mask" in batch else np.ones(len(idx), dtype=bool))
        dist.all_reduce(torch.ones(1))  # what DDP's gradient sync does: hangs on unequal counts
    n = torch.tensor([len(sizes)])
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, n)
    return {
        "index": np.concatenate(index) if index else np.zeros(0, np.int64),
        "mask": np.concatenate(mask) if mask else np.zeros(0, bool),
        "sizes": np.asarray(sizes, dtype=np.int64),
        "len": np.int64(len(ds)),
        "rank": np.int64(ds.rank),
        "world_size": np.int64(ds.world_size),
        "all_counts": torch.cat(counts).numpy(),
    }


def _save(out: Path, rank: int, results: dict[str, dict[str, Any]]) -> None:
    flat = {f"{case}/{k}": v for case, res in results.items() for k, v in res.items()}
    np.savez(out / f"rank{rank}.npz", **flat)


def spawn_entry(rank: int, world_size: int, port: int, paths: list[str], out: str) -> None:
    """``torch.multiprocessing.spawn`` target: every scenario of ``tests/test_ddp.py``."""
    # Built before the process group exists: rank/world size are resolved lazily, when the
    # dataset is iterated, measured or pickled for workers, in the process holding the group.
    before_fork = _dataset(paths)
    before_spawn = _dataset(paths)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        # In a process started by torch.multiprocessing.spawn, the default start method is
        # "spawn" too (inherited), so DataLoader workers would re-import everything; fork
        # explicitly except where spawned workers are the point.
        results = {
            "drop_e0": _run_epoch(_dataset(paths), 0, num_workers=2, context="fork"),
            "drop_e1": _run_epoch(_dataset(paths), 1, num_workers=2, context="fork"),
            "pad": _run_epoch(_dataset(paths, even_batches="pad", shuffle=False), 0, 2, "fork"),
            "before_fork": _run_epoch(before_fork, 0, num_workers=2, context="fork"),
            "before_spawn": _run_epoch(before_spawn, 0, num_workers=1, context="spawn"),
            "no_workers": _run_epoch(_dataset(paths), 0, num_workers=0),
        }
        _save(Path(out), rank, results)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """torchrun entry point: env-var rendezvous, two epochs, one ``rank{r}.npz`` per rank."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("inputs", nargs="+", help="h5ad files read in place")
    parser.add_argument("--out", required=True, help="folder for rank{r}.npz")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo", timeout=TIMEOUT)  # RANK, WORLD_SIZE, MASTER_* from env
    try:
        ds = _dataset(args.inputs)  # rank and world size come from torch.distributed
        results = {f"e{e}": _run_epoch(ds, e, args.num_workers) for e in range(args.epochs)}
        _save(Path(args.out), dist.get_rank(), results)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
