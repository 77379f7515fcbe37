"""Collection layouts side by side: narrow dtypes, the wide layout, codecs (issue 30).

Writes the benchmark inputs once per layout (``--layouts``; default the wide layout of
earlier collections, ``data_dtype="float32", index_dtype="int32"``, and the writer's
defaults, ``"auto"``: the narrowest lossless dtypes; also ``lz4`` and ``zstd`` on the narrow
dtypes), then runs the same cases of ``cases.py`` on each, each in a fresh process,
interleaved (the order rotated every round), and prints and writes a table of the best and
median figure per layout and each one's ratio to the first.

    python benchmarks/narrow_layout.py                     # 100,000 x 20,000, 3 rounds, warm
    python benchmarks/narrow_layout.py --cold              # also cold (root: drops the cache)
    python benchmarks/narrow_layout.py --n-obs 20000 --n-vars 2000 --rounds 1
    python benchmarks/narrow_layout.py --layouts narrow,lz4,zstd --cold

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

LAYOUTS = {"wide": {"data_dtype": "float32", "index_dtype": "int32"}, "narrow": {},
           "lz4": {"compressor": "lz4"}, "zstd": {"compressor": "zstd"}}
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
    p.add_argument("--layouts", default="wide,narrow",
                   help=f"comma-separated, the first is the reference ({', '.join(LAYOUTS)})")
    args = p.parse_args(argv)
    chosen = {k: LAYOUTS[k] for k in args.layouts.split(",") if k}
    paths, folder = build_data(args.data_dir, args.n_obs, args.n_vars, 0)
    cfgs = {name: _cfg(args, paths, folder / _store_name(kw), kw)
            for name, kw in chosen.items()}
    ref = next(iter(cfgs))
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M"),
                               "loadavg_start": os.getloadavg(), "layouts": chosen,
                               "writer": {}, "rounds": []}
    for name, cfg in cfgs.items():  # the stores (written once; the writer is timed then)
        if not (Path(cfg["store"]) / "manifest.json").exists():
            results["writer"][name] = run_cases(["writer"], cfg, args.timeout)["writer"]
    cases = list(WARM) + (list(COLD) if args.cold else [])
    if args.cases:
        cases = [c for c in args.cases.split(",") if c]
    for r in range(args.rounds):
        order = list(cfgs)[r % len(cfgs):] + list(cfgs)[: r % len(cfgs)]  # rotated
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
             "| what | " + " | ".join(cfgs) + " | each / " + ref + " (best; per round) |",
             "|---|" + "---:|" * (len(cfgs) + 1)]
    bpc = results["bytes_per_cell"]
    lines.append("| bytes per cell (the whole store) | "
                 + " | ".join(f"{bpc[n]:,.0f}" for n in cfgs) + " | "
                 + ", ".join(f"{n} {bpc[n] / bpc[ref]:.2f}" for n in cfgs if n != ref) + " |")
    for name, w in results["writer"].items():
        lines.append(f"| writer seconds ({name}) | {w.get('seconds', float('nan')):.1f} |"
                     + " |" * len(cfgs))
    for case in cases:
        figs = {name: [rd[case][name].get("cells_per_s") or 0.0 for rd in results["rounds"]]
                for name in cfgs}
        best = {n: max(v) for n, v in figs.items()}
        med = {n: statistics.median(v) for n, v in figs.items()}
        ratios = "; ".join(
            f"{n} {best[n] / best[ref]:.2f} ("
            + ", ".join(f"{a / b:.2f}" for a, b in zip(figs[n], figs[ref]) if b) + ")"
            for n in cfgs if n != ref and best[ref])
        lines.append(f"| {case} cells/s, best (median) | "
                     + " | ".join(f"{best[n]:,.0f} ({med[n]:,.0f})" for n in cfgs)
                     + f" | {ratios} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    args.out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
