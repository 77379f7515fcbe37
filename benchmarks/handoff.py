"""Batches at the training loop's door: in-process against worker processes (issue 32).

    python benchmarks/handoff.py [COLLECTION] [--workers 2 | 1,2,4] [--rounds 3] [--batches 40]
        [--warmup 2] [--loaders inproc,plain,abt] [--layouts sparse,dense]

Each configuration runs in a fresh process, as a user's loop does: the dataset
(``batch_size=4096``, the collection's X) iterated in-process (``inproc``: the dataset
itself, ``num_workers=0``), through a plain ``torch.utils.data.DataLoader(ds,
batch_size=None, num_workers=W, persistent_workers=True)`` (``plain``) or through
``AnnBatchDataLoader(ds, num_workers=W, persistent_workers=True)`` (``abt``); sparse
(``torch.sparse_csr_tensor``) or dense (``densify=True``). ``--warmup`` batches (default two)
untimed, then ``--batches`` timed, epoch after epoch (the default window holds the first
epoch's fresh pool memory, which workers have twice of; ``--warmup 60`` times epochs whose
memory is reused); the loop reads one value per page of each batch
(what a copy to a device would touch). Rounds alternate the configurations so that drift
hits each alike; printed and written to ``benchmarks/results/handoff.md``: the best and the
median cells/s of each over the rounds, the ratio of the bests to in-process of the same
layout, the CPU spent per cell (all processes, and the main process's share: where the
handoff's cost lands), the minor page faults per cell (all processes, and the workers':
fresh memory written), and the peak RSS of the main process and of the largest worker.

Default collection: the 100k x 20k benchmark collection of ``benchmarks/run.py``.
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
DEFAULT = (HERE / "data" / "grouped_100000x20000_seed0" /
           "collection_shard_elems-8388608_codec-raw_shard_obs-131072_dtypes-auto-auto")


def _child(args: argparse.Namespace) -> None:
    import resource

    import torch
    from benchlib import time_batches, touch_pages

    import annbatch_torch as abt

    ds = abt.AnnBatchDataset(args.collection, batch_size=4096, densify=args.layout == "dense")
    if args.loader == "inproc":
        loader = ds
    elif args.loader == "plain":
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=args.nworkers,
                                             persistent_workers=True)
    else:
        loader = abt.AnnBatchDataLoader(ds, num_workers=args.nworkers, persistent_workers=True)

    def epochs(e: int):  # type: ignore[no-untyped-def]
        ds.set_epoch(e)
        return loader

    run = time_batches(epochs, n_warmup=args.warmup, n_batches=args.batches,
                       n_cells_of=lambda b: int(b["X"].shape[0]), consume=touch_pages)
    print(json.dumps({
        "cells_per_s": run.cells_per_s, "cells_per_cpu_s": run.cells_per_cpu_s,
        "main_cpu_us": 1e6 * run.cpu["main_cpu_s"] / run.n_cells,
        "faults_per_cell": run.cpu["own_faults"] / run.n_cells,
        "main_faults_per_cell": run.cpu["main_faults"] / run.n_cells,
        "main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("collection", nargs="?", default=str(DEFAULT))
    p.add_argument("--workers", default="2", help="worker counts, e.g. 1,2,4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--warmup", type=int, default=2, help="untimed batches first")
    p.add_argument("--loaders", default="inproc,plain,abt")
    p.add_argument("--layouts", default="sparse,dense")
    p.add_argument("--out", default=str(HERE / "results" / "handoff.md"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--loader", default="inproc", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="sparse", help=argparse.SUPPRESS)
    p.add_argument("--nworkers", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        sys.path.insert(0, str(HERE))
        _child(args)
        return
    loaders, layouts = args.loaders.split(","), args.layouts.split(",")
    load = os.getloadavg()[0]
    counts = [int(w) for w in args.workers.split(",")]
    configs = [(lo, la, 0 if lo == "inproc" else w) for la in layouts for lo in loaders
               for w in (counts if lo != "inproc" else [0])]
    got: dict[tuple[str, str, int], list[dict[str, float]]] = {c: [] for c in configs}
    for _ in range(args.rounds):
        for lo, la, w in configs:
            cmd = [sys.executable, __file__, args.collection, "--child", "--loader", lo,
                   "--layout", la, "--nworkers", str(w), "--batches", str(args.batches),
                   "--warmup", str(args.warmup)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            got[(lo, la, w)].append(json.loads(out.strip().splitlines()[-1]))
            print(lo, la, w, json.dumps(got[(lo, la, w)][-1]), flush=True)
    rows = []
    for lo, la, w in configs:
        runs = got[(lo, la, w)]
        best = max(r["cells_per_s"] for r in runs)
        base = max(r["cells_per_s"] for r in got.get(("inproc", la, 0), runs))
        rows.append({"loader": lo, "layout": la, "workers": w, "best": best,
                     "median": statistics.median(r["cells_per_s"] for r in runs),
                     "ratio": best / base,
                     "cpu_us": 1e6 / statistics.median(r["cells_per_cpu_s"] for r in runs),
                     "main_us": statistics.median(r["main_cpu_us"] for r in runs),
                     "faults": statistics.median(r["faults_per_cell"] for r in runs),
                     "worker_faults": statistics.median(
                         r["faults_per_cell"] - r["main_faults_per_cell"] for r in runs),
                     "main_mb": max(r["main_mb"] for r in runs),
                     "worker_mb": max(r["worker_mb"] for r in runs)})
    names = {"inproc": "in-process (the dataset)", "plain": "plain `DataLoader`",
             "abt": "`AnnBatchDataLoader`"}
    lines = [f"# Batches at the training loop ({time.strftime('%Y-%m-%d %H:%M')}, load "
             f"{load:.2f} at the start, {os.cpu_count()} CPUs)", "",
             f"Collection: `{args.collection}`; batch 4096; {args.batches} batches timed "
             f"after {args.warmup}, {args.rounds} alternated rounds, each a fresh process; "
             "ratio: best against in-process's best, same layout; CPU: microseconds of CPU "
             "per cell delivered (median), all processes, and of it the main process's (the "
             "rest is the workers'); page faults: minor faults per cell delivered (median), "
             "all processes, and of them the workers' (a fresh 4 KiB page written is one: "
             "`benchmarks/fresh_pages.py` gives their cost).", "",
             "| loader | layout | workers | best cells/s | median | ratio | CPU us/cell | "
             "main process | page faults/cell | workers' | main peak MB | worker peak MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {names[r['loader']]} | {r['layout']} | {r['workers']} | {r['best']:,.0f} | "
              f"{r['median']:,.0f} | {r['ratio']:.2f} | {r['cpu_us']:.1f} | "
              f"{r['main_us']:.1f} | {r['faults']:.2f} | {r['worker_faults']:.2f} | "
              f"{r['main_mb']:,.0f} | {r['worker_mb']:,.0f} |"
              for r in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
