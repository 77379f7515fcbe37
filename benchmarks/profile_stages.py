"""Where the time of annbatch_torch's loader goes, stage by stage (in one process).

Usage::

    python benchmarks/profile_stages.py [--store PATH] [--pools 4] [--batch-size 4096]

Takes pools of epoch 0 of a collection (default: the one ``run.py`` wrote for
100,000 x 20,000) and times each stage of the loader in isolation:

per pool (``chunk_size * preload_nchunks`` rows)

* ``PoolReader.read`` with 4, 2 and 1 read threads (a warm reader);
* its parts: allocating and first touching the pool's ``data``/``indices`` buffers, reading
  the pieces into reused buffers (file reads and CRC checks), the column-index range check
  (``min``/``max``, and a single unsigned ``max``), a CRC-32C pass over the pool's bytes;

per batch (``--batch-size`` rows)

* the row gather ``pool[sorted_rows]`` (scipy);
* densifying: ``toarray()`` into fresh memory (what the loader does), into a reused buffer
  (``memset`` + fill), and torch's ``to_dense`` for comparison;
* converting to ``torch.sparse_csr_tensor``: the library's ``csr_to_torch``, and with int64
  indices (widening copies) for comparison;
* handing a batch from a DataLoader worker to the main process: ``share_memory_()`` of a
  dense batch and of a sparse batch's parts (int64 / int32), and allocating + touching a
  dense batch directly in shared memory.

Prints the median and the minimum over repeats, and the cells/s each stage alone would
allow. Run it on a quiet machine: stages that fault pages in (fresh buffers, shared memory)
slow down several-fold when other processes compete for the CPUs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
__all__ = ["main", "profile"]


def _t(fn: Callable[[], Any], repeat: int = 5) -> tuple[float, float]:
    """Median and minimum wall seconds of ``fn()`` over ``repeat`` calls."""
    walls = []
    for _ in range(repeat):
        w0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - w0)
    return statistics.median(walls), min(walls)


def _shared_zeros(shape: tuple[int, int]) -> Any:
    import torch

    st = torch.UntypedStorage._new_shared(shape[0] * shape[1] * 4)
    return torch.empty(0, dtype=torch.float32).set_(st, 0, shape, (shape[1], 1))


def profile(store: Path, pools: int, batch_size: int) -> dict[str, Any]:
    """Time each stage; returns ``{"stages": {name: {median_s, min_s, per, cells_per_s}}}``."""
    import google_crc32c
    import scipy.sparse as sp
    import torch

    from annbatch_torch import A, AnnBatchDataset, open_collection
    from annbatch_torch.convert import csr_to_torch
    from annbatch_torch.reader import PoolReader, split_ranges

    coll = open_collection(store)
    ds = AnnBatchDataset(coll, selector={"x": A.X}, batch_size=batch_size)
    items = list(ds.plan(epoch=0))[: pools + 1]
    stages: dict[str, dict[str, Any]] = {}

    def add(name: str, med_min: tuple[float, float], per: int) -> None:
        med, mn = med_min
        stages[name] = {"median_s": med, "min_s": mn, "per": per,
                        "cells_per_s": per / med if med > 0 else None}

    rows = items[1].n_rows
    for threads in (4, 2, 1):
        reader = PoolReader(coll, ["X"], threads=threads)
        reader.read(items[0].ranges)  # opens the elements

        def read_all(r: PoolReader = reader) -> None:
            for it in items[1:]:
                r.read(it.ranges)

        med, mn = _t(read_all, repeat=3)
        add(f"pool: PoolReader.read, {threads} threads", (med / pools, mn / pools), rows)
        reader.close()

    pieces = split_ranges(items[1].ranges, coll.shard_offsets)
    els = [coll.element(p.shard, "X") for p in pieces]
    spans = [el.nnz_range(p.start, p.stop) for p, el in zip(pieces, els)]
    nnz = sum(b - a for a, b in spans)
    data, indices = np.empty(nnz, np.float32), np.empty(nnz, np.int32)

    def alloc() -> None:
        np.empty(nnz, np.float32).fill(0)
        np.empty(nnz, np.int32).fill(0)

    def read_into() -> None:
        off = 0
        for p, el, (a, b) in zip(pieces, els, spans):
            if hasattr(el, "read_into"):
                el.read_into(p.start, p.stop, data[off : off + b - a], indices[off : off + b - a])
            else:
                d, i, _ = el.read_raw(p.start, p.stop)
                data[off : off + b - a], indices[off : off + b - a] = d, i
            off += b - a

    add("pool: allocate + first touch of data/indices buffers", _t(alloc), rows)
    add("pool: read pieces into reused buffers (I/O + CRC)", _t(read_into), rows)
    add("pool: index check, min() and max()", _t(lambda: (indices.min(), indices.max())), rows)
    add("pool: index check, one unsigned max()", _t(lambda: indices.view(np.uint32).max()),
        rows)
    add("pool: CRC-32C of data + indices", _t(lambda: (
        google_crc32c.value(data.view(np.uint8)), google_crc32c.value(indices.view(np.uint8)))),
        rows)

    pool = sp.csr_matrix((data, indices, np.concatenate(
        [[0], np.cumsum(np.concatenate([np.diff(el.indptr[p.start : p.stop + 1])
                                        for p, el in zip(pieces, els)]))])),
        shape=(rows, coll.n_vars))
    pos = np.sort(np.random.default_rng(0).permutation(rows)[:batch_size])
    xb = pool[pos]
    buf = np.zeros(xb.shape, np.float32)
    dense = xb.toarray()
    t64 = torch.sparse_csr_tensor(
        torch.from_numpy(xb.indptr.astype(np.int64)), torch.from_numpy(xb.indices.astype(np.int64)),
        torch.from_numpy(xb.data), size=xb.shape, check_invariants=False)
    t32 = torch.sparse_csr_tensor(
        torch.from_numpy(xb.indptr.astype(np.int32)), torch.from_numpy(xb.indices),
        torch.from_numpy(xb.data), size=xb.shape, check_invariants=False)

    def share_parts(t: torch.Tensor) -> None:
        for part in (t.crow_indices(), t.col_indices(), t.values()):
            part.clone().share_memory_()

    add("batch: gather rows pool[sorted_rows] (scipy)", _t(lambda: pool[pos]), batch_size)
    add("batch: toarray() into fresh memory", _t(xb.toarray), batch_size)
    add("batch: toarray() into a reused buffer (memset + fill)",
        _t(lambda: (buf.fill(0), xb.toarray(out=buf))), batch_size)
    add("batch: torch sparse CSR to_dense()", _t(lambda: t64.to_dense(), repeat=3), batch_size)
    add("batch: csr_to_torch (the library's converter)", _t(lambda: csr_to_torch(xb)),
        batch_size)
    add("batch: torch sparse CSR with int64 indices (widening copies)",
        _t(lambda: torch.sparse_csr_tensor(
            torch.from_numpy(xb.indptr.astype(np.int64)),
            torch.from_numpy(xb.indices.astype(np.int64)), torch.from_numpy(xb.data),
            size=xb.shape, check_invariants=False)), batch_size)
    add("hand-off: clone + share_memory_() of a dense batch",
        _t(lambda: torch.from_numpy(dense).clone().share_memory_(), repeat=3), batch_size)
    add("hand-off: clone of a dense batch (anonymous memory)",
        _t(lambda: torch.from_numpy(dense).clone(), repeat=3), batch_size)
    add("hand-off: allocate + touch a dense batch in shared memory",
        _t(lambda: _shared_zeros(xb.shape).numpy().fill(0), repeat=3), batch_size)
    add("hand-off: clone + share_memory_() of a CSR batch, int64 indices",
        _t(lambda: share_parts(t64)), batch_size)
    add("hand-off: clone + share_memory_() of a CSR batch, int32 indices",
        _t(lambda: share_parts(t32)), batch_size)
    return {"pool_rows": rows, "pool_mib": nnz * 8 / 2**20, "batch_size": batch_size,
            "stages": stages}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=Path,
                   default=HERE / "data" / "grouped_100000x20000_seed0" / "collection")
    p.add_argument("--pools", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    out = profile(args.store, args.pools, args.batch_size)
    print(f"pool: {out['pool_rows']:,} rows ({out['pool_mib']:,.0f} MiB of CSR); batch: "
          f"{args.batch_size:,} rows. Median / min ms, and cells/s at the median.")
    for name, s in out["stages"].items():
        print(f"  {name:<62} {s['median_s'] * 1e3:8.1f} {s['min_s'] * 1e3:8.1f} ms "
              f"{s['cells_per_s'] or 0:>12,.0f} cells/s")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
