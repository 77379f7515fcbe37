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


def _read_input(path: Path) -> ad.AnnData:
    return ad.read_zarr(path) if path.suffix == ".zarr" else ad.read_h5ad(path)


@pytest.fixture(scope="module")
def atlas(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    from annbatch_torch.datasets import write_synthetic_atlas

    out = tmp_path_factory.mktemp("atlas")
    paths = write_synthetic_atlas(out, 6000, 16, seed=3, n_genes=3000, n_cell_types=60,
                                  block_obs=700, progress=False)
    return out, paths


def test_atlas_inputs_shapes_formats_and_counts(atlas: tuple[Path, list[Path]]) -> None:
    import json

    out, paths = atlas
    meta = json.loads((out / "atlas.json").read_text())
    assert [out / r["path"] for r in meta["inputs"]] == paths
    sizes = [r["n_obs"] for r in meta["inputs"]]
    assert sum(sizes) == 6000
    assert max(sizes) >= 5 * min(sizes)  # heavy-tailed: a few large inputs, many small
    assert sorted({r["format"] for r in meta["inputs"]}) == ["csc", "csr", "dense", "zarr"]
    names, genes_per_cell, universe = [], [], set()
    for path, rec in zip(paths, meta["inputs"]):
        a = _read_input(path)
        assert a.shape == (rec["n_obs"], rec["n_vars"])
        x = a.X
        want = {"csr": sp.csr_matrix, "zarr": sp.csr_matrix, "csc": sp.csc_matrix,
                "dense": np.ndarray}[rec["format"]]
        assert isinstance(x, want), (path, type(x))
        values = x.data if sp.issparse(x) else x[x != 0]
        assert values.dtype == np.dtype(rec["dtype"])
        assert (values >= 1).all()
        assert (values == np.rint(values)).all()  # integer counts
        csr = sp.csr_matrix(x)
        genes_per_cell.append(np.diff(csr.indptr))
        if sp.issparse(x) and rec["format"] != "csc":
            assert x.has_sorted_indices
        np.testing.assert_allclose(a.obs["n_counts"], np.asarray(csr.sum(axis=1)).ravel())
        assert 0.6 * 3000 <= a.n_vars <= 3000
        assert a.var_names.is_unique
        universe |= set(a.var_names)
        names.append(a.obs_names)
        for col in ("cell_type", "donor_id", "assay", "tissue"):
            assert isinstance(a.obs[col].dtype, pd.CategoricalDtype), col
    assert len(universe) <= 3000
    allnames = pd.Index(np.concatenate([n.to_numpy() for n in names]))
    assert allnames.is_unique
    med = float(np.median(np.concatenate(genes_per_cell)))
    assert 150 <= med <= 350, med  # ~250 non-zeros per cell


def test_atlas_inputs_differ_in_genes_order_and_categories(
        atlas: tuple[Path, list[Path]]) -> None:
    _, paths = atlas
    adatas = [_read_input(p) for p in paths]
    orders = {tuple(a.var_names[:20]) for a in adatas}
    assert len(orders) == len(adatas)  # each input its own gene order
    common = set.intersection(*(set(a.var_names) for a in adatas))
    assert len(common) >= int(0.6 * 3000)  # the core every input holds
    cats = [tuple(a.obs["cell_type"].cat.categories) for a in adatas]
    assert len(set(cats)) > 1
    donors = [set(a.obs["donor_id"].cat.categories) for a in adatas]
    assert all(not (d & e) for i, d in enumerate(donors) for e in donors[i + 1:])
    assert set().union(*(set(a.obs["assay"].cat.categories) for a in adatas)) <= set(
        __import__("annbatch_torch.datasets", fromlist=["x"]).ATLAS_ASSAYS)


def test_atlas_is_reproducible_and_bounded(tmp_path: Path) -> None:
    """The same arguments give the same files; an input's matrix is streamed block by block
    (memory grows with its obs columns only)."""
    import tracemalloc

    from annbatch_torch.datasets import write_synthetic_atlas

    kw = dict(n_genes=2000, n_cell_types=20, block_obs=500, progress=False)
    a = write_synthetic_atlas(tmp_path / "a", 3000, 2, seed=5, **kw)
    b = write_synthetic_atlas(tmp_path / "b", 3000, 2, seed=5, **kw)
    for p, q in zip(a, b):
        x, y = _read_input(p), _read_input(q)
        assert (sp.csr_matrix(x.X) != sp.csr_matrix(y.X)).nnz == 0
        pd.testing.assert_frame_equal(x.obs, y.obs)
    peaks = []
    for n, inputs in ((2_000, 1), (16_000, 1)):  # 8x the cells of one input, streamed
        tracemalloc.start()
        write_synthetic_atlas(tmp_path / f"n{n}", n, inputs, seed=5, **kw)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 2 * peaks[0], peaks
    with pytest.raises(ValueError, match="n_inputs >= 3"):
        write_synthetic_atlas(tmp_path / "big", 2_500_000, 2, progress=False)
