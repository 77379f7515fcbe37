"""The benchmark cases; each runs in a fresh process.

Run one case by hand with::

    python benchmarks/cases.py CASE_NAME CONFIG.json

``CONFIG.json`` holds the inputs (h5ad paths, collection folder, batch size, number of
warm-up and timed batches, ...) and ``result``, the file the case writes its JSON result
to. :mod:`run` writes that file and calls this script once per case, so every loader
starts from a fresh interpreter and its peak RSS is its own.

Every loader case reports ``cells_per_s`` over ``n_batches`` timed batches after
``n_warmup`` warm-up batches, the peak RSS of the process (and of each DataLoader
worker) and ``entropy``, the mean per-batch Shannon entropy of ``cell_type`` (the caller
divides it by that of truly random batches).
"""

from __future__ import annotations

import gc
import importlib.util
import inspect
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    CpuClock,
    MemoryMonitor,
    batch_entropy,
    close_iterator,
    peak_rss_self_mb,
    rss_mb,
    time_batches,
)

__all__ = ["CASES", "EXPERIMENTS", "run_case", "main"]

Config = dict[str, Any]
Result = dict[str, Any]


# -- helpers -------------------------------------------------------------------------
def _n_classes(cfg: Config) -> int:
    return int(cfg["n_classes"])


def _loader_result(run: Any, mon: MemoryMonitor, cfg: Config, **extra: Any) -> Result:
    out: Result = {
        "cells_per_s": run.cells_per_s,
        "n_cells": run.n_cells,
        "n_batches": run.n_batches,
        "seconds": run.seconds,
        "warmup_seconds": run.warmup_seconds,
        "entropy": batch_entropy(run.labels, _n_classes(cfg)) if run.labels else None,
        "cells_per_cpu_s": run.cells_per_cpu_s,
        "cpu": run.cpu,
    }
    out.update(mon.summary())
    out.update(extra)
    return out


def _torch_labels(batch: dict[str, Any]) -> np.ndarray:
    return batch["y"].numpy()


def _rows(batch: dict[str, Any]) -> int:
    return int(batch["x"].shape[0])


def _check_sparse(batch: dict[str, Any]) -> None:
    import torch

    if batch["x"].layout != torch.sparse_csr:
        raise TypeError(f"expected a sparse CSR tensor, got layout {batch['x'].layout}")


def _check_dense(batch: dict[str, Any]) -> None:
    import torch

    x = batch["x"]
    if x.layout != torch.strided or x.dtype != torch.float32:
        raise TypeError(f"expected a dense float32 tensor, got {x.layout} {x.dtype}")


# -- the writer and its baseline -----------------------------------------------------
def _write(cfg: Config, paths: list[Any], store: Path, *, append_to: Path | None = None,
           **extra: Any) -> Result:
    """Time and peak RSS (this process and its children: Dask workers too) of one write:
    ``create_anndata_collection(paths, store, **extra)``, or with ``append_to`` the append
    of ``paths`` to that collection."""
    import annbatch_torch as abt

    writer = abt.create_anndata_collection
    params = inspect.signature(writer).parameters
    kwargs: dict[str, Any] = {"seed": cfg["seed"], "overwrite": True,
                              **cfg.get("writer_kwargs", {}), **extra}
    if cfg.get("max_memory") is not None:
        kwargs["max_memory"] = cfg["max_memory"]
    if "obs_columns" in params:
        kwargs["obs_columns"] = ["cell_type"]
    if "progress" in params:
        kwargs["progress"] = False
    max_memory = kwargs.get("max_memory", params["max_memory"].default
                            if "max_memory" in params else None)
    with MemoryMonitor(interval=0.05) as mon:
        clock = CpuClock()
        t0 = time.perf_counter()
        if append_to is None:
            coll = writer(paths, store, **kwargs)
        else:
            keep = ("seed", "max_memory", "progress", "scheduler", "n_workers")
            coll = abt.append_to_collection(append_to, paths,
                                            **{k: v for k, v in kwargs.items() if k in keep})
        seconds = time.perf_counter() - t0
        cpu = clock.read()
    n_new = (coll.n_obs if append_to is None
             else int(coll.manifest.extra["appended"][-1]["n_obs"]))
    files = [f for f in Path(coll.path).rglob("*") if f.is_file()]
    store_bytes = sum(f.stat().st_size for f in files)
    out = {
        "seconds": seconds,
        "cells_per_s": n_new / seconds,
        "max_memory": max_memory,
        "max_memory_bytes": _memory_bytes(max_memory),
        "n_shards": len(coll.shard_sizes),
        "shard_sizes": list(coll.shard_sizes),
        "store_mb": store_bytes / 2**20,
        "files": len(files),
        "files_per_million_cells": len(files) * 1e6 / max(coll.n_obs, 1),
        "bytes_per_cell": store_bytes / max(coll.n_obs, 1),
        "kwargs": {k: v for k, v in kwargs.items() if k != "overwrite"},
        "layout": _store_layout(Path(coll.path)),
        "cpu": cpu,
        "cells_per_cpu_s": n_new / cpu["own_cpu_s"] if cpu["own_cpu_s"] else None,
    }
    out.update(mon.summary())
    return out


def case_writer(cfg: Config) -> Result:
    """``create_anndata_collection`` on the two grouped h5ad files (time, peak RSS)."""
    return _write(cfg, cfg["paths"], Path(cfg["store"]))


def case_writer_parallel(cfg: Config) -> Result:
    """The writer on a local Dask cluster of 2 processes (``scheduler="processes"``),
    into a store of its own; peak RSS per worker among the children."""
    store = Path(str(cfg["store"]) + "_parallel")
    return _write(cfg, cfg["paths"], store, scheduler="processes", n_workers=2)


