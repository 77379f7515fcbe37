"""``Trainer.fit`` against the bare loop over the same loaders (issue 32).

    python benchmarks/lightning_fit.py [COLLECTION] [--workers 0,2] [--layouts sparse,dense]
        [--rounds 3] [--batches 40]

Both run a linear model (``genes -> 8``, squared output as the loss, SGD; sparse batches
through scipy's kernels, as torch's CPU CSR backward is ~40x slower) over the
``AnnBatchDataModule``'s training loader (``batch_size=4096``, ``num_workers=W``,
persistent workers): ``bare`` is the loop a user would write (``for batch in loader``:
forward, backward, step; ``set_epoch`` per epoch), ``fit`` is ``Trainer.fit`` with
logging, checkpoints, progress bar and sanity checks off. Each configuration runs in a fresh
process; two batches of warm-up, then ``--batches`` timed from one batch's start to the
next (what the training step and the loader cost together). Rounds alternate the
configurations; printed and written to ``benchmarks/results/lightning_fit.md``: best and
median cells/s per configuration and the ratio of ``fit`` to ``bare`` (bests).

Default collection: the 100k x 20k benchmark collection of ``benchmarks/run.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT = (HERE / "data" / "grouped_100000x20000_seed0" /
           "collection_shard_elems-8388608_codec-raw_shard_obs-131072_dtypes-auto-auto")


def _child(args: argparse.Namespace) -> None:
    import warnings

    import lightning.pytorch as pl
    import torch

    import annbatch_torch as abt

    warnings.filterwarnings("ignore")
    dense = args.layout == "dense"
    dm = abt.AnnBatchDataModule(None, args.collection, batch_size=4096,
                                num_workers=args.nworkers, densify=dense, seed=0)
    dm.setup("fit")
    n_vars = dm.collection.n_vars

    from annbatch_torch.read.csr import csr_view

    def scipy_of(x: torch.Tensor):  # type: ignore[no-untyped-def]
        return csr_view(x.values().numpy(), x.col_indices().numpy(),
                        x.crow_indices().numpy(), tuple(x.shape))

    class SparseLinear(torch.autograd.Function):
        """``x @ w`` for a CSR ``x`` with scipy's kernels: torch's CPU CSR backward
        (``x.t() @ grad``) takes ~0.6 s per 4096 x 20,000 batch here, scipy ~15 ms."""

        @staticmethod
        def forward(ctx, x, w):  # type: ignore[no-untyped-def]
            ctx.x = x
            return torch.from_numpy(scipy_of(x) @ w.detach().numpy())

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            return None, torch.from_numpy(scipy_of(ctx.x).T @ g.numpy())

    class Linear(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(n_vars, 8) * 1e-3)

        def training_step(self, batch: dict, i: int) -> torch.Tensor:
            x = batch["X"]
            y = (SparseLinear.apply(x, self.w) if x.layout == torch.sparse_csr
                 else x @ self.w)
            return y.pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-6)

    torch.manual_seed(0)
    model = Linear()
    stamps: list[float] = []
    cells: list[int] = []
    total = 2 + args.batches + 1

    if args.mode == "bare":
        opt = model.configure_optimizers()
        loader = dm.train_dataloader()
        epoch = 0
        while len(stamps) < total:
            loader.sampler.set_epoch(epoch)
            for i, batch in enumerate(loader):
                stamps.append(time.perf_counter())
                cells.append(int(batch["X"].shape[0]))
                if len(stamps) >= total:
                    break
                opt.zero_grad()
                model.training_step(batch, i).backward()
                opt.step()
            epoch += 1
    else:
        class Stamp(pl.Callback):
            def on_train_batch_start(self, trainer, module, batch, i) -> None:  # type: ignore[no-untyped-def]
                stamps.append(time.perf_counter())
                cells.append(int(batch["X"].shape[0]))

        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=total, max_epochs=1000,
                             logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, callbacks=[Stamp()])
        trainer.fit(model, datamodule=dm)
    timed = stamps[2:total]
    n_cells = sum(cells[2:total - 1])
    print(json.dumps({"cells_per_s": n_cells / (timed[-1] - timed[0])}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("collection", nargs="?", default=str(DEFAULT))
    p.add_argument("--workers", default="0,2")
    p.add_argument("--layouts", default="sparse,dense")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--out", default=str(HERE / "results" / "lightning_fit.md"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="bare", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="sparse", help=argparse.SUPPRESS)
    p.add_argument("--nworkers", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    load = os.getloadavg()[0]
    configs = [(layout, int(w), mode) for layout in args.layouts.split(",")
               for w in args.workers.split(",") for mode in ("bare", "fit")]
    got: dict[tuple[str, int, str], list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for layout, w, mode in configs:
            out = subprocess.run(
                [sys.executable, __file__, args.collection, "--child", "--mode", mode,
                 "--layout", layout, "--nworkers", str(w), "--batches", str(args.batches)],
                capture_output=True, text=True, check=True)
            rate = json.loads(out.stdout.strip().splitlines()[-1])["cells_per_s"]
            got[(layout, w, mode)].append(rate)
            print(f"round {r} {layout} workers={w} {mode}: {rate:,.0f} cells/s", flush=True)
    lines = [f"# Trainer.fit against the bare loop ({time.strftime('%Y-%m-%d %H:%M')}, "
             f"load {load:.2f} at the start, {os.cpu_count()} CPUs)", "",
             f"Collection: `{args.collection}`; `AnnBatchDataModule(batch_size=4096)`, a "
             f"linear model (genes -> 8); {args.batches} batches timed after 2, "
             f"{args.rounds} alternated rounds, each a fresh process; ratio: fit's best "
             "against bare's best.", "",
             "| layout | workers | bare best | bare median | fit best | fit median | ratio |",
             "|---|---|---|---|---|---|---|"]
    for layout in args.layouts.split(","):
        for w in (int(x) for x in args.workers.split(",")):
            b, f = got[(layout, w, "bare")], got[(layout, w, "fit")]
            lines.append(f"| {layout} | {w} | {max(b):,.0f} | {statistics.median(b):,.0f} | "
                         f"{max(f):,.0f} | {statistics.median(f):,.0f} | "
                         f"{max(f) / max(b):.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
