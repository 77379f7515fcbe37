"""The shuffle-quality report (``diversity_report``): its speed at atlas scale, its agreement
with the batches a loader actually yields, and the chunk_size / preload_nchunks grid of the
tuning guide.

    python benchmarks/diversity.py agree      # report vs labels read through the loader
    python benchmarks/diversity.py grid       # tuning grid on inputs sorted by cell type
    python benchmarks/diversity.py speed --n-obs 10000000   # a 10^7-cell collection (obs + a
                                              # 1-gene X), the report timed in fresh processes

``agree`` and ``grid`` use the benchmark's grouped inputs (``benchmarks/data/grouped_*``:
cells sorted by cell type inside each file, as atlases often are; made by ``run.py``),
read in place (what a loader over unshuffled inputs sees) and as the shuffled collection.
Outputs: ``benchmarks/results/diversity.md`` (appended per command), ``diversity.json`` and,
for ``grid``, ``diversity_tuning.png`` (shown by docs/tuning.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
FIGURE = RESULTS / "diversity_tuning.png"


def _grouped(n_obs: int, n_vars: int) -> Path:
    folder = HERE / "data" / f"grouped_{n_obs}x{n_vars}_seed0"
    if not (folder / "part0.h5ad").exists():
        sys.exit(f"{folder}: no grouped inputs; run benchmarks/run.py --n-obs {n_obs} "
                 f"--n-vars {n_vars} --only writer first")
    return folder


def _collection(folder: Path) -> Path:
    stores = sorted(p for p in folder.glob("collection_*codec-raw*dtypes-auto-auto")
                    if (p / "manifest.json").exists())
    if not stores:
        sys.exit(f"{folder}: no collection; run benchmarks/run.py --only writer first")
    return stores[0]


def _record(name: str, payload: dict[str, Any], lines: list[str]) -> None:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "diversity.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[name] = payload
    path.write_text(json.dumps(data, indent=1))
    md = RESULTS / "diversity.md"
    text = md.read_text() if md.exists() else "# The shuffle-quality report (issue 33)\n"
    head = f"\n## {name}\n"
    if head in text:  # replace the section of an earlier run of the same command
        start = text.index(head)
        end = text.find("\n## ", start + len(head))
        text = text[:start] + (text[end:] if end >= 0 else "")
    md.write_text(text.rstrip("\n") + "\n" + head + "\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


def _machine() -> str:
    load = os.getloadavg()[0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    return (f"{time.strftime('%Y-%m-%d %H:%M')}, code {commit or '?'}, {os.cpu_count()} CPUs, "
            f"load {load:.2f} at the start")


# -- agree ---------------------------------------------------------------------------------
def agree(args: argparse.Namespace) -> None:
    """Per batch, the report's entropy beside the entropy of the labels read through a
    DataLoader (2 workers), for chunked mode and class-balanced sampling, over the first
    ``n_batches`` batches; both divided by run.py's random-batch entropy too."""
    import torch

    import annbatch_torch as abt
    from annbatch_torch import A
    from annbatch_torch.sampling.diversity import entropy

    folder = _grouped(args.n_obs, args.n_vars)
    sources = {"in place (sorted inputs)": [str(folder / "part0.h5ad"),
                                            str(folder / "part1.h5ad")],
               "collection": str(_collection(folder))}
    rows = []
    for label, src in sources.items():
        for mode in ("chunked", "balanced"):
            sampler = abt.ClassBalancedSampler("cell_type") if mode == "balanced" else None
            ds = abt.AnnBatchDataset(src, selector={"y": A.obs["cell_type"]},
                                     batch_size=args.batch_size, sampler=sampler, seed=0)
            t = time.perf_counter()
            report = abt.diversity_report(ds, "cell_type", args.n_batches, per="batch")
            summary = abt.diversity_report(ds, "cell_type", args.n_batches)
            t_report = time.perf_counter() - t
            k = len(ds.source.categories("cell_type"))
            t = time.perf_counter()
            counts = []
            loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
            for b in loader:
                counts.append(np.bincount(b["y"].numpy().astype(np.int64), minlength=k))
                if len(counts) == args.n_batches:
                    break
            t_read = time.perf_counter() - t
            h_read = entropy(np.stack(counts))
            h_report = report.loc["cell_type", "entropy"].to_numpy()
            s = summary.loc["cell_type"]
            rows.append({
                "source": label, "mode": mode, "batches": len(counts),
                "max_abs_entropy_difference": float(np.abs(h_read - h_report).max()),
                "ratio_report": float(s["entropy_ratio"]),
                "ratio_read": float(h_read.mean() / s["random_entropy"]),
                "report_s": t_report, "read_s": t_read,
            })
    lines = [f"Run: {_machine()}; `python benchmarks/diversity.py agree` ({args.n_obs:,} x "
             f"{args.n_vars:,}, batch {args.batch_size}, the first {args.n_batches} batches "
             "of epoch 0, default chunk_size / preload_nchunks).", "",
             "| source | mode | batches | entropy ratio, report | entropy ratio, batches read "
             "| max per-batch difference (nats) | report s | read s |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['source']} | {r['mode']} | {r['batches']} | {r['ratio_report']:.4f} "
                     f"| {r['ratio_read']:.4f} | {r['max_abs_entropy_difference']:.1e} | "
                     f"{r['report_s']:.2f} | {r['read_s']:.2f} |")
    _record("agree", {"rows": rows}, lines)