def case_append(cfg: Config) -> Result:
    """The second input appended to a collection of the first (the append timed), next to
    ``append_alone``: the second input written alone."""
    import annbatch_torch as abt

    base = Path(str(cfg["store"]) + "_append")
    abt.create_anndata_collection(cfg["paths"][:1], base, seed=cfg["seed"], overwrite=True,
                                  obs_columns=["cell_type"], progress=False,
                                  **cfg.get("writer_kwargs", {}))
    out = _write(cfg, cfg["paths"][1:], base, append_to=base)
    out["entropy"] = _store_entropy(base, _n_classes(cfg))
    # the full rewrite of both inputs (the writer case's store), measured alike
    if (Path(cfg["store"]) / "manifest.json").exists():
        out["rewrite_entropy"] = _store_entropy(Path(cfg["store"]), _n_classes(cfg))
    return out


def case_append_alone(cfg: Config) -> Result:
    """The second input written alone (what an append should cost about as much as)."""
    return _write(cfg, cfg["paths"][1:], Path(str(cfg["store"]) + "_alone"))


def _store_entropy(store: Path, n_classes: int, batches: int = 200) -> float:
    """Mean per-batch entropy of ``cell_type`` (nats) over the first ``batches`` batches of a
    chunked epoch of ``store``: how well pools mix its cells."""
    import annbatch_torch as abt

    ds = abt.AnnBatchDataset(store, selector={"y": abt.A.obs["cell_type"]}, batch_size=4096,
                             seed=0)
    labels = []
    for i, b in enumerate(ds):
        if i == batches:
            break
        labels.append(b["y"].numpy())
    return batch_entropy(labels, n_classes)


def _memory_bytes(value: Any) -> int | None:
    """``max_memory`` in bytes, parsed the way the writer parses it."""
    if value is None:
        return None
    try:
        from annbatch_torch.write.writer import parse_memory
    except ImportError:
        return int(value) if isinstance(value, int | float) else None
    return parse_memory(value)


def _store_layout(store: Path) -> dict[str, Any]:
    """Chunk / shard shape and codecs of ``X/data`` in the first shard (for the report)."""
    import zarr

    try:
        from annbatch_torch import open_collection

        coll = open_collection(store)
        arr = zarr.open_group(str(coll.shard_path(0)), mode="r")["X"]["data"]
        meta = arr.metadata.to_dict()
        return {
            "X_data_chunks": list(arr.chunks),
            "X_data_shards": list(arr.shards) if getattr(arr, "shards", None) else None,
            "codecs": json.loads(json.dumps(meta.get("codecs"), default=str)),
            "zarr_format": meta.get("zarr_format"),
        }
    except Exception as e:  # only descriptive
        return {"error": f"{type(e).__name__}: {e}"}


def case_anndata_write(cfg: Config) -> Result:
    """Baseline for the writer: anndata reads both inputs into memory, writes one zarr."""
    import shutil

    import anndata as ad

    out_path = Path(cfg["store"]).with_name("anndata_baseline.zarr")
    shutil.rmtree(out_path, ignore_errors=True)
    with MemoryMonitor(interval=0.05) as mon:
        clock = CpuClock()
        t0 = time.perf_counter()
        adatas = [ad.read_h5ad(p) for p in cfg["paths"]]
        t1 = time.perf_counter()
        merged = ad.concat(adatas, merge="same")
        del adatas
        merged.write_zarr(out_path)
        seconds = time.perf_counter() - t0
        cpu = clock.read()
    n_obs = merged.n_obs
    shutil.rmtree(out_path, ignore_errors=True)
    out = {"seconds": seconds, "read_seconds": t1 - t0, "cells_per_s": n_obs / seconds,
           "cpu": cpu, "cells_per_cpu_s": n_obs / cpu["own_cpu_s"] if cpu["own_cpu_s"] else None}
    out.update(mon.summary())
    return out


# -- our loader ----------------------------------------------------------------------
def _ours_dataset(cfg: Config, source: Any, densify: bool, **kw: Any) -> Any:
    from annbatch_torch import A, AnnBatchDataset

    return AnnBatchDataset(
        source, selector={"x": A.X, "y": A.obs["cell_type"]}, batch_size=cfg["batch_size"],
        densify=densify, seed=cfg["seed"], **kw,
    )


def _run_ours(cfg: Config, source: Any, densify: bool, workers: int,
              expect_dense: bool | None = None, plain_loader: bool = False,
              rows_of: Callable[[Any], int] = _rows,
              consume: Callable[[Any], None] | None = None, **kw: Any) -> Result:
    import torch

    from annbatch_torch import AnnBatchDataLoader

    ds = _ours_dataset(cfg, source, densify, **kw)
    # AnnBatchDataLoader: with densify=True and workers, workers send CSR and the main
    # process densifies; a plain DataLoader gets dense batches from the workers
    loader_cls = torch.utils.data.DataLoader if plain_loader else AnnBatchDataLoader
    loader = loader_cls(ds, batch_size=None, num_workers=workers,
                        persistent_workers=workers > 0)
    dense = densify if expect_dense is None else expect_dense
    check = _check_dense if dense else _check_sparse

    def epochs(e: int) -> Any:
        ds.set_epoch(e)
        return loader

    with MemoryMonitor() as mon:
        run = time_batches(epochs, n_warmup=cfg["n_warmup"], n_batches=cfg["n_batches"],
                           n_cells_of=rows_of, labels_of=_torch_labels,
                           consume=check if consume is None else consume)
    return _loader_result(
        run, mon, cfg, chunk_size=ds.chunk_size, preload_nchunks=ds.preload_nchunks,
        read_threads=ds.read_threads,
    )


def _make_ours(densify: bool, workers: int) -> Callable[[Config], Result]:
    def case(cfg: Config) -> Result:
        return _run_ours(cfg, cfg["store"], densify, workers)

    kind = "dense (densify=True)" if densify else "torch sparse CSR"
    case.__doc__ = f"annbatch_torch on our collection, {kind}, num_workers={workers}."
    return case


def case_ours_inplace_dense_w0(cfg: Config) -> Result:
    """annbatch_torch reading the grouped h5ad files in place (no offline shuffle)."""
    return _run_ours(cfg, [Path(p) for p in cfg["paths"]], True, 0)


