"""``annbatch-torch demo`` / ``make demo``: the main job end to end on generated data.

Writes two synthetic h5ad files (cells grouped by cell type, as atlases often are),
shuffles them offline into a collection, streams the training chunks through a
``DataLoader`` with worker processes into a linear cell-type classifier for one epoch, and
prints cells/s and held-out accuracy.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from . import sampling
from .annbatch_dataset import AnnBatchDataset
from .datasets import write_synthetic_h5ads
from .fields import A
from .write.writer import create_anndata_collection

__all__ = ["main", "run"]


def run(
    workdir: Path,
    *,
    n_obs: int = 60_000,
    n_vars: int = 4_000,
    batch_size: int = 1024,
    num_workers: int = 2,
    epochs: int = 1,
    seed: int = 0,
) -> dict[str, float]:
    """Run the demo in ``workdir``; returns the measured figures."""
    t0 = time.perf_counter()
    paths = write_synthetic_h5ads(
        workdir / "inputs", 2, [n_obs // 2, n_obs - n_obs // 2], n_vars, grouped=True, seed=seed
    )
    t1 = time.perf_counter()
    print(f"wrote {len(paths)} grouped h5ad files ({n_obs:,} cells x {n_vars:,} genes) "
          f"in {t1 - t0:.1f} s")
    coll = create_anndata_collection(
        paths, workdir / "store", seed=seed, overwrite=True, obs_columns=["cell_type"]
    )
    t2 = time.perf_counter()
    print(f"shuffled them into {coll.path} ({len(coll.shards)} shards) in {t2 - t1:.1f} s "
          f"({n_obs / (t2 - t1):,.0f} cells/s)")

    chunk_size = 256
    train_ids, val_ids = sampling.split_chunks(coll.n_obs, chunk_size, 0.1, seed)
    sel = {"x": A.X.with_transform(_log1p), "y": A.obs["cell_type"]}
    common = dict(selector=sel, batch_size=batch_size, chunk_size=chunk_size, densify=True)
    train = AnnBatchDataset(coll, **common, chunk_ids=train_ids, seed=seed)
    val = AnnBatchDataset(coll, **common, chunk_ids=val_ids, shuffle=False)
    n_classes = len(coll.categories("cell_type"))

    torch.manual_seed(seed)
    model = torch.nn.Linear(coll.n_vars, n_classes)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(
        train, batch_size=None, num_workers=num_workers, persistent_workers=num_workers > 0
    )
    cells, t3 = 0, time.perf_counter()
    for epoch in range(epochs):
        train.set_epoch(epoch)
        for batch in loader:
            loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            cells += len(batch["y"])
    t4 = time.perf_counter()
    rate = cells / (t4 - t3)
    print(f"trained {epochs} epoch(s) on {cells:,} cells with {num_workers} workers: "
          f"{rate:,.0f} cells/s (loss {loss.item():.3f})")

    correct = total = 0
    with torch.no_grad():
        for batch in torch.utils.data.DataLoader(val, batch_size=None, num_workers=0):
            correct += int((model(batch["x"]).argmax(1) == batch["y"]).sum())
            total += len(batch["y"])
    acc = correct / max(total, 1)
    print(f"held-out accuracy: {acc:.3f} on {total:,} cells "
          f"(chance {1 / n_classes:.3f}, {n_classes} cell types)")
    return {"cells_per_s": rate, "accuracy": acc, "chance": 1 / n_classes}


def _log1p(x: np.ndarray) -> np.ndarray:
    return np.log1p(x, out=x)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry of the demo."""
    p = argparse.ArgumentParser(prog="annbatch-torch demo", description=__doc__)
    p.add_argument("--n-obs", type=int, default=60_000)
    p.add_argument("--n-vars", type=int, default=4_000)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="keep data here (default: temp)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    kw = dict(n_obs=args.n_obs, n_vars=args.n_vars, batch_size=args.batch_size,
              num_workers=args.workers, epochs=args.epochs, seed=args.seed)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        run(args.workdir, **kw)
    else:
        with tempfile.TemporaryDirectory(prefix="annbatch-demo-") as d:
            run(Path(d), **kw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
