"""Where the time of annbatch_torch's loader goes, stage by stage (in one process).

Usage::

    python benchmarks/profile_stages.py [--store PATH] [--pools 3] [--batch-size 4096]

Takes the first ``--pools`` pools of epoch 0 of a collection (default: the one
``run.py`` wrote for 100,000 x 20,000) and times, per pool or per batch of 4096 rows:

* ``read``: ``PoolReader.read`` (chunk reads + decode + assemble), with 4 threads and 1;
* ``read_raw``: the same pieces read one by one, without assembling (I/O + decode only);
* ``gather``: ``pool_csr[sorted_rows]`` (scipy row gather);
* ``toarray``: densify the gathered batch: fresh array (what the loader does), into a
  reused buffer, and into a fresh buffer backed by transparent huge pages;
* ``torch``: the default converter (``csr_to_torch``: int64 index copies) against int32
  indices, and ``torch.from_numpy`` for dense;
* ``share``: ``Tensor.share_memory_()`` of a dense batch and of a sparse batch's parts:
  the copy a DataLoader worker makes to hand a batch to the main process, against
  writing the dense batch straight into shared memory.

Reports the median wall time of each stage and what it means in cells/s. Wall and CPU
time are both printed: on a shared machine CPU time is the steadier of the two.
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
__all__ = ["main", "profile"]


def _t(fn: Callable[[], Any], repeat: int = 3) -> tuple[float, float, Any]:
    """Median wall and CPU seconds of ``fn()`` over ``repeat`` calls, and its last result."""
    walls, cpus, out = [], [], None
    for _ in range(repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus), out


def _hugepage_zeros(shape: tuple[int, int], dtype: Any = np.float32) -> np.ndarray:
    """A zeroed array in an anonymous mapping advised for transparent huge pages."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, dtype=dtype).reshape(shape)


def profile(store: Path, pools: int, batch_size: int) -> dict[str, Any]:
    """Time each stage on the first ``pools`` pools; returns ``{stage: seconds}``."""
    import scipy.sparse as sp
    import torch

    from annbatch_torch import A, AnnBatchDataset, open_collection
    from annbatch_torch.convert import csr_to_torch
    from annbatch_torch.reader import PoolReader, split_ranges

    coll = open_collection(store)
    ds = AnnBatchDataset(coll, selector={"x": A.X, "y": A.obs["cell_type"]},
                         batch_size=batch_size, densify=True)
    items = list(ds.plan(epoch=0))[:pools]
    res: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, wall: float, cpu: float) -> None:
        res.setdefault(name, []).append((wall, cpu))

    n_rows = []
    for item in items:
        for threads in (4, 1):
            reader = PoolReader(coll, ["X", "obs/cell_type"], threads=threads)
            w, c, pool = _t(lambda r=reader, it=item: r.read(it.ranges), repeat=2)
            add(f"read pool, {threads} threads", w, c)
            reader.close()
        n_rows.append(item.n_rows)
        pieces = split_ranges(item.ranges, coll.shard_offsets)

        def raw(pieces: Any = pieces) -> None:
            for p in pieces:
                coll.element(p.shard, "X").read_raw(p.start, p.stop)

        w, c, _ = _t(raw, repeat=2)
        add("read_raw pieces, sequential", w, c)
        x: sp.csr_matrix = pool["X"]
        perm = np.random.default_rng(0).permutation(x.shape[0])
        for b in range(min(3, x.shape[0] // batch_size)):
            pos = np.sort(perm[b * batch_size : (b + 1) * batch_size])
            w, c, xb = _t(lambda pos=pos, x=x: x[pos])
            add("gather rows (scipy)", w, c)
            w, c, dense = _t(lambda xb=xb: xb.toarray())
            add("toarray, fresh array", w, c)
            buf = np.zeros(xb.shape, np.float32)

            def reuse(xb: Any = xb, buf: np.ndarray = buf) -> np.ndarray:
                buf.fill(0)
                return xb.toarray(out=buf)

            w, c, _ = _t(reuse)
            add("toarray, reused buffer (memset + fill)", w, c)
            w, c, _ = _t(lambda xb=xb: xb.toarray(out=_hugepage_zeros(xb.shape)))
            add("toarray, fresh huge-page buffer", w, c)
            w, c, _ = _t(lambda xb=xb: csr_to_torch(xb))
            add("torch CSR, int64 indices (csr_to_torch)", w, c)

            def int32(xb: Any = xb) -> torch.Tensor:
                return torch.sparse_csr_tensor(
                    torch.from_numpy(xb.indptr.astype(np.int32)), torch.from_numpy(xb.indices),
                    torch.from_numpy(xb.data), size=xb.shape, check_invariants=False)

            w, c, _ = _t(int32)
            add("torch CSR, int32 indices", w, c)
            w, c, _ = _t(lambda d=dense: torch.from_numpy(d).clone().share_memory_())
            w0, c0, _ = _t(lambda d=dense: torch.from_numpy(d).clone())
            add("share_memory_() of a dense batch (worker hand-off)", w - w0, c - c0)

            def direct(xb: Any = xb) -> torch.Tensor:
                t = torch.zeros(xb.shape, dtype=torch.float32).share_memory_()
                xb.toarray(out=t.numpy())
                return t

            w, c, _ = _t(direct)
            add("toarray straight into shared memory", w, c)
            sparse = csr_to_torch(xb)

            def share_sparse(s: torch.Tensor = sparse) -> None:
                for p in (s.crow_indices(), s.col_indices(), s.values()):
                    p.clone().share_memory_()

            w, c, _ = _t(share_sparse)
            add("share_memory_() of a torch CSR batch (worker hand-off)", w, c)
    rows = float(np.mean(n_rows))
    out: dict[str, Any] = {"pool_rows": rows, "batch_size": batch_size, "stages": {}}
    for name, vals in res.items():
        wall = statistics.median(v[0] for v in vals)
        cpu = statistics.median(v[1] for v in vals)
        per = rows if name.startswith("read") else batch_size
        out["stages"][name] = {"wall_s": wall, "cpu_s": cpu,
                               "cells_per_s": per / wall if wall > 0 else None}
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=Path,
                   default=HERE / "data" / "grouped_100000x20000_seed0" / "collection")
    p.add_argument("--pools", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    out = profile(args.store, args.pools, args.batch_size)
    print(f"pool of {out['pool_rows']:,.0f} rows, batch of {args.batch_size:,} rows "
          "(median wall / CPU seconds, and the cells/s that stage alone would allow)")
    for name, s in out["stages"].items():
        print(f"  {name:<55} {s['wall_s'] * 1e3:8.1f} ms  cpu {s['cpu_s'] * 1e3:8.1f} ms"
              f"  {s['cells_per_s'] or 0:>12,.0f} cells/s")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
