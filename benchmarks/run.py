"""Benchmark annbatch_torch against its peers and ceilings, in one command.

Usage:

    python benchmarks/run.py                 # 100,000 x 20,000, batch 4096 (minutes)
    python benchmarks/run.py --small         # 20,000 x 2,000 (CI size)
    python benchmarks/run.py --only ours_dense_w0,scdataset_w0
    python benchmarks/run.py --cold --repeat 3   # also from disk: page cache dropped (root)
    python benchmarks/run.py --shard-elems 4194304   # a collection in zarr v3 shard files

Builds two grouped h5ad files with annbatch_torch.datasets.write_synthetic_h5ads (cached
under benchmarks/data/), runs every case of benchmarks/cases.py in its own fresh process,
and writes results.json, results.md and results.png under --out. With --only, earlier
results of the same configuration are kept and updated. See benchmarks/README.md for what
each case measures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import report  # noqa: E402
from cases import CASES, COLD_CASES, EXPERIMENTS  # noqa: E402

__all__ = ["main", "build_data", "run_cases", "best_of"]

#: cases that read the collection written by the ``writer`` case
NEEDS_STORE = {*EXPERIMENTS, *COLD_CASES, "ceiling_seq_zarr", "ceiling_seq_zarrs",
               "ceiling_seq_raw",
               "ours_dense_w0",
               "ours_dense_w2", "ours_sparse_w0", "ours_sparse_w2", "memory"}


def _parser() -> argparse.ArgumentParser:
    from annbatch_torch.cli.args import CliParser, int_at_least

    p = CliParser(prog="annbatch-torch bench", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    count, positive = int_at_least(0), int_at_least(1)
    p.add_argument("--n-obs", type=positive, default=None, help="cells (default 100000)")
    p.add_argument("--n-vars", type=positive, default=None, help="genes (default 20000)")
    p.add_argument("--batch-size", type=positive, default=4096)
    p.add_argument("--small", action="store_true",
                   help="20,000 x 2,000 cells, fewer batches (CI size)")
    p.add_argument("--only", default=None, help=f"comma-separated cases of: {', '.join(CASES)}")
    p.add_argument("--experiments", action="store_true",
                   help="also run the exp_* cases (candidate fast paths, see README)")
    p.add_argument("--skip", default=None, help="comma-separated cases to leave out")
    p.add_argument("--out", type=Path, default=HERE / "results",
                   help="folder for results.json/.md/.png (default: benchmarks/results/, the "
                        "committed results; `annbatch-torch bench` without --out writes a new "
                        "folder ./annbatch-torch-bench/<timestamp> instead)")
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--n-warmup", type=count, default=2, help="untimed batches first")
    p.add_argument("--n-batches", type=positive, default=None,
                   help="timed batches per loader (default 40; 10 with --small)")
    p.add_argument("--slow-batches", type=positive, default=12,
                   help="at most this many timed batches for AnnLoader (~1 s per batch)")
    p.add_argument("--memory-epochs", type=positive, default=5)
    p.add_argument("--max-memory", default="1GB",
                   help="writer max_memory: peak RSS bound of the writer process (default 1GB)")
    p.add_argument("--seed", type=count, default=0)
    p.add_argument("--scd-block-size", type=positive, default=4,
                   help="scDataset BlockShuffling block_size (as in the arrayloader benchmarks)")
    p.add_argument("--scd-fetch-factor", type=positive, default=16)
    p.add_argument("--seq-passes", type=positive, default=2,
                   help="front-to-back passes over the store (the best one counts)")
    p.add_argument("--repeat", type=positive, default=1,
                   help="rounds over all cases; the best round of each case counts (the "
                        "machine may be shared: the best round is the least disturbed)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    p.add_argument("--rebuild", action="store_true", help="regenerate the h5ad inputs")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--cold", action="store_true",
                   help="also run the cold cases (<case>_cold: the page cache is dropped "
                        "first and the first epoch timed; and ceiling_disk_cold); needs root")
    p.add_argument("--shard-elems", type=count, default=None, metavar="N",
                   help="write the collection in zarr v3 shard files of N elements, 0: one "
                        "file per chunk (zarr_shard_elems; default: the writer's)")
    p.add_argument("--shard-size", type=positive, default=None, metavar="ROWS",
                   help="rows per collection shard (n_obs_per_shard; default: the writer's)")
    p.add_argument("--compressor", default=None,
                   help="the collection's codec (raw, lz4, zstd; default: the writer's)")
    p.add_argument("--data-dtype", default=None,
                   help="how the collection stores X's values (auto, float32...; default: "
                        "the writer's)")
    p.add_argument("--index-dtype", default=None,
                   help="how the collection stores X's column indices (auto, int32; "
                        "default: the writer's)")
    p.add_argument("--in-process", action="store_true",
                   help="run the cases in this process (fast smoke tests; RSS figures are "
                        "then not per loader)")
    return p


def _store_name(writer_kwargs: dict[str, Any]) -> str:
    """The collection folder of a layout: the writer's defaults filled in, so a store
    written by another version's defaults is never taken for this one's."""
    import inspect

    from annbatch_torch import create_anndata_collection

    params = inspect.signature(create_anndata_collection).parameters
    layout = {k: writer_kwargs.get(k, params[k].default)
              for k in ("zarr_shard_elems", "compressor", "n_obs_per_shard")}
    # versions before the dtype options wrote float32 / int32 (a folder name of their own)
    dtypes = [str(writer_kwargs.get(k, params[k].default)) if k in params else "wide"
              for k in ("data_dtype", "index_dtype")]
    try:
        from annbatch_torch.write.budget import DEFAULT_SHARD_OBS

        if layout["n_obs_per_shard"] is None:
            layout["n_obs_per_shard"] = DEFAULT_SHARD_OBS
    except ImportError:  # a version whose shard size came from the memory budget
        pass
    short = {"zarr_shard_elems": "shard_elems", "compressor": "codec",
             "n_obs_per_shard": "shard_obs"}
    name = "collection_" + "_".join(f"{short[k]}-{v}" for k, v in layout.items())
    return name if dtypes == ["wide", "wide"] else f"{name}_dtypes-{'-'.join(dtypes)}"


def _log(quiet: bool, msg: str) -> None:
    if not quiet:
        print(msg, flush=True)


def build_data(data_dir: Path, n_obs: int, n_vars: int, seed: int, rebuild: bool = False,
               quiet: bool = False) -> tuple[list[Path], Path]:
    """Write (or reuse) the two grouped h5ad inputs; returns their paths and the folder.

    A ``data.json`` marker is written last, so an interrupted build is redone.
    """
    import shutil

    from annbatch_torch.datasets import write_synthetic_h5ads

    folder = data_dir / f"grouped_{n_obs}x{n_vars}_seed{seed}"
    marker = folder / "data.json"
    sizes = [n_obs // 2, n_obs - n_obs // 2]
    paths = [folder / "part0.h5ad", folder / "part1.h5ad"]
    if not rebuild and marker.exists() and all(p.exists() for p in paths):
        return paths, folder
    shutil.rmtree(folder, ignore_errors=True)
    _log(quiet, f"writing {n_obs:,} x {n_vars:,} grouped h5ad inputs to {folder} ...")
    t0 = time.perf_counter()
    paths = write_synthetic_h5ads(folder, 2, sizes, n_vars, grouped=True, seed=seed)
    marker.write_text(json.dumps({"n_obs": n_obs, "n_vars": n_vars, "seed": seed,
                                  "seconds": time.perf_counter() - t0}))
    _log(quiet, f"  done in {time.perf_counter() - t0:.1f} s")
    return [Path(p) for p in paths], folder


def _labels_and_nnz(paths: list[Path]) -> tuple[Any, int, float]:
    """Global cell_type codes of all rows, the number of classes and non-zeros per cell."""
    import anndata as ad
    import numpy as np
    import pandas as pd

    adatas = [ad.read_h5ad(p, backed="r") for p in paths]
    cats = pd.Index(sorted(set().union(*(a.obs["cell_type"].cat.categories for a in adatas))))
    codes = np.concatenate([cats.get_indexer(a.obs["cell_type"].astype(str)) for a in adatas])
    nnz = sum(int(a.file["X"]["indptr"][-1]) for a in adatas)
    n = sum(a.n_obs for a in adatas)
    for a in adatas:
        a.file.close()
    return codes, len(cats), nnz / n


def _machine() -> dict[str, Any]:
    import psutil

    ram = psutil.virtual_memory().total / 2**30
    cpus = os.cpu_count() or 0
    return {"cpu_count": cpus, "ram_gib": round(ram, 1), "python": platform.python_version(),
            "platform": platform.platform(),
            "summary": f"{cpus} CPUs, {ram:.0f} GiB RAM, Python {platform.python_version()}",
            "versions": _versions(), "git": _git()}


def _git() -> str:
    """Commit of the working tree, with ``+dirty`` when files differ from it."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                             capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=HERE, text=True, capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev or "unknown") + ("+dirty" if dirty.strip() else "")


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for pkg in ("annbatch-torch", "torch", "anndata", "zarr", "zarrs", "scDataset", "numpy",
                "scipy", "h5py", "numcodecs"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _run_one(name: str, cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        cfg = dict(cfg, result=str(Path(tmp) / "result.json"))
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_text(json.dumps(cfg))
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, str(HERE / "cases.py"), name, str(cfg_path)],
                capture_output=True, text=True, timeout=timeout, env=env,
            )
        except subprocess.TimeoutExpired:
            return {"case": name, "status": "failed",
                    "error": f"timed out after {timeout:.0f} s"}
        res_path = Path(cfg["result"])
        if res_path.exists():
            out = json.loads(res_path.read_text())
        else:
            out = {"case": name, "status": "failed",
                   "error": f"process exited with {proc.returncode} and no result: "
                            f"{proc.stderr[-1500:]}"}
        out["process_seconds"] = time.perf_counter() - t0
        return out


