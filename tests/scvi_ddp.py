"""Train scvi-tools' SCVI for one epoch on 2 CPU ranks (gloo) from a collection through
``SCVIDataModule``, with ``strategy="ddp_find_unused_parameters_true"`` (scvi-tools' modules
leave some parameters unused, which plain ``"ddp"`` refuses); each rank writes the
``ind_x`` of its training batches to ``OUT/rank{r}.npy`` and ``OUT/done{r}``.

Run as ``python tests/scvi_ddp.py STORE OUT``: Lightning's DDP launcher starts rank 1 by
running this script again.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import scvi

from annbatch_torch.integrations.scvi import SCVIDataModule


class RecordRows(pl.Callback):
    """Writes the global row ids of every training batch this rank saw."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[np.ndarray] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        full = batch[0] if isinstance(batch, list) else batch
        self.rows.append(full["ind_x"].cpu().numpy().ravel())

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        r = trainer.global_rank
        np.save(self.out / f"rank{r}.npy", np.concatenate(self.rows))
        (self.out / f"done{r}").write_text(str(len(self.rows)))


def main() -> None:
    store, out = sys.argv[1], Path(sys.argv[2])
    warnings.filterwarnings("ignore")
    scvi.settings.seed = 0
    dm = SCVIDataModule(store, layer="counts", batch_key="batch", batch_size=128,
                        num_workers=1)
    model = scvi.model.SCVI(registry=dm.registry, n_latent=4)
    model.train(max_epochs=1, datamodule=dm, accelerator="cpu", devices=2,
                strategy="ddp_find_unused_parameters_true", callbacks=[RecordRows(out)],
                enable_progress_bar=False, logger=False)


if __name__ == "__main__":
    main()
