"""annbatch_torch.datasets: realistic synthetic AnnData."""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from annbatch_torch.datasets import CELL_TYPE_NAMES, synthetic, write_synthetic_h5ads


@pytest.fixture(scope="module")
def adata() -> ad.AnnData:
    return synthetic(6000, 2000, seed=0, layers=("counts", "log1p"), obsm_pca=10)


def test_shape_obs_and_matrix(adata: ad.AnnData) -> None:
    x = adata.X
    assert adata.shape == (6000, 2000)
    assert isinstance(x, sp.csr_matrix)
    assert x.dtype == np.float32
    assert x.has_sorted_indices
    y = x.copy()
    y.sum_duplicates()
    assert y.nnz == x.nnz  # canonical: no duplicate entries
    assert (x.data >= 1).all()
    assert np.array_equal(x.data, np.round(x.data))
    assert abs(x.nnz / (6000 * 2000) - 0.092) < 0.092 * 0.15
    assert list(adata.obs.columns) == ["cell_type", "batch", "n_counts", "n_genes", "is_doublet"]
    assert list(adata.obs["cell_type"].cat.categories) == list(CELL_TYPE_NAMES[:8])
    assert list(adata.obs["batch"].cat.categories) == ["batch_0", "batch_1"]
    assert adata.obs["is_doublet"].dtype == bool
    assert 0 < adata.obs["is_doublet"].mean() < 0.1
    np.testing.assert_allclose(adata.obs["n_counts"], np.asarray(x.sum(axis=1)).ravel())
    np.testing.assert_array_equal(adata.obs["n_genes"], np.diff(x.indptr))
    assert adata.obs_names[0] == "cell_0"
    assert adata.var_names[0] == "gene_0"
    assert (adata.layers["counts"] != x).nnz == 0
    assert adata.layers["log1p"].nnz == x.nnz
    assert adata.obsm["X_pca"].shape == (6000, 10)
    assert adata.obsm["X_pca"].dtype == np.float32


def test_realistic_structure(adata: ad.AnnData) -> None:
    x = adata.X
    detected = np.sort(np.bincount(x.indices, minlength=x.shape[1]) / x.shape[0])[::-1]
    assert detected[0] > 0.9
    assert np.median(detected) < 0.1
    totals = adata.obs["n_counts"].to_numpy()
    assert totals.std() / totals.mean() > 0.4  # lognormal library sizes
    assert np.corrcoef(np.log(totals), np.log(adata.obs["n_genes"]))[0, 1] > 0.8
    # cell types are linearly separable: nearest centroid on log-normalised data
    logn = adata.layers["log1p"].toarray()
    y = adata.obs["cell_type"].cat.codes.to_numpy()
    train, test = np.arange(4000), np.arange(4000, 6000)
    centroids = np.stack([logn[train][y[train] == k].mean(0) for k in range(8)])
    scores = logn[test] @ centroids.T - 0.5 * (centroids**2).sum(1)
    assert (scores.argmax(1) == y[test]).mean() > 0.9


def test_grouped_seed_and_options() -> None:
    g = synthetic(1000, 300, grouped=True, seed=4)
    codes = g.obs["cell_type"].cat.codes.to_numpy()
    assert (np.diff(codes) >= 0).all()
    assert len(np.unique(codes)) > 4
    a, b = synthetic(500, 300, seed=1), synthetic(500, 300, seed=1)
    c = synthetic(500, 300, seed=2)
    assert (a.X != b.X).nnz == 0
    assert a.obs.equals(b.obs)
    assert (a.X != c.X).nnz > 0
    d = synthetic(200, 50, sparse=False, dtype=np.float64, n_cell_types=14, n_batches=3,
                  var_prefix="ENSG", obs_prefix="x", x="log1p")
    assert isinstance(d.X, np.ndarray)
    assert d.X.dtype == np.float64
    assert d.var_names[0] == "ENSG0"
    assert d.obs_names[0] == "x0"
    assert d.obs["cell_type"].cat.categories[-1] == "type_13"
    assert len(d.obs["batch"].cat.categories) == 3
    assert not np.array_equal(d.X, np.round(d.X))  # log1p, not counts
    with pytest.raises(ValueError, match="layers"):
        synthetic(10, 10, layers=("raw",))
    with pytest.raises(ValueError, match="density"):
        synthetic(10, 10, density=1.5)


def test_write_synthetic_h5ads(tmp_path: Path) -> None:
    paths = write_synthetic_h5ads(tmp_path / "same", 2, [300, 200], 100, layers=("counts",))
    assert [p.name for p in paths] == ["part0.h5ad", "part1.h5ad"]
    a, b = (ad.read_h5ad(p) for p in paths)
    assert (a.n_obs, b.n_obs) == (300, 200)
    assert list(a.var_names) == list(b.var_names)
    assert not set(a.obs_names) & set(b.obs_names)
    assert "counts" in a.layers
    paths = write_synthetic_h5ads(tmp_path / "overlap", 3, 400, 100, overlapping_genes=True,
                                  seed=3)
    sets = [list(ad.read_h5ad(p, backed="r").var_names) for p in paths]
    assert all(len(s) == 100 for s in sets)
    common = set(sets[0]).intersection(*sets[1:])
    assert 0 < len(common) < 100
    assert len(set().union(*sets)) > 100
    assert sets[1] != sorted(sets[1], key=lambda v: int(v.split("_")[1]))  # shuffled order
    # one gene model: a gene's detection rate agrees across files
    ads = [ad.read_h5ad(p) for p in paths]
    genes = sorted(common)
    rates = [np.asarray((x[:, genes].X > 0).mean(0)).ravel() for x in ads]
    assert np.corrcoef(rates[0], rates[1])[0, 1] > 0.9
    with pytest.raises(ValueError, match="entries"):
        write_synthetic_h5ads(tmp_path / "bad", 2, [1, 2, 3], 10)
    assert pd.api.types.is_float_dtype(ads[0].obs["n_counts"])
