"""Train a cell-type classifier with annbatch_torch: h5ad files -> shuffled collection ->
AnnBatchDataset -> DataLoader with worker processes -> logistic regression (or an MLP).

Whole chunks are held out for testing (``annbatch_torch.sampling.split_chunks``); the
script prints cells/s per epoch and the held-out accuracy next to chance.

    python examples/train_classifier.py --small                # CI-sized, seconds
    python examples/train_classifier.py                        # 200k generated cells
    python examples/train_classifier.py --hidden 256           # an MLP instead
    python examples/train_classifier.py --h5ad a.h5ad b.h5ad --label-key cell_type
    python examples/train_classifier.py --pbmc68k              # needs scanpy (optional)

Generated data: ``annbatch_torch.datasets`` writes files with cells grouped by cell type,
as atlases often are; the offline shuffle is what lets a chunked loader see every type in
every batch.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import annbatch_torch as abt
from annbatch_torch import A, AnnBatchDataset, sampling


def log1p_cp10k(x: np.ndarray) -> np.ndarray:
    """Counts -> log1p(counts per 10k), row by row (runs in the DataLoader workers)."""
    total = x.sum(axis=1, keepdims=True)
    return np.log1p(x * (1e4 / np.maximum(total, 1.0))).astype(np.float32)


def make_inputs(args: argparse.Namespace, workdir: Path) -> tuple[list[Path], str, str | None]:
    """The h5ad inputs, the label column and the matrix layer (None: X) to train on."""
    if args.h5ad:
        return [Path(p) for p in args.h5ad], args.label_key, args.layer
    if args.pbmc68k:
        try:
            import scanpy as sc
        except ImportError:
            raise SystemExit("--pbmc68k needs scanpy (pip install scanpy).") from None
        import anndata as ad

        pbmc = sc.datasets.pbmc68k_reduced()  # bundled with scanpy; .raw.X: log-normalised
        adata = ad.AnnData(pbmc.raw.X, obs=pbmc.obs[["bulk_labels"]], var=pbmc.raw.var[[]])
        path = workdir / "pbmc68k_reduced.h5ad"
        adata.write_h5ad(path)
        args.no_normalize = True
        return [path], "bulk_labels", None
    n_obs, n_vars = (6_000, 400) if args.small else (args.n_obs, args.n_vars)
    paths = abt.datasets.write_synthetic_h5ads(
        workdir / "inputs", 2, [n_obs // 2, n_obs - n_obs // 2], n_vars, grouped=True,
        n_cell_types=8, seed=args.seed,
    )
    print(f"generated {len(paths)} h5ad files: {n_obs:,} cells x {n_vars:,} genes, "
          "cells grouped by type")
    return paths, "cell_type", None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="small generated data (CI)")
    p.add_argument("--h5ad", nargs="+", metavar="PATH", help="train on these h5ad files")
    p.add_argument("--label-key", default="cell_type", help="obs column to predict")
    p.add_argument("--layer", default=None, help="train on this layer instead of X")
    p.add_argument("--pbmc68k", action="store_true", help="scanpy's pbmc68k_reduced")
    p.add_argument("--no-normalize", action="store_true", help="skip log1p(CP10k)")
    p.add_argument("--n-obs", type=int, default=200_000)
    p.add_argument("--n-vars", type=int, default=2_000)
    p.add_argument("--epochs", type=int, default=None, help="default 3 (--small) or 5")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=0, help="MLP hidden units (0: logistic)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--test-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder")
    args = p.parse_args(argv)
    epochs = args.epochs or (3 if args.small else 5)
    torch.manual_seed(args.seed)

    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        paths, label, layer = make_inputs(args, workdir)
        t0 = time.perf_counter()
        coll = abt.create_anndata_collection(
            paths, workdir / "store", seed=args.seed, overwrite=True, obs_columns=[label],
            layers=[layer] if layer else [], obsm=[], progress=not args.small,
        )
        print(f"shuffled {coll.n_obs:,} cells into {len(coll.shards)} shard(s) in "
              f"{time.perf_counter() - t0:.1f} s")

        classes = coll.categories(label)
        field = A.layers[layer] if layer else A.X
        if not args.no_normalize:
            field = field.with_transform(log1p_cp10k)
        chunk_size = 256
        train_ids, test_ids = sampling.split_chunks(coll.n_obs, chunk_size, args.test_fraction,
                                                    args.seed)
        common = dict(selector={"x": field, "y": A.obs[label]}, batch_size=args.batch_size,
                      chunk_size=chunk_size, densify=True, seed=args.seed)
        train = AnnBatchDataset(coll, **common, chunk_ids=train_ids)
        test = AnnBatchDataset(coll, **common, chunk_ids=test_ids, shuffle=False)
        loader = torch.utils.data.DataLoader(
            train, batch_size=None, num_workers=args.num_workers,
            persistent_workers=args.num_workers > 0,
        )

        n_in, n_out = coll.n_vars, len(classes)
        model: torch.nn.Module = (
            torch.nn.Sequential(torch.nn.Linear(n_in, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, n_out))
            if args.hidden else torch.nn.Linear(n_in, n_out)
        )
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        for epoch in range(epochs):
            train.set_epoch(epoch)  # a new order every epoch, in the workers too
            t, cells, loss_sum = time.perf_counter(), 0, 0.0
            for batch in loader:
                loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                cells += len(batch["y"])
                loss_sum += loss.item() * len(batch["y"])
            dt = time.perf_counter() - t
            print(f"epoch {epoch}: loss {loss_sum / cells:.4f}, {cells:,} cells in {dt:.2f} s, "
                  f"cells/s: {cells / dt:,.0f}")

        correct = total = 0
        counts = np.zeros(n_out, dtype=np.int64)
        model.eval()
        with torch.no_grad():
            for batch in torch.utils.data.DataLoader(test, batch_size=None,
                                                     num_workers=args.num_workers):
                correct += int((model(batch["x"]).argmax(1) == batch["y"]).sum())
                total += len(batch["y"])
                counts += np.bincount(batch["y"].numpy(), minlength=n_out)
        chance = counts.max() / max(total, 1)
        print(f"held-out accuracy: {correct / max(total, 1):.4f} on {total:,} cells "
              f"(chance: {chance:.4f}, majority class; {n_out} classes)")


if __name__ == "__main__":
    main()