def case_memory(cfg: Config) -> Result:
    """RSS of the main process and each worker at the end of each epoch (dense, 2
    persistent workers): a first epoch, then ``memory_epochs`` more; growth = end of the
    last epoch vs end of the first (and, for the record, vs end of the second)."""
    import psutil

    from annbatch_torch import AnnBatchDataLoader

    ds = _ours_dataset(cfg, cfg["store"], True)
    workers = 2
    loader = AnnBatchDataLoader(ds, num_workers=workers, persistent_workers=True)
    me = psutil.Process(os.getpid())
    per_epoch: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    cells = 0
    with MemoryMonitor() as mon:
        for e in range(cfg["memory_epochs"] + 1):  # epoch 0 warms allocators and caches up
            ds.set_epoch(e)
            for batch in loader:
                _check_dense(batch)
                cells += _rows(batch)
            del batch
            gc.collect()
            kids = sorted(me.children(recursive=True), key=lambda p: p.pid)
            per_epoch.append({
                "epoch": e,
                "main_rss_mb": rss_mb(),
                "worker_rss_mb": [k.memory_info().rss / 2**20 for k in kids],
                "worker_uss_mb": [k.memory_full_info().uss / 2**20 for k in kids],
            })
    seconds = time.perf_counter() - t0
    del loader

    def growth(key: str, start: int = 0) -> float:
        first, last = per_epoch[start][key], per_epoch[-1][key]
        if isinstance(first, list):
            pairs = list(zip(first, last))
            return max((b - a) / a for a, b in pairs) if pairs else float("nan")
        return (last - first) / first

    out = {
        "epochs": per_epoch,
        "cells_per_s": cells / seconds,
        "main_growth": growth("main_rss_mb"),
        "worker_growth": growth("worker_rss_mb"),
        "worker_uss_growth": growth("worker_uss_mb"),
        "main_growth_from_epoch1": growth("main_rss_mb", 1),
        "worker_growth_from_epoch1": growth("worker_rss_mb", 1),
    }
    out.update(mon.summary())
    return out


# -- peers -----------------------------------------------------------------------------
def _global_codes(adatas: list[Any]) -> np.ndarray:
    import pandas as pd

    cats = pd.Index(sorted(set().union(*(a.obs["cell_type"].cat.categories for a in adatas))))
    return np.concatenate([
        cats.get_indexer(a.obs["cell_type"].astype(str)).astype(np.int64) for a in adatas
    ])


def _scd_fetch(collection: Any, indices: np.ndarray) -> tuple[Any, np.ndarray]:
    # what the scDataset / arrayloader benchmarks do: AnnCollection view -> X (CSR)
    return collection[indices].X, collection.codes[indices]


def _scd_batch(data: tuple[Any, np.ndarray], idx: np.ndarray) -> tuple[Any, np.ndarray]:
    x, y = data
    return x[idx], y[idx]


def _scd_densify(batch: tuple[Any, np.ndarray]) -> dict[str, Any]:
    import torch

    x, y = batch
    x = x.toarray() if hasattr(x, "toarray") else np.asarray(x)
    return {"x": torch.from_numpy(x.astype(np.float32, copy=False)), "y": torch.from_numpy(y)}


def _scd_strategy(kind: str, codes: np.ndarray, block_size: int) -> Any:
    """scDataset's strategy: ``shuffle`` (block shuffling), ``balanced`` (class-balanced
    by ``codes``) or ``weighted`` (per-row weights, random, seed 0)."""
    from scdataset import BlockShuffling, BlockWeightedSampling, ClassBalancedSampling

    if kind == "balanced":
        return ClassBalancedSampling(codes, block_size=block_size)
    if kind == "weighted":
        weights = np.random.default_rng(0).random(len(codes)) + 0.1
        return BlockWeightedSampling(block_size=block_size, weights=weights)
    return BlockShuffling(block_size=block_size)


_SCD_STRATEGY = {"shuffle": "block shuffling", "balanced": "ClassBalancedSampling",
                 "weighted": "BlockWeightedSampling"}


def _make_scdataset(workers: int, kind: str = "shuffle") -> Callable[[Config], Result]:
    def case(cfg: Config) -> Result:
        import anndata as ad
        import scdataset
        import torch
        from anndata.experimental import AnnCollection
        from scdataset import scDataset

        adatas = [ad.read_h5ad(p, backed="r") for p in cfg["paths"]]
        collection = AnnCollection(adatas)
        collection.codes = _global_codes(adatas)
        block_size, fetch_factor = cfg["scd_block_size"], cfg["scd_fetch_factor"]
        ds = scDataset(
            collection, _scd_strategy(kind, collection.codes, block_size),
            batch_size=cfg["batch_size"], fetch_factor=fetch_factor, fetch_callback=_scd_fetch,
            batch_callback=_scd_batch, batch_transform=_scd_densify, seed=cfg["seed"],
        )
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers,
                                             persistent_workers=workers > 0)
        with MemoryMonitor() as mon:
            run = time_batches(lambda e: loader, n_warmup=cfg["n_warmup"],
                               n_batches=cfg["n_batches"], n_cells_of=_rows,
                               labels_of=_torch_labels, consume=_check_dense)
        extra = {} if kind == "shuffle" else {"sampler": kind}
        return _loader_result(run, mon, cfg, block_size=block_size, fetch_factor=fetch_factor,
                              version=scdataset.__version__, **extra)

    case.__doc__ = (f"scDataset {_SCD_STRATEGY[kind]} over backed h5ad (AnnCollection), "
                    f"densified in batch_transform, num_workers={workers}.")
    return case


def _annloader_batch_labels(batch: Any) -> np.ndarray:
    return np.asarray(batch.obs["codes"])


