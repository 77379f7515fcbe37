"""Multi-process DDP training with Lightning and ``AnnBatchDataModule``.

    python examples/lightning_ddp.py --small --devices 2       # CPU, gloo (CI)
    python examples/lightning_ddp.py --devices 4 --accelerator gpu

What the DataModule does for you:

* ``prepare_data`` writes the shuffled collection once (run the script twice: the second
  run finds the store current and does not rewrite it); a file lock keeps racing
  processes (e.g. one per node) from writing it twice;
* ``setup`` gives every rank its own share of the data; every rank takes the same number
  of steps per epoch (no DDP hang), and each cell is seen at most once per epoch;
* the epoch order changes every epoch by itself (Lightning calls ``set_epoch`` on the
  loader's sampler, which forwards it to the dataset and its workers);
* validation reads whole held-out chunks in order, padded to equal batch counts on every
  rank; padded rows have ``mask == False`` and are left out of the accuracy below.

With ``--strategy ddp`` (the default) Lightning starts the other ranks by running this
script again, so everything before ``trainer.fit`` runs in every rank: inputs are
generated under a file lock, and only if missing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from filelock import FileLock

import annbatch_torch as abt
from annbatch_torch import A


def log1p_cp10k(x: np.ndarray) -> np.ndarray:
    """Counts -> log1p(counts per 10k) (runs in the DataLoader workers)."""
    total = x.sum(axis=1, keepdims=True)
    return np.log1p(x * (1e4 / np.maximum(total, 1.0))).astype(np.float32)


class CellTypeClassifier(pl.LightningModule):
    """Logistic regression on normalised expression; reports steps and accuracy."""

    def __init__(self, n_vars: int, n_classes: int, lr: float = 1e-2) -> None:
        super().__init__()
        self.model = torch.nn.Linear(n_vars, n_classes)
        self.lr = lr
        self.steps = 0
        self.cells = 0
        self.correct = torch.zeros(())
        self.total = torch.zeros(())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.steps += 1
        self.cells += len(batch["y"])
        return torch.nn.functional.cross_entropy(self.model(batch["x"]), batch["y"])

    def on_train_epoch_end(self) -> None:
        print(f"rank {self.global_rank} epoch {self.current_epoch}: {self.steps} steps, "
              f"{self.cells} cells", flush=True)
        self.steps = self.cells = 0

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        real = batch["mask"]  # False for the rows that pad this rank to equal counts
        hit = (self.model(batch["x"]).argmax(1) == batch["y"]) & real
        self.correct = self.correct + hit.sum().cpu()
        self.total = self.total + real.sum().cpu()

    def on_validation_epoch_end(self) -> None:
        counts = torch.stack([self.correct, self.total]).to(self.device)
        correct, total = self.trainer.strategy.reduce(counts, reduce_op="sum").tolist()
        if not self.trainer.sanity_checking and self.global_rank == 0:
            print(f"epoch {self.current_epoch}: validation accuracy {correct / total:.4f} "
                  f"on {int(total)} cells (all ranks)", flush=True)
        self.correct, self.total = torch.zeros(()), torch.zeros(())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="small generated data (CI)")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--strategy", default="ddp", choices=["ddp", "ddp_spawn"],
                   help="gloo on CPU, nccl on GPU (Lightning picks)")
    p.add_argument("--epochs", type=int, default=None, help="default 2 (--small) or 5")
    p.add_argument("--batch-size", type=int, default=None, help="default 128 (--small) or 2048")
    p.add_argument("--num-workers", type=int, default=1, help="DataLoader workers per rank")
    p.add_argument("--workdir", type=Path, default=Path("annbatch_lightning_example"),
                   help="inputs and store live here (kept between runs)")
    args = p.parse_args(argv)
    n_obs, n_vars = (6_000, 300) if args.small else (200_000, 2_000)

    pl.seed_everything(0)  # the same model initialisation in every rank and run
    args.workdir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(args.workdir / "inputs.lock")):  # every rank runs this
        paths = sorted((args.workdir / "inputs").glob("part*.h5ad"))
        if not paths:
            paths = abt.datasets.write_synthetic_h5ads(
                args.workdir / "inputs", 2, n_obs // 2, n_vars, grouped=True, seed=0)

    dm = abt.AnnBatchDataModule(
        paths, args.workdir / "store",
        selector={"x": A.X.with_transform(log1p_cp10k), "y": A.obs["cell_type"]},
        batch_size=args.batch_size or (128 if args.small else 2048),
        num_workers=args.num_workers, densify=True,
        val_fraction=0.2, seed=0,
        # pools (chunk_size x preload_nchunks rows) are dealt whole to ranks: small data
        # needs small pools so that every rank gets several
        chunk_size=64 if args.small else 512, preload_nchunks=4 if args.small else 32,
        collection_kwargs={"obs_columns": ["cell_type"], "layers": [], "obsm": [],
                           "progress": False},
    )
    # Lightning calls prepare_data itself, on one process per node; calling it here sizes
    # the model from the data. Safe in every rank: the first writes (under a file lock),
    # the others find the store current.
    dm.prepare_data()
    written = dm.store_written
    coll = abt.open_collection(dm.store_path)
    model = CellTypeClassifier(coll.n_vars, len(coll.categories("cell_type")))
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=args.strategy,
        max_epochs=args.epochs or (2 if args.small else 5), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=dm)
    if trainer.global_rank == 0:
        print(f"store written by this run: {written}", flush=True)


if __name__ == "__main__":
    main()
