"""What a fresh page of memory costs this machine's kernel, outside the project.

    python benchmarks/fresh_pages.py [--mb 130] [--rounds 5] [--out FILE]

A loader's pools are read into buffers that are reused from one pool to the next; the
first pools of a process write into fresh memory, and every fresh 4 KiB page costs the
kernel an allocation, a zeroing and a mapping before the first write lands. That cost is
a property of the host (its kernel, its hypervisor), not of the loader, and it decides
what a DataLoader worker's first epoch costs: each worker has pools of its own (two, the
one consumed and the one read), so W workers fault W times the memory the in-process
loader faults, in shared memory (the batches travel by reference, ``read/handoff.py``).

Each variant allocates ``--mb`` MB (a pool field's size in the benchmark's 100k x 20k
collection), writes every byte and drops it, ``--rounds`` times in this process; printed
and written: the median CPU time (user + system) per 4 KiB page and per MB, and the page
faults counted:

* ``private, plain pages``: an anonymous private mapping declining huge pages
  (``MADV_NOHUGEPAGE``), what ``read/buffers.py::fresh_bytes`` gives the in-process pools;
* ``private, huge pages``: the same allowed transparent huge pages (``MADV_HUGEPAGE``,
  numpy's default for large arrays), where the kernel grants them;
* ``shared (torch)``: ``torch.UntypedStorage._new_shared``, what a worker's pool memory is
  made of (``read/handoff.py::PoolMemory``);
* ``shared, populated``: the same, its pages made by ``MADV_POPULATE_WRITE`` in one call
  before the writes (no fault per page taken by the process);
* ``memfd, written``: a ``memfd_create`` file filled by ``pwrite`` (allocation and zeroing
  without any mapping);
* ``reused``: memory written before (what every pool after a process's first two costs).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
PAGE = 4096
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_POPULATE_WRITE = 14, 15, 23


def _advise(a: np.ndarray, advice: int) -> bool:
    start = -(-a.ctypes.data // PAGE) * PAGE
    stop = (a.ctypes.data + a.nbytes) // PAGE * PAGE
    return stop <= start or _libc.madvise(start, stop - start, advice) == 0


def _private(n: int, advice: int) -> None:
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, dtype=np.uint8)
    _advise(a, advice)
    a[:] = 1
    del a
    m.close()


def _shared(n: int, populate: bool) -> None:
    s = torch.UntypedStorage._new_shared(n)
    a = torch.empty(0, dtype=torch.uint8).set_(s).numpy()
    if populate and not _advise(a, MADV_POPULATE_WRITE):
        raise OSError(ctypes.get_errno(), "MADV_POPULATE_WRITE refused (Linux >= 5.14)")
    a[:] = 1


#: written once, here: its own pages (faulted in by this write) are not the measured ones
_ZEROS = np.ones(1 << 20, dtype=np.uint8)
_ZEROS[:] = 0


def _memfd(n: int) -> None:
    fd = os.memfd_create("fresh-pages")
    block = memoryview(_ZEROS)  # (a slice of a view copies nothing)
    try:
        for o in range(0, n, len(block)):
            os.pwrite(fd, block[: n - o], o)
    finally:
        os.close(fd)


def _measure(fn: Callable[[], None], rounds: int) -> tuple[float, float, int]:
    """Median CPU seconds and wall seconds of ``fn`` over ``rounds``, and the page faults
    of the last round."""
    cpu, wall, faults = [], [], 0
    for _ in range(rounds):
        r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        fn()
        r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
        wall.append(w1 - w0)
        faults = r1.ru_minflt - r0.ru_minflt
    return statistics.median(cpu), statistics.median(wall), faults


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=130)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(HERE / "results" / "fresh_pages.md"))
    args = p.parse_args()
    n = args.mb << 20
    kept = np.empty(n, dtype=np.uint8)
    kept[:] = 0
    variants: dict[str, Callable[[], None]] = {
        "private, plain pages": lambda: _private(n, MADV_NOHUGEPAGE),
        "private, huge pages": lambda: _private(n, MADV_HUGEPAGE),
        "shared (torch)": lambda: _shared(n, False),
        "shared, populated": lambda: _shared(n, True),
        "memfd, written": lambda: _memfd(n),
        "reused": lambda: kept.fill(1),
    }
    load = os.getloadavg()[0]
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    settings = {f: (thp / f).read_text().strip() if (thp / f).exists() else "?"
                for f in ("enabled", "shmem_enabled", "defrag")}
    rows = []
    for name, fn in variants.items():
        cpu, wall, faults = _measure(fn, args.rounds)
        rows.append((name, 1e6 * cpu / (n // PAGE), 1e3 * cpu / args.mb, wall, faults))
        print(f"{name}: {rows[-1][1]:.2f} us CPU per page, {faults} faults", flush=True)
    lines = [f"# Fresh pages ({time.strftime('%Y-%m-%d %H:%M')}, load {load:.2f} at the "
             f"start, {os.cpu_count()} CPUs, kernel {os.uname().release})", "",
             f"{args.mb} MB allocated, written whole and dropped, median of {args.rounds}; "
             f"THP enabled `{settings['enabled']}`, shmem_enabled "
             f"`{settings['shmem_enabled']}`, defrag `{settings['defrag']}`.", "",
             "| memory | CPU us per 4 KiB page | CPU ms per MB | wall s | page faults |",
             "|---|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]:.2f} | {r[2]:.2f} | {r[3]:.3f} | {r[4]:,} |" for r in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