def _make_annloader(workers: int) -> Callable[[Config], Result]:
    def case(cfg: Config) -> Result:
        import warnings

        import anndata as ad
        import pandas as pd
        from anndata.experimental.pytorch import AnnLoader

        adatas = [ad.read_h5ad(p, backed="r") for p in cfg["paths"]]
        codes = _global_codes(adatas)
        off = 0
        for a in adatas:  # numeric codes survive the default converter as tensors
            a.obs["codes"] = pd.Series(codes[off : off + a.n_obs], index=a.obs_names)
            off += a.n_obs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loader = AnnLoader(adatas, batch_size=cfg["batch_size"], shuffle=True,
                               num_workers=workers)

        def cells(b: Any) -> int:
            return int(b.X.shape[0])

        def check(b: Any) -> None:
            import torch

            if not isinstance(b.X, torch.Tensor) or b.X.layout != torch.strided:
                raise TypeError(f"AnnLoader gave X of type {type(b.X)}")

        def labels(b: Any) -> np.ndarray:
            return np.asarray(b.obs["codes"]).astype(np.int64)

        iters: list[Any] = []  # each epoch's iterator, its workers stopped on the way out

        def epoch(e: int) -> Any:
            iters.append(iter(loader))
            return iters[-1]

        try:
            with MemoryMonitor() as mon:
                run = time_batches(epoch, n_warmup=cfg["n_warmup"],
                                   n_batches=min(cfg["n_batches"], cfg["slow_batches"]),
                                   n_cells_of=cells,
                                   labels_of=labels, consume=check)
        except TypeError as e:
            if workers and "AnnCollectionView" in str(e):
                return {"status": "unsupported", "reason": (
                    "with num_workers > 0 AnnLoader hands batch_size to a plain DataLoader, "
                    "which fetches one row at a time and cannot collate AnnCollectionView "
                    "rows (default_collate TypeError)")}
            raise
        finally:
            # an iterator left by an error (its traceback holds it) would stop its workers
            # only when collected, waiting 5 s for each, in whatever runs then
            for it in iters:
                close_iterator(it)
        return _loader_result(run, mon, cfg)

    case.__doc__ = f"anndata AnnLoader over backed h5ad, shuffle=True, num_workers={workers}."
    return case


def case_annbatch(cfg: Config) -> Result:
    """scverse annbatch (needs Python >= 3.12), when importable."""
    if importlib.util.find_spec("annbatch") is None:
        return {"status": "skipped",
                "reason": f"annbatch is not importable here (Python "
                          f"{sys.version_info.major}.{sys.version_info.minor}; annbatch 0.3 "
                          "needs >= 3.12)"}
    return {"status": "skipped", "reason": "annbatch is importable but this harness has no "
            "annbatch case yet"}


# -- ceilings --------------------------------------------------------------------------
def case_ceiling_inmemory(cfg: Config) -> Result:
    """CSR fully in RAM: random rows (sorted per batch) + ``.toarray()``."""
    import anndata as ad
    import scipy.sparse as sp

    adatas = [ad.read_h5ad(p) for p in cfg["paths"]]
    codes = _global_codes(adatas)
    x = sp.vstack([a.X for a in adatas], format="csr")
    del adatas
    gc.collect()
    bs = cfg["batch_size"]

    def epochs(e: int) -> Any:
        perm = np.random.default_rng([cfg["seed"], e]).permutation(x.shape[0])
        for b in range(0, len(perm), bs):
            idx = np.sort(perm[b : b + bs])
            yield x[idx].toarray(), codes[idx]

    with MemoryMonitor() as mon:
        run = time_batches(epochs, n_warmup=cfg["n_warmup"], n_batches=cfg["n_batches"],
                           n_cells_of=lambda b: b[0].shape[0], labels_of=lambda b: b[1])
    return _loader_result(run, mon, cfg)


def _front_to_back(cfg: Config, pipeline: str | None) -> Result:
    import zarr

    from annbatch_torch import open_collection

    coll = open_collection(cfg["store"])
    ctx = (zarr.config.set({"codec_pipeline.path": pipeline}) if pipeline
           else zarr.config.set({}))
    times, cpus = [], []
    nnz = 0
    with ctx, MemoryMonitor() as mon:
        for _ in range(cfg["seq_passes"]):
            nnz = 0
            clock = CpuClock()
            t0 = time.perf_counter()
            for s in range(len(coll.shard_sizes)):
                g = zarr.open_group(str(coll.shard_path(s)), mode="r")["X"]
                data, indices, indptr = g["data"][...], g["indices"][...], g["indptr"][...]
                nnz += data.shape[0]
                if indices.shape != data.shape or indptr[-1] != data.shape[0]:
                    raise RuntimeError(f"shard {s}: inconsistent CSR arrays")
                del data, indices, indptr
            times.append(time.perf_counter() - t0)
            cpus.append(clock.read())
    i = int(np.argmin(times))
    best = times[i]
    out = {"cells_per_s": coll.n_obs / best, "seconds": best, "all_seconds": times,
           "cpu": cpus[i], "cells_per_cpu_s": coll.n_obs / cpus[i]["own_cpu_s"]
           if cpus[i]["own_cpu_s"] else None,
           "n_cells": coll.n_obs, "nnz": nnz, "mb_per_s": nnz * 8 / 2**20 / best,
           "pipeline": pipeline or "zarr default"}
    out.update(mon.summary())
    return out


def case_ceiling_seq_zarr(cfg: Config) -> Result:
    """Front-to-back read of our store's X (data, indices, indptr) with zarr's default
    codec pipeline."""
    return _front_to_back(cfg, None)


