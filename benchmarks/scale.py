"""Atlas scale: the writer, opening, first batches, epochs, samplers, resume and append
measured at growing n_obs on many-input synthetic atlases (issue 31).

Usage::

    python benchmarks/scale.py [--sizes 1e5,1e6,1e7] [--n-inputs 100] [--data-dir DIR]
                               [--only writer,open,...] [--max-batches N]
                               [--max-batches-dense 200] [--append-rounds 5] [--keep]
                               [--n-genes N]
                               [--out benchmarks/results/scale]

For each size, ``datasets.write_synthetic_atlas`` writes the inputs (reused when present),
then every measurement runs in a fresh Python process (``--child``). ``--n-genes`` (default:
``write_synthetic_atlas``'s 30,000) shrinks the gene universe for smoke runs; such atlases
are kept in folders of their own (``atlas_{n}_genes{N}``), never taken for the default's.

* ``writer``: ``create_anndata_collection(inputs, var_join="outer")`` wall s, cells/s,
  VmHWM of the writing process against ``max_memory`` and the peak RSS of its largest
  child (Dask workers with ``scheduler="processes"``), peak extra disk on the collection's
  file system while it writes (inputs excluded), files and bytes per cell of the
  collection;
* ``open``: ``open_collection`` s (the import excluded) and VmRSS after it;
* ``first_batch``: construction of ``AnnBatchDataset`` to its first batch with 0 workers,
  and with 2 workers of a plain ``DataLoader(batch_size=None)`` (fork and spawn);
* ``epoch``: cells/s over the batches after the first 2, sparse and dense, 0 and 2 workers:
  a whole epoch when sparse (``--max-batches`` caps it; warm: the median of
  ``--epoch-repeats`` processes, 3), ``--max-batches-dense`` batches
  when dense (a whole 10^7-cell dense epoch through 2 workers would take ~10 minutes);
  warm (the collection read through first, when it fits in half the RAM) and cold (page
  cache dropped; root); peak RSS of the main process and of the largest worker;
* ``samplers``: ``ClassBalancedSampler("cell_type")`` and a 10% ``SubsetSampler``: bind
  seconds (construction with the sampler less without, both after a first construction)
  and traced peak memory (in a construction of its own);
* ``resume``: ``state_dict()`` bytes (pickled) after 5 batches (fewer in a collection of
  fewer), chunked and sampling mode,
  and the seconds from ``load_state_dict`` to the next batch in a new dataset;
* ``obs_names_at``: 10,000 random rows;
* ``epoch_pairs``: after the largest size is measured, ``--epoch-pairs`` rounds of warm
  sparse epochs with 0 workers, the smallest size and the largest alternated, each in a
  fresh process: their ratio from the same minutes (the target of 10^7 against 10^5); the
  sizes' own epoch figures are taken tens of minutes apart, across which this machine's
  speed drifts by more than the target's 10%. A side whose epoch is under 200 batches
  (10^5 cells: 23) is timed over as many epochs of one dataset (``set_epoch``) as make
  200, every batch after the first two of the run, each later epoch's start included
  (an epoch's cells/s is its cells over its whole time; the ratio with each epoch timed
  from its own third batch, which leaves out ~7% of a 10^5 epoch, its first pool load,
  is kept beside it as ``ratio_median_starts_excluded``); the largest is
  also paired with every other size (``epoch_pairs_vs_<n>``): an atlas that fits in the
  CPU's last-level cache (10^5 cells, ~105 MB, in the 480 MiB L3 of one host this ran
  on) is read warm from that cache, a larger one from memory (``benchmarks/page_cache_span.py``);
* ``append``: 100,000 new cells (one input, new cell types, genes in an order of its own;
  ``--append-cells``) appended to a copy of the collection made of hard links (the kept
  collection is not changed), against writing those cells alone, in their own gene order
  (``append_vs_alone``, the issue's comparison) and in the collection's
  (``append_vs_same_genes``: rows remapped and sorted as the append does them, which the
  write in their own order does not need, numba's start included): five of each
  (``--append-rounds``), alternated, each in a fresh process after ``os.sync()``, the
  medians compared (the collection must hold every gene of the new input: an outer join of
  100 inputs does from ~10^5 cells; a smaller one may not).

Writes ``OUT.json``, ``OUT.md`` (one column per size, the fitted log-log exponent of each
cost) and ``OUT.png`` (the costs against n_obs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from page_cache_span import l3_cache  # noqa: E402  (a sibling script)

SELECTOR = {"x": "X", "y": "obs/cell_type"}


# --- measurements, each run in a fresh process --------------------------------------------

def _vm(key: str) -> float:
    """VmHWM / VmRSS of this process in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _rss_monitor() -> tuple[dict[str, float], threading.Event]:
    """Peak RSS (MiB) of this process and of its largest child, and this process's own
    memory (``main_own_mb``: RSS less the shared memory it maps, e.g. the workers' pool
    memory it reads batches from by reference, resident in the workers and counted there),
    sampled every 0.1 s."""
    import psutil

    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from benchlib import own_rss_mb

    peaks = {"main_rss_mb": 0.0, "main_own_mb": 0.0, "worker_rss_mb": 0.0}
    stop = threading.Event()
    me = psutil.Process()

    def run() -> None:
        while not stop.is_set():
            try:
                peaks["main_rss_mb"] = max(peaks["main_rss_mb"], me.memory_info().rss / 2**20)
                peaks["main_own_mb"] = max(peaks["main_own_mb"], own_rss_mb() or 0.0)
                for c in me.children(recursive=True):
                    peaks["worker_rss_mb"] = max(peaks["worker_rss_mb"],
                                                 c.memory_info().rss / 2**20)
            except psutil.Error:
                pass
            stop.wait(0.1)

    threading.Thread(target=run, daemon=True).start()
    return peaks, stop


