"""Where a warm pool read spends its time: rows scattered into place vs read in order.

A pool of ``--chunks`` chunks of ``--chunk-size`` rows (random chunk starts in shard 0 of a
collection, as the plan draws them) is read into one CSR pool two ways, alternately:

* ``scatter`` (what ``PoolReader`` does today): ``CSRElement.read_rows_scatter`` puts every
  row at its shuffled position with one ``preadv`` per chunk (one buffer per row) and a
  CRC-32C update per row;
* ``gather``: ``CSRElement.read_into`` reads each chunk's rows in their stored order (one
  contiguous buffer, one CRC-32C call per chunk), then scipy's C++ row gather puts them in
  the pool's order (``csr[order]``).

Both give the same pool (checked). Beside them, the in-memory step that follows an in-order
read is timed for today's float32 / int32 pool and for a uint16 / uint16 one widened to
float32 / int32 after the gather (:func:`permute_steps`). The page cache is warmed first;
the figures are per pool, median of ``--repeats``, with the load average beside them::

    python benchmarks/pool_read_micro.py /tmp/inplace_regimes/30000x2000/collection.zarr
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import scipy.sparse as sp

from annbatch_torch import open_collection


def _pool(el: object, starts: np.ndarray, size: int) -> tuple[list[tuple[int, int]], int]:
    runs = [(int(s), int(min(s + size, el.n_rows))) for s in starts]  # type: ignore[attr-defined]
    return runs, sum(b - a for a, b in runs)


def scatter(el: object, runs: list[tuple[int, int]], order: np.ndarray) -> sp.csr_matrix:
    indptr_all = el.indptr  # type: ignore[attr-defined]
    lengths = np.concatenate([np.diff(indptr_all[a:b + 1]) for a, b in runs])
    out_len = lengths[order]
    indptr = np.zeros(len(out_len) + 1, np.int64)
    np.cumsum(out_len, out=indptr[1:])
    where = np.empty(len(order), np.int64)
    where[order] = np.arange(len(order))  # canonical row -> pool position
    dests = indptr[:-1][where]
    nnz = int(indptr[-1])
    data = np.empty(nnz, el.data.dtype)  # type: ignore[attr-defined]
    indices = np.empty(nnz, el.indices.dtype)  # type: ignore[attr-defined]
    k = 0
    for a, b in runs:
        el.read_rows_scatter(a, b, data, indices, dests[k:k + b - a])  # type: ignore[attr-defined]
        k += b - a
    return sp.csr_matrix((data, indices, indptr), shape=(len(order), el.n_cols))  # type: ignore[attr-defined]


def gather(el: object, runs: list[tuple[int, int]], order: np.ndarray) -> sp.csr_matrix:
    indptr_all = el.indptr  # type: ignore[attr-defined]
    lengths = np.concatenate([np.diff(indptr_all[a:b + 1]) for a, b in runs])
    indptr = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=indptr[1:])
    nnz = int(indptr[-1])
    data = np.empty(nnz, el.data.dtype)  # type: ignore[attr-defined]
    indices = np.empty(nnz, el.indices.dtype)  # type: ignore[attr-defined]
    k = 0
    for a, b in runs:
        lo, hi = int(indptr[k]), int(indptr[k + b - a])
        el.read_into(a, b, data[lo:hi], indices[lo:hi])  # type: ignore[attr-defined]
        k += b - a
    canon = sp.csr_matrix((data, indices, indptr), shape=(len(lengths), el.n_cols))  # type: ignore[attr-defined]
    return canon[order]


def permute_steps(canon: sp.csr_matrix, order: np.ndarray) -> dict[str, float]:
    """Seconds of the in-memory step after an in-order read, per layout: the row gather
    of today's float32 / int32 pool, and of a uint16 / uint16 pool (the narrow layout of
    counts below 65,536 over at most 65,536 genes) followed by widening to float32 / int32
    (what users receive)."""
    narrow = sp.csr_matrix((canon.data.astype(np.uint16), canon.indices.astype(np.uint16),
                            canon.indptr), shape=canon.shape)
    out = {}
    t0 = time.perf_counter()
    canon[order]
    out["gather_wide"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = narrow[order]
    out["gather_narrow"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    g.data.astype(np.float32)
    g.indices.astype(np.int32)
    out["widen"] = time.perf_counter() - t0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("collection")
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args()
    coll = open_collection(a.collection)
    el = coll.element(0, "X")
    rng = np.random.default_rng(0)
    n_chunks = el.n_rows // a.chunk_size
    load0 = os.getloadavg()
    times: dict[str, list[float]] = {"scatter": [], "gather": []}
    steps: dict[str, list[float]] = {}
    for r in range(a.repeats + 1):
        starts = rng.choice(n_chunks, size=min(a.chunks, n_chunks), replace=False) * a.chunk_size
        runs, n = _pool(el, starts, a.chunk_size)
        order = rng.permutation(n)
        got = {}
        for name, fn in (("scatter", scatter), ("gather", gather)) if r % 2 else (
                ("gather", gather), ("scatter", scatter)):
            t0 = time.perf_counter()
            got[name] = fn(el, runs, order)
            dt = time.perf_counter() - t0
            if r:  # the first round warms the page cache and the checks
                times[name].append(dt)
        if r:
            canon = gather(el, runs, np.arange(n))
            for k, v in permute_steps(canon, order).items():
                steps.setdefault(k, []).append(v)
        s, g = got["scatter"], got["gather"]
        if not ((s.indptr == g.indptr).all() and (s.indices == g.indices).all()
                and (s.data == g.data).all()):
            raise SystemExit("the two ways read different pools: a bug in this benchmark")
    rows = n
    nnz = int(got["scatter"].nnz)
    load = os.getloadavg()
    print(f"{a.collection}: pools of {rows:,} rows, {nnz / rows:,.0f} non-zeros per row; "
          f"load average before {load0[0]:.2f}, after {load[0]:.2f}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:8s} {med * 1e3:8.1f} ms per pool  {rows / med / 1e3:8.0f}k rows/s  "
              f"{med / rows * 1e6:.2f} us per row")
    ratio = statistics.median(times["gather"]) / statistics.median(times["scatter"])
    print(f"  gather / scatter time: {ratio:.2f}")
    print("  the step after an in-order read, in memory (ms per pool): " + ", ".join(
        f"{k} {statistics.median(v) * 1e3:.1f}" for k, v in steps.items()))


if __name__ == "__main__":
    main()
