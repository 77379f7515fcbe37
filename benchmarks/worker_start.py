"""Worker start-up: the time to the first batch with forked DataLoader workers, the CPU
the workers spend before it, and epochs whose workers start afresh.

Usage::

    python benchmarks/worker_start.py [--store PATH] [--workers 2,4] [--rounds 3]
                                      [--epochs 4] [--vs-tree OTHER_CHECKOUT] [--out FILE]

Each run is a fresh Python process, timed from its first line (imports included), as a
user's script runs:

* ``first``: ``AnnBatchDataset(store, batch_size=4096)`` (sparse X; ``dense``:
  ``densify=True``) handed to ``torch.utils.data.DataLoader(ds, batch_size=None,
  num_workers=W)`` (fork): seconds to the first batch, and the CPU seconds (user +
  system) its workers spent until then (read when the first batch arrives: the other
  workers' first reads count as far as they got);
* ``epochs``: the same DataLoader (sparse, without ``persistent_workers``: torch forks
  fresh workers every epoch) iterated for ``--epochs`` whole epochs: seconds and cells/s.

``--vs-tree`` runs the same with another checkout of the package first on ``PYTHONPATH``
(e.g. ``git worktree add /tmp/base HEAD~1``), the two interleaved run by run, so the
comparison sees the same machine load. Prints a table (medians over ``--rounds``) and
writes it to ``--out`` (Markdown) with the runs beside it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchlib import run_in_tree, warm_page_cache

HERE = Path(__file__).resolve().parent
DEFAULT = (HERE / "data" / "grouped_100000x20000_seed0" /
           "collection_shard_elems-8388608_codec-raw_shard_obs-131072_dtypes-auto-auto")

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import psutil, torch
import annbatch_torch as abt
store, mode, workers, dense, epochs = (sys.argv[1], sys.argv[2], int(sys.argv[3]),
                                       sys.argv[4] == "1", int(sys.argv[5]))
ds = abt.AnnBatchDataset(store, selector={"x": "X"}, batch_size=4096, densify=dense)
dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers,
                                 multiprocessing_context="fork")
if mode == "first":
    it = iter(dl)
    next(it)
    t = time.perf_counter() - t0
    cpu = sum(sum(p.cpu_times()[:2]) for p in psutil.Process().children())
    print(json.dumps({"first_batch_s": t, "workers_cpu_s": cpu, "package": abt.__file__}))
else:
    t1 = time.perf_counter()
    n = 0
    for e in range(epochs):
        ds.set_epoch(e)
        for b in dl:
            n += b["x"].shape[0]
    t = time.perf_counter() - t1
    print(json.dumps({"epochs_s": t, "cells_s": n / t, "package": abt.__file__}))
"""


def _run(tree: str | None, args: list[str]) -> dict[str, Any]:
    r = run_in_tree(CHILD, args, tree)
    want = Path(tree or HERE.parent).resolve() / "annbatch_torch" / "__init__.py"
    if Path(r["package"]).resolve() != want:
        raise SystemExit(f"the run imported {r['package']}, not {want}")
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", default=str(DEFAULT))
    p.add_argument("--workers", default="2,4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--vs-tree", default=None, help="another checkout to compare against")
    p.add_argument("--out", type=Path, default=HERE / "results" / "worker_start.md")
    args = p.parse_args()
    args.store = str(Path(args.store).resolve())  # the children start in benchmarks/
    warm_page_cache(args.store)  # start-up, not the disk
    trees = {"this tree": None} | ({"other tree": args.vs_tree} if args.vs_tree else {})
    configs = [("first", w, d) for w in (int(x) for x in args.workers.split(","))
               for d in (False, True)] + [("epochs", 2, False)]
    load = os.getloadavg()[0]
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for mode, w, dense in configs:
            for name, tree in trees.items():
                key = f"{name}|{mode}|{w}|{'dense' if dense else 'sparse'}"
                r = _run(tree, [args.store, mode, str(w), "1" if dense else "0",
                                str(args.epochs)])
                runs.setdefault(key, []).append(r)
                print(key, json.dumps(r), flush=True)
    lines = [f"# Worker start-up ({time.strftime('%Y-%m-%d %H:%M')}, load {load:.2f} at the "
             f"start, {os.cpu_count()} CPUs)", "",
             f"Store: `{args.store}`; batch 4096; forked workers of a plain `DataLoader`; "
             f"medians of {args.rounds} fresh processes"
             + (f", interleaved with `{args.vs_tree}` (other tree)" if args.vs_tree else "")
             + ". First batch: seconds from the process's first line; workers' CPU: user + "
             f"system seconds of all workers until then. Epochs: {args.epochs} epochs of "
             "sparse batches, 2 workers forked afresh each epoch.", "",
             "| tree | measure | workers | layout | median | runs |", "|---|---|---|---|---|---|"]
    for key, rs in runs.items():
        name, mode, w, layout = key.split("|")
        fields = (["first_batch_s", "workers_cpu_s"] if mode == "first"
                  else ["epochs_s", "cells_s"])
        for f in fields:
            vals = [r[f] for r in rs]
            fmt = "{:,.0f}" if f == "cells_s" else "{:.2f}"
            lines.append(f"| {name} | {f} | {w} | {layout} | "
                         f"{fmt.format(statistics.median(vals))} | "
                         f"{', '.join(fmt.format(v) for v in vals)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text + "\n```json\n" + json.dumps(runs, indent=1) + "\n```\n")


if __name__ == "__main__":
    main()