def task_generate(a: dict[str, Any]) -> dict[str, Any]:
    from annbatch_torch.datasets import write_synthetic_atlas

    kw = {"n_genes": a["n_genes"]} if a.get("n_genes") else {}
    t = time.perf_counter()
    write_synthetic_atlas(a["inputs"], a["n_obs"], a["n_inputs"], seed=0, progress=False, **kw)
    return {"generate_s": time.perf_counter() - t}


def _inputs(folder: str) -> list[str]:
    meta = json.loads((Path(folder) / "atlas.json").read_text())
    return [str(Path(folder) / r["path"]) for r in meta["inputs"]]


def task_writer(a: dict[str, Any]) -> dict[str, Any]:
    import annbatch_torch as abt

    kw: dict[str, Any] = {}
    if a.get("max_memory"):
        kw["max_memory"] = a["max_memory"]
    if a.get("scheduler"):
        kw.update(scheduler=a["scheduler"], n_workers=2)
    peaks, stop = _rss_monitor()  # Dask worker processes too
    os.sync()  # the inputs' or an earlier write's dirty pages are not this write's to flush
    t = time.perf_counter()
    abt.create_anndata_collection(_inputs(a["inputs"]), a["store"], var_join="outer",
                                  overwrite=True, progress=False, **kw)
    dt = time.perf_counter() - t
    stop.set()
    files = [p for p in Path(a["store"]).rglob("*") if p.is_file()]
    nbytes = sum(p.stat().st_size for p in files)
    params = __import__("inspect").signature(abt.create_anndata_collection).parameters
    return {"writer_s": dt, "writer_cells_s": a["n_obs"] / dt, "writer_vmhwm_mb": _vm("VmHWM"),
            "max_memory": str(a.get("max_memory") or params["max_memory"].default),
            "writer_worker_rss_mb": peaks["worker_rss_mb"],
            "files": len(files), "files_per_1e6_cells": len(files) / a["n_obs"] * 1e6,
            "bytes_per_cell": nbytes / a["n_obs"]}


def task_open(a: dict[str, Any]) -> dict[str, Any]:
    import annbatch_torch as abt

    rss0 = _vm("VmRSS")
    t = time.perf_counter()
    c = abt.open_collection(a["store"])
    dt = time.perf_counter() - t
    return {"open_s": dt, "open_rss_mb": _vm("VmRSS") - rss0, "n_obs": int(c.n_obs)}


def task_first_batch(a: dict[str, Any]) -> dict[str, Any]:
    import torch

    import annbatch_torch as abt

    t = time.perf_counter()
    ds = abt.AnnBatchDataset(a["store"], selector=SELECTOR, batch_size=4096)
    if a["workers"]:
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=a["workers"],
                                         multiprocessing_context=a["context"])
        next(iter(dl))
    else:
        next(iter(ds))
    return {"first_batch_s": time.perf_counter() - t}


