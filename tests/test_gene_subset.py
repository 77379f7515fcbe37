"""AnnBatchDataset(var_names=[...]): a subset or reordering of the genes of X and layers,
equal to the full batches' columns, on every path (sparse, dense, workers, device pool)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import annbatch_torch as abt
from annbatch_torch import A, SchemaError
from annbatch_torch.store.collection import Collection

SEL = {"x": A.X, "counts": A.layers["counts"], "pca": A.obsm["X_pca"], "ct": A.obs["cell_type"]}
KW = dict(selector=SEL, batch_size=256, chunk_size=64, preload_nchunks=4, seed=3,
          return_index=True)


def _dense(t: torch.Tensor) -> np.ndarray:
    return (t.to_dense() if t.layout == torch.sparse_csr else t).numpy()


def _check(coll: Collection, genes: list[str], workers: int = 0, **kw: object) -> None:
    cols = coll.var_names.get_indexer(genes)
    full = list(abt.AnnBatchDataset(coll, **KW, **kw))
    sub_ds = abt.AnnBatchDataset(coll, **KW, var_names=genes, **kw)
    assert list(sub_ds.var_names) == genes
    loader = abt.AnnBatchDataLoader(sub_ds, num_workers=workers) if workers else sub_ds
    sub = list(loader)
    assert len(sub) == len(full)
    for a, b in zip(full, sub):
        np.testing.assert_array_equal(a["index"].numpy(), b["index"].numpy())
        for key in ("x", "counts"):
            np.testing.assert_array_equal(_dense(b[key]), _dense(a[key])[:, cols])
            assert b[key].dtype == a[key].dtype
            assert b[key].layout == a[key].layout
        np.testing.assert_array_equal(b["pca"].numpy(), a["pca"].numpy())  # not gene-indexed
        np.testing.assert_array_equal(b["ct"].numpy(), a["ct"].numpy())


@pytest.mark.parametrize("densify", [False, True])
@pytest.mark.parametrize("how", ["subset", "reordered", "reversed all"])
def test_selected_genes_equal_the_full_batches_columns(small_collection: Collection,
                                                       densify: bool, how: str) -> None:
    names = list(small_collection.var_names)
    rng = np.random.default_rng(0)
    genes = {"subset": sorted(rng.choice(names, 50, replace=False), key=names.index),
             "reordered": list(rng.choice(names, 50, replace=False)),
             "reversed all": names[::-1]}[how]
    _check(small_collection, genes, densify=densify)


def test_selected_genes_with_workers_and_on_a_device_pool(small_collection: Collection) -> None:
    genes = list(np.random.default_rng(1).permutation(small_collection.var_names)[:40])
    _check(small_collection, genes, densify=True, workers=2)
    _check(small_collection, genes, densify=False, device="cpu")


def test_selected_genes_equal_the_source_anndata(small_collection: Collection,
                                                 synthetic_h5ads: list) -> None:
    import anndata as ad

    ref = ad.concat([ad.read_h5ad(p) for p in synthetic_h5ads])
    genes = list(ref.var_names[::-7])
    ds = abt.AnnBatchDataset(small_collection, var_names=genes, batch_size=500,
                             densify=True, return_index=True)
    for b in ds:
        names = small_collection.obs_names_at(b["index"].numpy())
        want = ref[names, genes].X
        np.testing.assert_array_equal(b["X"].numpy(), want.toarray())


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_any_subset_and_order(small_collection: Collection, data: st.DataObject) -> None:
    names = list(small_collection.var_names)
    genes = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names),
                               unique=True))
    ds = abt.AnnBatchDataset(small_collection, selector={"x": A.X}, batch_size=1000,
                             var_names=genes, shuffle=False)
    full = abt.AnnBatchDataset(small_collection, selector={"x": A.X}, batch_size=1000,
                               shuffle=False)
    cols = small_collection.var_names.get_indexer(genes)
    for a, b in zip(full, ds):
        np.testing.assert_array_equal(b["x"].to_dense().numpy(), a["x"].to_dense().numpy()[:, cols])


def test_unknown_or_repeated_genes_are_refused(small_collection: Collection) -> None:
    with pytest.raises(SchemaError, match=r"1 of the 2 var_names are not among its 200 genes"):
        abt.AnnBatchDataset(small_collection, var_names=[small_collection.var_names[0], "nope"])
    with pytest.raises(SchemaError, match="more than once"):
        abt.AnnBatchDataset(small_collection, var_names=[small_collection.var_names[0]] * 2)
    with pytest.raises(SchemaError, match="non-empty"):
        abt.AnnBatchDataset(small_collection, var_names=[])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30), st.integers(0, 12), st.data())
def test_cut_equals_numpy_column_indexing(n_vars: int, n_rows: int,
                                          data: st.DataObject) -> None:
    """GeneSelection.cut on CSR (a slice of a bigger pool too) and dense rows."""
    import scipy.sparse as sp

    from annbatch_torch.read.genes import GeneSelection

    names = [f"g{i}" for i in range(n_vars)]
    genes = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=n_vars,
                               unique=True))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    dense = (rng.random((n_rows + 2, n_vars)) < 0.4) * rng.integers(1, 9, (n_rows + 2, n_vars))
    sel = GeneSelection(names, genes)
    cols = [names.index(g) for g in genes]
    want = dense[1:-1][:, cols].astype(np.float32)
    m = sp.csr_matrix(dense.astype(np.float32))[1:-1]  # indptr not starting at 0 after slicing
    m = sp.csr_matrix((m.data, m.indices, m.indptr), shape=m.shape)
    got = sel.cut(m)
    assert got.shape == want.shape
    assert got.has_sorted_indices
    np.testing.assert_array_equal(got.toarray(), want)
    np.testing.assert_array_equal(sel.cut(dense[1:-1].astype(np.float32)), want)
