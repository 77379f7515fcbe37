"""scVI trained for several epochs with a held-out split: SCVIDataModule over a collection
against scvi-tools' own ``AnnDataLoader`` over the AnnData in memory (issue 32).

    .venv/bin/python benchmarks/scvi_epochs.py [--epochs 5] [--rounds 2] [--n-top-genes 2000]

Data as in ``benchmarks/scvi_train.py``: the benchmark's 100,000 x 20,000 counts restricted
to 2,000 highly variable genes; ours reads a collection written with those genes
(``collection_scvi_hvg``), scvi-tools the AnnData of those genes in memory. scVI with
``n_latent=10``, batch 128, ``batch_key="batch"``, 90% of the cells for training and 10%
held out (each side draws its own split with seed 0), validation after every epoch, CPU.
Each configuration runs in a fresh process; the rounds alternate them. Reported: seconds
per epoch (the whole ``model.train`` call divided by the epochs: validation included) and
the held-out ELBO after the last epoch; written to ``benchmarks/results/scvi_epochs.md``.
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


def _child(mode: str, epochs: int, n_top: int) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("scvi").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    import scvi
    import scvi_train as st

    data = HERE / "data" / "grouped_100000x20000_seed0"
    hvg = st.hvg_names(data, n_top)
    scvi.settings.seed = 0
    # scvi-tools' own history logger on (it keeps the losses per epoch)
    trainer = {k: v for k, v in st.TRAINER.items() if k != "logger"}
    train = dict(max_epochs=epochs, check_val_every_n_epoch=1, **trainer)
    if mode == "ours":
        from annbatch_torch.integrations.scvi import SCVIDataModule

        coll = st.collection(data, hvg)
        dm = SCVIDataModule(coll, batch_key="batch", batch_size=128, num_workers=0,
                            seed=0, train_size=0.9)
        model = scvi.model.SCVI(registry=dm.registry, n_latent=10)
        t0 = time.perf_counter()
        model.train(datamodule=dm, **train)
    else:
        adata = st.in_memory(data, hvg)
        scvi.model.SCVI.setup_anndata(adata, batch_key="batch")
        model = scvi.model.SCVI(adata, n_latent=10)
        t0 = time.perf_counter()
        model.train(train_size=0.9, batch_size=128, **train)
    seconds = time.perf_counter() - t0
    hist = model.history
    print(json.dumps({"s_per_epoch": seconds / epochs,
                      "elbo_validation": float(hist["elbo_validation"].iloc[-1, 0]),
                      "elbo_train": float(hist["elbo_train"].iloc[-1, 0])}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--n-top-genes", type=int, default=2000)
    p.add_argument("--out", default=str(HERE / "results" / "scvi_epochs.md"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        sys.path.insert(0, str(HERE))
        _child(args.child, args.epochs, args.n_top_genes)
        return
    load = os.getloadavg()[0]
    got: dict[str, list[dict[str, float]]] = {"ours": [], "scvi": []}
    for r in range(args.rounds):
        for mode in got:
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--epochs",
                                  str(args.epochs), "--n-top-genes", str(args.n_top_genes)],
                                 capture_output=True, text=True, check=True)
            got[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r} {mode}: {got[mode][-1]}", flush=True)
    names = {"ours": "`SCVIDataModule`, the 2,000-gene collection, 0 workers",
             "scvi": "scvi-tools `AnnDataLoader`, the AnnData in memory"}
    base = min(x["s_per_epoch"] for x in got["scvi"])
    stamp = time.strftime("%Y-%m-%d %H:%M")
    lines = [f"# scVI, {args.epochs} epochs with a held-out split ({stamp}, load {load:.2f} "
             f"at the start, {os.cpu_count()} CPUs)", "",
             "`python benchmarks/scvi_epochs.py`: 100,000 cells x 2,000 HVGs, scVI "
             "`n_latent=10`, batch 128, 90% train / 10% held out, validation every epoch, "
             f"{args.rounds} alternated rounds in fresh processes.", "",
             "| loader | s per epoch, best | median | vs scvi-tools | held-out ELBO (last "
             "epoch, per round) | train ELBO |", "|---|---|---|---|---|---|"]
    for mode, runs in got.items():
        best = min(x["s_per_epoch"] for x in runs)
        lines.append(f"| {names[mode]} | {best:.1f} | "
                     f"{statistics.median(x['s_per_epoch'] for x in runs):.1f} | "
                     f"{best / base:.2f}x | "
                     + ", ".join(f"{x['elbo_validation']:.1f}" for x in runs) + " | "
                     + ", ".join(f"{x['elbo_train']:.1f}" for x in runs) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