def case_ceiling_seq_raw(cfg: Config) -> Result:
    """Front-to-back read of our store's X with annbatch_torch's own raw-chunk reader
    (:mod:`annbatch_torch.store.rawzarr`: uncompressed chunks read straight into the buffer,
    each chunk's CRC-32C checked, as the loader does). One buffer per array and stored
    dtype, sized to the largest shard, is allocated and written once before the timed
    passes and reused by every pass, as the loader reuses its pool buffers: fresh buffers
    would time this machine's page faults (0.6-0.8x the speed), not the read. Every pass
    is timed (the cold case's one pass is the one read after the page cache was
    dropped)."""
    try:
        from annbatch_torch.store.rawzarr import open_raw
    except ImportError:
        return {"status": "skipped", "reason": "annbatch_torch.store.rawzarr does not exist"}
    from annbatch_torch import open_collection

    coll = open_collection(cfg["store"])
    arrays = []
    for s in range(len(coll.shard_sizes)):
        trio = [open_raw(coll.shard_path(s) / "X" / k) for k in ("data", "indices", "indptr")]
        if any(a is None for a in trio):
            return {"status": "skipped", "reason": "the store's X is not stored raw "
                    "(compressed or sharded chunks): the raw reader does not apply"}
        arrays.append(trio)
    nnz_bytes = sum(int(np.dtype(a.dtype).itemsize) for a in arrays[0][:2])  # data + index
    times, cpus = [], []
    nnz = 0
    with MemoryMonitor() as mon:
        sizes: dict[tuple[int, np.dtype], int] = {}  # shards may store narrower dtypes
        for trio in arrays:
            for k, a in enumerate(trio):
                key = (k, np.dtype(a.dtype))
                sizes[key] = max(sizes.get(key, 0), int(a.shape[0]))
        buffers = {key: np.empty(n, dtype=key[1]) for key, n in sizes.items()}
        for b in buffers.values():  # written once: their pages exist before the timing
            b.fill(0)  # (np.zeros would map them lazily, on first touch in a timed pass)
        for _ in range(cfg["seq_passes"]):
            nnz = 0
            clock = CpuClock()
            t0 = time.perf_counter()
            for trio in arrays:
                for k, a in enumerate(trio):  # into a buffer of its stored dtype: no cast
                    o = buffers[(k, np.dtype(a.dtype))]
                    a.read_into(0, a.shape[0], o[: a.shape[0]])
                nnz += trio[0].shape[0]
            times.append(time.perf_counter() - t0)
            cpus.append(clock.read())
    i = int(np.argmin(times))
    out = {"cells_per_s": coll.n_obs / times[i], "seconds": times[i], "all_seconds": times,
           "cpu": cpus[i], "cells_per_cpu_s": coll.n_obs / cpus[i]["own_cpu_s"]
           if cpus[i]["own_cpu_s"] else None, "n_cells": coll.n_obs, "nnz": nnz,
           "mb_per_s": nnz * nnz_bytes / 2**20 / times[i],
           "pipeline": "annbatch_torch.store.rawzarr"}
    out.update(mon.summary())
    return out


def case_ceiling_seq_zarrs(cfg: Config) -> Result:
    """Front-to-back read of our store's X with the zarrs (Rust) codec pipeline."""
    if importlib.util.find_spec("zarrs") is None:
        return {"status": "skipped", "reason": "zarrs is not installed"}
    return _front_to_back(cfg, "zarrs.ZarrsCodecPipeline")


# -- experiments: candidate fast paths, built from public hooks only -----------------------
def _variant_store(cfg: Config, name: str, **writer_kw: Any) -> str:
    """The inputs written again with other writer settings (once; not timed)."""
    import annbatch_torch as abt

    path = Path(cfg["store"]).with_name(f"collection_{name}")
    if not (path / "manifest.json").exists():
        abt.create_anndata_collection(cfg["paths"], path, seed=cfg["seed"], overwrite=True,
                                      obs_columns=["cell_type"], progress=False, **writer_kw)
    return str(path)


def _zarrs_pipeline(on: bool) -> Any:
    """Context in which annbatch_torch decodes compressed chunks with the zarrs codec
    pipeline (``on``) or with zarr-python (the library's default is zarrs when installed)."""
    import contextlib

    import annbatch_torch as abt

    @contextlib.contextmanager
    def ctx() -> Any:
        abt.set_codec_pipeline("zarrs" if on else "zarr")
        try:
            yield
        finally:
            abt.set_codec_pipeline("auto")

    return ctx()


def _experiment(densify: bool, workers: int, *, converter: Any = None, zarrs: bool = False,
                store: dict[str, Any] | None = None, **kw: Any) -> Callable[[Config], Result]:
    def case(cfg: Config) -> Result:
        if "io_depth" in kw:  # reads in flight per process (a module setting, not an argument)
            from annbatch_torch.read import reader

            reader.IO_DEPTH = kw["io_depth"]
        with _zarrs_pipeline(zarrs):
            return _run_experiment(cfg)

    def _run_experiment(cfg: Config) -> Result:
        path = cfg["store"]
        if store:
            path = _variant_store(cfg, "_".join(f"{k}-{v}" for k, v in store.items()), **store)
        out = _run_ours(cfg, path, densify and converter is None, workers,
                        batch_converter=converter, expect_dense=densify,
                        **{k: v for k, v in kw.items() if k != "io_depth"})
        out["variant"] = {"converter": getattr(converter, "__name__", None), "zarrs": zarrs,
                          "store": store, **kw}
        return out

    parts = [f"converter {converter.__name__}" if converter else "",
             "zarrs codec pipeline" if zarrs else "",
             f"store written with {store}" if store else "",
             ", ".join(f"{k}={v}" for k, v in kw.items())]
    case.__doc__ = (f"{'dense' if densify else 'torch CSR'}, {workers} workers: "
                    + "; ".join(p for p in parts if p))
    return case


EXPERIMENTS: dict[str, Callable[[Config], Result]] = {
    # dense batches made in the workers and moved through shared memory (plain DataLoader)
    "exp_dense_w2_plain_dataloader": _experiment(True, 2, plain_loader=True),
    "exp_sparse_w0_lz4": _experiment(False, 0, store={"compressor": "lz4"}),
    "exp_sparse_w0_lz4_zarrs": _experiment(False, 0, zarrs=True, store={"compressor": "lz4"}),
    "exp_sparse_w0_chunkel17": _experiment(False, 0, store={"zarr_chunk_elems": 1 << 17}),
    "exp_sparse_w0_threads1": _experiment(False, 0, read_threads=1),
    "exp_sparse_w0_threads2": _experiment(False, 0, read_threads=2),
    "exp_dense_w0_threads2": _experiment(True, 0, read_threads=2),
    "exp_sparse_w0_threads8": _experiment(False, 0, read_threads=8),
    "exp_sparse_w0_io2": _experiment(False, 0, io_depth=2),
    "exp_dense_w0_io2": _experiment(True, 0, io_depth=2),
    "exp_sparse_w0_threads16": _experiment(False, 0, read_threads=16),
    "exp_sparse_w0_noprefetch": _experiment(False, 0, prefetch=False),
    "exp_dense_w0_noprefetch": _experiment(True, 0, prefetch=False),
    "exp_sparse_w0_chunk256": _experiment(False, 0, chunk_size=256, preload_nchunks=64),
    "exp_sparse_w0_chunk1024": _experiment(False, 0, chunk_size=1024, preload_nchunks=16),
    "exp_sparse_w0_chunk2048": _experiment(False, 0, chunk_size=2048, preload_nchunks=8),
    "exp_dense_w2_prefetch": _experiment(True, 2, prefetch=True),
}


