"""Class-balanced training on imbalanced data with annbatch_torch's sampling mode.

A collection whose rarest cell type is well under 1% of the cells: trained one epoch with
each row once (what chunked mode gives), a linear classifier barely learns the rare types;
with rows drawn class-balanced it does. The script prints the balanced accuracy (mean
recall over the types) of both on held-out cells.

    python examples/class_balanced.py --small      # CI-sized, seconds
    python examples/class_balanced.py              # 100k generated cells

The imbalance is made by training on a subset of the collection whose type sizes fall as
1 / rank**2.5 (``SubsetSampler``); the balanced run draws from the same rows, each weighted
1 / its type's size (``WeightedSampler``). On your own data, where the collection itself is
imbalanced, ``abt.ClassBalancedSampler("cell_type")`` is all it takes.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

import annbatch_torch as abt
from annbatch_torch import A


def imbalanced_split(codes: np.ndarray, held_per_type: int, seed: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``(train, held)``: held-out rows, ``held_per_type`` of each type, and training rows
    whose type sizes fall as 1 / rank**2.5 (the largest type kept whole)."""
    rng = np.random.default_rng(seed)
    n_types = int(codes.max()) + 1
    by_type = [rng.permutation(np.flatnonzero(codes == k)) for k in range(n_types)]
    held = np.concatenate([rows[:held_per_type] for rows in by_type])
    order = np.argsort([-len(rows) for rows in by_type])
    largest = len(by_type[order[0]]) - held_per_type
    train = [by_type[k][held_per_type : held_per_type + max(5, int(largest / (r + 1) ** 2.5))]
             for r, k in enumerate(order)]
    return np.sort(np.concatenate(train)), held


def train_one_epoch(store: Path, sampler: abt.Sampler, genes: list[str], n_types: int,
                    batch_size: int) -> torch.nn.Module:
    ds = abt.AnnBatchDataset(store, selector={"x": A.X, "y": A.obs["cell_type"]},
                             batch_size=batch_size, densify=True, var_names=genes,
                             sampler=sampler, seed=0)
    torch.manual_seed(0)
    model = torch.nn.Linear(len(genes), n_types)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for batch in abt.AnnBatchDataLoader(ds, num_workers=0):
        loss = torch.nn.functional.cross_entropy(model(torch.log1p(batch["x"])), batch["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def balanced_accuracy(model: torch.nn.Module, store: Path, held: np.ndarray,
                      genes: list[str], n_types: int) -> tuple[float, list[float]]:
    ds = abt.AnnBatchDataset(store, selector={"x": A.X, "y": A.obs["cell_type"]},
                             batch_size=4096, densify=True, var_names=genes, shuffle=False,
                             sampler=abt.SubsetSampler(held, shuffle=False))
    pred, true = [], []
    with torch.no_grad():
        for batch in ds:
            pred.append(model(torch.log1p(batch["x"])).argmax(1).numpy())
            true.append(batch["y"].numpy())
    p, t = np.concatenate(pred), np.concatenate(true)
    recall = [float((p[t == k] == k).mean()) for k in range(n_types)]
    return float(np.mean(recall)), recall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="CI-sized data (seconds)")
    parser.add_argument("--genes", type=int, default=64,
                        help="random genes the classifier sees (few markers: a hard task)")
    args = parser.parse_args()
    n_obs, n_vars = (12_000, 400) if args.small else (100_000, 2_000)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        paths = abt.datasets.write_synthetic_h5ads(work / "inputs", 2, n_obs // 2, n_vars,
                                                   n_cell_types=8, seed=1)
        coll = abt.create_anndata_collection(paths, work / "store", seed=0, progress=False)
        codes = coll.obs_at(np.arange(coll.n_obs), ["cell_type"])["cell_type"].cat.codes
        codes = np.asarray(codes)
        n_types = int(codes.max()) + 1
        train, held = imbalanced_split(codes, held_per_type=100, seed=0)
        counts = np.bincount(codes[train], minlength=n_types)
        print(f"training rows: {len(train):,}; smallest type {counts.min() / len(train):.2%} "
              f"of them, largest {counts.max() / len(train):.1%}")
        genes = list(np.random.default_rng(2).choice(np.asarray(coll.var_names), args.genes,
                                                     replace=False))
        weights = np.zeros(coll.n_obs)
        weights[train] = 1.0 / counts[codes[train]]
        batch_size = 128 if args.small else 256
        for name, sampler in [("each row once", abt.SubsetSampler(train)),
                              ("class-balanced", abt.WeightedSampler(weights,
                                                                     num_samples=len(train)))]:
            model = train_one_epoch(work / "store", sampler, genes, n_types, batch_size)
            acc, recall = balanced_accuracy(model, work / "store", held, genes, n_types)
            rarest = recall[int(np.argmin(counts))]
            print(f"{name}: balanced accuracy {acc:.3f}, recall of the rarest type "
                  f"{rarest:.3f}")


if __name__ == "__main__":
    main()