# -- grid ----------------------------------------------------------------------------------
def grid(args: argparse.Namespace) -> None:
    """Entropy ratio (and distinct classes) over chunk_size x preload_nchunks on the grouped
    inputs read in place, plotted for the tuning guide."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import annbatch_torch as abt

    folder = _grouped(args.n_obs, args.n_vars)
    src = abt.open_source([str(folder / "part0.h5ad"), str(folder / "part1.h5ad")])
    chunks = [64, 256, 512, 1024, 4096]
    pools = [1, 2, 4, 8, 16, 32, 64, 128]
    table: dict[int, list[tuple[int, float, float]]] = {}
    t0 = time.perf_counter()
    for c in chunks:
        for p in pools:
            if c * p < args.batch_size:
                continue
            ds = abt.AnnBatchDataset(src, batch_size=args.batch_size, chunk_size=c,
                                     preload_nchunks=p, seed=0)
            s = abt.diversity_report(ds, "cell_type", args.n_batches).loc["cell_type"]
            table.setdefault(c, []).append((p, float(s["entropy_ratio"]),
                                            float(s["distinct_ratio"])))
    elapsed = time.perf_counter() - t0
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for c, points in table.items():
        pool_rows = [p * c for p, _, _ in points]
        ax.plot(pool_rows, [r for _, r, _ in points], marker="o", label=f"chunk_size={c}")
    ax.axhline(1.0, color="grey", ls="--", lw=0.8)
    ax.axvline(512 * 32, color="grey", ls=":", lw=0.8)
    ax.text(512 * 32, 0.05, " default pool\n (512 x 32)", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("rows per pool (chunk_size x preload_nchunks)")
    ax.set_ylabel("per-batch entropy / random batches")
    ax.set_title(f"Inputs sorted by cell type, read in place ({args.n_obs:,} cells, "
                 f"batch {args.batch_size})", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=110)
    lines = [f"Run: {_machine()}; `python benchmarks/diversity.py grid` (in place over the "
             f"two grouped inputs, {args.n_obs:,} cells sorted by cell type inside each file, "
             f"batch {args.batch_size}, the first {args.n_batches} batches of epoch 0; "
             f"{sum(len(v) for v in table.values())} reports in {elapsed:.1f} s). Entropy "
             "ratio (distinct-classes ratio) per chunk_size x preload_nchunks; the plot: "
             f"`benchmarks/results/{FIGURE.name}`.", "",
             "| chunk_size | " + " | ".join(f"x{p}" for p in pools) + " |",
             "|---:|" + "---:|" * len(pools)]
    for c, points in table.items():
        got = {p: (r, d) for p, r, d in points}
        cells = [f"{got[p][0]:.3f} ({got[p][1]:.2f})" if p in got else "" for p in pools]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    _record("grid", {"chunks": chunks, "pools": pools,
                     "table": {str(c): v for c, v in table.items()}}, lines)


# -- speed ---------------------------------------------------------------------------------
def _write_atlas(root: Path, n_obs: int, n_inputs: int) -> Path:
    """``n_inputs`` h5ad files of a 1-gene X (one non-zero per cell) and obs ``cell_type``
    (500 Zipf classes) and ``donor_id`` (1,000), written as one collection."""
    import anndata as ad
    import pandas as pd
    import scipy.sparse as sp

    import annbatch_torch as abt

    store = root / "collection"
    if (store / "manifest.json").exists():
        return store
    rng = np.random.default_rng(0)
    zipf = 1.0 / np.arange(1, 501)
    types = [f"type{i}" for i in range(500)]
    donors = [f"d{i}" for i in range(1000)]
    paths = []
    for i, n in enumerate(np.diff(np.linspace(0, n_obs, n_inputs + 1).astype(np.int64))):
        x = sp.csr_matrix((np.ones(n, np.float32), np.zeros(n, np.int32),
                           np.arange(n + 1, dtype=np.int64)), shape=(n, 1))
        obs = pd.DataFrame({
            "cell_type": pd.Categorical.from_codes(rng.choice(500, n, p=zipf / zipf.sum()),
                                                   types),
            "donor_id": pd.Categorical.from_codes(rng.integers(0, 1000, n), donors),
        }, index=pd.Index([f"i{i}_{j}" for j in range(n)]))
        path = root / f"in{i}.h5ad"
        ad.AnnData(x, obs=obs, var=pd.DataFrame(index=["g0"])).write_h5ad(path)
        paths.append(path)
    abt.create_anndata_collection(paths, store, progress=True)
    for p in paths:
        p.unlink()
    return store


_CHILD = """
import sys, time
t0 = time.perf_counter()
import annbatch_torch as abt
store, mode = sys.argv[1], sys.argv[2]
sampler = abt.ClassBalancedSampler("cell_type") if mode == "balanced" else None
ds = abt.AnnBatchDataset(store, batch_size=4096, sampler=sampler)
t1 = time.perf_counter()
r = abt.diversity_report(ds, ["cell_type", "donor_id"], 200)
t2 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {r.loc['cell_type', 'entropy_ratio']:.4f}")
"""


def speed(args: argparse.Namespace) -> None:
    root = Path(args.work) / f"diversity_atlas_{args.n_obs}"
    root.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    store = _write_atlas(root, args.n_obs, args.n_inputs)
    print(f"collection ready in {time.perf_counter() - t:.0f} s: {store}")
    rows = []
    for mode in ("chunked", "balanced"):
        for _ in range(args.rounds):
            out = subprocess.run([sys.executable, "-c", _CHILD, str(store), mode],
                                 capture_output=True, text=True, check=True).stdout.split()
            rows.append({"mode": mode, "import_open_s": float(out[0]),
                         "report_s": float(out[1]), "entropy_ratio": float(out[2])})
    lines = [f"Run: {_machine()}; `python benchmarks/diversity.py speed --n-obs {args.n_obs}` "
             f"(a collection of {args.n_obs:,} cells from {args.n_inputs} inputs, obs "
             "cell_type (500 Zipf classes) and donor_id (1,000); each report in a fresh "
             "process: both columns, 200 batches of 4,096, page cache warm).", "",
             "| mode | import + dataset s | diversity_report s (2 columns) | cell_type entropy "
             "ratio |", "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['import_open_s']:.2f} | {r['report_s']:.2f} | "
                     f"{r['entropy_ratio']:.4f} |")
    _record(f"speed at {args.n_obs:,} cells", {"rows": rows}, lines)
    if not args.keep:
        shutil.rmtree(root)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("agree", "grid"):
        s = sub.add_parser(name)
        s.add_argument("--n-obs", type=int, default=100_000)
        s.add_argument("--n-vars", type=int, default=20_000)
        s.add_argument("--batch-size", type=int, default=4096)
        s.add_argument("--n-batches", type=int, default=200 if name == "agree" else 24)
    s = sub.add_parser("speed")
    s.add_argument("--n-obs", type=int, default=10_000_000)
    s.add_argument("--n-inputs", type=int, default=100)
    s.add_argument("--rounds", type=int, default=2)
    s.add_argument("--work", default=str(HERE / "data"))
    s.add_argument("--keep", action="store_true", help="keep the collection")
    args = p.parse_args()
    {"agree": agree, "grid": grid, "speed": speed}[args.command](args)


if __name__ == "__main__":
    main()
