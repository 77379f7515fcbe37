"""In place vs a collection, by regime: h5ad compression, output kind, page cache.

Each measurement is a fresh process that iterates ``DataLoader(ds, batch_size=None)`` as a
user does, times every batch after a warm-up, and reports cells/s; sources alternate
A B A B within a round so that drift on the machine hits each alike. Inputs are written
once: an uncompressed h5ad, a gzip h5ad (what ``adata.write_h5ad(compression="gzip")``
gives) and the collection written from the uncompressed one with the default settings.

    python benchmarks/inplace_regimes.py --n-obs 30000 --n-vars 2000 --rounds 3 \
        --out benchmarks/results/inplace_regimes_issue29.md

``--cold`` drops the page cache before every measured process (root on Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SOURCES = ("collection", "h5ad", "h5ad_gzip")


def _write_inputs(root: Path, n_obs: int, n_vars: int, density: float, seed: int) -> None:
    import anndata as ad
    import numpy as np
    import pandas as pd
    import scipy.sparse as sp

    from annbatch_torch import create_anndata_collection

    if (root / "done").exists():
        return
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    x = sp.random(n_obs, n_vars, density=density, format="csr", random_state=rng,
                  data_rvs=lambda k: rng.poisson(3.0, k) + 1.0).astype(np.float32)
    obs = pd.DataFrame({"cell_type": pd.Categorical(rng.choice(list("abcdefgh"), n_obs))},
                       index=[f"c{i}" for i in range(n_obs)])
    adata = ad.AnnData(X=x, obs=obs, var=pd.DataFrame(index=[f"g{j}" for j in range(n_vars)]))
    adata.write_h5ad(root / "h5ad.h5ad")
    adata.write_h5ad(root / "h5ad_gzip.h5ad", compression="gzip")
    create_anndata_collection([root / "h5ad.h5ad"], root / "collection.zarr", seed=seed)
    (root / "done").touch()


def _measure(root: Path, source: str, densify: bool, n_warmup: int, epochs: int,
             batch_size: int) -> dict:
    import torch

    from annbatch_torch import AnnBatchDataset

    src = root / "collection.zarr" if source == "collection" else [root / f"{source}.h5ad"]
    t_open = time.perf_counter()
    ds = AnnBatchDataset(src, batch_size=batch_size, densify=densify, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
    t_open = time.perf_counter() - t_open
    cells = seen = 0
    elapsed = 0.0
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        it = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            dt = time.perf_counter() - t0
            seen += 1
            if seen > n_warmup:
                elapsed += dt
                cells += int(batch["X"].shape[0])
    return {"source": source, "densify": densify, "cells": cells, "seconds": elapsed,
            "cells_per_s": cells / elapsed, "open_s": t_open}


def _drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-obs", type=int, default=30_000)
    p.add_argument("--n-vars", type=int, default=2_000)
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--root", type=Path, default=Path("/tmp/inplace_regimes"))
    p.add_argument("--cold", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--write-only", action="store_true", help="write the inputs, measure nothing")
    p.add_argument("--measure", choices=SOURCES, help=argparse.SUPPRESS)
    p.add_argument("--densify", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    root = a.root / f"{a.n_obs}x{a.n_vars}"
    if a.measure:
        print(json.dumps(_measure(root, a.measure, bool(a.densify), a.warmup, a.epochs,
                                  a.batch_size)))
        return
    _write_inputs(root, a.n_obs, a.n_vars, a.density, seed=0)
    if a.write_only:
        return
    sizes = {s: sum(f.stat().st_size for f in (root / (s + (".zarr" if s == "collection"
                                                          else ".h5ad"))).rglob("*")
                    if f.is_file()) if s == "collection"
             else (root / f"{s}.h5ad").stat().st_size for s in SOURCES}
    load0 = os.getloadavg()
    runs: dict[tuple[str, bool], list[float]] = {}
    for r in range(a.rounds):
        for densify in (False, True):
            for source in SOURCES:
                if a.cold:
                    _drop_caches()
                out = subprocess.run(
                    [sys.executable, __file__, "--measure", source, "--densify", str(int(densify)),
                     "--n-obs", str(a.n_obs), "--n-vars", str(a.n_vars), "--root", str(a.root),
                     "--epochs", str(a.epochs), "--warmup", str(a.warmup),
                     "--batch-size", str(a.batch_size)],
                    check=True, capture_output=True, text=True).stdout
                res = json.loads(out.strip().splitlines()[-1])
                runs.setdefault((source, densify), []).append(res["cells_per_s"])
                print(f"round {r} densify={densify} {source}: {res['cells_per_s']:,.0f} cells/s",
                      file=sys.stderr)
    load = os.getloadavg()
    lines = [f"### {a.n_obs:,} x {a.n_vars:,}, density {a.density}, "
             f"{'cold (page cache dropped before each process)' if a.cold else 'warm page cache'}",
             "", f"load average before: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, at the end: "
             f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
             f"{a.rounds} rounds, median cells/s, batches of {a.batch_size:,} after "
             f"{a.warmup} warm-up batches, {a.epochs} epochs per process.", "",
             "| source | bytes on disk | output | cells/s (median) | vs collection |",
             "|---|---:|---|---:|---:|"]
    for densify in (False, True):
        base = statistics.median(runs[("collection", densify)])
        for source in SOURCES:
            med = statistics.median(runs[(source, densify)])
            lines.append(f"| {source} | {sizes[source] / 2**20:,.1f} MiB | "
                         f"{'dense' if densify else 'sparse CSR'} | {med:,.0f} | "
                         f"{med / base:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with a.out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
