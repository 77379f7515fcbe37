"""scVI training throughput on CPU: SCVIDataModule over a collection vs scvi-tools' own
``AnnDataLoader`` over the in-memory AnnData and over a backed h5ad, side by side.

    .venv/bin/python benchmarks/scvi_train.py [--data benchmarks/data/grouped_100000x20000_seed0]
        [--n-top-genes 2000] [--workers 0,2] [--out benchmarks/results/scvi_issue15_run.json]

Data: the benchmark's 100,000 x 20,000 counts (``part0.h5ad``, ``part1.h5ad``; written by
``benchmarks/run.py``), restricted to ``--n-top-genes`` highly variable genes
(``scanpy.pp.highly_variable_genes(flavor="seurat_v3")`` on the counts, cached in
``hvg.json``). Each configuration trains scVI (``n_latent=10``, batch 128, ``batch_key
"batch"``) for one epoch over every cell and reports cells/s; the loader alone (an epoch of
batches on the CPU, X dense, no model) and the model alone (the same number of steps on one
batch already in memory) say where the time goes. Every file a configuration reads is read
through once before it is timed (warm page cache: the collection and the backed h5ad are
2-3 GB, far less than RAM here).

* ``ours-w{N}``: ``SCVIDataModule(collection, var_names=hvg, num_workers=N)`` over a
  collection of all 20,000 genes (cached as ``collection_scvi``), reading the HVGs of each
  chunk;
* ``ours-hvgstore-w0``: a collection written with the HVGs only (``var_names=hvg`` at write
  time, cached as ``collection_scvi_hvg``): what to write for repeated training on them;
* ``scvi-memory``: scvi-tools' loader over ``adata[:, hvg]`` in memory;
* ``scvi-backed``: scvi-tools' loader over a backed h5ad of the HVG columns (written once,
  ``hvg_backed.h5ad``), the only backed layout it reads without loading the file.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
import warnings
from pathlib import Path
from typing import Any

import anndata as ad
import torch

import annbatch_torch as abt

HERE = Path(__file__).resolve().parent
TRAINER = {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False,
           "logger": False, "enable_checkpointing": False}


def read_through(path: Path) -> None:
    """Bring a file or folder into the page cache (warm runs, as for the in-memory case)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def hvg_names(data: Path, n_top: int) -> list[str]:
    cache = data / "hvg.json"
    if cache.exists():
        got = json.loads(cache.read_text())
        if got["n_top_genes"] == n_top:
            return list(got["genes"])
    import scanpy as sc

    adata = ad.concat([ad.read_h5ad(data / f"part{i}.h5ad") for i in range(2)])
    sc.pp.highly_variable_genes(adata, flavor="seurat_v3", n_top_genes=n_top)
    genes = [str(g) for g in adata.var_names[adata.var["highly_variable"]]]
    cache.write_text(json.dumps({"n_top_genes": n_top, "genes": genes}))
    return genes


def collection(data: Path, genes: list[str] | None = None) -> abt.Collection:
    path = data / ("collection_scvi" if genes is None else "collection_scvi_hvg")
    if not (path / "manifest.json").exists():
        abt.create_anndata_collection([data / "part0.h5ad", data / "part1.h5ad"], path,
                                      obs_columns=["batch", "cell_type"], seed=0,
                                      var_names=genes, progress=False)
    read_through(path)
    return abt.open_collection(path)


def in_memory(data: Path, hvg: list[str]) -> ad.AnnData:
    parts = [ad.read_h5ad(data / f"part{i}.h5ad") for i in range(2)]
    adata = ad.concat(parts)[:, hvg].copy()
    adata.obs_names_make_unique()
    return adata


def backed(data: Path, memory: ad.AnnData) -> ad.AnnData:
    path = data / "hvg_backed.h5ad"
    if not path.exists():
        memory.write_h5ad(path)
    read_through(path)
    return ad.read_h5ad(path, backed="r")


def model_alone(model: Any, batch: dict[str, torch.Tensor], steps: int) -> float:
    """Seconds of ``steps`` optimiser steps of the model on one in-memory batch."""
    module = model.module
    module.train()
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    for _ in range(steps):
        _, _, loss = module(batch)
        opt.zero_grad()
        loss.loss.backward()
        opt.step()
    return time.perf_counter() - t0