# -- sampling mode ----------------------------------------------------------------------
def _store_codes(store: str) -> np.ndarray:
    """Global ``cell_type`` codes of every row of our collection."""
    from annbatch_torch import open_collection

    coll = open_collection(store)
    return np.asarray(coll.obs_at(np.arange(coll.n_obs), "cell_type")["cell_type"].cat.codes)


def _sampler(kind: str, store: str) -> Any:
    """``balanced``: every class equally often; ``weighted``: weights per row (random,
    seed 0), with replacement; both ``n_obs`` draws per epoch."""
    import annbatch_torch as abt

    if kind == "balanced":
        return abt.ClassBalancedSampler("cell_type")
    n = abt.open_collection(store).n_obs
    return abt.WeightedSampler(np.random.default_rng(0).random(n) + 0.1)


def _make_sampling(kind: str, densify: bool, workers: int) -> Callable[[Config], Result]:
    def case(cfg: Config) -> Result:
        out = _run_ours(cfg, cfg["store"], densify, workers,
                        sampler=_sampler(kind, cfg["store"]))
        out["sampler"] = kind
        return out

    what = ("ClassBalancedSampler('cell_type')" if kind == "balanced"
            else "WeightedSampler(per-row weights)")
    case.__doc__ = (f"annbatch_torch sampling mode, {what}, "
                    f"{'dense' if densify else 'torch CSR'}, num_workers={workers}.")
    return case


def _pair_rows(batch: dict[str, Any]) -> int:
    """Rows read for a batch of pairs: the perturbed rows and their controls."""
    return int(batch["x"].shape[0]) + int(batch["control_x"].shape[0])


