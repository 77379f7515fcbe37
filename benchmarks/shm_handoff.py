"""What handing batches out of DataLoader workers costs, with nothing else to do.

    python benchmarks/shm_handoff.py [--batches 24] [--workers 2] [--rounds 3]

A plain ``torch.utils.data.DataLoader(num_workers=W)`` hands each batch to the main process
through shared memory, and the main process may hold a batch for as long as it likes, so a
worker cannot reuse a batch's memory: every batch is a fresh shared-memory segment whose
pages fault in as they are written. Here the "batches" are only allocated and filled (what
densifying or reading into them would write), in the sizes of the benchmark's batches:

* ``dense``: 4096 x 20000 float32 (328 MB);
* ``csr``: 7.5 M non-zeros as float32 values + int32 column indices (60 MB).

Each is yielded by the main process (fresh private memory per batch: ``in process``) and
by W workers (fresh shared memory per batch, ``torch.empty(...).share_memory_()``, which
is what the pickler would otherwise copy into). The main process touches one value per
page of each batch and drops it. Printed: cells/s, best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, IterableDataset

N, G, NNZ = 4096, 20000, 7_500_000
SIZES = {"dense": N * G, "csr": 2 * NNZ}  # float32-sized elements per batch


class _Batches(IterableDataset):
    def __init__(self, n: int, elems: int) -> None:
        self.n, self.elems = n, elems

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = torch.utils.data.get_worker_info()
        n = self.n if info is None else self.n // info.num_workers
        for _ in range(n):
            x = torch.empty(self.elems)
            if info is not None:
                x.share_memory_()  # what a worker's batch must be, for the hand-off
            x.fill_(1.0)  # what a densify kernel or a read would write
            yield x


def _rate(loader: DataLoader) -> float:
    it = iter(loader)
    next(it)  # workers started, first batch through
    t0, k = time.perf_counter(), 0
    for x in it:
        float(x[::1024].sum())  # one float per 4 KiB page
        k += 1
    return k * N / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=24)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    best: dict[str, float] = {}
    for _ in range(a.rounds):
        for kind, elems in SIZES.items():
            for where, workers in (("in process", 0), (f"{a.workers} workers", a.workers)):
                loader = DataLoader(_Batches(a.batches, elems), batch_size=None,
                                    num_workers=workers)
                name = f"{kind}, {where}"
                best[name] = max(best.get(name, 0.0), _rate(loader))
    for name, rate in best.items():
        print(f"{name:>20}: {rate:9,.0f} cells/s (best of {a.rounds})")


if __name__ == "__main__":
    main()
