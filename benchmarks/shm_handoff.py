"""What moving dense batches out of DataLoader workers costs, with nothing else to do.

    python benchmarks/shm_handoff.py [--batches 30] [--workers 2]

A plain ``torch.utils.data.DataLoader(num_workers=W)`` hands each batch to the main process
through shared memory. Here the workers make no batch at all: each yields the same
4096 x 20000 float32 tensor (328 MB, what a dense batch of the benchmark is), so the figures
are the ceiling of the hand-off alone, in cells/s:

* ``reused numpy-backed``: the worker's tensor is ordinary memory; torch copies it into a
  fresh shared-memory segment per batch (what a dataset densifying into reused buffers
  gets);
* ``fresh shared``: the worker allocates each batch in shared memory and fills it (no copy
  at pickling; the segment is new each time, so its pages fault in again);
* ``in process``: the same tensor yielded by the dataset in the main process (no hand-off).

The main process touches one value per page of each batch (as a consumer reading it
would fault the pages in) and drops it.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, IterableDataset

N, G = 4096, 20000


class _Batches(IterableDataset):
    def __init__(self, n: int, shared: bool) -> None:
        self.n, self.shared = n, shared

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = torch.utils.data.get_worker_info()
        n = self.n if info is None else self.n // info.num_workers
        reused = torch.ones(N, G)
        for _ in range(n):
            if self.shared:
                x = torch.empty(N, G).share_memory_()
                x.fill_(1.0)  # what a densify kernel would write
                yield x
            else:
                yield reused


def _rate(loader: DataLoader) -> float:
    it = iter(loader)
    next(it)  # workers started, first batch through
    t0, k = time.perf_counter(), 0
    for x in it:
        float(x.view(-1)[:: 1024].sum())  # one float per 4 KiB page
        k += 1
    return k * N / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    cases = {
        "in process": lambda: DataLoader(_Batches(a.batches, False), batch_size=None),
        "reused numpy-backed": lambda: DataLoader(_Batches(a.batches, False), batch_size=None,
                                                  num_workers=a.workers),
        "fresh shared": lambda: DataLoader(_Batches(a.batches, True), batch_size=None,
                                           num_workers=a.workers),
    }
    best: dict[str, float] = {}
    for _ in range(a.rounds):
        for name, make in cases.items():
            best[name] = max(best.get(name, 0.0), _rate(make()))
    for name, rate in best.items():
        print(f"{name:>22}: {rate:9,.0f} cells/s (best of {a.rounds})")


if __name__ == "__main__":
    main()
