"""Measurement helpers shared by the benchmark cases (no project imports here).

* :class:`MemoryMonitor` polls the RSS of this process and of every child process (the
  DataLoader workers) in a background thread and keeps per-process peaks; the true peak
  of this process comes from the kernel's high-water mark of this process image
  (``VmHWM``, see :func:`peak_rss_self_mb`).
* :func:`time_batches` drives any batch iterator: a few warm-up batches, then a fixed
  number of timed batches, collecting the labels of each timed batch.
* :func:`batch_entropy` / :func:`random_batch_entropy` give the shuffle-quality score:
  mean per-batch Shannon entropy of the label, divided by that of truly random batches.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "run_in_tree",
    "warm_page_cache",
    "MB",
    "CpuClock",
    "close_iterator",
    "MemoryMonitor",
    "TimedRun",
    "time_batches",
    "batch_entropy",
    "random_batch_entropy",
    "own_rss_mb",
    "peak_rss_self_mb",
    "rss_mb",
]

MB = 1024.0 * 1024.0


def _status_mb(pid: int | str, *keys: str) -> dict[str, float]:
    """Fields ``keys`` of ``/proc/PID/status`` (``pid`` may be ``"self"``) in MiB, those
    present; empty where the file cannot be read (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(v.split()[0]) / 1024.0
                    for k, _, v in (line.partition(":") for line in f) if k in keys}
    except (OSError, ValueError, IndexError):
        return {}


def _vm_hwm_mb(pid: int | str) -> float | None:
    """``VmHWM`` of process ``pid`` (or ``"self"``) in MiB; ``None`` where it cannot be
    read."""
    return _status_mb(pid, "VmHWM").get("VmHWM")


def own_rss_mb(pid: int | str = "self") -> float | None:
    """Resident memory of process ``pid`` that is its own, in MiB: ``VmRSS`` less
    ``RssShmem`` (shared memory it maps: a DataLoader worker's pool memory, which the
    main process maps to read batches by reference, is resident in the worker and counted
    there); ``None`` where it cannot be read."""
    got = _status_mb(pid, "VmRSS", "RssShmem")
    if "VmRSS" not in got:
        return None
    return got["VmRSS"] - got.get("RssShmem", 0.0)


def peak_rss_self_mb() -> float:
    """Peak resident set size of this process image so far, in MiB.

    Linux: ``VmHWM`` of ``/proc/self/status``, the high-water mark of this process image
    (reset at exec). Not ``getrusage().ru_maxrss``: Linux carries the parent's high-water
    mark into a fork+exec'd child's, so every case started from a large parent (one that
    generated the inputs in-process, say) reported the parent's peak. Elsewhere
    ``ru_maxrss`` (KiB on Linux and BSD, bytes on macOS).
    """
    hwm = _vm_hwm_mb("self")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MB if sys.platform == "darwin" else peak / 1024.0


def rss_mb(pid: int | None = None) -> float:
    """Current RSS of ``pid`` (default: this process) in MiB."""
    import psutil

    return psutil.Process(pid or os.getpid()).memory_info().rss / MB