def run_ours(coll: abt.Collection, hvg: list[str] | None, workers: int, seed: int
             ) -> dict[str, Any]:
    import scvi

    from annbatch_torch.integrations.scvi import SCVIDataModule

    dm = SCVIDataModule(coll, batch_key="batch", batch_size=128, num_workers=workers,
                        seed=seed, var_names=hvg)
    dm.setup("fit")
    t0 = time.perf_counter()
    n = 0
    first = None
    for b in dm.train_dataloader():
        batch = dm.transfer_batch_to_device(b, torch.device("cpu"), 0)
        first = first or batch
        n += batch["X"].shape[0]
    loader_s = time.perf_counter() - t0
    scvi.settings.seed = seed
    model = scvi.model.SCVI(registry=dm.registry, n_latent=10)
    dm2 = SCVIDataModule(coll, batch_key="batch", batch_size=128, num_workers=workers,
                         seed=seed, var_names=hvg)
    t0 = time.perf_counter()
    model.train(max_epochs=1, datamodule=dm2, **TRAINER)
    train_s = time.perf_counter() - t0
    steps = -(-n // 128)
    return {"cells": n, "loader_s": loader_s, "train_s": train_s,
            "model_s": model_alone(model, first, steps)}


def run_scvi(adata: ad.AnnData, seed: int, max_steps: int | None) -> dict[str, Any]:
    import scvi

    scvi.settings.seed = seed
    scvi.model.SCVI.setup_anndata(adata, batch_key="batch")
    model = scvi.model.SCVI(adata, n_latent=10)
    loader = model._make_data_loader(adata=adata, batch_size=128, shuffle=True)
    t0 = time.perf_counter()
    n = 0
    first = None
    for i, batch in enumerate(loader):
        first = first or batch
        n += batch["X"].shape[0]
        if max_steps is not None and i + 1 >= max_steps:
            break
    loader_s = time.perf_counter() - t0
    out: dict[str, Any] = {"cells": n, "loader_s": loader_s}
    if max_steps is None:
        t0 = time.perf_counter()
        model.train(max_epochs=1, train_size=1.0, batch_size=128, **TRAINER)
        out["train_s"] = time.perf_counter() - t0
        out["model_s"] = model_alone(model, first, -(-n // 128))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=HERE / "data" / "grouped_100000x20000_seed0")
    p.add_argument("--n-top-genes", type=int, default=2000)
    p.add_argument("--workers", default="0,2")
    p.add_argument("--backed-steps", type=int, default=200,
                   help="batches read from the backed h5ad (it is slow: not a whole epoch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=HERE / "results" / "scvi_issue15_run.json")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("scvi").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    hvg = hvg_names(args.data, args.n_top_genes)
    coll = collection(args.data)
    results: dict[str, Any] = {"n_obs": coll.n_obs, "n_vars": coll.n_vars,
                               "n_top_genes": len(hvg), "batch_size": 128,
                               "machine": f"{platform.machine()}, {torch.get_num_threads()} "
                                          "torch threads", "configs": {}}
    for w in (int(x) for x in args.workers.split(",")):
        results["configs"][f"ours-w{w}"] = run_ours(coll, hvg, w, args.seed)
        print(f"ours-w{w}", results["configs"][f"ours-w{w}"], flush=True)
    results["configs"]["ours-hvgstore-w0"] = run_ours(collection(args.data, hvg), None, 0,
                                                      args.seed)
    print("ours-hvgstore-w0", results["configs"]["ours-hvgstore-w0"], flush=True)
    memory = in_memory(args.data, hvg)
    results["configs"]["scvi-memory"] = run_scvi(memory.copy(), args.seed, None)
    print("scvi-memory", results["configs"]["scvi-memory"], flush=True)
    results["configs"]["scvi-backed"] = run_scvi(backed(args.data, memory), args.seed,
                                                 args.backed_steps)
    print("scvi-backed", results["configs"]["scvi-backed"], flush=True)
    for c in results["configs"].values():
        c["loader_cells_per_s"] = c["cells"] / c["loader_s"]
        if "train_s" in c:
            c["train_cells_per_s"] = c["cells"] / c["train_s"]
            c["model_cells_per_s"] = c["cells"] / c["model_s"]
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
