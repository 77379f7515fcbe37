"""What ``AnnBatchDataset(out_dtype=...)`` costs or saves against the default float32.

    python benchmarks/out_dtype.py COLLECTION [--dtypes float32,int32,int16] [--rounds 3]
        [--batches 60] [--workers 0,2]

Each configuration (dtype x sparse/dense x workers) runs in a fresh process, a user's loop:
``AnnBatchDataLoader`` over the collection's counts, two batches of warm-up, then
``--batches`` timed (one value per page of each batch is read: what a copy to a device
would touch; a sum over a whole int32 tensor costs torch ~13x a float32 one here).
Rounds alternate the dtypes (A B C A B C ...) so that drift hits each alike; printed and
written to ``benchmarks/results/out_dtype.md``: the median cells/s of each, its ratio to
float32 in the same round, and the peak RSS of the main process and of its workers. The
collection must store integer values (written with ``data_dtype="auto"``).
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

HERE = Path(__file__).resolve().parent


def _child(args: argparse.Namespace) -> None:
    import resource

    from benchlib import time_batches, touch_pages

    import annbatch_torch as abt

    ds = abt.AnnBatchDataset(
        args.collection, batch_size=4096, densify=args.dense,
        out_dtype=None if args.dtype == "default" else args.dtype)
    loader = abt.AnnBatchDataLoader(ds, num_workers=args.workers)

    def epochs(e: int):  # type: ignore[no-untyped-def]
        ds.set_epoch(e)
        return loader

    run = time_batches(epochs, n_warmup=2, n_batches=args.batches,
                       n_cells_of=lambda b: int(b["X"].shape[0]), consume=touch_pages)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"cells_per_s": run.cells_per_s, "main_mb": own, "worker_mb": kids}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("collection")
    p.add_argument("--dtypes", default="default,int32,int16")
    p.add_argument("--workers", default="0,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=60)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="default", help=argparse.SUPPRESS)
    p.add_argument("--dense", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nworkers", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.workers = args.nworkers
        sys.path.insert(0, str(HERE))
        _child(args)
        return
    dtypes = args.dtypes.split(",")
    load = os.getloadavg()[0]
    rows = []
    for workers in [int(w) for w in args.workers.split(",")]:
        for dense in (False, True):
            got: dict[str, list[dict[str, float]]] = {d: [] for d in dtypes}
            for _ in range(args.rounds):
                for d in dtypes:
                    cmd = [sys.executable, __file__, args.collection, "--child", "--dtype", d,
                           "--nworkers", str(workers), "--batches", str(args.batches)]
                    out = subprocess.run(cmd + (["--dense"] if dense else []), check=True,
                                         capture_output=True, text=True).stdout
                    got[d].append(json.loads(out.strip().splitlines()[-1]))
            base = got[dtypes[0]]
            for d in dtypes:
                ratios = [a["cells_per_s"] / b["cells_per_s"] for a, b in zip(got[d], base)]
                row = {
                    "workers": workers, "layout": "dense" if dense else "sparse", "dtype": d,
                    "cells_per_s": statistics.median(r["cells_per_s"] for r in got[d]),
                    "ratio": statistics.median(ratios),
                    "main_mb": max(r["main_mb"] for r in got[d]),
                    "worker_mb": max(r["worker_mb"] for r in got[d]),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    lines = [f"# out_dtype against float32 ({time.strftime('%Y-%m-%d %H:%M')}, load "
             f"{load:.2f} at the start, {os.cpu_count()} CPUs)", "",
             f"Collection: `{args.collection}`; {args.batches} batches of 4096 after 2, "
             f"median of {args.rounds} alternated rounds; ratio: to `{dtypes[0]}` in the "
             "same round.", "",
             "| workers | layout | out_dtype | cells/s | ratio | main peak MB | "
             "worker peak MB |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['workers']} | {r['layout']} | {r['dtype']} | {r['cells_per_s']:,.0f} | "
              f"{r['ratio']:.2f} | {r['main_mb']:,.0f} | {r['worker_mb']:,.0f} |" for r in rows]
    out = HERE / "results" / "out_dtype.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
