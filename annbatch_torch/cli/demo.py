"""``annbatch-torch demo`` / ``make demo``: the main job end to end on generated data.

Writes two synthetic h5ad files (cells grouped by cell type, as atlases often are),
shuffles them offline into a collection, streams the training chunks through a
``DataLoader`` with worker processes into a linear cell-type classifier (one epoch by default),
and prints cells/s and held-out accuracy.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from .. import sampling
from ..annbatch_dataset import AnnBatchDataset
from ..datasets import write_synthetic_h5ads
from ..fields import A
from ..write.writer import create_anndata_collection

__all__ = ["command", "command_parser", "run"]


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
    n_shards = len(coll.shards)
    print(f"shuffled them into {coll.path} ({n_shards} shard{'' if n_shards == 1 else 's'}) "
          f"in {t2 - t1:.1f} s "
          f"({n_obs / (t2 - t1):,.0f} cells/s)")

    # chunks of 256 rows, smaller for a small demo: 10% held out needs >= 2 chunks (ten here)
    chunk_size = max(1, min(256, coll.n_obs // 10))
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


def command_parser() -> argparse.ArgumentParser:
    """The demo's argument parser: every option with its help and default."""
    from .args import CliParser, int_at_least, plain_text

    p = CliParser(prog="annbatch-torch demo", description=plain_text(__doc__ or ""))
    p.add_argument("--n-obs", type=int_at_least(2), default=60_000, metavar="N",
                   help="cells, split over two generated h5ad files (default: %(default)s)")
    p.add_argument("--n-vars", type=int_at_least(1), default=4_000, metavar="N",
                   help="genes (default: %(default)s)")
    p.add_argument("--batch-size", type=int_at_least(1), default=1024, metavar="N",
                   help="cells per training batch (default: %(default)s)")
    p.add_argument("--workers", type=int_at_least(0), default=2, metavar="N",
                   help="DataLoader worker processes; 0 reads in the main process "
                        "(default: %(default)s)")
    p.add_argument("--epochs", type=int_at_least(1), default=1, metavar="N",
                   help="training epochs (default: %(default)s)")
    p.add_argument("--seed", type=int_at_least(0), default=0, metavar="N",
                   help="seed of the data, the shuffle and the model (default: %(default)s)")
    p.add_argument("--workdir", type=Path, default=None, metavar="DIR",
                   help="write the inputs and the collection here and keep them (default: a "
                        "temporary folder, deleted at the end)")
    return p


def command(argv: list[str] | None = None) -> int:
    """Command-line entry of the demo (``annbatch-torch demo``).

    Parameters
    ----------
    argv
        The demo's arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        0 on success (an argument error exits with status 2 through :mod:`argparse`).
    """
    args = command_parser().parse_args(argv)
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


if __name__ == "__main__":  # python -m annbatch_torch.cli.demo [options]
    import runpy
    import sys

    # the command's own entry point (one-line errors), as `annbatch-torch demo ...`; run,
    # not imported: cli.main imports this module, and the module graph stays acyclic
    sys.argv = [sys.argv[0], "demo", *sys.argv[1:]]
    runpy.run_module("annbatch_torch.cli", run_name="__main__", alter_sys=True)
