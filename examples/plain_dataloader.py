"""The smallest complete loop: h5ad files -> shuffled collection -> DataLoader -> model."""

import argparse
import tempfile

import torch

import annbatch_torch as abt
from annbatch_torch import A


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true", help="4k cells instead of 100k")
    n_obs = 4_000 if parser.parse_args().small else 100_000
    with tempfile.TemporaryDirectory() as tmp:
        paths = abt.datasets.write_synthetic_h5ads(tmp, 2, n_obs // 2, 500)  # a.h5ad, b.h5ad
        coll = abt.create_anndata_collection(paths, f"{tmp}/store", seed=0)  # once, offline
        ds = abt.AnnBatchDataset(coll, selector={"x": A.X, "y": A.obs["cell_type"]},
                                 batch_size=1024, densify=True, seed=0)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        model = torch.nn.Linear(coll.n_vars, len(coll.categories("cell_type")))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for epoch in range(3):
            ds.set_epoch(epoch)  # a new order every epoch, workers included
            for batch in loader:  # {"x": float32 [B, n_vars], "y": int64 [B]}
                loss = torch.nn.functional.cross_entropy(model(torch.log1p(batch["x"])), batch["y"])
                opt.zero_grad()
                loss.backward()
                opt.step()
            print(f"epoch {epoch}: loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