def _read_through(paths: list[Path]) -> None:
    """Read every file under ``paths`` once (into the page cache)."""
    buf = bytearray(8 << 20)
    for root in paths:
        for f in [root] if root.is_file() else sorted(root.rglob("*")) if root.exists() else []:
            if f.is_file():
                with open(f, "rb", buffering=0) as fh:
                    while fh.readinto(buf):
                        pass


def run_cases(names: list[str], cfg: dict[str, Any], timeout: float, quiet: bool = False,
              in_process: bool = False) -> dict[str, dict[str, Any]]:
    """Run each case in a fresh subprocess (or here), in order; returns ``{name: result}``."""
    from cases import run_case

    out: dict[str, dict[str, Any]] = {}
    for name in names:
        _log(quiet, f"[{time.strftime('%H:%M:%S')}] {name} ...")
        if not name.endswith("_cold") and name not in ("writer", "anndata_write"):
            # warm means in the page cache: a cold case (or a round) before may have
            # dropped it, and a loader's first epoch would then read from disk
            _read_through([Path(cfg["store"]), *map(Path, cfg["paths"])])
        load = os.getloadavg()[0]
        r = run_case(name, cfg) if in_process else _run_one(name, cfg, timeout)
        r["loadavg_before"] = load
        r["loadavg_after"] = os.getloadavg()[0]
        out[name] = r
        if r.get("status") == "ok":
            rate = r.get("cells_per_s")
            extra = f"{rate:,.0f} cells/s" if rate else ""
            if name == "writer":
                extra = f"{r['seconds']:.1f} s"
            wk = [round(x) for x in r.get("worker_peak_rss_mb") or []]
            _log(quiet, f"    ok {extra}  (peak RSS {r.get('main_peak_rss_mb', 0):,.0f} MiB"
                 f"{', workers ' + str(wk) if wk else ''})")
        else:
            _log(quiet, f"    {r.get('status')}: {r.get('reason') or r.get('error')}")
    return out


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge repeated runs of one case: the fastest run, with memory peaks over all runs.

    Fastest is the highest ``cells_per_s`` (the lowest ``seconds`` for the writers); peak
    RSS figures are the maxima over every run, so memory claims stay conservative.
    """
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return runs[-1]
    if len(ok) == 1 and len(runs) == 1:
        return ok[0]
    best = dict(max(ok, key=lambda r: r.get("cells_per_s") or -r.get("seconds", 0.0)))
    best["main_peak_rss_mb"] = max(r.get("main_peak_rss_mb", 0.0) for r in ok)
    own = [r["main_peak_own_mb"] for r in ok if r.get("main_peak_own_mb")]
    if own:
        best["main_peak_own_mb"] = max(own)
    wk = [x for r in ok for x in r.get("worker_peak_rss_mb") or []]
    if wk:
        best["worker_peak_rss_mb"] = [max(wk)]
    best["rounds"] = [{"cells_per_s": r.get("cells_per_s"), "seconds": r.get("seconds"),
                       "loadavg_before": r.get("loadavg_before"), "status": r.get("status")}
                      for r in runs]
    return best


def main(argv: list[str] | None = None) -> int:
    """Command-line entry (also ``annbatch-torch bench``)."""
    args = _parser().parse_args(argv)
    n_obs = args.n_obs if args.n_obs is not None else (20_000 if args.small else 100_000)
    n_vars = args.n_vars if args.n_vars is not None else (2_000 if args.small else 20_000)
    n_batches = args.n_batches if args.n_batches is not None else (10 if args.small else 40)
    names = [n for n in CASES if n not in EXPERIMENTS and n not in COLD_CASES]
    if args.experiments:
        names += list(EXPERIMENTS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in CASES]
        if unknown:
            print(f"unknown case(s) {unknown}; cases: {', '.join(CASES)}", file=sys.stderr)
            return 2
    if args.cold:  # the cold twins of the chosen cases, and the disk ceiling
        cold = [c for c in COLD_CASES if c.removesuffix("_cold") in names]
        names += [c for c in [*cold, "ceiling_disk_cold", "ceiling_disk_parallel_cold"]
                  if c not in names]
    if args.skip:
        names = [n for n in names if n not in set(args.skip.split(","))]

    paths, folder = build_data(args.data_dir, n_obs, n_vars, args.seed, args.rebuild,
                               args.quiet)
    writer_kwargs = {k: v for k, v in (("zarr_shard_elems", args.shard_elems),
                                       ("compressor", args.compressor),
                                       ("n_obs_per_shard", args.shard_size),
                                       ("data_dtype", args.data_dtype),
                                       ("index_dtype", args.index_dtype)) if v is not None}
    store = folder / _store_name(writer_kwargs)
    if ("writer" not in names and NEEDS_STORE & set(names)
            and not (store / "manifest.json").exists()):
        names.insert(0, "writer")  # the loaders need the collection
    codes, n_classes, nnz_per_cell = _labels_and_nnz(paths)

    from benchlib import random_batch_entropy

    cfg = {
        "n_obs": n_obs, "n_vars": n_vars, "batch_size": args.batch_size,
        "paths": [str(p) for p in paths], "store": str(store), "seed": args.seed,
        "n_warmup": args.n_warmup, "n_batches": n_batches,
        "slow_batches": args.slow_batches, "memory_epochs": args.memory_epochs,
        "max_memory": args.max_memory, "n_classes": n_classes,
        "scd_block_size": args.scd_block_size, "scd_fetch_factor": args.scd_fetch_factor,
        "seq_passes": args.seq_passes, "writer_kwargs": writer_kwargs,
    }
    key = {k: cfg[k] for k in ("n_obs", "n_vars", "batch_size", "seed")}
    results: dict[str, Any] = {"cases": {}}
    old = args.out / "results.json"
    if args.only and old.exists():  # keep earlier cases of the same configuration
        prev = json.loads(old.read_text())
        if {k: prev.get("config", {}).get(k) for k in key} == key:
            results = prev
    results.update({
        "config": cfg, "machine": _machine(), "started": time.strftime("%Y-%m-%d %H:%M"),
        "random_entropy": random_batch_entropy(codes, args.batch_size, n_classes),
        "nnz_per_cell": nnz_per_cell,
    })
    results["in_process"] = args.in_process
    rounds = []
    for i in range(max(1, args.repeat)):
        if args.repeat > 1:
            _log(args.quiet, f"-- round {i + 1} of {args.repeat}")
        rounds.append(run_cases(names, cfg, args.timeout, args.quiet, args.in_process))
    results["repeat"] = args.repeat
    results["cases"].update({n: best_of([r[n] for r in rounds]) for n in names})
    report.write_all(results, args.out)
    _log(args.quiet, f"\nwrote {args.out / 'results.md'}\n")
    _log(args.quiet, "\n".join(report.target_table(results["targets"])))
    failed = [n for n in names if results["cases"][n].get("status") == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
