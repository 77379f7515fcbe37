"""Pool reads alone, cold: how fast the reader brings an epoch's pools in from disk.

    python benchmarks/cold_pool_reads.py [STORE] [--pools 6] [--rounds 2]

Drops the page cache (root), then reads ``--pools`` pools of the loader's default shape
(32 random 512-row chunks, rows permuted; ``--chunk-rows`` for longer or shorter
chunks in pools of as many cells) with ``PoolReader`` and nothing else running:
no batches, no consumer. Once with 2 reads in flight, once with 16 (``io_depth``), each
after its own cache drop. Prints cells/s per setting (best of ``--rounds``); compare with
the loader's cold case and with ``ceiling_disk_parallel_cold`` of the same machine.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from annbatch_torch import open_collection
from annbatch_torch.read.reader import PoolReader

HERE = Path(__file__).resolve().parent
DEFAULT = HERE / "data" / "grouped_100000x20000_seed0"


def _drop() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("store", nargs="?", type=Path, default=None,
                   help="a collection (default: the benchmark's newest default-layout one)")
    p.add_argument("--pools", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--chunk-rows", type=int, default=512,
                   help="rows per contiguous chunk; pools keep 32 * 512 rows")
    a = p.parse_args()
    store = a.store or max(DEFAULT.glob("collection_shard_elems-*"), key=os.path.getmtime)
    coll = open_collection(store)
    best: dict[int, float] = {}
    rows = a.chunk_rows
    per_pool = max(1, 32 * 512 // rows)  # chunks per pool: pools of the same cells
    for r in range(a.rounds):
        rng = np.random.default_rng(r)
        chunks = rng.permutation(coll.n_obs // rows)[: per_pool * a.pools] * rows
        for depth in (2, 16):
            reader = PoolReader(open_collection(store), ["X"], threads=2, io_depth=depth)
            _drop()
            t0 = time.perf_counter()
            for k in range(a.pools):
                starts = np.sort(chunks[per_pool * k: per_pool * (k + 1)])
                ranges = np.stack([starts, np.minimum(starts + rows, coll.n_obs)], axis=1)
                n = int((ranges[:, 1] - ranges[:, 0]).sum())
                reader.read(ranges, rng.permutation(n))
                if depth > 2:
                    reader._from_disk = True  # deep for every pool, whatever it measured
            rate = per_pool * rows * a.pools / (time.perf_counter() - t0)
            best[depth] = max(best.get(depth, 0.0), rate)
            reader.close()
    print(f"store {store}, chunks of {rows} rows, {per_pool} per pool")
    for depth, rate in best.items():
        print(f"  {depth:2d} reads in flight: {rate:9,.0f} cells/s cold (best of {a.rounds})")


if __name__ == "__main__":
    main()
