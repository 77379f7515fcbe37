"""Draw how one epoch's rows are dealt: chunks -> pools -> ranks -> workers -> batches.

Run by the docs build (``docs/conf.py``) and by hand: ``python docs/figures/epoch_deal.py
OUT.png``. Every position comes from the real plan functions of
:mod:`annbatch_torch.sampling` (``chunk_order``, ``rank_items``, ``worker_items``), so the
picture is what the loader does for these settings: 40 rows, chunks of 4, pools of 2
chunks, batches of 4, 2 ranks with 2 DataLoader workers each, seed 0, epoch 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from annbatch_torch import sampling

N_OBS, CHUNK, PRELOAD, BATCH, WORLD, WORKERS, SEED = 40, 4, 2, 4, 2, 2, 0


def draw(out: Path) -> None:
    n_chunks = -(-N_OBS // CHUNK)
    cmap = plt.get_cmap("tab10")
    color = {c: cmap(c % 10) for c in range(n_chunks)}
    order = sampling.chunk_order(N_OBS, CHUNK, shuffle=True, seed=SEED, epoch=0)
    fig, axes = plt.subplots(4, 1, figsize=(10, 6.4),
                             gridspec_kw={"height_ratios": [1, 1, 1.4, 2.2]})
    for ax in axes:
        ax.set_axis_off()
    # 1. rows on disk, coloured by chunk
    ax = axes[0]
    ax.set_title("1. the collection's rows (already shuffled offline), in chunks of "
                 f"{CHUNK}", loc="left", fontsize=10)
    for r in range(N_OBS):
        ax.add_patch(plt.Rectangle((r, 0), 0.95, 1, color=color[r // CHUNK]))
    ax.set_xlim(0, N_OBS)
    ax.set_ylim(0, 1.3)
    # 2. the epoch's chunk order
    ax = axes[1]
    ax.set_title("2. epoch 0 draws the chunks in a random order", loc="left", fontsize=10)
    for i, c in enumerate(order):
        ax.add_patch(plt.Rectangle((i * CHUNK, 0), CHUNK - 0.1, 1, color=color[int(c)]))
        ax.text(i * CHUNK + CHUNK / 2, 0.5, str(int(c)), ha="center", va="center",
                fontsize=8, color="white")
    ax.set_xlim(0, N_OBS)
    ax.set_ylim(0, 1.3)
    # 3. pools dealt to ranks, then to workers
    ax = axes[2]
    ax.set_title(f"3. pools of {PRELOAD} chunks go to {WORLD} ranks in turn (the last, "
                 "incomplete round split by batches), and a rank's pools to its "
                 f"{WORKERS} workers in turn", loc="left", fontsize=10)
    x = 0.0
    for rank in range(WORLD):
        items = sampling.rank_items(N_OBS, CHUNK, PRELOAD, BATCH, shuffle=True, seed=SEED,
                                    epoch=0, rank=rank, world_size=WORLD)
        for w in range(WORKERS):
            for it in sampling.worker_items(items, w, WORKERS):
                assert it.order is not None
                lo, hi = it.bounds(it.batch_start)[0], it.bounds(it.batch_stop - 1)[1]
                rows = np.sort(sampling.global_rows(it.ranges)[it.order[lo:hi]])
                for k, r in enumerate(rows):
                    ax.add_patch(plt.Rectangle((x + k, 0), 0.95, 1,
                                               color=color[int(r) // CHUNK]))
                part = "" if it.batch_start == 0 and hi == it.n_rows else (
                    f", batch {it.batch_start}" if it.batch_stop - it.batch_start == 1 else
                    f", batches {it.batch_start}-{it.batch_stop - 1}")
                ax.text(x + len(rows) / 2, 1.15, f"rank {rank}, worker {w}", ha="center",
                        fontsize=7)
                ax.text(x + len(rows) / 2, -0.35, f"pool {it.pool_index}{part}",
                        ha="center", fontsize=7)
                x += len(rows) + 1
    ax.set_xlim(0, x)
    ax.set_ylim(-0.5, 1.5)
    # 4. one pool shuffled and cut into batches
    ax = axes[3]
    ax.set_title("4. inside each pool the rows are shuffled and cut into batches of "
                 f"{BATCH}", loc="left", fontsize=10)
    items = sampling.rank_items(N_OBS, CHUNK, PRELOAD, BATCH, shuffle=True, seed=SEED,
                                epoch=0, rank=0, world_size=WORLD)
    y = 1.2
    for it in list(items)[:2]:
        rows = sampling.global_rows(it.ranges)
        assert it.order is not None
        x = 0.0
        for b in range(it.batch_start, it.batch_stop):
            lo, hi = it.bounds(b)
            for k, pos in enumerate(it.order[lo:hi]):
                r = int(rows[pos])
                ax.add_patch(plt.Rectangle((x + k, y), 0.95, 0.8,
                                           color=color[r // CHUNK]))
                ax.text(x + k + 0.47, y + 0.4, str(r), ha="center", va="center",
                        fontsize=6, color="white")
            ax.text(x + (hi - lo) / 2, y + 0.95, f"batch {b}", ha="center", fontsize=7)
            x += hi - lo + 1.5
        ax.text(-0.5, y + 0.4, f"pool {it.pool_index}", ha="right", va="center", fontsize=8)
        y -= 1.2
    ax.set_xlim(-4, N_OBS)
    ax.set_ylim(-0.2, 2.4)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    draw(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("epoch_deal.png"))