def _store_bytes(store: Path) -> int:
    """Bytes of every file of a collection."""
    return sum(p.stat().st_size for p in store.rglob("*") if p.is_file())


def task_epoch(a: dict[str, Any]) -> dict[str, Any]:
    import torch

    import annbatch_torch as abt

    store = Path(a["store"])
    if a["cold"]:
        _drop_caches()
    else:
        size = _store_bytes(store)
        import psutil

        if size > psutil.virtual_memory().total / 2:
            return {"skipped": f"{size / 2**30:.1f} GiB do not stay in the page cache"}
        for p in store.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    while f.read(1 << 24):
                        pass
    peaks, stop = _rss_monitor()
    ds = abt.AnnBatchDataset(store, selector=SELECTOR, batch_size=a.get("batch_size", 4096),
                             densify=a["dense"])
    # a plain DataLoader densifies dense batches as they arrive (torch then holds those it
    # puts back in order); AnnBatchDataLoader densifies them once they are in order
    loader = abt.AnnBatchDataLoader if a.get("abt_loader") else torch.utils.data.DataLoader
    source = ds if not a["workers"] else loader(ds, batch_size=None, num_workers=a["workers"])
    # several epochs (a small atlas's pairs): ``cells_s`` times every batch after the
    # run's first two, each later epoch's start included, as a user's epochs run one after
    # another; ``cells_s_starts_excluded`` times each epoch from its own third batch (what
    # the pairs timed before 2026-12-07: each epoch's first pool load left out)
    n = n_all = timed = 0
    dt = 0.0
    t_run = None
    for epoch in range(a.get("epochs", 1)):
        ds.set_epoch(epoch)
        it = iter(source)
        k = 0
        t = time.perf_counter()
        for b in it:
            k += 1
            if k == 2:
                t = time.perf_counter()
                t_run = t if t_run is None else t_run
            elif k > 2:
                n += b["x"].shape[0]
            if k > 2 or (epoch > 0 and t_run is not None):
                n_all += b["x"].shape[0]
            if a["max_batches"] is not None and k >= a["max_batches"] + 2:
                break
        dt += time.perf_counter() - t
        timed += max(k - 2, 0)
        del it
    t_end = time.perf_counter()
    stop.set()
    whole = n_all / (t_end - t_run) if t_run is not None and t_end > t_run else None
    return {"cells_s": whole if a.get("epochs", 1) > 1 else n / dt,
            "cells_s_starts_excluded": n / dt if dt else None, "batches": timed, **peaks}