@dataclass
class MemoryMonitor:
    """Poll RSS of this process and its children until :meth:`stop`.

    Children are every process started below this one (DataLoader workers; a new set per
    epoch unless ``persistent_workers``); each keeps its own peak, and a child still alive
    at :meth:`stop` contributes its kernel high-water mark (``VmHWM``), which no poll can
    miss.

    The polls run beside the timed loader and cost it CPU: listing the children scans
    every process of the machine, and reading a worker's USS walks ``/proc/PID/smaps``
    (its mapping of the pool memory included). Polled every 20 ms with USS every 0.5 s,
    the monitor cost 2 dense workers ~10% of their cells/s on 2 CPUs, the in-process
    loader nothing beyond the rounds' spread (benchmarks/results/handoff_w2.md), so it is
    slow by default and reads USS at :meth:`stop` only.

    Parameters
    ----------
    interval
        Seconds between polls of RSS.
    uss_every
        Also read the unique set size (pages no other process shares, e.g. not the
        copy-on-write pages a forked worker shares with its parent) every this many polls
        (0: at :meth:`stop` only).
    """

    interval: float = 0.25
    uss_every: int = 0
    main_peak: float = 0.0
    main_own_peak: float = 0.0
    child_peak: dict[int, float] = field(default_factory=dict)
    child_uss_peak: dict[int, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> MemoryMonitor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start polling in a daemon thread."""
        self._thread = threading.Thread(target=self._run, name="rss-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling (one last poll is taken first)."""
        self.poll(uss=True)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def poll(self, uss: bool = False) -> None:
        """Take one sample of every process now (``uss``: and the children's USS and
        kernel high-water marks)."""
        import psutil

        me = psutil.Process(os.getpid())
        try:
            self.main_peak = max(self.main_peak, me.memory_info().rss / MB)
            self.main_own_peak = max(self.main_own_peak, own_rss_mb() or 0.0)
            children = me.children(recursive=True)
        except psutil.Error:
            return
        for c in children:
            try:
                r = c.memory_info().rss / MB
                self.child_peak[c.pid] = max(self.child_peak.get(c.pid, 0.0), r)
                if uss:
                    u = c.memory_full_info().uss / MB
                    self.child_uss_peak[c.pid] = max(self.child_uss_peak.get(c.pid, 0.0), u)
                    self.child_peak[c.pid] = max(self.child_peak[c.pid],
                                                 _vm_hwm_mb(c.pid) or 0.0)
            except psutil.Error:
                continue

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            self.poll(uss=self.uss_every > 0 and i % self.uss_every == 0)
            i += 1
            self._stop.wait(self.interval)

    def summary(self) -> dict[str, Any]:
        """Peaks in MiB: this process (kernel high-water mark; and, polled, its own memory:
        RSS less the shared memory it maps) and each child."""
        rss = sorted((v for v in self.child_peak.values() if v > 0), reverse=True)
        uss = sorted((v for v in self.child_uss_peak.values() if v > 0), reverse=True)
        return {
            "main_peak_rss_mb": max(self.main_peak, peak_rss_self_mb()),
            "main_peak_own_mb": self.main_own_peak or None,
            "worker_peak_rss_mb": rss,
            "worker_peak_uss_mb": uss,
            "n_child_processes": len(rss),
        }


class CpuClock:
    """CPU seconds used by this process tree, and by everything else on the machine.

    On a shared machine wall-clock rates depend on what else runs; the CPU seconds a loader
    spends per cell do much less, and the share of the machine others used says how far
    the wall-clock figure can be trusted.
    """

    def __init__(self) -> None:
        import psutil

        self._me = psutil.Process(os.getpid())
        self._start_tree = self._tree()
        self._start_faults = self._faults(self._start_tree)
        self._start_sys = self._busy()
        self._t0 = time.perf_counter()

    @staticmethod
    def _faults(pids: dict[int, float]) -> dict[int, int]:
        """Minor page faults of each process so far (Linux ``/proc``; 0 elsewhere): a fresh
        page of memory written costs one."""
        out = {}
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    out[pid] = int(f.read().rsplit(b")", 1)[1].split()[7])  # minflt
            except (OSError, IndexError, ValueError):
                out[pid] = 0
        return out

    def _tree(self) -> dict[int, float]:
        import psutil

        # this process by its own nanosecond clock: /proc counts in 10 ms ticks, and a short
        # window of a small collection can fall within one tick (0 CPU seconds, no rate)
        out = {self._me.pid: time.process_time()}
        for p in self._me.children(recursive=True):
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except psutil.Error:
                continue
        return out

    @staticmethod
    def _busy() -> float:
        import psutil

        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def read(self) -> dict[str, float]:
        """``own_cpu_s`` (this process and its children), ``main_cpu_s`` (this process
        alone), ``others_cpu_s``, ``wall_s``, ``others_share`` (of all CPUs), and the minor
        page faults ``own_faults`` and ``main_faults`` (the same processes)."""
        tree = self._tree()
        faults = self._faults(tree)
        own = sum(v - self._start_tree.get(pid, 0.0) for pid, v in tree.items())
        me = self._me.pid
        main = tree.get(me, 0.0) - self._start_tree.get(me, 0.0)
        wall = time.perf_counter() - self._t0
        others = max(0.0, self._busy() - self._start_sys - own)
        ncpu = os.cpu_count() or 1
        return {"own_cpu_s": own, "main_cpu_s": main, "others_cpu_s": others, "wall_s": wall,
                "others_share": others / (wall * ncpu) if wall > 0 else 0.0,
                "own_faults": float(sum(v - self._start_faults.get(pid, 0)
                                        for pid, v in faults.items())),
                "main_faults": float(faults.get(me, 0) - self._start_faults.get(me, 0))}


@dataclass
class TimedRun:
    """Outcome of :func:`time_batches`."""

    n_batches: int
    n_cells: int
    seconds: float
    labels: list[np.ndarray]
    warmup_seconds: float
    cpu: dict[str, float] = field(default_factory=dict)

    @property
    def cells_per_s(self) -> float:
        """Cells delivered per second over the timed batches."""
        return self.n_cells / self.seconds if self.seconds > 0 else float("nan")

    @property
    def cells_per_cpu_s(self) -> float:
        """Cells delivered per CPU second of this process and its workers."""
        own = self.cpu.get("own_cpu_s", 0.0)
        return self.n_cells / own if own > 0 else float("nan")


def time_batches(
    epochs: Callable[[int], Iterable[Any]],
    *,
    n_warmup: int,
    n_batches: int,
    n_cells_of: Callable[[Any], int],
    labels_of: Callable[[Any], np.ndarray | None] | None = None,
    consume: Callable[[Any], None] | None = None,
    max_epochs: int = 1000,
) -> TimedRun:
    """Iterate batches, epoch after epoch, and time ``n_batches`` after ``n_warmup``.

    Parameters
    ----------
    epochs
        ``epochs(e)`` returns the batch iterable of epoch ``e`` (set the epoch there).
    n_warmup, n_batches
        Untimed warm-up batches, then timed batches (across epoch boundaries if needed).
    n_cells_of
        Number of cells in a batch.
    labels_of
        Label codes of a batch (for the shuffle score); ``None`` to skip.
    consume
        Called on every batch (e.g. what a training step would touch); default nothing.
    max_epochs
        Safety bound on the number of epochs iterated.
    """
    t_start = time.perf_counter()
    clock: CpuClock | None = None
    labels: list[np.ndarray] = []
    seen = cells = 0
    t0 = None
    for e in range(max_epochs):
        it: Iterator[Any] = iter(epochs(e))
        for batch in it:
            if consume is not None:
                consume(batch)
            seen += 1
            if seen == n_warmup:
                clock = CpuClock()
                t0 = time.perf_counter()
                continue
            if seen < n_warmup:
                continue
            if t0 is None:  # n_warmup == 0
                clock = CpuClock()
                t0 = t_start
            cells += n_cells_of(batch)
            if labels_of is not None:
                lab = labels_of(batch)
                if lab is not None:
                    labels.append(np.asarray(lab))
            if seen >= n_warmup + n_batches:
                t1 = time.perf_counter()
                cpu = clock.read()
                close_iterator(it)
                return TimedRun(n_batches, cells, t1 - t0, labels, t0 - t_start, cpu)
        if seen == 0:
            raise RuntimeError("the loader yielded no batch in an epoch")
    raise RuntimeError(f"fewer than {n_warmup + n_batches} batches in {max_epochs} epochs")


def touch_pages(batch: Any, key: str = "X") -> None:
    """Read one value per 4 KiB page of ``batch[key]`` (a dense tensor, or a sparse CSR
    tensor's values): what a copy to a device would touch, without the cost of a reduction
    over every value (a whole-tensor int32 sum costs torch ~13x a float32 one)."""
    import torch

    x = batch[key]
    v = (x.values() if x.layout == torch.sparse_csr else x).reshape(-1)
    v[:: max(1, 4096 // v.element_size())].sum()


def close_iterator(it: Iterator[Any]) -> None:
    """Stop a half-consumed batch iterator now (DataLoader workers included)."""
    # stop a half-consumed iterator now: workers (persistent ones too) would otherwise
    # keep prefetching and compete with whatever runs next
    close = getattr(it, "close", None)
    if close is not None:
        close()
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def _entropy(codes: np.ndarray, n_classes: int) -> float:
    counts = np.bincount(codes[codes >= 0], minlength=n_classes).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def batch_entropy(labels: Iterable[np.ndarray], n_classes: int) -> float:
    """Mean Shannon entropy (nats) of the label distribution of each batch."""
    values = [_entropy(np.asarray(b, dtype=np.int64), n_classes) for b in labels if len(b)]
    return float(np.mean(values)) if values else float("nan")


def random_batch_entropy(
    all_labels: np.ndarray, batch_size: int, n_classes: int, n_draws: int = 200, seed: int = 0
) -> float:
    """Mean per-batch entropy of truly random batches (rows drawn without replacement)."""
    rng = np.random.default_rng(seed)
    all_labels = np.asarray(all_labels, dtype=np.int64)
    k = min(batch_size, len(all_labels))
    draws = (rng.choice(all_labels, size=k, replace=False) for _ in range(n_draws))
    return batch_entropy(draws, n_classes)


def run_in_tree(code: str, args: Sequence[str], tree: str | None = None,
                timeout: float | None = None) -> dict[str, Any]:
    """Run ``python -c code *args`` with checkout ``tree`` (default: the one holding this
    file) first on the path and return the JSON its last line of output holds; a failed
    run ends the benchmark with its stderr. The child starts in this folder, outside any
    checkout: ``-c`` puts the working folder first on the path, which would win over
    ``PYTHONPATH`` when a benchmark is started from a checkout's root."""
    import json
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (tree or str(here.parent), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, env=env, cwd=here, timeout=timeout)
    if proc.returncode:
        raise SystemExit(f"run failed ({tree or 'this tree'}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def warm_page_cache(folder: str | os.PathLike[str]) -> None:
    """Read every file under ``folder`` once (16 MiB at a time), so that what follows
    reads from the page cache."""
    from pathlib import Path

    for p in Path(folder).rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass
