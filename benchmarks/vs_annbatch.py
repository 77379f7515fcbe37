"""annbatch_torch and scverse annbatch side by side: writer, warm and cold epochs.

annbatch 0.3 needs Python >= 3.12 and this project's environment may be older, so
annbatch runs in an interpreter of its own (``--annbatch-python``, a venv with
``pip install "annbatch[zarrs]"``; torch is not needed: its batches stay scipy CSR, which
costs it less than the torch sparse CSR tensors ours yield). Each measurement is a fresh
process; the two loaders alternate round by round.

    python benchmarks/vs_annbatch.py --annbatch-python /path/to/py312/bin/python \
        [--data-dir benchmarks/data] [--rounds 3] [--cold] [--no-writer] [--out FILE]

What each side does, as its README tells users to:

* writer: ours ``create_anndata_collection(inputs, obs_columns=["cell_type"])`` (defaults:
  narrow dtypes, raw chunks); annbatch ``DatasetCollection(...).add_adatas(inputs,
  load_adata=X + obs["cell_type"])`` (defaults: Blosc lz4, 1 GB shards, zarr-python writer);
  wall seconds and peak RSS of the process;
* loader: ours ``AnnBatchDataset(store, selector={"x": "X", "y": "obs/cell_type"},
  batch_size=4096)`` (pool 16,384 rows); annbatch ``Loader(batch_size=4096, chunk_size=32,
  preload_nchunks=256, shuffle=True).use_collection(c, load_adata=X + obs["cell_type"])``
  with the zarrs codec pipeline (its README's settings, pool 8,192 rows);
* warm: the store read through first, then batches 3-42 timed (a user's harness) and a
  whole second epoch; cold (``--cold``, root): the page cache dropped, then the first
  epoch timed whole from the first ``next``.

The inputs are ``run.py``'s two grouped h5ad files (100,000 x 20,000 by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import build_data  # noqa: E402

COMMON = r"""
import json, resource, sys, time
def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
def drop_caches():
    import os
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
def warm(path):
    import pathlib
    for p in pathlib.Path(path).rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass
def measure(make_iter, n_of, mode):
    out = {}
    if mode == "cold":
        drop_caches()
        t = time.perf_counter(); n = 0
        for b in make_iter(0):
            n += n_of(b)
        out["cold_epoch_cells_s"] = n / (time.perf_counter() - t)
        return out
    k = n = epoch = 0
    while k < 42:  # into the next epochs when one holds fewer than 42 batches
        for b in make_iter(epoch):
            k += 1
            if k == 2:
                t = time.perf_counter()
            elif k > 2:
                n += n_of(b)
            if k == 42:
                break
        epoch += 1
    out["harness_cells_s"] = n / (time.perf_counter() - t)
    t = time.perf_counter(); n = 0
    for b in make_iter(epoch):
        n += n_of(b)
    out["epoch_cells_s"] = n / (time.perf_counter() - t)
    return out
"""

OURS_WRITE = COMMON + r"""
import annbatch_torch as abt
t = time.perf_counter()
abt.create_anndata_collection(sys.argv[2:], sys.argv[1], seed=0, overwrite=True,
                              obs_columns=["cell_type"], progress=False)
print(json.dumps({"writer_s": time.perf_counter() - t, "peak_rss_mb": peak_mb()}))
"""

ANNBATCH_COMMON = COMMON + r"""
import anndata as ad
import zarr
zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"})
from annbatch import DatasetCollection, Loader
def x_and_cell_type(g):
    a = ad.experimental.read_lazy(g) if not isinstance(g, zarr.Group) else None
    if a is not None:
        return ad.AnnData(X=a.X, obs=a.obs[["cell_type"]].to_memory(), var=a.var.to_memory())
    return ad.AnnData(X=ad.io.sparse_dataset(g["X"]),
                      obs=ad.io.read_elem(g["obs"])[["cell_type"]])
"""

ANNBATCH_WRITE = ANNBATCH_COMMON + r"""
import numpy as np
t = time.perf_counter()
DatasetCollection(sys.argv[1]).add_adatas(sys.argv[2:], load_adata=x_and_cell_type,
                                          rng=np.random.default_rng(0))
print(json.dumps({"writer_s": time.perf_counter() - t, "peak_rss_mb": peak_mb()}))
"""

OURS_READ = COMMON + r"""
import annbatch_torch as abt
store, mode = sys.argv[1], sys.argv[2]
if mode == "warm":
    warm(store)
ds = abt.AnnBatchDataset(store, selector={"x": "X", "y": "obs/cell_type"}, batch_size=4096)
def make_iter(epoch):
    ds.set_epoch(epoch)
    return iter(ds)
out = measure(make_iter, lambda b: b["x"].shape[0], mode)
out["peak_rss_mb"] = peak_mb()
print(json.dumps(out))
"""

ANNBATCH_READ = ANNBATCH_COMMON + r"""
import numpy as np
store, mode = sys.argv[1], sys.argv[2]
if mode == "warm":
    warm(store)
with ad.settings.override(remove_unused_categories=False):
    loader = Loader(batch_size=4096, chunk_size=32, preload_nchunks=256, shuffle=True,
                    rng=np.random.default_rng(0), preload_to_gpu=False)
    loader = loader.use_collection(DatasetCollection(store, mode="r"),
                                   load_adata=x_and_cell_type)
def make_iter(epoch):
    return iter(loader)
out = measure(make_iter, lambda b: b["X"].shape[0], mode)
out["peak_rss_mb"] = peak_mb()
print(json.dumps(out))
"""


def _child(python: str, code: str, *args: str) -> dict[str, Any]:
    proc = subprocess.run([python, "-c", code, *args], capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{python} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--annbatch-python", required=True)
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--n-obs", type=int, default=100_000)
    p.add_argument("--n-vars", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="also cold epochs (root)")
    p.add_argument("--no-writer", action="store_true", help="reuse stores written before")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    paths, folder = build_data(args.data_dir, args.n_obs, args.n_vars, 0)
    stores = {"ours": folder / "vs_annbatch_ours", "annbatch": folder / "vs_annbatch.zarr"}
    sides = {"ours": (sys.executable, OURS_WRITE, OURS_READ),
             "annbatch": (args.annbatch_python, ANNBATCH_WRITE, ANNBATCH_READ)}
    res: dict[str, dict[str, list[Any]]] = {s: {} for s in sides}
    print(f"load average at the start: {os.getloadavg()[0]:.2f}", flush=True)
    modes = ["warm"] + (["cold"] if args.cold else [])
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for side in order:
            python, write, read = sides[side]
            if not args.no_writer and r < 2:  # the writer twice per side (it is slow)
                import shutil

                shutil.rmtree(stores[side], ignore_errors=True)
                w = _child(python, write, str(stores[side]), *map(str, paths))
                res[side].setdefault("writer", []).append(w)
                print(f"round {r} {side} writer: {w['writer_s']:.1f} s, peak "
                      f"{w['peak_rss_mb']:,.0f} MB", flush=True)
            for mode in modes:
                m = _child(python, read, str(stores[side]), mode)
                res[side].setdefault(mode, []).append(m)
                print(f"round {r} {side} {mode}: " + ", ".join(
                    f"{k} {v:,.0f}" for k, v in m.items()), flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    summary: dict[str, dict[str, float]] = {}
    for side in sides:
        s = summary[side] = {"bytes_per_cell": _du(stores[side]) / args.n_obs}
        for mode, runs in res[side].items():
            for key in runs[0]:
                vals = [x[key] for x in runs]  # best of the rounds; memory: the median
                s[f"{mode}.{key}"] = (min(vals) if key == "writer_s" else max(vals)
                                      if "cells_s" in key else statistics.median(vals))
    print("\n| figure | ours | annbatch | ours / annbatch |\n|---|---:|---:|---:|")
    for key in summary["ours"]:
        a, b = summary["ours"][key], summary["annbatch"].get(key)
        if b:
            print(f"| {key} | {a:,.1f} | {b:,.1f} | {a / b:.2f}x |")
    if args.out:
        args.out.write_text(json.dumps({"runs": res, "summary": summary}, indent=1))
    else:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"runs": res, "summary": summary}, f, indent=1)
            print(f"figures: {f.name}")


if __name__ == "__main__":
    main()