def task_samplers(a: dict[str, Any]) -> dict[str, Any]:
    import tracemalloc

    import numpy as np

    import annbatch_torch as abt

    def make_ds(**kw: Any) -> float:
        t = time.perf_counter()
        abt.AnnBatchDataset(a["store"], selector=SELECTOR, batch_size=4096, **kw)
        return time.perf_counter() - t

    make_ds()  # one-time costs (imports, the first open) out of both figures
    plain = make_ds()
    out: dict[str, Any] = {}
    n = a["n_obs"]
    rows = np.sort(np.random.default_rng(0).choice(n, size=n // 10, replace=False))
    for name, make in (("class_balanced", lambda: abt.ClassBalancedSampler("cell_type")),
                       ("subset_10pct", lambda: abt.SubsetSampler(rows))):
        out[f"{name}_bind_s"] = max(0.0, make_ds(sampler=make()) - plain)
        tracemalloc.start()  # memory in a run of its own: tracing slows Python down
        make_ds(sampler=make())
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        out[f"{name}_bind_peak_mb"] = peak / 2**20
        out[f"{name}_bytes_per_row"] = peak / n
    return out


def task_resume(a: dict[str, Any]) -> dict[str, Any]:
    import pickle

    import annbatch_torch as abt

    out: dict[str, Any] = {}
    for mode, kw in (("chunked", {}),
                     ("sampling", {"sampler": abt.ClassBalancedSampler("cell_type")})):
        ds = abt.AnnBatchDataset(a["store"], selector=SELECTOR, batch_size=4096, **kw)
        it = iter(ds)
        for _ in range(min(5, len(ds) - 1)):  # mid-epoch, also in a small collection
            next(it)
        sd = ds.state_dict()
        del it
        out[f"{mode}_state_dict_bytes"] = len(pickle.dumps(sd))
        new = abt.AnnBatchDataset(a["store"], selector=SELECTOR, batch_size=4096, **kw)
        t = time.perf_counter()
        new.load_state_dict(sd)
        next(iter(new))
        out[f"{mode}_resume_s"] = time.perf_counter() - t
    return out


def task_obs_names_at(a: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    import annbatch_torch as abt

    src = abt.open_source(a["store"])
    k = min(10_000, a["n_obs"])  # fewer in a smoke run's tiny collection
    rows = np.random.default_rng(1).choice(a["n_obs"], size=k, replace=False)
    t = time.perf_counter()
    names = src.obs_names_at(rows)
    dt = time.perf_counter() - t
    assert len(names) == k
    return {"obs_names_at_10k_s": dt}


def task_append_input(a: dict[str, Any]) -> dict[str, Any]:
    from annbatch_torch.datasets import write_synthetic_atlas

    cells = int(a["append_cells"])
    new = Path(a["store"]).parent / ("append_input" if cells == 100_000
                                     else f"append_input_{cells}")
    if not (new / "atlas.json").exists():
        kw = {"n_genes": a["n_genes"]} if "n_genes" in a else {}
        write_synthetic_atlas(new, cells, 1, seed=99, n_cell_types=600, progress=False, **kw)
    return {"paths": _inputs(str(new))}


def task_write_alone(a: dict[str, Any]) -> dict[str, Any]:
    """The appended input written alone: in its own gene order (the issue's comparison:
    no gene remap, so no compiled loop), or with ``genes="collection"`` in the
    collection's (its rows remapped and sorted as the append does them)."""
    import annbatch_torch as abt

    alone = Path(a["store"]).parent / "append_alone"
    same = a.get("genes") == "collection"
    kw: dict[str, Any] = ({"var_names": list(abt.open_collection(a["store"]).var_names)}
                          if same else {"var_join": "outer"})
    os.sync()  # earlier writes' dirty pages are not this write's to flush
    t = time.perf_counter()
    abt.create_anndata_collection(a["paths"], alone, overwrite=True, progress=False, **kw)
    dt = time.perf_counter() - t
    shutil.rmtree(alone, ignore_errors=True)
    return {"write_1e5_same_genes_s" if same else "write_1e5_alone_s": dt}


def task_append(a: dict[str, Any]) -> dict[str, Any]:
    import annbatch_torch as abt

    # into a copy made of hard links: an append writes new shard folders and replaces
    # manifest.json by a rename, never a file of the collection, so the kept one stays as
    # it was (and this measurement can be run again)
    copy = Path(a["store"]).parent / "collection_append"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(a["store"], copy, copy_function=os.link)
    try:
        os.sync()
        t = time.perf_counter()
        abt.append_to_collection(copy, a["paths"], progress=False)
        dt = time.perf_counter() - t
        n = abt.open_collection(copy).n_obs
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    return {"append_1e5_s": dt, "n_obs_after": n}


TASKS = {name[5:]: fn for name, fn in globals().items() if name.startswith("task_")}


# --- the driver ---------------------------------------------------------------------------

def _child(task: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", task, json.dumps(args)],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else
                f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _disk_peak(path: Path, stop: threading.Event, out: dict[str, float]) -> None:
    base = shutil.disk_usage(path).used
    peak = base
    while not stop.is_set():
        peak = max(peak, shutil.disk_usage(path).used)
        stop.wait(0.25)
    out["writer_peak_extra_disk_gb"] = (peak - base) / 1e9


def _atlas_name(n: int, args: argparse.Namespace) -> str:
    return f"atlas_{n}" if not args.n_genes else f"atlas_{n}_genes{args.n_genes}"


def measure_size(n: int, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    folder = args.data_dir / _atlas_name(n, args)
    inputs, store = folder / "inputs", folder / "collection"
    a = {"n_obs": n, "n_inputs": min(args.n_inputs, n), "inputs": str(inputs),
         "store": str(store)}
    if args.n_genes:
        a["n_genes"] = args.n_genes
    a["append_cells"] = args.append_cells
    res: dict[str, Any] = {"n_obs": n, "n_inputs": a["n_inputs"]}
    only = set(args.only.split(",")) if args.only else None

    def want(name: str) -> bool:
        return only is None or name in only

    def run(task: str, key: str | None = None, timeout: float = 7200, **extra: Any) -> None:
        t = time.perf_counter()
        r = _child(task, {**a, **extra}, timeout)
        label = key or task
        res[label] = r
        log(f"  {n:,} {label}: {json.dumps(r)} ({time.perf_counter() - t:.0f} s)")

    if not (inputs / "atlas.json").exists():
        run("generate")
    if want("writer") or not (store / "manifest.json").exists():
        stop, disk = threading.Event(), {}
        th = threading.Thread(target=_disk_peak, args=(folder, stop, disk), daemon=True)
        th.start()
        run("writer")
        stop.set()
        th.join()
        res["writer"].update(disk)
        if args.max_memory:
            run("writer", "writer_max_memory", max_memory=args.max_memory)
    if want("open"):
        run("open")
    if want("first_batch"):
        run("first_batch", "first_batch_w0", workers=0, context=None)
        for ctx in ("fork", "spawn"):
            run("first_batch", f"first_batch_w2_{ctx}", workers=2, context=ctx)
    if want("epoch"):
        for cold in (False, True):
            if cold and os.geteuid() != 0:
                continue
            for dense in (False, True):
                for workers in (0, 2):
                    if cold and (dense or workers):  # cold: sparse, 0 workers
                        continue
                    key = (f"epoch_{'cold' if cold else 'warm'}_"
                           f"{'dense' if dense else 'sparse'}_w{workers}")
                    # warm sparse epochs (the 10^7-vs-10^5 target) as the median of
                    # --epoch-repeats fresh processes: a 10^5 epoch is 23 batches
                    reps = args.epoch_repeats if not (cold or dense) else 1
                    runs = []
                    for _ in range(reps):
                        run("epoch", key, cold=cold, dense=dense, workers=workers,
                            max_batches=args.max_batches_dense if dense else args.max_batches)
                        runs.append(res[key])
                    ok = sorted((r for r in runs if "cells_s" in r), key=lambda r: r["cells_s"])
                    if ok:
                        res[key] = {**ok[len(ok) // 2], "repeats": len(ok)}
                    if dense and workers and not cold:
                        run("epoch", f"{key}_abt_loader", cold=False, dense=True,
                            workers=workers, max_batches=args.max_batches_dense,
                            abt_loader=True)
    if want("samplers"):
        run("samplers")
    if want("resume"):
        run("resume")
    if want("obs_names_at"):
        run("obs_names_at")
    if want("parallel_writer") and n == args.parallel_at:
        for sched in ("threads", "processes"):
            run("writer", f"writer_{sched}", scheduler=sched,
                store=str(folder / f"collection_{sched}"))
            shutil.rmtree(folder / f"collection_{sched}", ignore_errors=True)
    if want("append"):  # each in a fresh process, append and writing alone alternated:
        # the median of each (a 10^5 write is 2-4 s, where one run's noise is 10-20%: the
        # fsync of its ~110 MB, the disk's pace)
        paths = _child("append_input", a, 3600).get("paths")
        alone, appended, same = [], [], []
        for _ in range(args.append_rounds):
            alone.append(_child("write_alone", {**a, "paths": paths}, 3600))
            run("append", paths=paths)
            appended.append(res["append"])
            same.append(_child("write_alone", {**a, "paths": paths, "genes": "collection"},
                               3600))
        # each side's runs that ended (a failed child reports an error, kept beside)
        times = sorted(x["write_1e5_alone_s"] for x in alone if "write_1e5_alone_s" in x)
        same_times = sorted(x["write_1e5_same_genes_s"] for x in same
                            if "write_1e5_same_genes_s" in x)
        ok = sorted((r for r in appended if "append_1e5_s" in r),
                    key=lambda r: r["append_1e5_s"])
        errors = [x["error"] for x in (*alone, *appended, *same) if "error" in x]

        def median(xs: list[float]) -> float:
            return xs[len(xs) // 2] if xs else float("nan")

        res["append"] = {**(ok[len(ok) // 2] if ok else appended[-1]), "repeats": len(ok),
                         "append_1e5_s_runs": [r["append_1e5_s"] for r in ok],
                         "write_1e5_alone_s_runs": times,
                         "write_1e5_alone_s": median(times),
                         "write_1e5_same_genes_s_runs": same_times,
                         "write_1e5_same_genes_s": median(same_times)}
        if errors:
            res["append"]["failed_runs"] = errors
        appended_s = res["append"].get("append_1e5_s", float("nan"))
        res["append"]["append_vs_alone"] = appended_s / median(times)
        # the append's own cost: against the same cells written alone in the same layout
        res["append"]["append_vs_same_genes"] = appended_s / median(same_times)
        log(f"  {n:,} append: writing alone {times}, in the collection's genes {same_times}")
    return res


#: batches of 4096 timed at least on each side of a pair (several epochs of a small atlas)
PAIRED_BATCHES = 200


def paired_epochs(small: int, large: int, args: argparse.Namespace,
                  log: Any) -> dict[str, Any]:
    """Warm sparse epochs with 0 workers of the atlases of ``small`` and ``large`` cells,
    alternated, each in a fresh process: the large one's cells/s over the small one's, per
    pair and their median."""
    import numpy as np

    runs: dict[int, list[float]] = {small: [], large: []}
    excl: dict[int, list[float]] = {small: [], large: []}
    # an epoch of the small atlas is a few batches (23 of 4096 at 10^5: 0.2 s, whose rate
    # swings by 30% run to run): epochs of it are timed until they make --paired-batches
    per_epoch = {n: max(1, min(n // args.epoch_batch_size - 2,
                               args.max_batches or n)) for n in (small, large)}
    for _ in range(args.epoch_pairs):
        for n in (small, large):
            store = args.data_dir / _atlas_name(n, args) / "collection"
            t = time.perf_counter()
            r = _child("epoch", {"n_obs": n, "store": str(store), "cold": False,
                                 "dense": False, "workers": 0,
                                 "max_batches": args.max_batches,
                                 "epochs": -(-args.paired_batches // per_epoch[n]),
                                 "batch_size": args.epoch_batch_size}, 7200)
            log(f"  {n:,} epoch_pairs: {json.dumps(r)} ({time.perf_counter() - t:.0f} s)")
            if not r.get("cells_s"):  # (none timed: under 3 batches)
                return {"error": f"{n:,} cells: {r.get('error') or r.get('skipped') or r}"}
            runs[n].append(r["cells_s"])
            excl[n].append(r["cells_s_starts_excluded"])
    ratios = [b / a for a, b in zip(runs[small], runs[large])]
    ratios_excl = [b / a for a, b in zip(excl[small], excl[large])]
    # what decides whether a warm epoch reads from the CPU's cache or from memory
    mb = {n: _store_bytes(args.data_dir / _atlas_name(n, args) / "collection") / 2**20
          for n in (small, large)}
    return {"small_n_obs": small, "small_cells_s_runs": runs[small],
            "large_cells_s_runs": runs[large], "pairs": len(ratios),
            "ratio_median": float(np.median(ratios)),
            # each epoch timed from its third batch: its start (first pool load) left out
            "small_cells_s_runs_starts_excluded": excl[small],
            "ratio_median_starts_excluded": float(np.median(ratios_excl)),
            "small_store_mib": mb[small], "large_store_mib": mb[large], "l3": l3_cache()}


def _flat(res: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, val in res.items():
        if isinstance(val, dict):
            for k, v in val.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"{key}.{k}"] = float(v)
    return out


def report(results: list[dict[str, Any]], out: Path) -> None:
    import numpy as np

    sizes = [r["n_obs"] for r in results]
    flats = [_flat(r) for r in results]
    keys = list(dict.fromkeys(k for f in flats for k in f))
    lines = ["| figure | " + " | ".join(f"{n:,}" for n in sizes) + " | exponent |",
             "|---|" + "---:|" * (len(sizes) + 1)]
    exps: dict[str, float] = {}
    for k in keys:
        vals = [f.get(k) for f in flats]
        ok = [(n, v) for n, v in zip(sizes, vals) if v is not None and v > 0]
        exp = ""
        if len(ok) >= 2:
            e = float(np.polyfit(np.log([n for n, _ in ok]), np.log([v for _, v in ok]), 1)[0])
            exps[k] = e
            exp = f"{e:.2f}"
        cells = ["" if v is None else (f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}")
                 for v in vals]
        lines.append(f"| {k} | " + " | ".join(cells) + f" | {exp} |")
    md = (f"# Atlas scale (benchmarks/scale.py)\n\n{time.strftime('%Y-%m-%d %H:%M')}, "
          f"load {os.getloadavg()[0]:.2f} at the end, L3 cache {l3_cache()}. Exponent: "
          f"slope of log(figure) on "
          f"log(n_obs) (1 = linear for totals; 0 = flat for rates and per-cell costs).\n\n"
          + "\n".join(lines) + "\n")
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    if len(sizes) >= 2:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plot = ["writer.writer_s", "open.open_s", "first_batch_w0.first_batch_s",
                "first_batch_w2_fork.first_batch_s", "obs_names_at.obs_names_at_10k_s",
                "samplers.class_balanced_bind_s", "resume.chunked_resume_s",
                "append.append_1e5_s"]
        fig, ax = plt.subplots(figsize=(7, 5))
        for k in plot:
            pts = [(n, f[k]) for n, f in zip(sizes, flats) if f.get(k)]
            if len(pts) >= 2:
                ax.plot(*zip(*pts), marker="o", label=f"{k} (exponent {exps.get(k, 0):.2f})")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("cells (n_obs)")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    print(md)


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] == "--child":
        print(json.dumps(TASKS[sys.argv[2]](json.loads(sys.argv[3]))))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1e5,1e6")
    p.add_argument("--n-inputs", type=int, default=100)
    p.add_argument("--data-dir", type=Path, default=HERE / "data" / "scale")
    p.add_argument("--only", default=None, help="comma-separated measurements")
    p.add_argument("--max-batches", type=int, default=None,
                   help="cap of a sparse epoch (default: the whole epoch)")
    p.add_argument("--max-batches-dense", type=int, default=200)
    p.add_argument("--epoch-repeats", type=int, default=3,
                   help="fresh processes per warm sparse epoch; the median is kept")
    p.add_argument("--epoch-pairs", type=int, default=3,
                   help="rounds of warm sparse epochs alternating the smallest and the "
                        "largest size (0: none)")
    p.add_argument("--paired-batches", type=int, default=PAIRED_BATCHES,
                   help="batches timed at least on each side of a pair (fewer for smoke runs)")
    p.add_argument("--epoch-batch-size", type=int, default=4096,
                   help="batch size of the paired epochs (smaller for smoke runs)")
    p.add_argument("--max-memory", default=None, help="also write with this max_memory")
    p.add_argument("--parallel-at", type=float, default=1e6)
    p.add_argument("--append-rounds", type=int, default=5,
                   help="appends and lone writes alternated (the medians compared)")
    p.add_argument("--append-cells", type=int, default=100_000,
                   help="cells of the appended input (the figures keep their 1e5 names)")
    p.add_argument("--keep", action="store_true", help="keep each size's data")
    p.add_argument("--n-genes", type=int, default=None,
                   help="genes of the synthetic atlases (default: write_synthetic_atlas's, "
                        "30,000; smaller for smoke runs)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "scale")
    args = p.parse_args()
    args.parallel_at = int(args.parallel_at)
    if args.append_rounds < 1 or args.append_cells < 1:
        p.error("--append-rounds and --append-cells must be at least 1")
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    print(f"load average at the start: {os.getloadavg()[0]:.2f}", flush=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    only = set(args.only.split(",")) if args.only else None
    # the smaller atlases are kept until the largest one's epochs are paired with each of
    # theirs: with the smallest (the target's 10^5), and with every other one (a 10^5
    # atlas, ~105 MB, fits in a large CPU cache and reads faster warm than any atlas that
    # does not: benchmarks/page_cache_span.py; pairs within one memory tier show scaling)
    pairs = (len(set(sizes)) > 1 and args.epoch_pairs > 0
             and (only is None or "epoch_pairs" in only))
    large = max(sizes)
    smaller = sorted(set(sizes) - {large})
    results = []
    for i, n in enumerate(sizes):
        results.append(measure_size(n, args, log))
        last = i == len(sizes) - 1
        if pairs and last:
            done = next(r for r in results if r["n_obs"] == large)
            for small in smaller:
                key = "epoch_pairs" if small == smaller[0] else f"epoch_pairs_vs_{small}"
                done[key] = paired_epochs(small, large, args, log)
        report(results, args.out)
        if not args.keep and (last or not pairs):  # pairs: every atlas kept until then
            for m in sorted(set(sizes)) if pairs else [n]:
                shutil.rmtree(args.data_dir / _atlas_name(m, args), ignore_errors=True)


if __name__ == "__main__":
    main()
