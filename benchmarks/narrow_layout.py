"""Narrow dtypes vs the wide layout, side by side (issue 30).

Writes the benchmark inputs twice, as the wide layout of earlier collections
(``data_dtype="float32", index_dtype="int32"``) and with the writer's defaults (``"auto"``:
the narrowest lossless dtypes), then runs the same cases of ``cases.py`` on both, each in a
fresh process, interleaved (wide, narrow; then narrow, wide; ...), and prints and writes a
table of the best and median figure per layout and the narrow / wide ratio.

    python benchmarks/narrow_layout.py                     # 100,000 x 20,000, 3 rounds, warm
    python benchmarks/narrow_layout.py --cold              # also cold (root: drops the cache)
    python benchmarks/narrow_layout.py --n-obs 20000 --n-vars 2000 --rounds 1

Warm cases read each store through once before they start; cold ones drop the page cache
and time the first epoch. ``ceiling_disk_cold`` divides the disk's cold sequential
bandwidth by each layout's bytes per cell.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import _store_name, build_data, run_cases  # noqa: E402

LAYOUTS = {"wide": {"data_dtype": "float32", "index_dtype": "int32"}, "narrow": {}}
WARM = ("ours_sparse_w0", "ours_dense_w0", "ceiling_seq_raw")
COLD = ("ours_sparse_w0_cold", "ceiling_seq_raw_cold", "ceiling_disk_cold")


def _cfg(args: argparse.Namespace, paths: list[Path], store: Path,
         writer_kwargs: dict[str, Any]) -> dict[str, Any]:
    return {"n_obs": args.n_obs, "n_vars": args.n_vars, "batch_size": args.batch_size,
            "paths": [str(p) for p in paths], "store": str(store), "seed": 0,
            "n_warmup": 2, "n_batches": args.n_batches, "slow_batches": 12,
            "memory_epochs": 1, "max_memory": None, "n_classes": 8, "scd_block_size": 4,
            "scd_fetch_factor": 16, "seq_passes": 2, "writer_kwargs": writer_kwargs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-obs", type=int, default=100_000)
    p.add_argument("--n-vars", type=int, default=20_000)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--n-batches", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cold", action="store_true")
    p.add_argument("--cases", default=None, help="comma-separated cases (default: all)")
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--out", type=Path, default=HERE / "results" / "narrow_layout_issue30")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    paths, folder = build_data(args.data_dir, args.n_obs, args.n_vars, 0)
    cfgs = {name: _cfg(args, paths, folder / _store_name(kw), kw)
            for name, kw in LAYOUTS.items()}
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M"),
                               "loadavg_start": os.getloadavg(), "layouts": LAYOUTS,
                               "writer": {}, "rounds": []}
    for name, cfg in cfgs.items():  # the stores (written once; the writer is timed then)
        if not (Path(cfg["store"]) / "manifest.json").exists():
            results["writer"][name] = run_cases(["writer"], cfg, args.timeout)["writer"]
    cases = list(WARM) + (list(COLD) if args.cold else [])
    if args.cases:
        cases = [c for c in args.cases.split(",") if c]
    for r in range(args.rounds):
        order = list(cfgs) if r % 2 == 0 else list(reversed(cfgs))
        got: dict[str, dict[str, Any]] = {}
        for case in cases:
            for name in order:
                got.setdefault(case, {})[name] = run_cases([case], cfgs[name],
                                                           args.timeout)[case]
        results["rounds"].append(got)
    results["bytes_per_cell"] = {
        name: sum(f.stat().st_size for f in Path(cfg["store"]).rglob("*") if f.is_file())
        / args.n_obs for name, cfg in cfgs.items()}
    results["loadavg_end"] = os.getloadavg()
    lines = [f"# Narrow vs wide layout, {args.n_obs:,} x {args.n_vars:,}, batch "
             f"{args.batch_size}, {args.rounds} interleaved rounds ({results['started']}; "
             f"load average {results['loadavg_start'][0]:.2f} at the start, "
             f"{results['loadavg_end'][0]:.2f} at the end)", "",
             "| what | wide | narrow | narrow / wide |", "|---|---:|---:|---:|"]
    bpc = results["bytes_per_cell"]
    lines.append(f"| bytes per cell (the whole store) | {bpc['wide']:,.0f} | "
                 f"{bpc['narrow']:,.0f} | {bpc['narrow'] / bpc['wide']:.2f} |")
    for name, w in results["writer"].items():
        lines.append(f"| writer seconds ({name}) | {w.get('seconds', float('nan')):.1f} | | |")
    for case in cases:
        figs = {name: [rd[case][name].get("cells_per_s") or 0.0 for rd in results["rounds"]]
                for name in cfgs}
        best = {n: max(v) for n, v in figs.items()}
        med = {n: statistics.median(v) for n, v in figs.items()}
        ratio = best["narrow"] / best["wide"] if best["wide"] else float("nan")
        per_round = ", ".join(f"{a / b:.2f}" for a, b in zip(figs["narrow"], figs["wide"]) if b)
        lines.append(f"| {case} cells/s, best (median) | {best['wide']:,.0f} "
                     f"({med['wide']:,.0f}) | {best['narrow']:,.0f} ({med['narrow']:,.0f}) | "
                     f"{ratio:.2f} (rounds: {per_round}) |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    args.out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