def _make_paired(densify: bool, workers: int) -> Callable[[Config], Result]:
    def case(cfg: Config) -> Result:
        import annbatch_torch as abt

        counts = abt.open_collection(cfg["store"]).category_counts("cell_type")
        control = str(counts.idxmax())
        # (the benchmark's collection keeps cell_type only: any control matches)
        sampler = abt.PairedSampler("cell_type", control, n_controls=1)
        # batches of the same rows read as chunked mode's: half perturbed, half controls
        out = _run_ours({**cfg, "batch_size": cfg["batch_size"] // 2}, cfg["store"], densify,
                        workers, rows_of=_pair_rows, sampler=sampler)
        out.update(sampler=repr(sampler), rows_per_batch=cfg["batch_size"])
        return out

    case.__doc__ = ("annbatch_torch PairedSampler: the largest cell type as the controls, "
                    "each other row once with one control drawn from all controls, "
                    f"batches of batch_size // 2 pairs; cells/s counts both rows; "
                    f"{'dense' if densify else 'torch CSR'}, num_workers={workers}.")
    return case


#: the weights of ``ours_mixed_*``: the two inputs' collections, 0.7 / 0.3
MIX_WEIGHTS = {"part0": 0.7, "part1": 0.3}


def _part_stores(cfg: Config) -> dict[str, str]:
    """Each input written as a collection of its own (once, untimed, beside the store)."""
    import annbatch_torch as abt

    out = {}
    for i, path in enumerate(cfg["paths"][:2]):
        store = Path(f"{cfg['store']}_part{i}")
        if not (store / "manifest.json").exists():
            abt.create_anndata_collection([path], store, seed=cfg["seed"], overwrite=True,
                                          progress=False, **cfg.get("writer_kwargs", {}))
        out[f"part{i}"] = str(store)
    return out


def _make_mixed(densify: bool, workers: int) -> Callable[[Config], Result]:
    def case(cfg: Config) -> Result:
        import annbatch_torch as abt

        mixture = abt.mix(_part_stores(cfg), MIX_WEIGHTS)
        counts: list[np.ndarray] = []
        check = _check_dense if densify else _check_sparse

        def consume(batch: dict[str, Any]) -> None:
            check(batch)
            counts.append(np.bincount(batch["source"].numpy(), minlength=2))

        out = _run_ours(cfg, mixture, densify, workers, consume=consume)
        per_batch = np.array(counts)
        quota = np.array([MIX_WEIGHTS["part0"], MIX_WEIGHTS["part1"]])
        full = per_batch[per_batch.sum(axis=1) == cfg["batch_size"]]
        out.update(weights=MIX_WEIGHTS, shares=(per_batch.sum(axis=0) / per_batch.sum()
                                                ).tolist(),
                   max_quota_deviation_rows=float(np.abs(
                       full - cfg["batch_size"] * quota).max()) if len(full) else None)
        return out

    case.__doc__ = ("annbatch_torch mix() of the two inputs' collections, weights 0.7 / 0.3 "
                    "(runs of the dataset's chunk_size rows, pools permuted within each "
                    f"collection's positions), {'dense' if densify else 'torch CSR'}, "
                    f"num_workers={workers}; shares and per-batch quota deviation reported.")
    case.prepare = _part_stores  # type: ignore[attr-defined]
    return case


def _grouped_store(cfg: Config) -> str:
    """Our collection of the same inputs and seed written with ``group_by="cell_type"``
    (written once, untimed, beside the writer case's store)."""
    import annbatch_torch as abt

    store = Path(str(cfg["store"]) + "_grouped")
    if not (store / "manifest.json").exists():
        abt.create_anndata_collection(cfg["paths"], store, seed=cfg["seed"], overwrite=True,
                                      group_by="cell_type", progress=False,
                                      **cfg.get("writer_kwargs", {}))
    return str(store)


def _make_grouped(kind: str, densify: bool, workers: int) -> Callable[[Config], Result]:
    def case(cfg: Config) -> Result:
        import annbatch_torch as abt

        store = _grouped_store(cfg)
        sampler = _sampler("balanced", store) if kind == "balanced" else None
        out = _run_ours(cfg, store, densify, workers, sampler=sampler)
        out["sampler"] = kind
        out["group_by"] = "cell_type"
        # the mix against random batches of the epoch the sampler draws (obs only)
        report = abt.diversity_report(
            abt.AnnBatchDataset(store, batch_size=cfg["batch_size"], seed=cfg["seed"],
                                sampler=_sampler("balanced", store) if kind == "balanced"
                                else None), "cell_type")
        out["entropy_ratio"] = float(report.loc["cell_type", "entropy_ratio"])
        return out

    what = ("ClassBalancedSampler('cell_type') (runs of 64 rows)" if kind == "balanced"
            else "chunked mode")
    case.__doc__ = (f"annbatch_torch on the collection written with group_by='cell_type', "
                    f"{what}, {'dense' if densify else 'torch CSR'}, num_workers={workers}.")
    case.prepare = _grouped_store  # type: ignore[attr-defined]  # (run before a cold twin)
    return case


def case_train_balanced(cfg: Config) -> Result:
    """The training effect of class balancing: a linear classifier on the log1p counts of
    64 random genes (few of each type's marker genes: a task a linear model does not
    solve outright), trained one epoch on an imbalanced subset of our collection (class
    sizes ~ 1/k^2.5, the smallest < 0.5%), with each row once (what chunked mode gives)
    or with rows weighted 1/class size (sampling mode); balanced accuracy on 300 held-out
    cells of each class."""
    import torch

    import annbatch_torch as abt
    from annbatch_torch import A

    codes = _store_codes(cfg["store"])
    n_classes = int(codes.max()) + 1
    rng = np.random.default_rng(cfg["seed"])
    by_class = [rng.permutation(np.flatnonzero(codes == k)) for k in range(n_classes)]
    order = np.argsort([-len(r) for r in by_class])
    held = np.concatenate([by_class[k][:300] for k in range(n_classes)])
    big = len(by_class[order[0]]) - 300
    subset = []
    for rank, k in enumerate(order):  # Zipf sizes, the largest class kept whole
        want = max(20, int(big / (rank + 1) ** 2.5))
        subset.append(by_class[k][300 : 300 + want])
    train = np.sort(np.concatenate(subset))
    counts = np.bincount(codes[train], minlength=n_classes)
    weights = np.zeros(len(codes))
    weights[train] = 1.0 / counts[codes[train]]
    samplers = {"each row once": abt.SubsetSampler(train),
                "class-balanced": abt.WeightedSampler(weights, num_samples=len(train))}
    out: Result = {"train_cells": len(train), "genes": 64,
                   "smallest_class_share": counts.min() / len(train), "modes": {}}
    genes = list(np.random.default_rng(1).choice(
        np.asarray(abt.open_collection(cfg["store"]).var_names), 64, replace=False))
    held_ds = abt.AnnBatchDataset(cfg["store"], selector={"x": A.X, "y": A.obs["cell_type"]},
                                  batch_size=4096, densify=True, var_names=genes, shuffle=False,
                                  sampler=abt.SubsetSampler(held, shuffle=False))
    for name, sampler in samplers.items():
        torch.manual_seed(0)
        ds = abt.AnnBatchDataset(cfg["store"], selector={"x": A.X, "y": A.obs["cell_type"]},
                                 batch_size=256, densify=True, sampler=sampler, seed=cfg["seed"],
                                 var_names=genes)
        model = torch.nn.Linear(len(genes), n_classes)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        t0 = time.perf_counter()
        for batch in ds:
            loss = torch.nn.functional.cross_entropy(model(torch.log1p(batch["x"])),
                                                     batch["y"].long())
            opt.zero_grad()
            loss.backward()
            opt.step()
        seconds = time.perf_counter() - t0
        pred, true = [], []
        with torch.no_grad():
            for batch in held_ds:
                pred.append(model(torch.log1p(batch["x"])).argmax(1).numpy())
                true.append(batch["y"].numpy())
        p, t = np.concatenate(pred), np.concatenate(true)
        recall = [float((p[t == k] == k).mean()) for k in range(n_classes)]
        out["modes"][name] = {"balanced_accuracy": float(np.mean(recall)),
                              "recall_smallest": recall[int(order[-1])],
                              "epoch_seconds": seconds}
    out["cells_per_s"] = None
    return out


# -- cold: the page cache dropped before the case ---------------------------------------
def drop_page_cache() -> str | None:
    """Drop Linux's page cache (``sync; echo 3 > /proc/sys/vm/drop_caches``); why not, or
    ``None`` when done (needs root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        return f"cannot drop the page cache ({e.strerror or e}); cold cases need root on Linux"
    return None


def _cold(name: str) -> Callable[[Config], Result]:
    warm = CASES[name]

    def case(cfg: Config) -> Result:
        # the first epoch only, from disk: no warm-up, no batch of a second epoch
        per_epoch = max(1, cfg["n_obs"] // cfg["batch_size"] - 1)
        cfg = dict(cfg, n_warmup=0, n_batches=min(cfg["n_batches"], per_epoch), seq_passes=1)
        prepare = getattr(warm, "prepare", None)
        if prepare is not None:  # e.g. a store of its own, written before the cache drop
            prepare(cfg)
        why = drop_page_cache()
        if why is not None:
            return {"status": "skipped", "reason": why}
        out = warm(cfg)
        out["cold"] = True
        return out

    case.__doc__ = (f"{' '.join((warm.__doc__ or name).split())} Cold: the page cache is "
                    "dropped first and only the first epoch's batches are timed.")
    return case


def case_ceiling_disk_cold(cfg: Config) -> Result:
    """The disk's cold sequential read bandwidth (one large input file, 8 MiB reads) divided
    by the collection's bytes per cell: the most cells/s any loader could read from disk on
    that layout."""
    big = max(cfg["paths"], key=lambda p: Path(p).stat().st_size)
    files = [f for f in Path(cfg["store"]).rglob("*") if f.is_file()]
    store_bytes = sum(f.stat().st_size for f in files)
    why = drop_page_cache()
    if why is not None:
        return {"status": "skipped", "reason": why}
    buf = bytearray(8 << 20)
    n = 0
    t0 = time.perf_counter()
    with open(big, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                break
            n += k
    seconds = time.perf_counter() - t0
    per_cell = store_bytes / cfg["n_obs"]
    return {"cells_per_s": n / seconds / per_cell, "seconds": seconds, "cold": True,
            "disk_mb_per_s": n / seconds / 2**20, "file_bytes": n,
            "store_bytes_per_cell": per_cell, "file": str(big)}


def case_ceiling_disk_parallel_cold(cfg: Config) -> Result:
    """The collection's files read cold by 16 threads at once (8 MiB reads, each file front
    to back): the disk's throughput with a deep queue, in cells/s of this layout (what a
    loader reading the whole store in parallel could reach)."""
    from concurrent.futures import ThreadPoolExecutor

    files = sorted(f for f in Path(cfg["store"]).rglob("*") if f.is_file())
    why = drop_page_cache()
    if why is not None:
        return {"status": "skipped", "reason": why}

    def read(path: Path) -> int:
        buf, n = bytearray(8 << 20), 0
        with open(path, "rb", buffering=0) as f:
            while True:
                k = f.readinto(buf)
                if not k:
                    return n
                n += k

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as ex:
        total = sum(ex.map(read, files))
    seconds = time.perf_counter() - t0
    per_cell = total / cfg["n_obs"]
    return {"cells_per_s": total / seconds / per_cell, "seconds": seconds, "cold": True,
            "disk_mb_per_s": total / seconds / 2**20, "store_bytes": total,
            "files": len(files)}


# -- registry ---------------------------------------------------------------------------
CASES: dict[str, Callable[[Config], Result]] = {
    "writer": case_writer,
    "writer_parallel": case_writer_parallel,
    "append": case_append,
    "append_alone": case_append_alone,
    "anndata_write": case_anndata_write,
    "ceiling_inmemory": case_ceiling_inmemory,
    "ceiling_seq_zarr": case_ceiling_seq_zarr,
    "ceiling_seq_zarrs": case_ceiling_seq_zarrs,
    "ceiling_seq_raw": case_ceiling_seq_raw,
    "ours_dense_w0": _make_ours(True, 0),
    "ours_dense_w2": _make_ours(True, 2),
    "ours_sparse_w0": _make_ours(False, 0),
    "ours_sparse_w2": _make_ours(False, 2),
    "ours_inplace_dense_w0": case_ours_inplace_dense_w0,
    "scdataset_w0": _make_scdataset(0),
    "scdataset_w2": _make_scdataset(2),
    "annloader_w0": _make_annloader(0),
    "annloader_w2": _make_annloader(2),
    "annbatch": case_annbatch,
    "memory": case_memory,
    **{f"ours_{kind}_{'dense' if d else 'sparse'}_w{w}": _make_sampling(kind, d, w)
       for kind in ("balanced", "weighted") for d in (False, True) for w in (0, 2)},
    **{f"ours_grouped_{kind}_{'dense' if d else 'sparse'}_w{w}": _make_grouped(kind, d, w)
       for kind in ("balanced", "chunked") for d in (False, True) for w in (0, 2)},
    **{f"ours_paired_{'dense' if d else 'sparse'}_w{w}": _make_paired(d, w)
       for d in (False, True) for w in (0, 2)},
    **{f"ours_mixed_{'dense' if d else 'sparse'}_w{w}": _make_mixed(d, w)
       for d in (False, True) for w in (0, 2)},
    "scdataset_balanced_w0": _make_scdataset(0, "balanced"),
    "scdataset_weighted_w0": _make_scdataset(0, "weighted"),
    "train_balanced": case_train_balanced,
    **EXPERIMENTS,
}
#: cases also run cold (``run.py --cold``) as ``<name>_cold``
COLD = ("ours_sparse_w0", "ours_dense_w0", "ours_sparse_w2", "ours_dense_w2", "annbatch",
        "ceiling_seq_raw", "exp_sparse_w0_threads8", "exp_sparse_w0_threads16",
        "exp_sparse_w0_io2", "exp_sparse_w0_chunk1024", "exp_sparse_w0_chunk2048",
        "ours_balanced_sparse_w0", "ours_grouped_balanced_sparse_w0",
        "ours_grouped_chunked_sparse_w0")
CASES.update({f"{n}_cold": _cold(n) for n in COLD})
CASES["ceiling_disk_cold"] = case_ceiling_disk_cold
CASES["ceiling_disk_parallel_cold"] = case_ceiling_disk_parallel_cold
COLD_CASES = (*(f"{n}_cold" for n in COLD), "ceiling_disk_cold", "ceiling_disk_parallel_cold")


def run_case(name: str, cfg: Config) -> Result:
    """Run case ``name``; failures become ``{"status": "failed", "error": ...}``."""
    t0 = time.perf_counter()
    try:
        out = CASES[name](cfg)
        out.setdefault("doc", " ".join((CASES[name].__doc__ or "").split()))
        out.setdefault("status", "ok")
    except Exception as e:
        out = {"status": "failed", "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc(limit=8)}
    out["case"] = name
    out["wall_seconds"] = time.perf_counter() - t0
    out.setdefault("main_peak_rss_mb", peak_rss_self_mb())
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``cases.py CASE CONFIG.json`` writes the result to ``config["result"]``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in CASES:
        print(f"usage: cases.py CASE CONFIG.json; cases: {', '.join(CASES)}", file=sys.stderr)
        return 2
    cfg = json.loads(Path(argv[1]).read_text())
    out = run_case(argv[0], cfg)
    Path(cfg["result"]).write_text(json.dumps(out, indent=1, default=float))
    return 0 if out["status"] != "failed" else 1


if __name__ == "__main__":
    raise SystemExit(main())
