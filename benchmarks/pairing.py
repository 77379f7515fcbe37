"""Perturbation / control pairing against chunked mode and cell-load (issue 34 target).

Target: ``PairedSampler`` with ``n_controls=1`` reads at >= 0.5x chunked mode's cells/s,
counting perturbed + control rows, warm; compared with cell-load 0.10
(``PerturbationDataModule``) on the same data.

Usage::

    python benchmarks/pairing.py [--n-obs 100000] [--n-vars 2000] [--batch-size 256]
                                 [--n-batches 200] [--n-batches-cell-load 50]
                                 [--n-warmup 10] [--workers 0,2]
                                 [--cases ours_chunked,ours_paired,ours_paired_runs,
                                          cell_load,cell_load_h5py]
                                 [--rounds 1]
                                 [--cell-load-path DIR] [--sentence-len 64]
                                 [--data-dir benchmarks/data] [--out benchmarks/results/pairing]

Data: ``datasets.synthetic_screen(n_obs, n_vars, n_perturbations=20, n_cell_lines=2,
n_gem_groups=4, seed)`` (obs ``target_gene``, control ``"non-targeting"``, ``cell_line``,
``gem_group``; X float32 CSR counts) written as one h5ad per cell line
(``DATA/h5ad/<line>.h5ad``: cell-load's layout, a folder of files, one per cell type), and
our collection written from those files (``create_anndata_collection(paths, ...)``), in
``DATA/pairing_<n_obs>x<n_vars>_seed<seed>/`` (reused when present). Every file is read
once before the cases, so the page cache is warm.

Cases, each in a fresh Python process (this script with ``--case NAME CONFIG.json``),
``B = --batch-size`` perturbed rows per batch, ``w`` in ``--workers``:

* ``ours_chunked_w{w}``: ``AnnBatchDataset(collection, batch_size=2*B, densify=True)``
  through ``AnnBatchDataLoader(num_workers=w, persistent_workers=w > 0)``: the reference,
  the same rows per batch as a batch of pairs;
* ``ours_paired_w{w}``: the same with ``batch_size=B`` and ``PairedSampler("target_gene",
  "non-targeting", match=("cell_line", "gem_group"), n_controls=1)``; cells counted are the
  rows of ``x`` plus ``control_x``. The first batch is checked (each control shares its
  perturbed row's cell_line and gem_group, is a control, the perturbed rows are not), else
  the case fails. Both of our cases select ``x`` (X) and the codes of ``target_gene``,
  ``cell_line`` and ``gem_group``, so they read the same fields;
* ``ours_paired_runs_w{w}``: the same with ``PairedSampler(..., chunk_size=256)``: the
  perturbed rows of runs of 256 rows of the collection, the runs in a random order and the
  pairs mixed inside each pool (the controls are still read one by one);
* ``cell_load_w{w}``: cell-load's ``PerturbationDataModule`` over the h5ad folder (a TOML
  config naming it as a training dataset), ``embed_key=None`` (X as the features: with it
  ``pert_cell_emb`` / ``ctrl_cell_emb`` are dense X rows whatever ``output_space``),
  ``basal_mapping_strategy="batch"`` with ``batch_col="gem_group"`` (a control of the
  same gem_group, within the file: the same cell line), ``n_basal_samples=1``,
  ``should_yield_control_cells=False`` (batches of perturbed cells only, as ours),
  ``cell_sentence_len=--sentence-len`` and ``batch_size=round(B / sentence_len)``
  sentences, so a batch holds ~B perturbed cells; iterating ``dm.train_dataloader()``
  (its own DataLoader: ``num_workers=w``, ``prefetch_factor=4``, persistent workers).
  Cells counted are the rows of ``pert_cell_emb`` plus ``ctrl_cell_emb``. If cell_load
  cannot be imported the case is ``unsupported`` (with the reason); ``--cell-load-path``
  puts a folder holding the unpacked wheel (and ``toml``) first on the child's sys.path.
  cell-load opens its h5 files with a 64 MiB chunk cache of ``rdcc_nslots=1,000,003``
  (its default, ``CELL_LOAD_H5_RDCC_*``), which makes every h5py object lookup cost ~1 ms:
  one per row fetched, four more when the row is not in its LRU cache;
* ``cell_load_h5py_w{w}``: the same with ``h5_open_kwargs={}`` (h5py's default chunk cache):
  cell-load with that cost removed, for a fairer figure.

Each case: ``--n-warmup`` untimed batches, then ``--n-batches`` timed ones (across epoch
boundaries when needed; cell-load's cases ``--n-batches-cell-load``: it reads row by row, at
a steady rate, ~100x slower); cells/s, cells per CPU second (the case's process and its
workers), peak RSS of the process (VmHWM) and of its largest worker. ``uptime`` is
recorded before and after. With ``--rounds N`` every case runs N times (interleaved) and
the table shows the median.

Writes ``OUT.json`` and ``OUT.md``: the table, ours_paired / ours_chunked (best worker
count of each, and per worker count) against the 0.5x target, and ours_paired /
cell_load (and cell_load_h5py), with how cell-load was installed and configured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib import MemoryMonitor, peak_rss_self_mb, time_batches  # noqa: E402

CONTROL = "non-targeting"  # annbatch_torch.datasets.CONTROL (checked when data is made)
TARGET = 0.5
KINDS = ("ours_chunked", "ours_paired", "ours_paired_runs", "cell_load", "cell_load_h5py")
#: rows per run of the source in ``ours_paired_runs`` (``PairedSampler(chunk_size=...)``)
RUN = 256

Config = dict[str, Any]
Result = dict[str, Any]


# --- data ---------------------------------------------------------------------------------
def _data_folder(args: argparse.Namespace) -> Path:
    return Path(args.data_dir) / f"pairing_{args.n_obs}x{args.n_vars}_seed{args.seed}"


def make_data(args: argparse.Namespace) -> dict[str, Any]:
    """The h5ad files (one per cell line) and our collection of them, made once."""
    folder = _data_folder(args)
    meta_path = folder / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("n_perturbations") == args.n_perturbations:
            print(f"data: reusing {folder}", flush=True)
            return meta
        sys.exit(f"{folder} holds data of n_perturbations={meta.get('n_perturbations')}; "
                 "remove it or pass that value")
    import annbatch_torch as abt
    from annbatch_torch.datasets import CONTROL as control
    from annbatch_torch.datasets import synthetic_screen

    if control != CONTROL:
        sys.exit(f"annbatch_torch.datasets.CONTROL is {control!r}, this script expects "
                 f"{CONTROL!r}")
    h5_dir = folder / "h5ad"
    h5_dir.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    adata = synthetic_screen(args.n_obs, args.n_vars, n_perturbations=args.n_perturbations,
                             n_cell_lines=2, n_gem_groups=4, seed=args.seed)
    t_gen = time.perf_counter() - t
    t = time.perf_counter()
    paths, per_file = [], {}
    for line in adata.obs["cell_line"].cat.categories:
        sub = adata[(adata.obs["cell_line"] == line).to_numpy()].copy()
        path = h5_dir / f"{line}.h5ad"
        sub.write_h5ad(path)
        paths.append(str(path))
        per_file[str(line)] = {
            "n_obs": int(sub.n_obs),
            "controls": int((sub.obs["target_gene"] == CONTROL).sum()),
        }
    t_h5 = time.perf_counter() - t
    del adata
    t = time.perf_counter()
    store = folder / "collection"
    abt.create_anndata_collection(paths, store, progress=False, overwrite=True)
    t_coll = time.perf_counter() - t
    meta = {"folder": str(folder), "h5ad_dir": str(h5_dir), "paths": paths,
            "store": str(store), "n_obs": args.n_obs, "n_vars": args.n_vars,
            "n_perturbations": args.n_perturbations, "seed": args.seed, "files": per_file,
            "seconds": {"synthetic_screen": t_gen, "h5ad": t_h5, "collection": t_coll}}
    meta_path.write_text(json.dumps(meta, indent=1))
    print(f"data: made {folder} (generate {t_gen:.1f} s, h5ad {t_h5:.1f} s, collection "
          f"{t_coll:.1f} s)", flush=True)
    return meta


def warm_page_cache(meta: dict[str, Any]) -> float:
    """Read every file of the inputs and the collection once; returns the bytes read, MiB."""
    n = 0
    for root in (Path(meta["h5ad_dir"]), Path(meta["store"])):
        for p in sorted(root.rglob("*")):
            if p.is_file():
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 24):
                        n += len(chunk)
    return n / 2**20


# --- cases (run in a child process) -------------------------------------------------------
def _result(run: Any, mon: MemoryMonitor, **extra: Any) -> Result:
    out: Result = {
        "cells_per_s": run.cells_per_s, "n_cells": run.n_cells, "n_batches": run.n_batches,
        "seconds": run.seconds, "warmup_seconds": run.warmup_seconds,
        "cells_per_cpu_s": run.cells_per_cpu_s, "cpu": run.cpu,
    }
    out.update(mon.summary())
    out.update(extra)
    return out


def _ours(cfg: Config, paired: bool, runs: int | None = None) -> Result:
    import torch

    import annbatch_torch as abt
    from annbatch_torch import A

    b = int(cfg["batch_size"])
    workers = int(cfg["workers"])
    sel = {"x": A.X, "pert": A.obs["target_gene"], "line": A.obs["cell_line"],
           "gem": A.obs["gem_group"]}
    kw: dict[str, Any] = {}
    if paired:
        kw["sampler"] = abt.PairedSampler("target_gene", CONTROL,
                                          match=("cell_line", "gem_group"), n_controls=1,
                                          chunk_size=runs)
    ds = abt.AnnBatchDataset(cfg["store"], selector=sel, batch_size=b if paired else 2 * b,
                             densify=True, seed=int(cfg["seed"]), **kw)
    control_code = list(ds.source.categories("target_gene")).index(CONTROL)
    loader = abt.AnnBatchDataLoader(ds, num_workers=workers, persistent_workers=workers > 0)
    checked: dict[str, Any] = {}

    def check(batch: dict[str, Any]) -> None:
        x = batch["x"]
        if x.layout != torch.strided or x.dtype != torch.float32:
            raise TypeError(f"expected a dense float32 x, got {x.layout} {x.dtype}")
        if checked or not paired:
            return
        cx = batch["control_x"]
        if cx.shape != x.shape:
            raise AssertionError(f"control_x {tuple(cx.shape)} != x {tuple(x.shape)} with "
                                 "n_controls=1")
        bad = {k: int((batch[k] != batch[f"control_{k}"]).sum()) for k in ("line", "gem")}
        bad["perturbed rows that are controls"] = int((batch["pert"] == control_code).sum())
        bad["controls that are not controls"] = int(
            (batch["control_pert"] != control_code).sum())
        if any(bad.values()):
            raise AssertionError(f"first batch: pairing broken ({bad} of {x.shape[0]} rows)")
        checked.update(rows=int(x.shape[0]), mismatches=bad)

    def rows(batch: dict[str, Any]) -> int:
        n = int(batch["x"].shape[0])
        return n + int(batch["control_x"].shape[0]) if paired else n

    def epochs(e: int) -> Any:
        ds.set_epoch(e)
        return loader

    with MemoryMonitor() as mon:
        run = time_batches(epochs, n_warmup=int(cfg["n_warmup"]),
                           n_batches=int(cfg["n_batches"]), n_cells_of=rows, consume=check)
    return _result(run, mon, rows_per_batch=2 * b, chunk_size=ds.chunk_size,
                   preload_nchunks=ds.preload_nchunks, read_threads=ds.read_threads,
                   sampler=repr(kw.get("sampler")), first_batch_check=checked or None,
                   torch_threads=torch.get_num_threads())


def _import_cell_load(cfg: Config) -> tuple[Any, dict[str, Any]] | str:
    """``(PerturbationDataModule, info)`` or the reason it cannot be imported."""
    path = cfg.get("cell_load_path")
    if path:
        if not Path(path).is_dir():
            return f"--cell-load-path {path}: no such folder"
        sys.path.insert(0, str(path))
    try:
        from cell_load.data_modules import PerturbationDataModule
    except Exception as e:  # ImportError, or a dependency failing at import
        return f"import cell_load failed: {type(e).__name__}: {e}"
    import cell_load

    info: dict[str, Any] = {"module": str(Path(cell_load.__file__).parent),
                            "from_path": path or None}
    try:
        from importlib.metadata import version

        info["version"] = version("cell-load")
    except Exception:
        info["version"] = None
    return PerturbationDataModule, info


def _cell_load(cfg: Config, h5py_defaults: bool) -> Result:
    got = _import_cell_load(cfg)
    if isinstance(got, str):
        return {"status": "unsupported", "reason": got}
    module_cls, info = got
    import logging

    import torch

    logging.disable(logging.WARNING)  # its per-setup log lines; tqdm goes to stderr
    b = int(cfg["batch_size"])
    sentence = int(cfg["sentence_len"])
    n_sentences = max(1, round(b / sentence))
    toml_path = Path(cfg["tmp"]) / "cell_load.toml"
    toml_path.write_text(f'[datasets]\nscreen = "{cfg["h5ad_dir"]}"\n\n'
                         '[training]\nscreen = "train"\n')
    kwargs = dict(
        toml_config_path=str(toml_path), batch_size=n_sentences,
        num_workers=int(cfg["workers"]), random_seed=int(cfg["seed"]),
        pert_col="target_gene", batch_col="gem_group", cell_type_key="cell_line",
        control_pert=CONTROL, embed_key=None, output_space="gene",
        basal_mapping_strategy="batch", n_basal_samples=1,
        should_yield_control_cells=False, cell_sentence_len=sentence,
    )
    if h5py_defaults:  # {} passes its sanitising as is: h5py.File(path, "r")
        kwargs["h5_open_kwargs"] = {}
    np.random.seed(int(cfg["seed"]))  # noqa: NPY002  (its sampler shuffles with np.random)
    t = time.perf_counter()
    dm = module_cls(**kwargs)
    dm.setup()
    loader = dm.train_dataloader()
    t_setup = time.perf_counter() - t
    checked: dict[str, Any] = {}

    def check(batch: dict[str, Any]) -> None:
        if checked:
            return
        p, c = batch["pert_cell_emb"], batch["ctrl_cell_emb"]
        if p.shape != c.shape or p.ndim != 2 or p.shape[1] != int(cfg["n_vars"]):
            raise AssertionError(f"pert_cell_emb {tuple(p.shape)}, ctrl_cell_emb "
                                 f"{tuple(c.shape)}: expected (n, {cfg['n_vars']}) both")
        if p.dtype != torch.float32 or p.layout != torch.strided:
            raise TypeError(f"expected dense float32 rows, got {p.layout} {p.dtype}")
        names = set(map(str, batch["pert_name"]))
        if CONTROL in names:
            raise AssertionError("a control among the perturbed cells "
                                 "(should_yield_control_cells=False)")
        checked.update(rows=int(p.shape[0]), perturbations=len(names),
                       keys=sorted(batch))

    def rows(batch: dict[str, Any]) -> int:
        return int(batch["pert_cell_emb"].shape[0]) + int(batch["ctrl_cell_emb"].shape[0])

    with MemoryMonitor() as mon:
        run = time_batches(lambda e: loader, n_warmup=int(cfg["n_warmup"]),
                           n_batches=int(cfg["n_batches_cell_load"]), n_cells_of=rows,
                           consume=check)
    kwargs["toml_config_path"] = ("(a temporary file: [datasets] screen = DATA/h5ad; "
                                  "[training] screen = 'train')")
    return _result(run, mon, cell_load=info, kwargs=kwargs, setup_seconds=t_setup,
                   batches_per_epoch=len(loader), perturbed_per_batch=n_sentences * sentence,
                   first_batch_check=checked or None, torch_threads=torch.get_num_threads())


def run_case(name: str, cfg: Config) -> Result:
    kind = name.rsplit("_w", 1)[0]
    t = time.perf_counter()
    try:
        if kind in ("cell_load", "cell_load_h5py"):
            out = _cell_load(cfg, h5py_defaults=kind == "cell_load_h5py")
        elif kind in ("ours_chunked", "ours_paired", "ours_paired_runs"):
            out = _ours(cfg, paired=kind != "ours_chunked",
                        runs=RUN if kind == "ours_paired_runs" else None)
        else:
            raise ValueError(f"unknown case {name!r}")
        out.setdefault("status", "ok")
    except Exception as e:
        out = {"status": "failed", "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc(limit=8)}
    out.update(case=name, wall_seconds=time.perf_counter() - t)
    out.setdefault("main_peak_rss_mb", peak_rss_self_mb())
    return out


def child_main(name: str, cfg_path: str) -> int:
    cfg = json.loads(Path(cfg_path).read_text())
    cfg["workers"] = int(name.rsplit("_w", 1)[1])
    out = run_case(name, cfg)
    Path(cfg["result"]).write_text(json.dumps(out, indent=1, default=float))
    return 1 if out["status"] == "failed" else 0


# --- the driver ---------------------------------------------------------------------------
def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _spawn(name: str, cfg: Config, tmp: Path, timeout: float) -> Result:
    cfg = {**cfg, "result": str(tmp / f"{name}.json"), "tmp": str(tmp)}
    cfg_path = tmp / f"{name}.config.json"
    cfg_path.write_text(json.dumps(cfg))
    Path(cfg["result"]).unlink(missing_ok=True)
    log = tmp / f"{name}.log"
    t = time.perf_counter()
    try:
        with open(log, "w") as f:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--case",
                                   name, str(cfg_path)], stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout, cwd=str(HERE.parent))
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        return {"case": name, "status": "failed", "error": f"timed out after {timeout:.0f} s",
                "wall_seconds": time.perf_counter() - t}
    res = Path(cfg["result"])
    if res.exists():
        return json.loads(res.read_text())
    tail = log.read_text()[-2000:] if log.exists() else ""
    return {"case": name, "status": "failed", "error": f"exit status {rc}, no result",
            "log_tail": tail, "wall_seconds": time.perf_counter() - t}


def _fmt(v: float | None, spec: str = ".0f") -> str:
    return "" if v is None or (isinstance(v, float) and np.isnan(v)) else format(v, spec)


def _summarise(runs: list[Result]) -> Result:
    """The median round (by cells/s) of a case, with every round's cells/s."""
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return {**runs[-1], "rounds": len(runs)}
    ok.sort(key=lambda r: r["cells_per_s"])
    mid = ok[(len(ok) - 1) // 2]
    return {**mid, "cells_per_s": statistics.median(r["cells_per_s"] for r in ok),
            "rounds_cells_per_s": [r["cells_per_s"] for r in runs if r.get("status") == "ok"],
            "rounds": len(runs)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def report(args: argparse.Namespace, meta: dict[str, Any], cases: dict[str, Result],
           extra: dict[str, Any]) -> list[str]:
    b = args.batch_size
    rate = {n: r["cells_per_s"] for n, r in cases.items() if r.get("status") == "ok"}

    def best(kind: str) -> tuple[str | None, float | None]:
        got = [(n, v) for n, v in rate.items() if n.rsplit("_w", 1)[0] == kind]
        return max(got, key=lambda nv: nv[1]) if got else (None, None)

    n_ctrl = sum(f["controls"] for f in meta["files"].values())
    lines = [
        f"Run: {extra['started']}, code {extra['commit'] or '?'}, {os.cpu_count()} CPUs; "
        f"`{extra['command']}`.", "",
        f"Load (`uptime`) before: {extra['uptime_before']}; after: {extra['uptime_after']}.",
        "",
        f"Data: `synthetic_screen({args.n_obs:,}, {args.n_vars:,}, n_perturbations="
        f"{args.n_perturbations}, n_cell_lines=2, n_gem_groups=4, seed={args.seed})`, "
        f"{n_ctrl:,} controls; one h5ad per cell line "
        + ", ".join(f"{k} ({v['n_obs']:,} cells)" for k, v in meta["files"].items())
        + f" (X float32 CSR), and our collection of those files (`{meta['store']}`). "
        f"Warm: every file read once before the cases ({extra['warm_mib']:.0f} MiB), then "
        f"{args.n_warmup} untimed batches per case, then {args.n_batches} timed ones "
        f"({args.n_batches_cell_load} for cell-load's cases). "
        f"Batches of {b} perturbed cells + {b} controls (chunked: {2 * b} rows). "
        "cells/s counts perturbed + control rows. Each case in a fresh process"
        + (f", {args.rounds} rounds interleaved, the median shown" if args.rounds > 1 else "")
        + ".", "",
        "| case | status | cells/s | cells/CPU-s | rows/batch | peak RSS main MiB | "
        "largest worker RSS MiB | wall s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n, r in cases.items():
        status = r.get("status", "?")
        if status != "ok":
            why = r.get("reason") or r.get("error") or ""
            lines.append(f"| {n} | {status}: {why[:160]} | | | | | | "
                         f"{_fmt(r.get('wall_seconds'))} |")
            continue
        per_batch = r["n_cells"] / r["n_batches"] if r.get("n_batches") else None
        worker = max(r.get("worker_peak_rss_mb") or [0.0]) or None
        lines.append(
            f"| {n} | ok | {_fmt(r['cells_per_s'])} | {_fmt(r.get('cells_per_cpu_s'))} | "
            f"{_fmt(per_batch)} | {_fmt(r.get('main_peak_rss_mb'))} | {_fmt(worker)} | "
            f"{_fmt(r.get('wall_seconds'), '.1f')} |")
    lines += ["", "Ratios (cells/s):", "",
              "| ratio | value | target |", "|---|---:|---|"]
    ratios: dict[str, float | None] = {}
    pairs: dict[str, tuple[str | None, str | None]] = {}
    for mine in ("ours_paired", "ours_paired_runs"):
        bp, vp = best(mine)
        for other in ("ours_chunked", "cell_load", "cell_load_h5py"):
            bo, vo = best(other)
            key = f"{mine} / {other}, best of each"
            ratios[key] = _ratio(vp, vo)
            pairs[key] = (bp, bo)
            for w in args.workers:
                ratios[f"{mine} / {other}, w{w}"] = _ratio(
                    rate.get(f"{mine}_w{w}"), rate.get(f"{other}_w{w}"))
    for k, v in ratios.items():
        if v is None and not k.endswith("best of each"):
            continue
        target = ""
        if k.startswith(("ours_paired / ours_chunked", "ours_paired_runs / ours_chunked")):
            target = (f">= {TARGET}x: " + ("met" if v >= TARGET else "**not met**")
                      if v is not None else f">= {TARGET}x")
        a, o = pairs.get(k, (None, None))
        detail = f" ({a} / {o})" if a and o else ""
        lines.append(f"| {k}{detail} | {_fmt(v, '.2f')}{'x' if v is not None else ''} | "
                     f"{target} |")
    extra["ratios"] = ratios

    cl = next((r for n, r in cases.items() if n.startswith("cell_load")
               and r.get("status") == "ok"), None)
    cl_any = next((r for n, r in cases.items() if n.startswith("cell_load")), None)
    lines += ["", "cell-load:", ""]
    if cl is not None:
        info = cl["cell_load"]
        how = (f"the unpacked wheel put first on sys.path (`--cell-load-path "
               f"{info['from_path']}`)" if info.get("from_path") else "installed")
        kw = ", ".join(f"{k}={v!r}" for k, v in cl["kwargs"].items())
        sentence = cl["kwargs"]["cell_sentence_len"]
        lines += [
            f"* version {info.get('version') or '?'} from `{info['module']}`, {how}; its "
            "other dependencies (anndata, h5py, lightning, torch, toml) from this venv "
            "(scanpy, a declared dependency, is imported only by its `_cli` script).",
            f"* `PerturbationDataModule({kw})`; `dm.setup()` then `dm.train_dataloader()` "
            f"iterated (setup {cl['setup_seconds']:.2f} s, {cl['batches_per_epoch']} "
            "batches per epoch).",
            f"* A batch: `batch_size` = round({b} / {sentence}) sentences of "
            f"`cell_sentence_len` = {sentence} perturbed cells sharing cell line, gem_group "
            f"and perturbation (a group's last sentence filled up by drawing from the group "
            f"with replacement), {cl['perturbed_per_batch']} perturbed cells, each with one "
            "control (`ctrl_cell_emb`) of the same gem_group in its file; rows read one at a "
            "time from the h5ad (h5py, an LRU cache of 10,000 rows per process), densified "
            "per row, stacked by its collate_fn.",
            "* `cell_load`: its default h5 open (chunk cache of 64 MiB, `rdcc_nslots="
            "1,000,003`: each h5py object lookup costs ~1 ms, 1 per row fetched, 4 more when "
            "the row is not in its LRU cache); "
            "`cell_load_h5py`: the same with `h5_open_kwargs={}` (h5py's default cache).",
        ]
    elif cl_any is not None:
        lines.append(f"* {cl_any.get('status')}: {cl_any.get('reason') or cl_any.get('error')}")
    else:
        lines.append("* not run (`--cases`).")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--case"]:
        if len(argv) != 3:
            print("usage: pairing.py --case NAME CONFIG.json", file=sys.stderr)
            return 2
        return child_main(argv[1], argv[2])
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-obs", type=int, default=100_000)
    p.add_argument("--n-vars", type=int, default=2000)
    p.add_argument("--n-perturbations", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=256,
                   help="perturbed cells per batch (chunked mode: twice as many rows)")
    p.add_argument("--n-batches", type=int, default=200, help="timed batches per case")
    p.add_argument("--n-batches-cell-load", type=int, default=None,
                   help="timed batches of the cell-load cases (default: --n-batches, at most "
                        "50)")
    p.add_argument("--n-warmup", type=int, default=10, help="untimed batches first")
    p.add_argument("--workers", default="0,2", help="DataLoader num_workers values")
    p.add_argument("--cases", default=",".join(KINDS),
                   help=f"which of {', '.join(KINDS)}")
    p.add_argument("--rounds", type=int, default=1, help="runs of every case (median shown)")
    p.add_argument("--sentence-len", type=int, default=64, help="cell-load cell_sentence_len")
    p.add_argument("--cell-load-path", default=os.environ.get("CELL_LOAD_PATH"),
                   help="folder holding the cell_load package (and toml), put first on the "
                        "cell-load case's sys.path; default $CELL_LOAD_PATH, else installed")
    p.add_argument("--case-timeout", type=float, default=3600.0, help="seconds per case")
    p.add_argument("--data-dir", default=str(HERE / "data"))
    p.add_argument("--out", default=str(HERE / "results" / "pairing"),
                   help="writes OUT.md and OUT.json")
    args = p.parse_args(argv)
    args.workers = [int(w) for w in args.workers.split(",") if w.strip()]
    if args.n_batches_cell_load is None:
        args.n_batches_cell_load = min(args.n_batches, 50)
    kinds = [k.strip() for k in args.cases.split(",") if k.strip()]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        p.error(f"unknown cases {sorted(unknown)}; choose from {KINDS}")

    started = time.strftime("%Y-%m-%d %H:%M")
    uptime_before = _uptime()
    meta = make_data(args)
    warm = warm_page_cache(meta)
    cfg = {"store": meta["store"], "h5ad_dir": meta["h5ad_dir"], "n_vars": args.n_vars,
           "batch_size": args.batch_size, "n_batches": args.n_batches,
           "n_batches_cell_load": args.n_batches_cell_load,
           "n_warmup": args.n_warmup, "seed": args.seed, "sentence_len": args.sentence_len,
           "cell_load_path": args.cell_load_path}
    names = [f"{k}_w{w}" for w in args.workers for k in KINDS if k in kinds]
    runs: dict[str, list[Result]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="pairing_") as tmp:
        for r in range(args.rounds):
            for n in names:
                res = _spawn(n, cfg, Path(tmp), args.case_timeout)
                runs[n].append(res)
                status = res.get("status")
                what = (f"{res['cells_per_s']:,.0f} cells/s" if status == "ok"
                        else res.get("reason") or res.get("error"))
                print(f"[round {r + 1}/{args.rounds}] {n}: {status}: {what}", flush=True)
    cases = {n: _summarise(v) for n, v in runs.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    extra: dict[str, Any] = {
        "started": started, "commit": commit, "uptime_before": uptime_before,
        "uptime_after": _uptime(), "warm_mib": warm,
        "command": "python benchmarks/pairing.py " + " ".join(argv),
    }
    lines = [f"# Pairing vs chunked mode and cell-load (issue 34), {args.n_obs:,} x "
             f"{args.n_vars:,}", "", *report(args, meta, cases, extra)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md, js = Path(f"{out}.md"), Path(f"{out}.json")
    md.write_text("\n".join(lines) + "\n")
    payload = {"args": {k: v for k, v in vars(args).items()}, "data": meta, **extra,
               "cpu_count": os.cpu_count(), "cases": cases, "runs": runs}
    js.write_text(json.dumps(payload, indent=1, default=float))
    print("\n".join(lines))
    print(f"\nwrote {md} and {js}")
    return 1 if any(r.get("status") == "failed" for r in cases.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
