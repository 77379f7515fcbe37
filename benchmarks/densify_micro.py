"""Densifying one 4096 x 20000 batch (7.5 M non-zeros) into fresh vs reused memory.

    python benchmarks/densify_micro.py

Prints the best of 5 runs of: a fresh ``np.zeros`` array + scipy's kernel (2 threads); a
reused array zeroed by ``fill(0)`` in the same threads (what ``read.buffers.DenseBuffers``
does); a reused array whose previous batch's positions only are zeroed (not kept: slower).
"""

from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp

from annbatch_torch.read.csr import _todense_into

N, G, NNZ = 4096, 20000, 7_500_000


def main() -> None:
    m = sp.random(N, G, density=NNZ / (N * G), format="csr", dtype=np.float32, random_state=0)
    prev = sp.random(N, G, density=NNZ / (N * G), format="csr", dtype=np.float32,
                     random_state=1)
    buf = np.zeros((N, G), np.float32)
    _todense_into(prev, buf, True)

    def fresh() -> None:
        out = np.zeros((N, G), np.float32)
        _todense_into(m, out, True)

    def reused_fill() -> None:
        _todense_into(m, buf, True, zero=True)

    def reused_scatter() -> None:
        rows = np.repeat(np.arange(N, dtype=np.int64) * G, np.diff(prev.indptr))
        buf.reshape(-1)[rows + prev.indices] = 0
        _todense_into(m, buf, True)

    for fn in (fresh, reused_fill, reused_scatter):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        print(f"{fn.__name__:15s} {1000 * min(times):6.1f} ms")


if __name__ == "__main__":
    main()
