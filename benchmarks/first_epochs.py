"""The first epochs of a fresh process, epoch by epoch, and a user's harness window.

Usage::

    python benchmarks/first_epochs.py --store PATH [--dense] [--epochs 4] [--rounds 3]
                                      [--vs-tree OTHER_CHECKOUT] [--out FILE]

Each run is a fresh Python process that opens ``AnnBatchDataset(store, batch_size=4096)``
(sparse X and ``obs/cell_type``; ``--dense``: ``densify=True``) and iterates it as a user
does:

* ``harness``: batches 3 to 42 timed after two warm-up batches (crossing into epoch 1 at
  100,000 cells), what an independent harness measures;
* ``epoch N``: each of ``--epochs`` epochs timed whole, with the process's user and system
  CPU seconds and minor page faults over that epoch (``getrusage``).

``--vs-tree`` runs the same with another checkout of the package first on ``PYTHONPATH``
(e.g. ``git worktree add /tmp/base HEAD~1``), the two interleaved round by round, so the
comparison sees the same machine load. The store is read through once before the first
round (warm page cache). Prints a table; ``--out`` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

from benchlib import run_in_tree, warm_page_cache

CHILD = r"""
import json, resource, sys, time
t00 = time.perf_counter()
import annbatch_torch as abt
store, dense, epochs = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
kw = dict(selector={"x": "X", "y": "obs/cell_type"}, batch_size=4096, densify=dense)

def usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt

out = {"import_s": time.perf_counter() - t00}
ds = abt.AnnBatchDataset(store, **kw)
k = n = 0
t0 = time.perf_counter()
epoch = 0
while k < 42:
    ds.set_epoch(epoch)
    for b in ds:
        k += 1
        if k == 2:
            t = time.perf_counter()
            out["first_2_batches_s"] = t - t0
        elif k > 2:
            n += b["x"].shape[0]
        if k == 42:
            break
    epoch += 1
out["harness_cells_s"] = n / (time.perf_counter() - t)
del ds, b
ds = abt.AnnBatchDataset(store, seed=1, **kw)  # a second dataset: buffers of its own
out["epochs"] = []
for e in range(epochs):
    ds.set_epoch(e)
    n, t, u = 0, time.perf_counter(), usage()
    for b in ds:
        n += b["x"].shape[0]
    dt, v = time.perf_counter() - t, usage()
    out["epochs"].append({"cells_s": n / dt, "user_s": v[0] - u[0], "sys_s": v[1] - u[1],
                          "minor_faults": v[2] - u[2]})
print(json.dumps(out))
"""


def _run(store: str, dense: bool, epochs: int, tree: str | None) -> dict[str, Any]:
    # (the child starts in the benchmarks folder: the store's path made absolute)
    return run_in_tree(CHILD, [str(Path(store).resolve()), "1" if dense else "0", str(epochs)],
                       tree, timeout=900)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--dense", action="store_true")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--vs-tree", default=None, help="another checkout to compare against")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    warm_page_cache(args.store)
    trees = {"this": None} | ({"vs": args.vs_tree} if args.vs_tree else {})
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    for r in range(args.rounds):
        for name, tree in (list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]):
            runs[name].append(_run(str(args.store), args.dense, args.epochs, tree))
            last = runs[name][-1]
            print(f"round {r} {name}: harness {last['harness_cells_s']:,.0f} cells/s; epochs "
                  + ", ".join(f"{e['cells_s']:,.0f}" for e in last["epochs"]), flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    print("\n| tree | harness cells/s (median) | " + " | ".join(
        f"epoch {e} cells/s, user/sys s, faults" for e in range(args.epochs)) + " |")
    print("|---|---:|" + "---:|" * args.epochs)
    for name, rs in runs.items():
        cells = [f"{statistics.median(x['harness_cells_s'] for x in rs):,.0f}"]
        for e in range(args.epochs):
            es = [x["epochs"][e] for x in rs]
            cells.append(f"{statistics.median(x['cells_s'] for x in es):,.0f}, "
                         f"{statistics.median(x['user_s'] for x in es):.2f}/"
                         f"{statistics.median(x['sys_s'] for x in es):.2f}, "
                         f"{statistics.median(x['minor_faults'] for x in es):,.0f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
