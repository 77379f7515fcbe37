"""The parallel writer's planning at atlas scale, run for real (no I/O): the permutation the
driver draws, the pass-1 tasks, and the bucket files they make, at 10^6, 10^7 and 10^8 cells.

    .venv/bin/python benchmarks/writer_scale.py [--cells 1e6,1e7,1e8] [--workers 32]

Prints one JSON line per size: seconds and peak RSS of the planning, tasks, shards and the
bucket files pass 1 creates (tasks x buckets: each task's rows spread over every shard).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from annbatch_torch.write.parallel import pass1_tasks
from annbatch_torch.write.writer import permutation

SHARD_OBS = 1 << 17  # the writer's default rows per shard
BLOCK_OBS = 1 << 14  # a pass-2 block of a 20k-gene collection at ~1 GB of working memory
INPUT_CELLS = 10**6  # an atlas is many inputs: one per donor / study


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cells", default="1e6,1e7,1e8")
    p.add_argument("--workers", type=int, default=32)
    args = p.parse_args()
    for n in (int(float(x)) for x in args.cells.split(",")):
        t0 = time.perf_counter()
        dest = permutation(n, True, 0)
        t_perm = time.perf_counter() - t0
        sizes = [INPUT_CELLS] * (n // INPUT_CELLS) + ([n % INPUT_CELLS] if n % INPUT_CELLS else [])
        t0 = time.perf_counter()
        tasks = pass1_tasks(sizes, args.workers)
        # what each task is sent: its slice of the permutation (a view: no copy here)
        biggest = max(t.stop - t.start for t in tasks)
        t_tasks = time.perf_counter() - t0
        shards = -(-n // SHARD_OBS)
        buckets = shards * -(-SHARD_OBS // BLOCK_OBS)
        assert dest is not None
        assert len(dest) == n
        print(json.dumps({
            "cells": n, "workers": args.workers, "permutation_s": round(t_perm, 2),
            "permutation_mb": dest.nbytes / 2**20, "tasks": len(tasks),
            "tasks_s": round(t_tasks, 3), "rows_per_task_max": biggest,
            "task_message_mb": biggest * dest.itemsize / 2**20, "shards": shards,
            "buckets": buckets, "bucket_files": len(tasks) * buckets,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
        del dest


if __name__ == "__main__":
    main()
