"""GPU check (~5 minutes): values of the GPU path equal the CPU path's, and cells/s.

Streams a collection with sparse (CSR) batches, moves each batch with
``annbatch_torch.to_device(batch, "cuda", densify=True)`` (pinned host memory, CSR
components copied asynchronously, densified on the GPU) and compares every batch with the
CPU path (scipy densification in the loader, ``densify=True``). Prints cells/s of both.
Exits 0 with a note where CUDA is absent.

Usage: ``python benchmarks/gpu_check.py [--n-obs 100000 --n-vars 20000 --batch-size 4096]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import annbatch_torch as abt
from annbatch_torch import A


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n-obs", type=int, default=100_000)
    p.add_argument("--n-vars", type=int, default=20_000)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check.")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        paths = abt.datasets.write_synthetic_h5ads(
            Path(tmp) / "in", 2, args.n_obs // 2, args.n_vars, grouped=True
        )
        coll = abt.create_anndata_collection(paths, Path(tmp) / "store", progress=False)
        kw = dict(selector={"x": A.X}, batch_size=args.batch_size, return_index=True, seed=0)
        rates = {}
        outs = {}
        for name, densify in (("cpu-densify", True), ("gpu-densify", False)):
            ds = abt.AnnBatchDataset(coll, densify=densify, **kw)
            loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=args.workers)
            n, sums = 0, []
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for batch in loader:
                b = abt.to_device(batch, "cuda", densify=True)
                sums.append(b["x"].sum(dim=1).double().cpu().numpy())
                n += len(b["index"])
            torch.cuda.synchronize()
            rates[name] = n / (time.perf_counter() - t0)
            outs[name] = np.concatenate(sums)
        same = np.allclose(outs["cpu-densify"], outs["gpu-densify"], rtol=1e-6)
        for name, r in rates.items():
            print(f"{name}: {r:,.0f} cells/s")
        print(f"values equal: {same}")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
