"""Turn the per-case results into ``results.json``, ``results.md`` and ``results.png``.

All comparisons are ratios of figures measured in the same run (same machine, same page
cache state), never against numbers from elsewhere.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["LABELS", "derive", "targets", "write_markdown", "write_plot", "write_all"]

GIB = 1024.0  # MiB per GiB

#: case -> (group, label) in display order
LABELS: dict[str, tuple[str, str]] = {
    "ours_dense_w0": ("ours", "annbatch_torch dense, 0 workers"),
    "ours_dense_w2": ("ours", "annbatch_torch dense, 2 workers"),
    "ours_sparse_w0": ("ours", "annbatch_torch torch-CSR, 0 workers"),
    "ours_sparse_w2": ("ours", "annbatch_torch torch-CSR, 2 workers"),
    "ours_inplace_dense_w0": ("ours", "annbatch_torch in place on grouped h5ad, dense, 0 w."),
    "scdataset_w0": ("peer", "scDataset block shuffling, in-process"),
    "scdataset_w2": ("peer", "scDataset block shuffling, 2 workers"),
    "annloader_w0": ("peer", "AnnLoader (backed h5ad), in-process"),
    "annloader_w2": ("peer", "AnnLoader (backed h5ad), 2 workers"),
    "annbatch": ("peer", "scverse annbatch"),
    **{f"ours_{k}_{m}_w{w}": ("sampling", f"annbatch_torch {what}, {desc}, {w} workers")
       for k, what in (("balanced", "ClassBalancedSampler"), ("weighted", "WeightedSampler"))
       for m, desc in (("sparse", "torch-CSR"), ("dense", "dense")) for w in (0, 2)},
    **{f"ours_grouped_{k}_{m}_w{w}": ("sampling", f"annbatch_torch group_by collection, {what}, "
                                                  f"{desc}, {w} workers")
       for k, what in (("balanced", "ClassBalancedSampler runs"), ("chunked", "chunked"))
       for m, desc in (("sparse", "torch-CSR"), ("dense", "dense")) for w in (0, 2)},
    **{f"ours_paired_{m}_w{w}": ("sampling", f"annbatch_torch PairedSampler (n_controls=1), "
                                             f"{desc}, {w} workers")
       for m, desc in (("sparse", "torch-CSR"), ("dense", "dense")) for w in (0, 2)},
    **{f"ours_mixed_{m}_w{w}": ("sampling", f"annbatch_torch mix() of two collections "
                                            f"0.7/0.3, {desc}, {w} workers")
       for m, desc in (("sparse", "torch-CSR"), ("dense", "dense")) for w in (0, 2)},
    "scdataset_balanced_w0": ("sampling", "scDataset ClassBalancedSampling, in-process"),
    "scdataset_weighted_w0": ("sampling", "scDataset BlockWeightedSampling, in-process"),
    "ceiling_inmemory": ("ceiling", "ceiling: CSR in RAM, random rows + toarray"),
    "ceiling_seq_zarr": ("ceiling", "ceiling: front-to-back read of our store (zarr)"),
    "ceiling_seq_zarrs": ("ceiling", "ceiling: front-to-back read of our store (zarrs)"),
    "ceiling_seq_raw": ("ceiling", "ceiling: front-to-back read of our store (our raw reader)"),
}
#: cold cases (run.py --cold): the page cache dropped first, the first epoch timed
LABELS.update({f"{n}_cold": (g, f"{label}, cold") for n, (g, label) in list(LABELS.items())
               if n in ("ours_sparse_w0", "ours_dense_w0", "ours_sparse_w2", "ours_dense_w2",
                        "annbatch", "ceiling_seq_raw", "ours_balanced_sparse_w0",
                        "ours_grouped_balanced_sparse_w0", "ours_grouped_chunked_sparse_w0")})
LABELS["ceiling_disk_cold"] = ("ceiling", "ceiling: the disk's cold sequential read / the "
                               "collection's bytes per cell")
LABELS["ceiling_disk_parallel_cold"] = ("ceiling", "ceiling: the collection's files read cold "
                                        "by 16 threads")
_OURS_COLLECTION = ("ours_dense_w0", "ours_dense_w2", "ours_sparse_w0", "ours_sparse_w2")


def _ok(cases: dict[str, Any], name: str) -> dict[str, Any] | None:
    r = cases.get(name)
    return r if r is not None and r.get("status") == "ok" else None


def _rate(cases: dict[str, Any], *names: str,
          key: str = "cells_per_s") -> tuple[float | None, str | None]:
    """Best ``key`` (cells/s) among ``names`` that succeeded, and which case it was."""
    best: tuple[float | None, str | None] = (None, None)
    for n in names:
        r = _ok(cases, n)
        rate = r.get(key) if r is not None else None
        if rate and (best[0] is None or rate > best[0]):
            best = (float(rate), n)
    return best


def derive(results: dict[str, Any]) -> None:
    """Add ``quality`` (entropy / random entropy) to every loader case, in place."""
    h_rand = results.get("random_entropy")
    for r in results["cases"].values():
        h = r.get("entropy")
        if h is not None and h_rand:
            r["quality"] = h / h_rand


def _target(name: str, value: float | None, goal: float, *, higher: bool, fmt: str,
            detail: str, cpu_value: float | None = None) -> dict[str, Any]:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        met = None
    else:
        met = value >= goal if higher else value <= goal
    return {"target": name, "value": value, "goal": goal, "higher_is_better": higher,
            "met": met, "fmt": fmt, "detail": detail, "cpu_value": cpu_value}


def _vs_chunked_cold(c: dict[str, Any], name: str, case: str, goal: float) -> list[dict]:
    """A cold case against chunked mode's cold sparse epoch (none when either is missing)."""
    got, _ = _rate(c, case)
    base, _ = _rate(c, "ours_sparse_w0_cold")
    if got is None or base is None:
        return []
    return [_target(name, got / base, goal, higher=True, fmt="{:.2f}x",
                    detail=f"{case} / ours_sparse_w0_cold")]


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured figure and met / missed."""
    c = results["cases"]
    dense, dense_case = _rate(c, "ours_dense_w0", "ours_dense_w2")
    sparse, sparse_case = _rate(c, "ours_sparse_w0", "ours_sparse_w2")
    scd, scd_case = _rate(c, "scdataset_w0", "scdataset_w2")
    inmem, _ = _rate(c, "ceiling_inmemory")
    seq, seq_case = _rate(c, "ceiling_seq_zarr", "ceiling_seq_zarrs", "ceiling_seq_raw")

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def cpu_ratio(a: str | None, b: str | None) -> float | None:
        ra, rb = _ok(c, a or ""), _ok(c, b or "")
        if ra is None or rb is None:
            return None
        return ratio(ra.get("cells_per_cpu_s"), rb.get("cells_per_cpu_s"))

    out = [
        _target("dense >= 4x scDataset", ratio(dense, scd), 4.0, higher=True, fmt="{:.2f}x",
                detail=f"best ours dense ({dense_case}) / best scDataset ({scd_case})",
                cpu_value=cpu_ratio(dense_case, scd_case)),
        _target("dense >= 0.85x in-memory ceiling", ratio(dense, inmem), 0.85, higher=True,
                fmt="{:.2f}x", detail=f"{dense_case} / ceiling_inmemory",
                cpu_value=cpu_ratio(dense_case, "ceiling_inmemory")),
        _target("sparse >= 8x scDataset", ratio(sparse, scd), 8.0, higher=True, fmt="{:.2f}x",
                detail=f"best ours torch-CSR ({sparse_case}) / best scDataset ({scd_case})",
                cpu_value=cpu_ratio(sparse_case, scd_case)),
        _target("sparse >= 0.9x front-to-back read of our store", ratio(sparse, seq), 0.9,
                higher=True, fmt="{:.2f}x", detail=f"{sparse_case} / {seq_case}",
                cpu_value=cpu_ratio(sparse_case, seq_case)),
    ]
    cold, cold_case = _rate(c, "ours_sparse_w0_cold", "ours_sparse_w2_cold")
    disk, _ = _rate(c, "ceiling_disk_cold")
    if cold is not None or disk is not None:
        out.append(_target("cold sparse >= 0.8x the disk ceiling of the layout",
                           ratio(cold, disk), 0.8, higher=True, fmt="{:.2f}x",
                           detail=f"{cold_case} / ceiling_disk_cold"))
    deep, _ = _rate(c, "ceiling_disk_parallel_cold")
    if cold is not None and deep is not None:
        out.append(_target("cold sparse >= 0.8x the store read cold by 16 threads",
                           ratio(cold, deep), 0.8, higher=True, fmt="{:.2f}x",
                           detail=f"{cold_case} / ceiling_disk_parallel_cold"))
    sampled, sampled_case = _rate(c, *(n for n in c if n.startswith(("ours_balanced_sparse",
                                                                    "ours_weighted_sparse"))
                                       and not n.endswith("_cold")))
    if sampled is not None:
        out.append(_target("sampling mode >= 0.5x chunked mode (sparse, warm)",
                           ratio(sampled, sparse), 0.5, higher=True, fmt="{:.2f}x",
                           detail=f"best sampling torch-CSR ({sampled_case}) / best chunked "
                           f"torch-CSR ({sparse_case})",
                           cpu_value=cpu_ratio(sampled_case, sparse_case)))
        bal, bal_case = _rate(c, "ours_balanced_sparse_w0", "ours_balanced_sparse_w2",
                              "ours_balanced_dense_w0", "ours_balanced_dense_w2")
        scd_bal, _ = _rate(c, "scdataset_balanced_w0")
        out.append(_target("class-balanced >= 4x scDataset's ClassBalancedSampling",
                           ratio(bal, scd_bal), 4.0, higher=True, fmt="{:.2f}x",
                           detail=f"best ours class-balanced ({bal_case}) / "
                           "scdataset_balanced_w0",
                           cpu_value=cpu_ratio(bal_case, "scdataset_balanced_w0")))
    if sampled is not None:  # issue 33: sampling at the speed of chunked reading
        out.append(_target("sampling mode >= 0.8x chunked mode (sparse, warm)",
                           ratio(sampled, sparse), 0.8, higher=True, fmt="{:.2f}x",
                           detail=f"{sampled_case} / {sparse_case}"))
        out += _vs_chunked_cold(c, "class-balanced cold >= 0.6x chunked mode cold",
                                "ours_balanced_sparse_w0_cold", 0.6)
    grouped, grouped_case = _rate(c, "ours_grouped_balanced_sparse_w0",
                                  "ours_grouped_balanced_sparse_w2")
    if grouped is not None:
        out.append(_target("group_by: class-balanced >= 0.9x chunked mode (warm)",
                           ratio(grouped, sparse), 0.9, higher=True, fmt="{:.2f}x",
                           detail=f"{grouped_case} / {sparse_case}"))
        out += _vs_chunked_cold(c, "group_by: class-balanced cold >= 0.9x chunked mode cold",
                                "ours_grouped_balanced_sparse_w0_cold", 0.9)
        scd_bal, _ = _rate(c, "scdataset_balanced_w0")
        out.append(_target("group_by: class-balanced >= 4x scDataset's ClassBalancedSampling",
                           ratio(grouped, scd_bal), 4.0, higher=True, fmt="{:.2f}x",
                           detail=f"{grouped_case} / scdataset_balanced_w0"))
        q = (c.get(grouped_case) or {}).get("entropy_ratio")
        out.append(_target("group_by: per-batch entropy >= 0.9x random batches",
                           q, 0.9, higher=True, fmt="{:.3f}",
                           detail=f"{grouped_case}: diversity_report's entropy_ratio (random "
                           "batches of the epoch the sampler draws)"))
    paired, paired_case = _rate(c, "ours_paired_sparse_w0", "ours_paired_sparse_w2")
    if paired is not None:  # issue 34: pairs at half chunked mode's speed or better
        out.append(_target("pairing (n_controls=1) >= 0.5x chunked mode (rows read, warm)",
                           ratio(paired, sparse), 0.5, higher=True, fmt="{:.2f}x",
                           detail=f"{paired_case} / {sparse_case}"))
    mixed, mixed_case = _rate(c, "ours_mixed_sparse_w0", "ours_mixed_sparse_w2")
    if mixed is not None:  # issue 34: mixing collections at chunked mode's speed
        out.append(_target("mixing two collections 0.7/0.3 >= 0.9x chunked mode (warm)",
                           ratio(mixed, sparse), 0.9, higher=True, fmt="{:.2f}x",
                           detail=f"{mixed_case} / {sparse_case}"))
        r = c[mixed_case]
        dev = max(abs(a - b) for a, b in zip(r["shares"], (0.7, 0.3)))
        out.append(_target("mixing: realised shares within 1% of the weights", dev, 0.01,
                           higher=False, fmt="{:.4f}",
                           detail=f"{mixed_case}: shares {r['shares']} over the timed "
                           "and warm-up batches"))
        out.append(_target("mixing: per-batch counts within 1 row of the quota",
                           r.get("max_quota_deviation_rows"), 1.0, higher=False,
                           fmt="{:.2f}", detail=f"{mixed_case}: the largest |count - "
                           "batch_size x weight| of a full batch"))
    qual = [c[n]["quality"] for n in _OURS_COLLECTION if _ok(c, n) and "quality" in c[n]]
    out.append(_target("shuffle quality >= 0.97", min(qual) if qual else None, 0.97,
                       higher=True, fmt="{:.3f}",
                       detail="lowest of the four collection cases"))
    w = _ok(c, "writer")
    base = _ok(c, "anndata_write")
    if w is not None and w.get("max_memory_bytes"):
        peak = max([w["main_peak_rss_mb"], *w.get("worker_peak_rss_mb", [])])
        lim = w["max_memory_bytes"] / 2**20
        out.append(_target("writer peak RSS <= max_memory", peak / lim, 1.0, higher=False,
                           fmt="{:.2f}x",
                           detail=f"{peak:,.0f} MiB peak / {lim:,.0f} MiB max_memory"))
    else:
        out.append(_target("writer peak RSS <= max_memory", None, 1.0, higher=False,
                           fmt="{:.2f}x", detail="writer did not run or has no max_memory"))
    out.append(_target(
        "writer >= 0.5x anndata read+write speed",
        ratio(base["seconds"], w["seconds"]) if w and base else None, 0.5, higher=True,
        fmt="{:.2f}x", cpu_value=cpu_ratio("writer", "anndata_write"),
        detail=(f"anndata {base['seconds']:.1f} s / writer {w['seconds']:.1f} s"
                if w and base else "writer or baseline did not run")))
    mains = {n: _main_own_mb(c[n]) for n in (*_OURS_COLLECTION, "memory") if _ok(c, n)}
    top = max(mains, key=mains.__getitem__) if mains else None
    out.append(_target(
        "main process <= 1.5 GiB", mains[top] / GIB if top else None, 1.5, higher=False,
        fmt="{:.2f} GiB",
        detail=("highest main-process peak over our collection cases, of its own memory: "
                "RSS less the workers' shared pool memory it maps to read their batches "
                "(resident in the workers, counted there), polled every 0.25 s (a sampled "
                "peak: a spike between two polls is missed)"
                + (f"; {top}: the kernel's high-water mark with the shared memory "
                   f"{c[top]['main_peak_rss_mb']:,.0f} MiB"
                   if top and mains[top] < 0.95 * c[top]["main_peak_rss_mb"] else ""))))
    workers = [x for n in ("ours_dense_w2", "ours_sparse_w2", "memory") if _ok(c, n)
               for x in c[n].get("worker_peak_rss_mb", [])]
    out.append(_target("each worker <= 1 GiB", max(workers) / GIB if workers else None, 1.0,
                       higher=False, fmt="{:.2f} GiB",
                       detail="highest worker peak RSS (shared copy-on-write pages included)"))
    m = _ok(c, "memory")
    growth = max(m["main_growth"], m["worker_growth"]) if m else None
    n_ep = len(m["epochs"]) - 1 if m else 5
    out.append(_target(f"RSS growth over {n_ep} epochs < 5%",
                       100 * growth if growth is not None else None, 5.0, higher=False,
                       fmt="{:+.1f}%", detail="max of main and worker RSS growth, end of epoch "
                       f"{n_ep} vs end of epoch 0" if m else "memory case did not run"))
    return out


def _f(v: Any, fmt: str = "{:,.0f}") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v)


def _met(t: dict[str, Any]) -> str:
    return {True: "met", False: "**missed**", None: "not measured"}[t["met"]]


def target_table(tgts: list[dict[str, Any]]) -> list[str]:
    """Markdown lines of the targets table."""
    lines = ["| target | measured | status | per CPU-second | how |", "|---|---|---|---|---|"]
    for t in tgts:
        lines.append(f"| {t['target']} | {_f(t['value'], t['fmt'])} | {_met(t)} | "
                     f"{_f(t.get('cpu_value'), t['fmt'])} | {t['detail']} |")
    return lines


def write_markdown(results: dict[str, Any], path: Path) -> None:
    """Write ``results.md``: loaders, writer, memory and targets tables."""
    cfg, c = results["config"], results["cases"]
    scd, _ = _rate(c, "scdataset_w0")
    lines = [
        "# Benchmark results",
        "",
        f"{cfg['n_obs']:,} cells x {cfg['n_vars']:,} genes, CSR float32, "
        f"{results.get('nnz_per_cell', 0):,.0f} non-zeros per cell, two h5ad files grouped by "
        f"cell type; batch size {cfg['batch_size']:,}; {cfg['n_batches']} timed batches after "
        f"{cfg['n_warmup']} warm-up batches; machine: {results['machine']['summary']}.",
        f"Run: {results.get('started', '?')}, code {results['machine'].get('git', '?')}. "
        "Shuffle quality = mean per-batch entropy of "
        f"cell_type / that of truly random batches ({_f(results.get('random_entropy'), '{:.3f}')}"
        " nats). *cells per CPU-s*: cells per CPU second of the loader's process and its "
        "workers (steadier than cells/s when the machine is shared). *peak RSS main*: the "
        "kernel's high-water mark; *(own N)*: the main process's own memory (RSS less the "
        "workers' shared pool memory it maps to read their batches by reference, resident "
        "in the workers and counted there), polled every 0.25 s. *others' CPU*: share of "
        f"the machine's {results['machine']['cpu_count']} CPUs used by other processes while "
        "the case was timed (0% = a quiet machine; wall-clock figures measured above ~10% are "
        f"depressed). Each figure is the best of {results.get('repeat', 1)} round(s).",
        "",
        "| loader | cells/s | vs scDataset in-process | cells per CPU-s | peak RSS main (MiB) | "
        "peak RSS of a worker (MiB) | shuffle quality | others' CPU | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (_, label) in LABELS.items():
        r = c.get(name)
        if r is None:
            continue
        if r.get("status") != "ok":
            why = r.get("reason") or r.get("error") or r.get("status")
            lines.append(f"| {label} | - | - | - | - | - | - | - | {r['status']}: {_short(why)} |")
            continue
        rate = r.get("cells_per_s")
        wk = (r.get("worker_peak_rss_mb") or [])[:1]
        notes = []
        if "pipeline" in r:
            notes.append(f"{r.get('mb_per_s', 0):,.0f} MiB/s of data+indices")
        if "chunk_size" in r:
            notes.append(f"chunk {r['chunk_size']}, pool {r['preload_nchunks']} chunks")
        if "block_size" in r:
            notes.append(f"block {r['block_size']}, fetch_factor {r['fetch_factor']}")
        lines.append(
            f"| {label} | {_f(rate)} | {_f(rate / scd if rate and scd else None, '{:.2f}x')} "
            f"| {_f(r.get('cells_per_cpu_s'))} "
            f"| {_main_cell(r)} | {', '.join(_f(x) for x in wk) or '-'} | "
            f"{_f(r.get('quality'), '{:.3f}')} | "
            f"{_f((r.get('cpu') or {}).get('others_share'), '{:.0%}')} | {'; '.join(notes)} |"
        )
    w, base = c.get("writer"), c.get("anndata_write")
    lines += ["", "## Writer", "", "| writer | seconds | cells/s | peak RSS (MiB) | notes |",
              "|---|---|---|---|---|"]
    if w is not None:
        if w.get("status") == "ok":
            lay = w.get("layout", {})
            lines.append(
                f"| create_anndata_collection | {w['seconds']:.1f} | {_f(w['cells_per_s'])} | "
                f"{_f(w['main_peak_rss_mb'])} | max_memory={w.get('max_memory')}, "
                f"{w['n_shards']} shards, {w['store_mb']:,.0f} MiB on disk"
                + (f" ({w['bytes_per_cell']:,.0f} bytes per cell), {w['files']:,} files "
                   f"({w['files_per_million_cells']:,.0f} per 10^6 cells)" if "files" in w
                   else "")
                + f", X/data chunks {lay.get('X_data_chunks')} shards "
                f"{lay.get('X_data_shards')} |")
        else:
            lines.append(f"| create_anndata_collection | - | - | - | {w['status']}: "
                         f"{_short(w.get('error') or w.get('reason'))} |")
    if base is not None and base.get("status") == "ok":
        lines.append(
            f"| anndata: read_h5ad x2 + concat + write_zarr | {base['seconds']:.1f} | "
            f"{_f(base['cells_per_s'])} | {_f(base['main_peak_rss_mb'])} | read "
            f"{base['read_seconds']:.1f} s |")
    m = c.get("memory")
    if m is not None and m.get("status") == "ok":
        lines += ["", f"## Memory over {len(m['epochs']) - 1} epochs after the first "
                  "(dense, 2 persistent workers)",
                  "", "| epoch | main RSS (MiB) | worker RSS (MiB) | worker USS (MiB) |",
                  "|---|---|---|---|"]
        for e in m["epochs"]:
            lines.append(f"| {e['epoch']} | {_f(e['main_rss_mb'])} | "
                         f"{', '.join(_f(x) for x in e['worker_rss_mb'])} | "
                         f"{', '.join(_f(x) for x in e['worker_uss_mb'])} |")
        lines.append(f"\nGrowth, end of epoch {len(m['epochs']) - 1} vs end of epoch 0: main "
                     f"{100 * m['main_growth']:+.1f}%, workers "
                     f"{100 * m['worker_growth']:+.1f}% (RSS), "
                     f"{100 * m['worker_uss_growth']:+.1f}% (USS); vs end of epoch 1: main "
                     f"{100 * m.get('main_growth_from_epoch1', float('nan')):+.1f}%, workers "
                     f"{100 * m.get('worker_growth_from_epoch1', float('nan')):+.1f}%.")
    exps = {n: r for n, r in c.items() if n.startswith("exp_")}
    if exps:
        base = {"dense_w0": "ours_dense_w0", "dense_w2": "ours_dense_w2",
                "sparse_w0": "ours_sparse_w0", "sparse_w2": "ours_sparse_w2"}
        lines += ["", "## Experiments (candidate fast paths, through public hooks)", "",
                  "| experiment | cells/s | vs same-mode baseline | cells per CPU-s | vs baseline "
                  "per CPU-s | peak RSS main (MiB) | peak RSS of a worker (MiB) | others' CPU | "
                  "what |", "|---|---|---|---|---|---|---|---|---|"]
        for n, r in exps.items():
            key = "_".join(n.split("_")[1:3])
            b = _ok(c, base.get(key, ""))
            if r.get("status") != "ok":
                lines.append(f"| {n} | - | - | - | - | - | - | - | {r.get('status')}: "
                             f"{_short(r.get('error') or r.get('reason'))} |")
                continue
            rel = r["cells_per_s"] / b["cells_per_s"] if b else None
            cpu = r.get("cells_per_cpu_s")
            rel_cpu = cpu / b["cells_per_cpu_s"] if b and cpu and b.get("cells_per_cpu_s") else None
            wk = (r.get("worker_peak_rss_mb") or [])[:1]
            lines.append(f"| {n} | {_f(r['cells_per_s'])} | {_f(rel, '{:.2f}x')} | "
                         f"{_f(cpu)} | {_f(rel_cpu, '{:.2f}x')} | "
                         f"{_f(r.get('main_peak_rss_mb'))} | "
                         f"{', '.join(_f(x) for x in wk) or '-'} | "
                         f"{_f((r.get('cpu') or {}).get('others_share'), '{:.0%}')} | "
                         f"{_short(r.get('doc', ''), 120)} |")
    t = _ok(c, "train_balanced")
    if t is not None:
        lines += ["", "## Training effect of class balancing", "",
                  f"{' '.join((t.get('doc') or '').split())} Training cells: "
                  f"{t['train_cells']:,} (smallest class {t['smallest_class_share']:.2%}).", "",
                  "| rows of the epoch | balanced accuracy | recall of the smallest class | "
                  "epoch seconds |", "|---|---|---|---|"]
        for mode, r in t["modes"].items():
            lines.append(f"| {mode} | {r['balanced_accuracy']:.3f} | "
                         f"{r['recall_smallest']:.3f} | {r['epoch_seconds']:.1f} |")
    lines += ["", "## Targets", ""]
    if any(t["met"] is None for t in results["targets"]):
        lines += ["Some targets need cases this run did not include (run without `--only`).",
                  ""]
    lines += [*target_table(results["targets"]), ""]
    path.write_text("\n".join(lines))


def _main_cell(r: dict[str, Any]) -> str:
    """Peak RSS of the main process, and its own memory where the workers' shared pool
    memory it maps made the RSS larger."""
    own = _main_own_mb(r)
    total = r.get("main_peak_rss_mb")
    if total is None or own >= 0.95 * total:  # nothing worth a word mapped beside
        return _f(total)
    return f"{_f(total)} (own {_f(own)})"


def _main_own_mb(r: dict[str, Any]) -> float:
    """A case's main-process peak of its own memory (MiB): the polled peak of RSS less the
    shared memory it maps, where measured and below the kernel's RSS high-water mark;
    else that high-water mark."""
    own = r.get("main_peak_own_mb")
    return min(own, r["main_peak_rss_mb"]) if own else r["main_peak_rss_mb"]


def _short(s: Any, n: int = 160) -> str:
    s = " ".join(str(s).split()).replace("|", "/")
    return s if len(s) <= n else s[: n - 3] + "..."


def write_plot(results: dict[str, Any], path: Path) -> None:
    """Horizontal bar chart of cells/s per case (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ours": "#1f77b4", "peer": "#ff7f0e", "ceiling": "#7f7f7f", "sampling": "#2ca02c"}
    rows = [(label, float(results["cases"][n]["cells_per_s"]), colors[g])
            for n, (g, label) in LABELS.items()
            if _ok(results["cases"], n) and results["cases"][n].get("cells_per_s")]
    if not rows:
        return
    rows.reverse()
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    ax.barh([r[0] for r in rows], [r[1] for r in rows], color=[r[2] for r in rows])
    top = max(r[1] for r in rows)
    for i, (_, v, _) in enumerate(rows):
        ax.text(v + top * 0.01, i, f"{v:,.0f}", va="center", fontsize=8)
    cfg = results["config"]
    ax.set_xlabel("cells / s (higher is better)")
    ax.set_xlim(0, top * 1.15)
    ax.set_title(f"{cfg['n_obs']:,} x {cfg['n_vars']:,} CSR, batch {cfg['batch_size']:,}, "
                 f"{results['machine']['cpu_count']} CPUs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(results: dict[str, Any], out: Path) -> None:
    """Derive ratios and targets, then write the JSON, markdown and PNG under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    derive(results)
    results["targets"] = targets(results)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    write_markdown(results, out / "results.md")
    write_plot(results, out / "results.png")
