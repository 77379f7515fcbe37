"""Where the time of annbatch_torch's loader goes, stage by stage (in one process).

Usage::

    python benchmarks/profile_stages.py [--store PATH] [--pools 4] [--batch-size 4096]
                                        [--repeat 7] [--out DIR | --no-save]

Takes pools of epoch 0 of a collection (default: the one ``run.py`` wrote for
100,000 x 20,000) and times each stage of the loader's data path (docs/architecture.md,
"The data path of one pool") in isolation:

per pool (``chunk_size * preload_nchunks`` rows)

* the pool's row order: ``sampling.item_permutation`` + ``sampling.pool_order``;
* ``PoolReader.read(ranges)`` (canonical row order) and ``PoolReader.read(ranges, order)``
  (every CSR row read straight into its shuffled place: one ``preadv`` per chunk file,
  CRC-32C over the same buffers), each with 4, 2 and 1 read threads, on a warm reader whose
  ``BufferCache`` hands the previous pool's buffers out again;
* the same scattered read with fresh buffers (a new ``BufferCache`` before every read: the
  page faults of first touching new 100-MB buffers, what a caller keeping batches costs);

per batch (``--batch-size`` rows, a middle batch of the scattered pool)

* ``read.csr.row_slice`` + ``convert.csr_to_torch``: a sparse batch, zero copy;
* ``read.csr.densify_csr`` with ``threads=1`` and ``threads=2`` (the default from 2**22
  values on 2+ CPUs), and with ``shared=True`` (a DataLoader worker's dense batch, written
  straight into shared memory);
* ``read.csr.csr_tensor_to_dense``: the main process densifying a CSR batch a worker sent
  (``AnnBatchDataLoader`` with workers and ``densify=True``);
* for comparison, the previous path's per-batch gather ``pool[sorted_rows]`` (scipy, from a
  canonical pool) and torch's own CPU ``to_dense``.

Configurations of one group run interleaved, round after round, so drifting machine load
hits them alike. Prints the median and the minimum over the rounds, and the cells/s each
stage alone would allow, and writes the figures to ``DIR/profile_stages.txt`` and
``DIR/profile_stages.json`` (default: ``benchmarks/results``). Run it on a quiet machine:
stages that fault pages in (fresh buffers, shared memory) slow down several-fold when
other processes compete for the CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
__all__ = ["main", "profile"]


def _time_group(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, tuple[float, float]]:
    """Median and minimum wall seconds of each ``fn()``, the functions run interleaved
    (one call of each per round, after one untimed warm-up call)."""
    for fn in fns.values():
        fn()
    walls: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            w0 = time.perf_counter()
            fn()
            walls[name].append(time.perf_counter() - w0)
    return {name: (statistics.median(w), min(w)) for name, w in walls.items()}


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not Unix
        return None


def profile(store: Path, pools: int, batch_size: int, repeat: int = 7) -> dict[str, Any]:
    """Time each stage; returns ``{"stages": {name: {median_s, min_s, per, cells_per_s}}}``
    plus the pool's size and checks that the measured path is the one the loader takes."""
    import torch

    from annbatch_torch import A, AnnBatchDataset, open_collection, sampling
    from annbatch_torch.convert import csr_to_torch
    from annbatch_torch.read.buffers import BufferCache
    from annbatch_torch.read.csr import csr_tensor_to_dense, densify_csr
    from annbatch_torch.read.csr import row_slice as _row_slice
    from annbatch_torch.read.reader import PoolReader, split_ranges

    coll = open_collection(store)
    ds = AnnBatchDataset(coll, selector={"x": A.X}, batch_size=batch_size)
    items = [it for it in ds.plan(epoch=0) if not it.padding][: pools + 1]
    if len(items) < 2:
        raise SystemExit(f"{store}: needs at least 2 pools of epoch 0, found {len(items)}")
    timed = items[1:]
    perms = [sampling.item_permutation(it, seed=ds.seed, epoch=0, shuffle=True) for it in items]
    orders = [sampling.pool_order(p, batch_size) for p in perms]
    rows = timed[0].n_rows
    n_pools = len(timed)
    pieces = split_ranges(timed[0].ranges, coll.shard_offsets)
    scatter = all(coll.element(p.shard, "X").can_scatter for p in pieces)
    stages: dict[str, dict[str, Any]] = {}

    def add(name: str, med_min: tuple[float, float], per: int, scale: float = 1.0) -> None:
        med, mn = med_min[0] * scale, med_min[1] * scale
        stages[name] = {"median_s": med, "min_s": mn, "per": per,
                        "cells_per_s": per / med if med > 0 else None}

    # -- per pool --------------------------------------------------------------------------
    def order_all() -> None:
        for it in timed:
            sampling.pool_order(
                sampling.item_permutation(it, seed=ds.seed, epoch=0, shuffle=True), batch_size)

    add("pool: row order (item_permutation + pool_order)",
        _time_group({"o": order_all}, repeat)["o"], rows, 1 / n_pools)

    readers = {t: PoolReader(coll, ["X"], threads=t) for t in (4, 2, 1)}
    for r in readers.values():
        for it, order in zip(items, orders):  # opens the elements, warms the page cache
            r.read(it.ranges, order)

    def reads(r: PoolReader, shuffled: bool, fresh: bool) -> Callable[[], None]:
        def run() -> None:
            for it, order in zip(timed, orders[1:]):
                if fresh:
                    r.buffers = BufferCache(keep=r.buffers.keep)
                r.read(it.ranges, order if shuffled else None)  # dropped: buffers free again
        return run

    fns: dict[str, Callable[[], None]] = {}
    for t, r in readers.items():
        fns[f"pool: PoolReader.read(ranges), canonical, {t} threads"] = reads(r, False, False)
    for t, r in readers.items():
        fns[f"pool: PoolReader.read(ranges, order), scatter, {t} threads"] = reads(r, True, False)
    warm_allocs = {t: r.buffers.allocations for t, r in readers.items()}
    warm_group = _time_group(fns, repeat)
    warm_allocs = {t: r.buffers.allocations - warm_allocs[t] for t, r in readers.items()}
    fresh_fns = {f"pool: read(ranges, order), fresh buffers, {t} threads": reads(r, True, True)
                 for t, r in readers.items()}
    fresh_group = _time_group(fresh_fns, repeat)
    for name, mm in {**warm_group, **fresh_group}.items():
        add(name, mm, rows, 1 / n_pools)

    # -- per batch -------------------------------------------------------------------------
    reader = readers[2]
    item, order = timed[0], orders[1]
    pool = reader.read(item.ranges, order)["X"]
    canonical = readers[1].read(item.ranges)["X"]
    for r in readers.values():
        r.close()
    b = (item.batch_start + item.batch_stop) // 2
    lo, hi = b * batch_size, min((b + 1) * batch_size, rows)
    batch = _row_slice(pool, lo, hi)
    sorted_rows = order[lo:hi]  # ascending canonical positions of batch b
    old = canonical[sorted_rows]
    same = bool(np.array_equal(old.indptr, batch.indptr)
                and np.array_equal(old.indices, batch.indices)
                and np.array_equal(old.data, batch.data))
    if not same:
        raise SystemExit("the scattered pool's batch differs from the old gather's batch")
    shares = bool(np.shares_memory(batch.data, pool.data))
    tensor = csr_to_torch(batch)
    bfns: dict[str, Callable[[], Any]] = {
        "batch: _row_slice + csr_to_torch (sparse batch, zero copy)":
            lambda: csr_to_torch(_row_slice(pool, lo, hi)),
        "batch: densify_csr, threads=1": lambda: densify_csr(batch, threads=1),
        "batch: densify_csr, threads=2": lambda: densify_csr(batch, threads=2),
        "batch: densify_csr(shared=True) (worker, into shared memory)":
            lambda: densify_csr(batch, shared=True),
        "batch: csr_tensor_to_dense (main process, CSR from a worker)":
            lambda: csr_tensor_to_dense(tensor),
        "old: gather pool[sorted_rows] (scipy, canonical pool)":
            lambda: canonical[sorted_rows],
    }
    for name, mm in _time_group(bfns, repeat).items():
        add(name, mm, hi - lo)
    add("old: torch sparse CSR to_dense()",
        _time_group({"t": tensor.to_dense}, max(1, min(repeat, 3)))["t"], hi - lo)
    ref = torch.from_numpy(old.toarray())
    dense_same = all(torch.equal(ref, torch.as_tensor(d)) for d in (
        densify_csr(batch, threads=1), densify_csr(batch, threads=2),
        densify_csr(batch, shared=True), csr_tensor_to_dense(tensor)))
    if not dense_same:
        raise SystemExit("densify_csr / csr_tensor_to_dense disagree with scipy's toarray()")
    try:
        where = str(Path(store).resolve().relative_to(HERE.parent))
    except ValueError:
        where = str(store)
    return {"store": where, "pool_rows": rows, "pools": n_pools,
            "pool_mib": pool.nnz * (pool.data.itemsize + pool.indices.itemsize) / 2**20,
            "batch_size": batch_size, "batch_nnz": int(batch.nnz), "repeat": repeat,
            "scatter_read": scatter, "batch_is_view_of_pool": shares,
            "batch_equals_old_gather": same,
            "dense_equals_toarray": dense_same, "warm_buffer_allocations": warm_allocs,
            "stages": stages}


