"""Selectors, per-field transforms and a custom ``batch_converter``.

One batch carries several fields of the same cells, each under a key you choose:

* ``"counts"``: the ``counts`` layer, as a ``torch.sparse_csr_tensor`` (sparse stays
  sparse until the GPU, see ``annbatch_torch.to_device``);
* ``"x"``: X normalised in the DataLoader worker by a transform (library size to 10,000
  counts, then ``log1p``), still sparse;
* ``"pca"``: ``obsm["X_pca"]``, dense float32;
* ``"label"`` / ``"batch"``: categorical obs columns as int64 codes of the collection's
  global categories;
* ``"library_size"``: added by a custom ``batch_converter`` that composes with
  ``annbatch_torch.batch_dict_converter`` (it runs in the worker, on numpy/scipy values).

The script checks every value of the first batches against the input files.

    python examples/selectors_and_transforms.py --small
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import scipy.sparse as sp
import torch

import annbatch_torch as abt
from annbatch_torch import A


def log1p_normalize(x: sp.csr_matrix | np.ndarray, target: float = 1e4) -> Any:
    """Scale each row to ``target`` total counts, then ``log1p``; keeps CSR sparse.

    A module-level function (not a lambda), so the dataset pickles for ``spawn`` workers.
    """
    total = np.asarray(x.sum(axis=1)).ravel()
    scale = (target / np.maximum(total, 1.0)).astype(np.float32)
    if sp.issparse(x):
        out = sp.csr_matrix(sp.diags(scale) @ x, dtype=np.float32)
        out.data = np.log1p(out.data)
        return out
    return np.log1p(x * scale[:, None])


def with_library_size(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A ``batch_converter``: the default conversion plus each cell's total counts."""
    library_size = np.asarray(batch["counts"].sum(axis=1), dtype=np.float32).ravel()
    out = abt.batch_dict_converter(batch)
    out["library_size"] = torch.from_numpy(library_size)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="small generated data (CI)")
    parser.add_argument("--num-workers", type=int, default=2)
    args = parser.parse_args(argv)
    n_obs, n_vars = (3_000, 200) if args.small else (100_000, 2_000)

    with tempfile.TemporaryDirectory() as tmp:
        paths = abt.datasets.write_synthetic_h5ads(
            Path(tmp) / "inputs", 2, n_obs // 2, n_vars, layers=("counts",), obsm_pca=16,
        )
        coll = abt.create_anndata_collection(paths, Path(tmp) / "store", seed=0,
                                             progress=False)
        print(f"collection: {coll.n_obs:,} cells, fields {sorted(coll.fields)}")

        selector = {
            "counts": A.layers["counts"],
            "x": A.X.with_transform(log1p_normalize),
            "pca": "obsm/X_pca",  # field strings work too
            "label": A.obs["cell_type"],
            "batch": A.obs["batch"],
        }
        ds = abt.AnnBatchDataset(coll, selector=selector, batch_size=256, seed=0,
                                 return_index=True, batch_converter=with_library_size)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=args.num_workers)

        # Only to check the values: "index" holds collection rows; the shards are plain
        # AnnData zarr stores, so their obs_names map a row back to its input cell.
        truth = ad.concat([ad.read_h5ad(p) for p in paths])
        store_names = np.concatenate([ad.read_zarr(coll.shard_path(i)).obs_names.to_numpy()
                                      for i in range(len(coll.shards))])
        cell_types = coll.categories("cell_type")
        checked = 0
        for i, b in enumerate(loader):
            if i == 0:
                for key, value in b.items():
                    print(f"  {key:13s} {value.dtype!s:14s} {tuple(value.shape)} "
                          f"{'sparse CSR' if value.layout == torch.sparse_csr else 'dense'}")
            if i >= 3:
                continue
            rows = truth.obs_names.get_indexer(store_names[b["index"].numpy()])
            counts = truth.layers["counts"][rows].toarray()
            np.testing.assert_allclose(b["counts"].to_dense().numpy(), counts)
            np.testing.assert_allclose(b["x"].to_dense().numpy(),
                                       log1p_normalize(counts), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(b["pca"].numpy(), truth.obsm["X_pca"][rows], rtol=1e-6)
            names = np.asarray(cell_types, dtype=object)[b["label"].numpy()]
            assert (names == truth.obs["cell_type"].to_numpy()[rows]).all()
            np.testing.assert_allclose(b["library_size"].numpy(), counts.sum(axis=1), rtol=1e-5)
            checked += len(rows)
        print(f"checked every field of {checked:,} cells against the input files: OK")


if __name__ == "__main__":
    main()
