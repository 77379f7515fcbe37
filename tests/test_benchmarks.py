"""Smoke test of the benchmark harness (``benchmarks/run.py``) at a tiny size, so it
cannot rot: every case, experiments included, runs (in one process, for speed), and one
case runs the real way, in its own subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "run.py"
TINY = ["--n-obs", "3000", "--n-vars", "200", "--batch-size", "256", "--n-batches", "3",
        "--n-warmup", "1", "--memory-epochs", "1", "--seq-passes", "1", "--quiet"]
LOADERS = ["ours_dense_w0", "ours_dense_w2", "ours_sparse_w0", "ours_sparse_w2",
           "ours_inplace_dense_w0", "scdataset_w0", "scdataset_w2", "annloader_w0",
           "ours_balanced_sparse_w0", "ours_weighted_dense_w2", "scdataset_balanced_w0",
           "ours_grouped_balanced_sparse_w0", "ours_paired_sparse_w0", "ours_paired_dense_w2",
           "ours_mixed_sparse_w0",
           "ceiling_inmemory", "ceiling_seq_raw", "ceiling_seq_zarr"]


def _run(tmp: Path, *extra: str) -> dict:
    cmd = [sys.executable, str(RUN), *TINY, "--data-dir", str(tmp / "data"),
           "--out", str(tmp / "out"), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp / "out" / "results.json").read_text())


@pytest.mark.timeout(180)
def test_every_case_runs_and_reports(tmp_path: Path) -> None:
    res = _run(tmp_path, "--in-process", "--experiments")
    cases = res["cases"]
    bad = {k: v.get("error") for k, v in cases.items()
           if v["status"] not in ("ok", "skipped", "unsupported")}
    assert not bad, bad
    for name in LOADERS:
        assert cases[name]["status"] == "ok", (name, cases[name])
        assert cases[name]["cells_per_s"] > 0
    for name in LOADERS[:-2]:
        assert 0.3 < cases[name]["quality"] <= 1.1, (name, cases[name]["quality"])
    exps = [n for n in cases if n.startswith("exp_")]
    assert len(exps) >= 10
    assert all(cases[n]["status"] == "ok" for n in exps), {n: cases[n] for n in exps}
    assert cases["annbatch"]["status"] in ("ok", "skipped")
    modes = cases["train_balanced"]["modes"]
    assert set(modes) == {"each row once", "class-balanced"}
    assert all(0 <= m["balanced_accuracy"] <= 1 for m in modes.values())
    assert cases["writer"]["status"] == "ok"
    assert cases["writer"]["seconds"] > 0
    assert len(cases["memory"]["epochs"]) == 2
    assert len(cases["ours_dense_w2"]["worker_peak_rss_mb"]) >= 1
    names = {t["target"] for t in res["targets"]}
    assert "shuffle quality >= 0.97" in names
    assert all(t["met"] is not None for t in res["targets"]), res["targets"]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "## Targets" in md
    assert "annbatch_torch dense, 2 workers" in md
    assert "## Training effect of class balancing" in md
    assert "sampling mode >= 0.5x chunked mode (sparse, warm)" in names
    assert "pairing (n_controls=1) >= 0.5x chunked mode (rows read, warm)" in names
    assert "mixing two collections 0.7/0.3 >= 0.9x chunked mode (warm)" in names
    assert cases["ours_mixed_sparse_w0"]["max_quota_deviation_rows"] < 1
    assert (tmp_path / "out" / "results.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(120)
def test_case_in_own_process_and_only_merges(tmp_path: Path) -> None:
    res = _run(tmp_path, "--only", "ceiling_inmemory")
    r = res["cases"]["ceiling_inmemory"]
    assert r["status"] == "ok"
    assert r["main_peak_rss_mb"] > 10  # measured in the case's own process
    res = _run(tmp_path, "--only", "annbatch")  # same configuration: results are merged
    assert set(res["cases"]) == {"ceiling_inmemory", "annbatch"}


def test_a_case_reports_its_own_peak_not_its_parents() -> None:
    """Linux carries a parent's ru_maxrss into a fork+exec'd child: every case started from
    a large parent reported the parent's peak (issue 18). The child here allocates nothing."""
    import numpy as np

    big = np.ones(400 * 2**20 // 8)  # ~400 MiB, touched: the parent's high-water mark
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
            "from benchlib import peak_rss_self_mb; print(peak_rss_self_mb())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert big.sum() > 0
    assert float(out) < 200, out  # an interpreter with numpy; the parent is above 400


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_the_main_process_own_memory_leaves_out_shared_memory_it_maps() -> None:
    """A DataLoader worker's pool memory is shared memory the main process maps to read
    batches by reference: resident in both, it is the worker's. The monitor reports the
    main process's own peak without it, and the kernel's high-water mark with it."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchlib import MemoryMonitor

    with MemoryMonitor(interval=0.05) as mon:
        shared = torch.ones(300 * 2**20 // 4).share_memory_()  # ~300 MiB, touched
        for _ in range(50):  # until a poll has seen it
            if mon.main_peak >= 300:
                break
            time.sleep(0.05)
    got = mon.summary()
    assert float(shared.sum()) > 0
    assert got["main_peak_rss_mb"] - got["main_peak_own_mb"] > 250, got


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/PID/stat")
def test_the_cpu_clock_counts_the_page_faults_of_fresh_memory_in_a_child() -> None:
    """``CpuClock`` counts the minor page faults of this process and of its children since
    it started: a child writing 16 MiB of fresh plain pages takes a fault per page."""
    import multiprocessing as mp

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchlib import CpuClock

    ctx = mp.get_context("fork")
    go, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_fault_pages, args=(16 << 20, go, done))
    child.start()
    try:
        clock = CpuClock()  # the child exists: its faults so far are left out
        go.set()
        assert done.wait(30)
        got = clock.read()
    finally:
        child.join(30)
    assert got["own_faults"] - got["main_faults"] >= (16 << 20) // 4096
    assert got["main_faults"] < (16 << 20) // 4096  # the parent wrote nothing


def _fault_pages(nbytes: int, go: Any, done: Any) -> None:
    from annbatch_torch.read.buffers import fresh_bytes

    go.wait(30)
    a = fresh_bytes(nbytes)  # plain pages (huge pages declined): one fault per 4 KiB
    a[:] = 1
    done.set()
    time.sleep(2)  # alive while the parent reads its counters


def test_the_raw_ceiling_times_every_pass_it_reads(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The cold case reads once after dropping the page cache: that read must be the timed
    one (an untimed first pass to touch the buffers would leave a warm read timed)."""
    import annbatch_torch as abt
    from annbatch_torch.datasets import write_synthetic_h5ads
    from annbatch_torch.store.rawzarr import RawZarrArray

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cases

    paths = write_synthetic_h5ads(tmp_path / "in", 2, [300, 200], 40, seed=1)
    store = tmp_path / "store"
    abt.create_anndata_collection(paths, store, n_obs_per_shard=256, progress=False)
    reads: list[int] = []
    real = RawZarrArray.read_into

    def counting(self: RawZarrArray, lo: int, hi: int, out: np.ndarray) -> None:
        reads.append(hi - lo)
        real(self, lo, hi, out)

    monkeypatch.setattr(RawZarrArray, "read_into", counting)
    for passes in (1, 3):
        reads.clear()
        r = cases.case_ceiling_seq_raw({"store": str(store), "seq_passes": passes})
        assert len(r["all_seconds"]) == passes
        assert len(reads) == passes * 3 * 2  # passes x (data, indices, indptr) x shards
        assert r["n_cells"] == 500


# 2,000 genes, not the real runs' 30,000: every child (generate, writer, open, the
# measurements) then builds and reads a smaller gene universe; nothing checked here
# depends on how many genes there are
GENES = "2000"


def _scale(tmp: Path, out: Path, sizes: str, only: str, *extra: str) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--sizes", sizes,
           "--n-inputs", "8", "--max-batches", "2", "--data-dir", str(tmp / "data"),
           "--n-genes", GENES, "--only", only, "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=380, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.with_suffix(".json").read_text())
    for r in res:
        errors = {k: v["error"] for k, v in r.items() if isinstance(v, dict) and "error" in v}
        assert not errors, errors
    return res


@pytest.mark.timeout(400)
def test_scale_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/scale.py at two tiny sizes: every measurement asked for reports figures
    (no child fails), the table carries an exponent per figure, the chart is drawn.

    Every measurement runs once, each in its own process (start-up costs, not the data,
    make this test's time): the writer and the open at two sizes (the exponents, the
    chart), kept; the others at the smaller size, reusing its kept atlas."""
    out = tmp_path / "scale"
    res = _scale(tmp_path, out, "3e3,6e3", "writer,open", "--keep")
    assert [r["n_obs"] for r in res] == [3000, 6000]
    for r in res:
        assert r["open"]["n_obs"] == r["n_obs"]
        assert r["writer"]["files"] > 0
    md = out.with_suffix(".md").read_text()
    assert "| writer.writer_s |" in md
    assert "exponent" in md
    assert out.with_suffix(".png").stat().st_size > 1000
    # warm epochs of the largest size alternated with each smaller one's, after the last
    # size (here the largest comes first: it is kept until then), on the kept atlases
    # (batches of 512: the epoch times those after the first 2)
    large, small, mid = _scale(tmp_path, tmp_path / "pairs", "6e3,2e3,3e3", "epoch_pairs",
                               "--epoch-pairs", "1", "--epoch-batch-size", "512", "--keep",
                               "--paired-batches", "8")
    assert "epoch_pairs" not in small
    assert "epoch_pairs" not in mid
    assert "writer" not in mid  # the kept collections were reused
    for key, n in (("epoch_pairs", 2000), ("epoch_pairs_vs_3000", 3000)):
        pairs = large[key]
        assert pairs["pairs"] == 1
        assert pairs["small_n_obs"] == n
        [a], [b] = pairs["small_cells_s_runs"], pairs["large_cells_s_runs"]
        assert pairs["ratio_median"] == pytest.approx(b / a)
        [a0] = pairs["small_cells_s_runs_starts_excluded"]
        assert pairs["ratio_median_starts_excluded"] > 0
        assert a0 > 0
        assert a0 != a  # the small side's epochs timed two ways
        assert 0 < pairs["small_store_mib"] < pairs["large_store_mib"]
    [r] = _scale(tmp_path, tmp_path / "one", "3e3", "resume,obs_names_at,samplers,append",
                 "--append-rounds", "1", "--append-cells", "400")
    assert set(r) >= {"resume", "obs_names_at", "samplers", "append"}
    assert r["append"]["n_obs_after"] == 3400  # into a copy: the kept collection unchanged
    assert r["append"]["append_vs_alone"] > 0
    assert r["append"]["append_vs_same_genes"] > 0
    assert "writer" not in r  # the kept collection was reused
    assert r["resume"]["chunked_state_dict_bytes"] > 0
    assert r["samplers"]["class_balanced_bind_peak_mb"] > 0
    assert r["obs_names_at"]["obs_names_at_10k_s"] > 0
    assert (tmp_path / "data" / f"atlas_6000_genes{GENES}" / "collection").exists()  # --keep
    assert not (tmp_path / "data" / f"atlas_3000_genes{GENES}").exists()  # removed
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [
        f"atlas_2000_genes{GENES}", f"atlas_6000_genes{GENES}"]  # kept by the pairs' --keep
    # without --keep, pairs keep every atlas until they have run, then remove them all
    _small, large = _scale(tmp_path, tmp_path / "pairs2", "2e3,6e3", "epoch_pairs",
                           "--epoch-pairs", "1", "--epoch-batch-size", "512",
                           "--paired-batches", "8")
    assert large["epoch_pairs"]["pairs"] == 1
    assert not any((tmp_path / "data").iterdir())


def test_fresh_pages_reports_each_kind_of_memory(tmp_path: Path) -> None:
    out = tmp_path / "fresh.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fresh_pages.py"),
                           "--mb", "8", "--rounds", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")
            for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"memory", "private, plain pages", "private, huge pages",
                         "shared (torch)", "shared, populated", "memfd, written", "reused"}
    faults = {k: int(v[4].rstrip(" |").replace(",", "")) for k, v in rows.items() if k != "memory"}
    assert faults["private, plain pages"] >= (8 << 20) // 4096  # a fault per page written
    assert faults["shared (torch)"] >= (8 << 20) // 4096
    assert faults["reused"] == 0
    assert faults["memfd, written"] == 0


@pytest.mark.timeout(170)
def test_handoff_reports_rates_cpu_and_page_faults(small_collection: Any, tmp_path: Path
                                                   ) -> None:
    """``benchmarks/handoff.py`` at a tiny size, in-process and through 2 workers, dense:
    every row of its table has a rate, a ratio, CPU and page faults per cell (the workers'
    are theirs, in-process has none)."""
    out = tmp_path / "handoff.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "handoff.py"),
                           str(small_collection.path), "--rounds", "1", "--batches", "2",
                           "--warmup", "1", "--loaders", "inproc,abt", "--layouts", "dense",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=160, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines()
            if line.startswith("| ") and "---" not in line and "best cells/s" not in line]
    assert [r[0].lstrip("| ") for r in rows] == ["in-process (the dataset)",
                                                "`AnnBatchDataLoader`"]
    for r in rows:
        assert float(r[3].replace(",", "")) > 0  # best cells/s
        assert float(r[6]) > 0  # CPU us per cell
        assert float(r[8]) >= 0  # page faults per cell
    assert float(rows[0][9]) == 0  # in-process: no worker faults
    assert "1 alternated rounds" in out.read_text()