def _report(out: dict[str, Any], env: dict[str, Any]) -> str:
    lines = [
        f"pool: {out['pool_rows']:,} rows ({out['pool_mib']:,.0f} MiB of CSR), "
        f"{out['pools']} pools; batch: {out['batch_size']:,} rows ({out['batch_nnz']:,} "
        f"non-zeros). Median / min ms over {out['repeat']} rounds, and cells/s at the median.",
        f"checks: scattered reads from chunk files: {out['scatter_read']}; batch is a view "
        f"of the pool: {out['batch_is_view_of_pool']}; equals the old gather: "
        f"{out['batch_equals_old_gather']}; dense batches equal toarray(): "
        f"{out['dense_equals_toarray']}; buffers allocated during warm reads: "
        f"{sum(out['warm_buffer_allocations'].values())}.",
        f"machine: {env['cpus']} CPUs, load average {env['load_before']} before, "
        f"{env['load_after']} after; {env['seconds']:.0f} s.",
    ]
    for name, s in out["stages"].items():
        lines.append(f"  {name:<62} {s['median_s'] * 1e3:8.2f} {s['min_s'] * 1e3:8.2f} ms "
                     f"{s['cells_per_s'] or 0:>14,.0f} cells/s")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=Path,
                   default=HERE / "data" / "grouped_100000x20000_seed0" / "collection")
    p.add_argument("--pools", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=7, help="timed rounds per stage")
    p.add_argument("--out", type=Path, default=HERE / "results",
                   help="write profile_stages.txt and profile_stages.json here")
    p.add_argument("--no-save", action="store_true", help="only print the figures")
    args = p.parse_args(argv)
    t0, load_before = time.perf_counter(), _loadavg()
    out = profile(args.store, args.pools, args.batch_size, args.repeat)
    env = {"cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
           else os.cpu_count(), "load_before": load_before, "load_after": _loadavg(),
           "seconds": time.perf_counter() - t0, "python": platform.python_version()}
    text = _report(out, env)
    print(text, end="")
    if not args.no_save:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_stages.txt").write_text(text)
        (args.out / "profile_stages.json").write_text(json.dumps({**out, "machine": env},
                                                                 indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
