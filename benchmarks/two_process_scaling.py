"""How much two processes at once get out of this machine, per kind of work.

The parallel writer's ceiling on a machine is what two (or N) processes doing its kinds of
work achieve together. Each kind runs alone, then in two forked processes at once; the
figure is the throughput of the two against one (2.0 = perfect scaling). Best of
``--repeat`` rounds (the machine may be shared).

    python benchmarks/two_process_scaling.py --repeat 3

* ``cpu``: arithmetic on a 128 KiB array (in cache);
* ``copy``: copying 256 MB arrays (memory bandwidth);
* ``fault``: allocating and touching fresh 256 MB arrays (page faults, zeroing);
* ``write``: writing 1 GiB to a file in the page cache, then deleting it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time

import numpy as np

MB = 2**20


def work(kind: str, folder: str) -> float:
    t = time.perf_counter()
    if kind == "cpu":
        x = np.ones(2**14)
        for _ in range(20_000):
            x = np.sqrt(x) + 1.0
    elif kind == "copy":
        a = np.ones(64 * MB, np.float32)
        b = np.empty_like(a)
        for _ in range(8):
            np.copyto(b, a)
    elif kind == "fault":
        for _ in range(8):
            a = np.empty(64 * MB, np.float32)
            a.fill(1)
            del a
    elif kind == "write":
        buf = b"\1" * (64 * MB)
        path = os.path.join(folder, f"scale_{os.getpid()}.bin")
        with open(path, "wb", buffering=0) as f:
            for _ in range(16):
                f.write(buf)
        os.remove(path)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="folder for the write case (default: temp)")
    args = p.parse_args()
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for kind in ("cpu", "copy", "fault", "write"):
            best = []
            for _ in range(args.repeat):
                one = work(kind, folder)
                with ctx.Pool(2) as pool:
                    t = time.perf_counter()
                    pool.starmap(work, [(kind, folder)] * 2)
                    two = time.perf_counter() - t
                best.append((2 * one / two, one, two))
            ratios = sorted(r for r, _, _ in best)
            print(f"{kind:6s} two processes vs one: x{ratios[-1]:.2f} best, "
                  f"x{ratios[0]:.2f} worst of {args.repeat} "
                  f"(one alone {min(o for _, o, _ in best):.2f} s)", flush=True)


if __name__ == "__main__":
    main()
