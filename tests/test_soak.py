"""Soak: 20 epochs with 2 persistent workers on a 100,000-cell collection. Memory, open
files and threads of the main process and of each worker stay flat after epoch 2, and
every epoch yields every cell exactly once."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import psutil
import pytest

import annbatch_torch as abt
from annbatch_torch import A, AnnBatchDataLoader, AnnBatchDataset

N_OBS, EPOCHS = 100_000, 20


def _usage(proc: psutil.Process) -> tuple[int, int, int]:
    """(RSS bytes, open descriptors, threads) from ``/proc/<pid>``."""
    pid = proc.pid
    return proc.memory_info().rss, len(os.listdir(f"/proc/{pid}/fd")), proc.num_threads()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_twenty_epochs_with_persistent_workers_stay_flat(tmp_path: Path) -> None:
    adata = abt.datasets.synthetic(N_OBS, 200, density=0.1, seed=1)
    adata.write_h5ad(tmp_path / "in.h5ad")
    coll = abt.create_anndata_collection([tmp_path / "in.h5ad"], tmp_path / "store", seed=0,
                                         progress=False)
    del adata
    ds = AnnBatchDataset(coll, selector={"x": A.X, "y": A.obs["cell_type"]}, batch_size=1024,
                         densify=True, return_index=True, seed=5)
    loader = AnnBatchDataLoader(ds, num_workers=2, persistent_workers=True)
    main = psutil.Process()
    others = {p.pid for p in main.children()}  # children of earlier tests, not the loader's
    usage: list[dict[int, tuple[int, int, int]]] = []
    workers: list[int] | None = None
    for epoch in range(EPOCHS):
        ds.set_epoch(epoch)
        seen = np.zeros(N_OBS, dtype=np.int64)
        for batch in loader:
            np.add.at(seen, batch["index"].numpy(), 1)
        assert (seen == 1).all(), f"epoch {epoch}: not every cell exactly once"
        kids = sorted(p.pid for p in main.children() if p.is_running() and p.pid not in others)
        if workers is None:
            workers = kids
        assert kids == workers, "persistent workers were replaced"
        usage.append({pid: _usage(psutil.Process(pid)) for pid in [main.pid, *workers]})
    assert workers is not None
    assert len(workers) == 2
    base = usage[1]  # after epoch 2: caches, pools and thread pools are in place
    for pid in base:
        rss = [u[pid][0] for u in usage[1:]]
        fds = [u[pid][1] for u in usage[1:]]
        threads = [u[pid][2] for u in usage[1:]]
        what = "main" if pid == main.pid else f"worker {pid}"
        assert max(rss) <= 1.05 * base[pid][0], f"{what}: RSS grew {rss}"
        assert max(fds) <= base[pid][1], f"{what}: open descriptors grew {fds}"
        assert max(threads) <= base[pid][2], f"{what}: threads grew {threads}"
