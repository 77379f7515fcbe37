"""Page-cache reads alone, by the span of data they sweep: what a warm epoch's bytes cost
on this machine when an atlas fits in the CPU's last-level cache and when it does not.

    python benchmarks/page_cache_span.py STORE [--spans 1e8,3e8,6e8,1.5e9,5e9,2e10]
        [--gb 3] [--piece 262144] [--rounds 3] [--out FILE]

No loader, no numpy copy: two threads ``preadv`` random ``--piece``-byte, page-aligned
pieces of a collection's X chunk files (as a pool's chunk reads do) into two reused
buffers, from the first files of ``STORE`` holding ``span`` bytes together, after one
untimed pass that brings them into the page cache. Prints GB/s per span (best of
``--rounds``) and the machine's L3 size (``lscpu``). A warm epoch of a collection that
fits in the L3 (10^5 cells of the scale atlas: 105 MB) reads from the CPU's cache; one of
10^6 or 10^7 cells reads from memory: compare loader epochs within one memory tier.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def l3_cache() -> str:
    """The L3 line of ``lscpu`` (or "unknown")."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("L3")), "unknown")


def chunk_files(store: Path, piece: int) -> list[Path]:
    """X's chunk (or shard) files of every collection shard, larger than one piece."""
    return sorted(p for p in store.glob("*/X/*/c/*") if p.is_file()
                  and p.stat().st_size > piece)


def read_rate(files: list[Path], span: float, total: int, piece: int, rounds: int,
              seed: int = 0) -> tuple[float, int, int]:
    """Best GB/s of ``rounds`` timed passes over the first files holding ``span`` bytes;
    returns it with the bytes and files spanned."""
    sel, acc = [], 0
    for f in files:
        if acc >= span:
            break
        sel.append(f)
        acc += f.stat().st_size
    fds = [os.open(f, os.O_RDONLY) for f in sel]
    try:
        sizes = [os.fstat(fd).st_size for fd in fds]
        rng = np.random.default_rng(seed)
        n = max(total // piece, 2)
        which = rng.integers(0, len(fds), n)
        offs = [int(rng.integers(0, sizes[w] - piece)) // 4096 * 4096 for w in which]
        bufs = [bytearray(piece) for _ in range(2)]

        def work(t: int) -> None:
            for i in range(t, n, 2):
                os.preadv(fds[which[i]], [bufs[t]], offs[i])

        best = 0.0
        for r in range(rounds + 1):  # the first pass brings the span into the page cache
            t0 = time.perf_counter()
            with ThreadPoolExecutor(2) as ex:
                list(ex.map(work, range(2)))
            if r:
                best = max(best, n * piece / (time.perf_counter() - t0) / 1e9)
        return best, acc, len(sel)
    finally:
        for fd in fds:
            os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("store", type=Path, help="a collection")
    p.add_argument("--spans", default="1e8,3e8,6e8,1.5e9,5e9,2e10",
                   help="bytes of chunk files swept (comma-separated)")
    p.add_argument("--gb", type=float, default=3.0, help="GB read per timed pass")
    p.add_argument("--piece", type=int, default=1 << 18)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = p.parse_args()
    files = chunk_files(args.store, args.piece)
    if not files:
        raise SystemExit(f"{args.store}: no X chunk files larger than {args.piece} bytes")
    l3 = l3_cache()
    print(f"{args.store}: {len(files)} X chunk files; L3 {l3}; load "
          f"{os.getloadavg()[0]:.2f}")
    rows = []
    for span in (float(s) for s in args.spans.split(",")):
        gbs, acc, n_files = read_rate(files, span, int(args.gb * 1e9), args.piece,
                                      args.rounds)
        rows.append({"span_mib": acc / 2**20, "files": n_files, "gb_s": gbs})
        print(f"  span {acc / 2**20:8,.0f} MiB over {n_files:4d} files: {gbs:5.1f} GB/s")
        if acc < span:
            break  # the store holds no more
    if args.out:
        args.out.write_text(json.dumps({"store": str(args.store), "l3": l3,
                                        "piece": args.piece, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
