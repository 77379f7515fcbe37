"""GPU check (~5 minutes on one GPU): the GPU paths' values equal the CPU path's; cells/s.

Paths, each checked row by row against the CPU path and timed:

* ``cpu``: the reference. DataLoader workers densify with scipy (``densify=True``); batches
  stay on the host.
* ``to_device``: workers yield sparse CSR batches; ``annbatch_torch.to_device(batch,
  "cuda")`` pins them, copies the CSR components asynchronously and densifies on the GPU.
* ``pool-on-gpu``: ``AnnBatchDataset(..., device="cuda")`` (``num_workers=0``): each pool
  is uploaded once and batches are cut and densified on the GPU
  (``annbatch_torch.read.device_pool``).
  Skipped, with a note, where the dataset has no ``device`` parameter yet.
* ``DevicePool``: ``annbatch_torch.read.device_pool.DevicePool`` on one in-memory pool, against
  scipy on the same pool: every batch compared exactly, densification alone timed (no reading).

How values are compared: ``return_index=True`` gives each row's position in the
collection. The reference pass stores, per row, its float64 sum and a float32 weighted sum
(``x @ w``: catches values in the wrong column), and the full rows of a random subset of
rows; every batch of every GPU path is checked against these (subset rows exactly), and each
row must come exactly once per epoch.

cells/s: rows delivered per second, from the first batch to the last (worker start-up not
counted), GPU work synchronised at the end, in a separate pass without the checks.

Exits 0 with a note where CUDA is absent, 1 when a check fails.

Usage: ``python benchmarks/gpu_check.py [--n-obs 100000 --n-vars 20000 --batch-size 4096]``
(``--collection DIR`` reuses a written collection).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

import annbatch_torch as abt
from annbatch_torch import A

Batches = Callable[[int], Iterator[tuple[torch.Tensor, np.ndarray]]]


def _numpy(v: Any) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().numpy()
    return np.asarray(v)


class Reference:
    """Per-row statistics of the CPU path, keyed by global row id."""

    def __init__(self, n_obs: int, n_vars: int, n_subset: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.w = torch.from_numpy(rng.uniform(0.5, 1.5, n_vars).astype(np.float32))
        self.sum = np.full(n_obs, np.nan)
        self.wsum = np.full(n_obs, np.nan)
        self.subset = np.sort(rng.choice(n_obs, min(n_subset, n_obs), replace=False))
        self.rows = np.zeros((len(self.subset), n_vars), dtype=np.float32)
        self.n_obs = n_obs

    def _subset_hits(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pos = np.searchsorted(self.subset, idx)
        hit = pos < len(self.subset)
        hit[hit] = self.subset[pos[hit]] == idx[hit]
        return np.flatnonzero(hit), pos[hit]

    def record(self, x: torch.Tensor, idx: np.ndarray) -> None:
        self.sum[idx] = x.sum(dim=1, dtype=torch.float64).numpy()
        self.wsum[idx] = (x @ self.w).double().numpy()
        where, pos = self._subset_hits(idx)
        self.rows[pos] = x.numpy()[where]

    def check(self, x: torch.Tensor, idx: np.ndarray, seen: np.ndarray) -> list[str]:
        """Problems of one batch (an empty list when it matches)."""
        problems = []
        if x.layout != torch.strided or x.dtype != torch.float32:
            problems.append(f"batch is {x.layout} {x.dtype}, not dense float32")
            x = x.to_dense().float()
        if x.shape != (len(idx), self.rows.shape[1]):
            return [*problems, f"batch shape {tuple(x.shape)} for {len(idx)} indices"]
        seen[idx] += 1
        s = x.sum(dim=1, dtype=torch.float64).cpu().numpy()
        ws = (x @ self.w.to(x.device)).double().cpu().numpy()
        bad = ~np.isclose(s, self.sum[idx], rtol=1e-9, atol=1e-6)
        bad |= ~np.isclose(ws, self.wsum[idx], rtol=1e-4, atol=1e-2)
        if bad.any():
            problems.append(f"{int(bad.sum())} rows' sums differ (e.g. row {idx[bad][0]})")
        where, pos = self._subset_hits(idx)
        if len(where):
            got = x[torch.from_numpy(where).to(x.device)].cpu().numpy()
            diff = np.any(got != self.rows[pos], axis=1)
            if diff.any():
                problems.append(f"{int(diff.sum())} of {len(where)} checked rows differ "
                                f"(e.g. row {idx[where[diff]][0]})")
        return problems


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _time(batches: Iterator[tuple[torch.Tensor, np.ndarray]], device: str) -> float:
    """Cells/s from the first batch to the last, GPU work included."""
    n, t0 = 0, None
    for x, idx in batches:
        if t0 is None:
            _sync(device)
            t0 = time.perf_counter()
        else:
            n += len(idx)
        del x
    _sync(device)
    return n / (time.perf_counter() - t0) if t0 is not None and n else float("nan")


def _check(name: str, batches: Iterator[tuple[torch.Tensor, np.ndarray]], ref: Reference,
           device: str, sparse: bool = False) -> list[str]:
    seen = np.zeros(ref.n_obs, dtype=np.int64)
    problems: list[str] = []
    n = 0
    for b, (x, idx) in enumerate(batches):
        if x.device.type != torch.device(device).type:
            problems.append(f"batch {b} is on {x.device}, not {device}")
        if sparse:
            if x.layout != torch.sparse_csr:
                problems.append(f"batch {b} is {x.layout}, not sparse CSR")
            x = x.to_dense()
        problems += [f"batch {b}: {p}" for p in ref.check(x, idx, seen)]
        n += 1
    if (seen != 1).any():
        problems.append(f"{int((seen == 0).sum())} rows never came, "
                        f"{int((seen > 1).sum())} came more than once")
    status = "OK" if not problems else "FAILED\n    " + "\n    ".join(problems[:10])
    print(f"  {name}: {n} batches checked: {status}")
    return problems


def _loader(ds: Any, workers: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers,
                                       persistent_workers=False)


def _device_pool_check(coll: Any, args: argparse.Namespace) -> tuple[list[str], dict]:
    """DevicePool alone on one pool read into memory: exact values, densify-only speed."""
    from annbatch_torch.read.device_pool import DevicePool

    n = min(args.pool_rows, coll.n_obs)
    # one pool's worth of rows, read with the CPU path (sparse, unshuffled)
    ds = abt.AnnBatchDataset(coll, selector={"x": A.X}, batch_size=n, shuffle=False,
                             preload_nchunks=max(1, -(-n // 512)), batch_converter=_identity)
    x = next(iter(ds))["x"]
    assert sp.issparse(x)
    x = sp.csr_matrix(x, dtype=np.float32)
    codes = np.arange(n, dtype=np.int16) % 7
    order = np.random.default_rng(1).permutation(n)
    bs = args.batch_size
    problems: list[str] = []
    t0 = time.perf_counter()
    dpool = DevicePool({"x": x, "codes": codes}, args.device, order=order)
    _sync(args.device)
    upload = time.perf_counter() - t0
    for start in range(0, n, bs):
        stop = min(start + bs, n)
        rows = order[start:stop]
        ref = x[rows]
        dense = dpool.batch(start, stop)
        sparse = dpool.batch(start, stop, densify=False)["x"]
        if not torch.equal(dense["x"].cpu(), torch.from_numpy(ref.toarray())):
            problems.append(f"DevicePool dense batch {start}:{stop} differs from scipy")
        if not (np.array_equal(sparse.crow_indices().cpu().numpy(), ref.indptr)
                and np.array_equal(sparse.col_indices().cpu().numpy(), ref.indices)
                and np.array_equal(sparse.values().cpu().numpy(), ref.data)):
            problems.append(f"DevicePool sparse batch {start}:{stop} differs from scipy")
        if not np.array_equal(dense["codes"].cpu().numpy(), codes[rows]):
            problems.append(f"DevicePool codes {start}:{stop} differ")
    reps = 3
    _sync(args.device)
    t0 = time.perf_counter()
    for _ in range(reps):
        for b in dpool.batches(bs):
            del b
    _sync(args.device)
    gpu_rate = reps * n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for start in range(0, n, bs):
        x[order[start : start + bs]].toarray()
    cpu_rate = n / (time.perf_counter() - t0)
    nbytes = dpool.nbytes
    dpool.close()
    status = "OK" if not problems else "FAILED\n    " + "\n    ".join(problems[:10])
    print(f"  DevicePool: {n:,} rows, {nbytes / 2**20:,.0f} MiB on {args.device}: {status}")
    return problems, {
        "upload_s": upload, "gpu_cells_s": gpu_rate, "cpu_cells_s": cpu_rate, "rows": n,
    }


def _identity(batch: dict[str, Any]) -> dict[str, Any]:
    return batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-obs", type=int, default=100_000)
    p.add_argument("--n-vars", type=int, default=20_000)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--workers", type=int, default=min(8, max(1, (os.cpu_count() or 2) - 2)))
    p.add_argument("--check-rows", type=int, default=2048,
                   help="rows compared exactly (the others by their sums)")
    p.add_argument("--pool-rows", type=int, default=16384, help="rows of the DevicePool check")
    p.add_argument("--collection", type=Path, default=None,
                   help="reuse this collection instead of writing synthetic data")
    p.add_argument("--device", default="cuda",
                   help="'cpu' dry-runs this script's logic without a GPU (no speed figures)")
    args = p.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); "
              "nothing to check.")
        return 0
    try:
        import cupy

        cupy_version = cupy.__version__
    except Exception as e:
        cupy_version = f"not importable ({type(e).__name__}: {e})"
    gpu_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}), {gpu_name}, "
          f"cupy {cupy_version}, {os.cpu_count()} CPUs, {args.workers} workers, "
          f"device {args.device}")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        if args.collection is not None:
            coll = abt.open_collection(args.collection)
        else:
            paths = abt.datasets.write_synthetic_h5ads(
                Path(tmp) / "in", 2, args.n_obs // 2, args.n_vars, grouped=True
            )
            coll = abt.create_anndata_collection(paths, Path(tmp) / "store", progress=False)
        print(f"data: {coll.n_obs:,} x {coll.n_vars:,} ({time.perf_counter() - t0:.0f} s)")
        return _run(coll, args)


def _pool_batches(ds: Any, epoch: int) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
    ds.set_epoch(epoch)
    for b in ds:  # in the main process: device pools need num_workers=0
        yield b["x"], _numpy(b["index"])


def _run(coll: Any, args: argparse.Namespace) -> int:
    dev = args.device
    kw: dict[str, Any] = dict(selector={"x": A.X}, batch_size=args.batch_size,
                              return_index=True, seed=0)
    ref = Reference(coll.n_obs, coll.n_vars, args.check_rows, seed=0)
    rates: dict[str, float] = {}
    problems: dict[str, list[str]] = {}
    notes: list[str] = []

    # -- cpu: the reference (scipy densifies in the workers)
    cpu_ds = abt.AnnBatchDataset(coll, densify=True, **kw)

    def cpu_batches(epoch: int) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
        cpu_ds.set_epoch(epoch)
        for b in _loader(cpu_ds, args.workers):
            yield b["x"], _numpy(b["index"])

    t0 = time.perf_counter()
    for x, idx in cpu_batches(0):
        ref.record(x, idx)
    if np.isnan(ref.sum).any():
        print("FAILED: the CPU pass did not deliver every row")
        return 1
    print(f"reference pass (CPU, scipy densify): {time.perf_counter() - t0:.1f} s")
    rates["cpu"] = _time(cpu_batches(1), "cpu")

    # -- to_device: sparse batches from workers, pinned, densified on the GPU
    sparse_ds = abt.AnnBatchDataset(coll, densify=False, **kw)

    def to_device_batches(epoch: int) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
        sparse_ds.set_epoch(epoch)
        for b in _loader(sparse_ds, args.workers):
            idx = _numpy(b["index"])
            yield abt.to_device(b, dev, densify=True)["x"], idx

    print("checks:")
    problems["to_device"] = _check("to_device", to_device_batches(0), ref, dev)
    rates["to_device"] = _time(to_device_batches(1), dev)

    # -- pool-on-gpu: AnnBatchDataset(device="cuda")
    try:
        dev_ds = abt.AnnBatchDataset(coll, densify=True, device=dev, **kw)
        dev_sparse_ds = abt.AnnBatchDataset(coll, densify=False, device=dev, **kw)
    except TypeError as e:
        if "device" not in str(e):
            raise
        dev_ds = dev_sparse_ds = None
        notes.append("pool-on-gpu SKIPPED: this AnnBatchDataset has no `device` parameter "
                     f"yet ({e}); wire annbatch_torch.read.device_pool.DevicePool into it first.")
    except (ImportError, RuntimeError, ValueError) as e:
        dev_ds = dev_sparse_ds = None
        if dev == "cpu":  # the dry run: the dataset may take CUDA devices only
            notes.append(f"pool-on-gpu SKIPPED: AnnBatchDataset(device='cpu') raised: {e}")
        else:
            problems["pool-on-gpu"] = [f"AnnBatchDataset(device={dev!r}) raised: {e}"]
    if dev_ds is not None and dev_sparse_ds is not None:
        problems["pool-on-gpu"] = _check("pool-on-gpu", _pool_batches(dev_ds, 0), ref, dev)
        problems["pool-on-gpu sparse"] = _check(
            "pool-on-gpu, densify=False", _pool_batches(dev_sparse_ds, 0), ref, dev,
            sparse=True)
        rates["pool-on-gpu"] = _time(_pool_batches(dev_ds, 1), dev)

    # -- DevicePool alone
    try:
        problems["DevicePool"], dp = _device_pool_check(coll, args)
        rates["DevicePool densify only"] = dp["gpu_cells_s"]
        rates["scipy densify only (1 CPU)"] = dp["cpu_cells_s"]
        notes.append(f"DevicePool upload of {dp['rows']:,} rows: {dp['upload_s'] * 1e3:.0f} ms")
    except ImportError as e:
        problems["DevicePool"] = [f"DevicePool needs cupy: {e}"]

    print("cells/s:")
    for name, r in rates.items():
        rel = f"  ({r / rates['cpu']:.2f}x cpu)" if name in ("to_device", "pool-on-gpu") else ""
        print(f"  {name:<28} {r:>12,.0f}{rel}")
    for note in notes:
        print(f"note: {note}")
    failed = {k: v for k, v in problems.items() if v}
    print("values equal: " + ("yes" if not failed else f"NO ({', '.join(failed)})"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
