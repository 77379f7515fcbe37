"""Train scvi-tools' SCVI and SCANVI straight from a collection (``pip install
'annbatch-torch[scvi]'``): h5ad files -> shuffled collection -> SCVIDataModule -> SCVI
(batch-corrected latent space, one row per cell in collection order) -> SCANVI (labels for
the cells that had none).

    python examples/scvi_from_collection.py --small          # CI-sized, under a minute
    python examples/scvi_from_collection.py                  # 50k generated cells
    python examples/scvi_from_collection.py --store my_store/ --layer counts \\
        --batch-key batch --labels-key cell_type             # your own collection

Nothing is held in memory as an AnnData: the model reads minibatches from the collection's
chunks through DataLoader workers, as the rest of annbatch_torch does.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd

import annbatch_torch as abt


def generated_collection(workdir: Path, n_obs: int, n_vars: int, seed: int) -> Path:
    """Generated counts of 8 cell types in 2 batches; 60% of the cells lose their label
    (``cell_type`` becomes "Unknown"; the truth stays in ``true_type``)."""
    paths = abt.datasets.write_synthetic_h5ads(
        workdir / "inputs", 2, [n_obs // 2, n_obs - n_obs // 2], n_vars, grouped=True,
        n_cell_types=8, layers=("counts",), seed=seed)
    rng = np.random.default_rng(seed)
    for p in paths:
        a = ad.read_h5ad(p)
        labels = np.asarray(a.obs["cell_type"], dtype=object)
        a.obs["true_type"] = pd.Categorical(labels)
        labels[rng.random(a.n_obs) < 0.6] = "Unknown"
        a.obs["cell_type"] = pd.Categorical(labels)
        a.write_h5ad(p)
    store = workdir / "store"
    abt.create_anndata_collection(paths, store, seed=seed, progress=False)
    print(f"collection: {n_obs:,} cells x {n_vars:,} genes at {store}")
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CI-sized run")
    parser.add_argument("--store", help="an existing collection (default: generated)")
    parser.add_argument("--layer", default="counts", help="the layer of raw counts")
    parser.add_argument("--batch-key", default="batch")
    parser.add_argument("--labels-key", default="cell_type")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import scvi

    from annbatch_torch.integrations.scvi import SCVIDataModule

    scvi.settings.seed = args.seed
    trainer = {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False}
    with tempfile.TemporaryDirectory() as tmp:
        n_obs, n_vars = (4_000, 300) if args.small else (50_000, 2_000)
        store = Path(args.store) if args.store else generated_collection(
            Path(tmp), n_obs, n_vars, args.seed)
        epochs = args.epochs or (5 if args.small else 20)

        # SCVI: a batch-corrected latent space
        dm = SCVIDataModule(store, layer=args.layer, batch_key=args.batch_key,
                            batch_size=256, num_workers=args.workers, train_size=0.9,
                            seed=args.seed)
        print(f"SCVIDataModule: n_obs {dm.n_obs:,}, n_vars {dm.n_vars:,}, n_batch "
              f"{dm.n_batch}, train {dm.n_train:,} / validation {dm.n_val:,} cells")
        model = scvi.model.SCVI(registry=dm.registry, n_latent=10)
        t0 = time.perf_counter()
        model.train(max_epochs=epochs, datamodule=dm, check_val_every_n_epoch=1, **trainer)
        seconds = time.perf_counter() - t0
        elbo = model.history["elbo_validation"]["elbo_validation"].to_numpy()
        print(f"SCVI: {epochs} epochs in {seconds:.1f} s "
              f"({epochs * dm.n_train / seconds:,.0f} cells/s); validation ELBO "
              f"{elbo[0]:.1f} -> {elbo[-1]:.1f}")

        # one latent row per cell, in the collection's row order: name them
        latent = model.get_latent_representation(dataloader=dm.inference_dataloader())
        coll = abt.open_collection(store)
        names = coll.obs_names_at(np.arange(coll.n_obs))
        frame = pd.DataFrame(latent, index=names)
        print(f"latent: {frame.shape[0]:,} x {frame.shape[1]} (first cell {names[0]})")

        # SCANVI: labels for the cells that have none
        dm2 = SCVIDataModule(store, layer=args.layer, batch_key=args.batch_key,
                             labels_key=args.labels_key, model_name="SCANVI",
                             batch_size=256, num_workers=args.workers, seed=args.seed)
        scanvi = scvi.model.SCANVI(registry=dm2.registry, datamodule=dm2, n_latent=10)
        scanvi.train(max_epochs=epochs, datamodule=dm2, **trainer)
        pred = np.asarray(scanvi.predict(dataloader=dm2.inference_dataloader()))
        obs = coll.obs_at(np.arange(coll.n_obs), [args.labels_key])
        unlabeled = obs[args.labels_key].to_numpy() == dm2.unlabeled_category
        print(f"SCANVI: predicted labels for {int(unlabeled.sum()):,} unlabeled cells")
        if "obs/true_type" in coll.fields:  # generated data: the labels that were hidden
            truth = coll.obs_at(np.arange(coll.n_obs), ["true_type"])["true_type"].to_numpy()
            accuracy = float(np.mean(pred[unlabeled] == truth[unlabeled]))
            print(f"SCANVI accuracy on the unlabeled cells: {accuracy:.3f} "
                  f"(chance: {1 / 8:.3f})")


if __name__ == "__main__":
    main()
