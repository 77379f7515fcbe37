"""Perturbed cells with matched controls: learn what each perturbation does.

A Perturb-seq-like screen (``abt.datasets.synthetic_screen``: CRISPRi knock-downs of the
most expressed genes, non-targeting controls, two cell lines x four GEM groups) is written
as a collection; ``PairedSampler`` yields every perturbed cell once per epoch with two
control cells of the same cell line and GEM group. A model learns one shift per
perturbation, the perturbed cell's log-expression minus the mean of its controls'. The
script prints, for each perturbation, the gene its learned shift lowers most, and how many
of those are the knocked-down gene.

    python examples/perturbation_pairs.py --small      # CI-sized, seconds
    python examples/perturbation_pairs.py              # 100k generated cells
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

import annbatch_torch as abt
from annbatch_torch import A

N_CONTROLS = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a CI-sized screen")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    n_obs, n_vars, n_perts, epochs = ((4_000, 200, 8, 4) if args.small
                                      else (100_000, 2_000, 50, 3))
    with tempfile.TemporaryDirectory() as tmp:
        screen = abt.datasets.synthetic_screen(n_obs, n_vars, n_perturbations=n_perts,
                                               seed=0)
        screen.write_h5ad(Path(tmp) / "screen.h5ad")
        coll = abt.create_anndata_collection([Path(tmp) / "screen.h5ad"], Path(tmp) / "store",
                                             progress=False)
        sampler = abt.PairedSampler("target_gene", abt.datasets.CONTROL,
                                    match=("cell_line", "gem_group"), n_controls=N_CONTROLS)
        ds = abt.AnnBatchDataset(coll, selector={"x": A.X, "pert": A.obs["target_gene"]},
                                 batch_size=256, densify=True, sampler=sampler, seed=0)
        perts = list(coll.categories("target_gene"))
        torch.manual_seed(0)
        shift = torch.nn.Embedding(len(perts), n_vars)
        torch.nn.init.zeros_(shift.weight)
        opt = torch.optim.Adam(shift.parameters(), lr=5e-2)
        loader = abt.AnnBatchDataLoader(ds, num_workers=args.workers)
        for epoch in range(epochs):
            ds.set_epoch(epoch)
            total, n = 0.0, 0
            for batch in loader:
                x = torch.log1p(batch["x"])
                basal = torch.log1p(batch["control_x"]).view(len(x), N_CONTROLS, -1).mean(1)
                loss = torch.nn.functional.mse_loss(basal + shift(batch["pert"]), x)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total, n = total + float(loss.detach()) * len(x), n + len(x)
            print(f"epoch {epoch}: loss {total / n:.4f} over {n} perturbed cells")
        genes = np.asarray(coll.var_names)
        lowest = genes[shift.weight.detach().numpy().argmin(axis=1)]
        hits = 0
        for code, name in enumerate(perts):
            if name == abt.datasets.CONTROL:
                continue
            hits += int(lowest[code] == name)
            print(f"{name}: lowered most {lowest[code]}")
        print(f"recovered {hits} of {len(perts) - 1} knocked-down genes")


if __name__ == "__main__":
    main()
