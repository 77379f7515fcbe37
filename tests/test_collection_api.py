"""Collection metadata without the matrices (issue 17): obs_names_at, obs_at,
category_counts and var, checked against the source AnnData.

The reference is the concatenation of the inputs (``anndata.concat``); the collection's
row ``r`` is the reference row with the same obs_name. That correspondence is checked on
values (X, obsm), read from the shards by anndata itself, so the names the API returns are
tied to the rows the collection really holds, not to another reading of the same index.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import shutil
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from annbatch_torch import A, AnnBatchDataset
from annbatch_torch.errors import CollectionError, ReadError, SchemaError
from annbatch_torch.store import metadata
from annbatch_torch.store.collection import Collection, open_collection
from annbatch_torch.store.elements import CategoricalElement
from annbatch_torch.store.metadata import read_dataframe
from annbatch_torch.write.writer import create_anndata_collection

OBS_COLUMNS = ["cell_type", "batch", "n_counts", "n_genes", "is_doublet"]
CATEGORICALS = ["cell_type", "batch"]


@pytest.fixture(scope="module")
def reference(synthetic_h5ads: list[Path]) -> ad.AnnData:
    """The inputs concatenated, in input order."""
    return ad.concat([ad.read_h5ad(p) for p in synthetic_h5ads])


@pytest.fixture(scope="module")
def stored(small_collection: Collection) -> ad.AnnData:
    """The collection's rows as anndata reads its shards (in the collection's order)."""
    shards = [ad.read_zarr(small_collection.shard_path(i))
              for i in range(len(small_collection.shards))]
    return ad.concat(shards)


@pytest.fixture
def coll(small_collection: Collection) -> Collection:
    """A fresh object over the shared collection: no cache, no handle."""
    return open_collection(small_collection.path)


def _rows_of(reference: ad.AnnData, names: Any) -> np.ndarray:
    idx = reference.obs_names.get_indexer(pd.Index(names))
    assert (idx >= 0).all()
    return idx


# -- the collection's rows are the reference's rows of the same names ----------------------
def test_stored_rows_are_reference_rows_with_the_same_names(
    small_collection: Collection, stored: ad.AnnData, reference: ad.AnnData
) -> None:
    assert small_collection.n_obs == reference.n_obs == stored.n_obs
    names = small_collection.obs_names_at(np.arange(small_collection.n_obs))
    assert names.equals(stored.obs_names)
    assert names.is_unique
    assert set(names) == set(reference.obs_names)
    rows = _rows_of(reference, names)
    assert not np.array_equal(rows, np.arange(reference.n_obs))  # the collection is shuffled
    np.testing.assert_array_equal(stored.X.toarray(), reference.X[rows].toarray())
    np.testing.assert_array_equal(stored.obsm["X_pca"], reference.obsm["X_pca"][rows])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_obs_names_at_random_rows(
    data: st.DataObject, small_collection: Collection, stored: ad.AnnData,
    reference: ad.AnnData,
) -> None:
    n = small_collection.n_obs
    kind = data.draw(st.sampled_from(["list", "permutation", "repeats"]))
    if kind == "list":  # any order, duplicates likely near shard edges
        rows = np.array(data.draw(st.lists(
            st.one_of(st.integers(0, n - 1), st.sampled_from([0, 1023, 1024, 2047, 2048, n - 1])),
            max_size=200)), dtype=np.int64)
    else:
        seed = data.draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        size = data.draw(st.integers(0, n))
        rows = rng.permutation(n)[:size]
        if kind == "repeats":
            rows = np.concatenate([rows, rng.choice(n, size=data.draw(st.integers(1, 50)))])
            rng.shuffle(rows)
    dtype = data.draw(st.sampled_from([np.int64, np.int32, np.uint32]))
    got = small_collection.obs_names_at(rows.astype(dtype))
    assert isinstance(got, pd.Index)
    assert got.dtype == object
    assert len(got) == len(rows)
    assert list(got) == list(stored.obs_names[rows])
    if len(rows):  # the names point at the rows' values in the reference
        np.testing.assert_array_equal(reference.X[_rows_of(reference, got)].toarray(),
                                      stored.X[rows].toarray())


def test_obs_names_at_accepts_tensors_lists_and_scalars(
    small_collection: Collection, stored: ad.AnnData
) -> None:
    rows = [2699, 0, 1024, 1023, 0]
    want = list(stored.obs_names[rows])
    assert list(small_collection.obs_names_at(torch.tensor(rows))) == want
    assert list(small_collection.obs_names_at(rows)) == want
    assert list(small_collection.obs_names_at(1024)) == [stored.obs_names[1024]]
    assert len(small_collection.obs_names_at([])) == 0


@pytest.mark.parametrize("bad", [[2700], [-1], [0, 5, 10**12], np.array([2**63], np.uint64)])
def test_out_of_range_ids_name_the_valid_range(coll: Collection, bad: Any) -> None:
    with pytest.raises(IndexError, match=r"\[0, 2700\)"):
        coll.obs_names_at(bad)
    with pytest.raises(IndexError, match=r"\[0, 2700\)"):
        coll.obs_at(bad)


@pytest.mark.parametrize("bad", [[0.0, 1.0], np.array([True, False]), ["a"]])
def test_non_integer_ids_are_refused(coll: Collection, bad: Any) -> None:
    with pytest.raises(TypeError, match="integers"):
        coll.obs_names_at(bad)


# -- obs_at -----------------------------------------------------------------------------
def test_obs_at_values_equal_the_reference(
    small_collection: Collection, stored: ad.AnnData, reference: ad.AnnData
) -> None:
    rng = np.random.default_rng(0)
    rows = np.concatenate([rng.choice(small_collection.n_obs, 500), [0, 2699, 1024, 1024]])
    got = small_collection.obs_at(rows)
    assert list(got.columns) == OBS_COLUMNS
    names = small_collection.obs_names_at(rows)
    assert got.index.equals(names)
    assert got.index.equals(stored.obs_names[rows])
    want = reference.obs.iloc[_rows_of(reference, names)]
    pd.testing.assert_frame_equal(got, stored.obs.iloc[rows], check_categorical=True)
    for col in OBS_COLUMNS:
        if col in CATEGORICALS:
            assert isinstance(got[col].dtype, pd.CategoricalDtype)
            assert list(got[col].cat.categories) == small_collection.categories(col)
            assert list(got[col].astype(str)) == list(want[col].astype(str))
        else:
            assert got[col].dtype == want[col].dtype, col
            np.testing.assert_array_equal(got[col].to_numpy(), want[col].to_numpy())


def test_obs_at_selected_columns_and_empty_rows(
    small_collection: Collection, reference: ad.AnnData
) -> None:
    got = small_collection.obs_at([3, 3, 2000], columns=["obs/n_genes", "cell_type"])
    assert list(got.columns) == ["n_genes", "cell_type"]
    want = reference.obs.iloc[_rows_of(reference, got.index)]
    np.testing.assert_array_equal(got["n_genes"].to_numpy(), want["n_genes"].to_numpy())
    one = small_collection.obs_at([7], columns="batch")
    assert list(one.columns) == ["batch"]
    empty = small_collection.obs_at([], columns=["cell_type", "n_counts"])
    assert len(empty) == 0
    assert isinstance(empty["cell_type"].dtype, pd.CategoricalDtype)
    assert empty["n_counts"].dtype == np.float32


def test_obs_at_unknown_column_lists_the_columns(coll: Collection) -> None:
    with pytest.raises(SchemaError, match=r"'cell_typ'.*cell_type.*is_doublet"):
        coll.obs_at([0], columns=["cell_typ"])


# -- category_counts --------------------------------------------------------------------
@pytest.mark.parametrize("column", ["cell_type", "obs/batch"])
def test_category_counts_equal_value_counts(
    coll: Collection, reference: ad.AnnData, column: str
) -> None:
    got = coll.category_counts(column)
    name = column.removeprefix("obs/")
    cats = coll.categories(name)
    want = reference.obs[name].value_counts().reindex(cats, fill_value=0)
    assert list(got.index) == cats  # the collection's order, no missing entry
    assert got.dtype == np.int64
    assert got.name == "count"
    np.testing.assert_array_equal(got.to_numpy(), want.to_numpy())
    assert got.sum() == coll.n_obs
    got.iloc[0] = -5  # a copy: the cache is not touched
    assert coll.category_counts(column).iloc[0] == want.iloc[0]


@pytest.mark.parametrize("column", ["n_counts", "is_doublet", "nope"])
def test_category_counts_of_a_non_categorical_column(coll: Collection, column: str) -> None:
    with pytest.raises(SchemaError, match=rf"'{column}'.*\['cell_type', 'batch'\]"):
        coll.category_counts(column)


GAPPY_CHUNK = 32


@pytest.fixture(scope="module")
def gappy_collection(tmp_path_factory: pytest.TempPathFactory) -> tuple[Collection, ad.AnnData]:
    """A collection whose categorical has a category without cells and missing values."""
    rng = np.random.default_rng(5)
    parts = []
    for i, n in enumerate([300, 250]):
        label = rng.choice(["a", "b", "c"], n).astype(object)
        label[rng.random(n) < 0.1] = np.nan
        obs = pd.DataFrame(
            {"label": pd.Categorical(label, categories=["a", "b", "c", "never"])},
            index=[f"g{i}_{j}" for j in range(n)],
        )
        x = rng.poisson(1.0, (n, 6)).astype(np.float32)
        parts.append(ad.AnnData(x, obs=obs, var=pd.DataFrame(index=[f"v{k}" for k in range(6)])))
    out = tmp_path_factory.mktemp("gappy") / "store"
    coll = create_anndata_collection(parts, out, seed=1, n_obs_per_shard=128, progress=False,
                                     zarr_chunk_elems=GAPPY_CHUNK, compressor="lz4")
    return coll, ad.concat(parts)


def test_category_counts_zero_and_missing(gappy_collection: tuple[Collection, ad.AnnData]) -> None:
    coll, ref = gappy_collection
    got = coll.category_counts("label")
    n_missing = int(ref.obs["label"].isna().sum())
    assert n_missing > 0
    assert list(got.index[:-1]) == ["a", "b", "c", "never"]
    assert pd.isna(got.index[-1])
    want = ref.obs["label"].value_counts().reindex(["a", "b", "c", "never"], fill_value=0)
    np.testing.assert_array_equal(got.to_numpy()[:-1], want.to_numpy())
    assert got["never"] == 0
    assert got.iloc[-1] == n_missing
    assert got.sum() == coll.n_obs
    # obs_at keeps the missing values missing, whatever the shards' chunking and codec
    rows = np.arange(coll.n_obs)
    labels = coll.obs_at(rows, ["label"])["label"]
    truth = ref.obs["label"].iloc[ref.obs_names.get_indexer(labels.index)]
    assert (labels.isna().to_numpy() == truth.isna().to_numpy()).all()
    assert list(labels.dropna().astype(str)) == list(truth.dropna().astype(str))


def test_category_counts_read_codes_chunk_by_chunk(
    gappy_collection: tuple[Collection, ad.AnnData], monkeypatch: pytest.MonkeyPatch
) -> None:
    coll, _ = gappy_collection
    want = coll.category_counts("label")
    reads: list[tuple[int, int]] = []
    original = CategoricalElement.read

    def spy(self: CategoricalElement, start: int, stop: int) -> np.ndarray:
        reads.append((start, stop))
        return original(self, start, stop)

    monkeypatch.setattr(metadata, "COUNT_BLOCK_ROWS", GAPPY_CHUNK + 5)  # one chunk a read
    monkeypatch.setattr(CategoricalElement, "read", spy)
    fresh = open_collection(coll.path)
    got = fresh.category_counts("label")
    pd.testing.assert_series_equal(got, want)
    sizes = coll.shard_sizes
    assert len(reads) == sum(-(-n // GAPPY_CHUNK) for n in sizes)
    assert all(b - a <= GAPPY_CHUNK and a % GAPPY_CHUNK == 0 for a, b in reads)
    assert sum(b - a for a, b in reads) == coll.n_obs
    reads.clear()
    fresh.category_counts("obs/label")  # cached: nothing read again
    assert reads == []


def test_damaged_codes_are_refused(small_collection: Collection, tmp_path: Path) -> None:
    import zarr

    copy = tmp_path / "store"
    shutil.copytree(small_collection.path, copy)
    codes = zarr.open_array(str(copy / small_collection.shards[1].path / "obs/batch/codes"),
                            mode="r+")
    codes[5] = 7  # 'batch' has two categories
    damaged = open_collection(copy)
    with pytest.raises(ReadError, match=r"shard_00001.*'obs/batch'.*code 7 at row 5"):
        damaged.category_counts("batch")
    with pytest.raises(ReadError, match="code 7"):
        damaged.obs_at([1024 + 5], ["batch"])
    assert len(damaged.obs_at([1024 + 4], ["batch"])) == 1


# -- var --------------------------------------------------------------------------------
def test_var_is_the_var_names_index(coll: Collection, reference: ad.AnnData) -> None:
    var = coll.var
    assert isinstance(var, pd.DataFrame)
    assert var.index.equals(coll.var_names)
    assert var.index.equals(reference.var_names)
    assert list(var.columns) == []  # today's writer keeps no var columns


def _var_frame(var_names: pd.Index) -> pd.DataFrame:
    n = len(var_names)
    rng = np.random.default_rng(2)
    return pd.DataFrame({
        "gene_symbol": [f"SYM{k}" for k in range(n)],
        "feature_type": pd.Categorical(rng.choice(["Gene Expression", "Peaks"], n)),
        "mean": rng.random(n).astype(np.float32),
        "n_cells": rng.integers(0, 100, n).astype(np.int64),
        "highly_variable": rng.random(n) < 0.3,
        "missing_ids": pd.array([1, None] * (n // 2), dtype="Int64"),
    }, index=var_names)


def test_var_columns_are_read_whatever_the_shards_store(
    small_collection: Collection, tmp_path: Path
) -> None:
    import zarr
    from anndata.io import write_elem

    copy = tmp_path / "store"
    shutil.copytree(small_collection.path, copy)
    want = _var_frame(small_collection.var_names)
    for i in range(len(small_collection.shards)):  # as a writer keeping var columns would
        g = zarr.open_group(str(copy / small_collection.shards[i].path), mode="r+")
        write_elem(g, "var", want)
    var = open_collection(copy).var
    assert var.index.equals(small_collection.var_names)
    assert list(var.columns) == list(want.columns)
    assert list(var["gene_symbol"]) == list(want["gene_symbol"])
    assert isinstance(var["feature_type"].dtype, pd.CategoricalDtype)
    assert list(var["feature_type"].astype(str)) == list(want["feature_type"].astype(str))
    for col in ("mean", "n_cells", "highly_variable"):
        assert var[col].dtype == want[col].dtype
        np.testing.assert_array_equal(var[col].to_numpy(), want[col].to_numpy())
    # a nullable integer column as obs columns are read: float64, NaN where missing
    np.testing.assert_array_equal(var["missing_ids"].to_numpy(),
                                  want["missing_ids"].to_numpy(dtype=np.float64, na_value=np.nan))


def test_read_dataframe_reads_an_anndata_var_group(tmp_path: Path) -> None:
    import zarr

    names = pd.Index([f"g{k}" for k in range(10)], name="gene_ids")
    want = _var_frame(names)
    ad.AnnData(np.zeros((3, 10), np.float32), var=want).write_zarr(tmp_path / "a.zarr")
    g = zarr.open_group(str(tmp_path / "a.zarr"), mode="r")
    got = read_dataframe(g["var"], 10, "a.zarr", "var")
    assert got.index.equals(names)
    assert got.index.name == "gene_ids"
    assert list(got.columns) == list(want.columns)
    with pytest.raises(CollectionError, match="expected 11"):
        read_dataframe(g["var"], 11, "a.zarr", "var")


def test_var_index_disagreeing_with_the_manifest_is_damage(
    small_collection: Collection, tmp_path: Path
) -> None:
    import zarr
    from anndata.io import write_elem

    copy = tmp_path / "store"
    shutil.copytree(small_collection.path, copy)
    g = zarr.open_group(str(copy / small_collection.shards[0].path), mode="r+")
    write_elem(g, "var", pd.DataFrame(index=small_collection.var_names[::-1]))
    with pytest.raises(CollectionError, match="var names"):
        _ = open_collection(copy).var


# -- none of it reads X -----------------------------------------------------------------
def test_metadata_never_opens_the_matrices(
    small_collection: Collection, tmp_path: Path
) -> None:
    copy = tmp_path / "store"
    shutil.copytree(small_collection.path, copy)
    for s in small_collection.shards:
        for matrix in ("X", "layers/counts", "obsm/X_pca"):
            shutil.rmtree(copy / s.path / matrix)
    bare = open_collection(copy)
    rows = np.random.default_rng(1).choice(bare.n_obs, 300)
    assert bare.obs_names_at(rows).equals(small_collection.obs_names_at(rows))
    pd.testing.assert_frame_equal(bare.obs_at(rows), small_collection.obs_at(rows))
    pd.testing.assert_series_equal(bare.category_counts("cell_type"),
                                   small_collection.category_counts("cell_type"))
    pd.testing.assert_frame_equal(bare.var, small_collection.var)
    with pytest.raises(CollectionError):  # the matrix really is gone
        bare.element(0, "X")
    # obs_names_at needs the obs index and nothing else
    for s in small_collection.shards:
        for col in OBS_COLUMNS:
            shutil.rmtree(copy / s.path / "obs" / col)
    names_only = open_collection(copy)
    assert names_only.obs_names_at(rows).equals(small_collection.obs_names_at(rows))


def test_obs_names_are_cached_per_shard_and_not_pickled(
    small_collection: Collection, tmp_path: Path
) -> None:
    copy = tmp_path / "store"
    shutil.copytree(small_collection.path, copy)
    c = open_collection(copy)
    first = c.obs_names_at([0, 1500])  # shards 0 and 1 read, shard 2 not
    for s in small_collection.shards:
        shutil.rmtree(copy / s.path / "obs" / "_index")
    assert c.obs_names_at([1, 1025, 0, 1500]).equals(
        small_collection.obs_names_at([1, 1025, 0, 1500]))  # from the cache
    assert c.obs_names_at([0, 1500]).equals(first)
    with pytest.raises(CollectionError, match="obs index"):
        c.obs_names_at([2600])  # shard 2 was never read
    clone = pickle.loads(pickle.dumps(c))
    with pytest.raises(CollectionError, match="obs index"):
        clone.obs_names_at([0])  # a pickled collection carries no names


# -- the way back: batches to the input AnnData's order ---------------------------------
def _collect(loader: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids, pca, x = [], [], []
    for b in loader:
        ids.append(b["index"].numpy().copy())
        pca.append(b["pca"].numpy().copy())
        x.append(b["x"].numpy().copy())
    return np.concatenate(ids), np.concatenate(pca), np.concatenate(x)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_map_back_to_the_input_order_by_names(
    coll: Collection, reference: ad.AnnData, num_workers: int
) -> None:
    ds = AnnBatchDataset(coll, selector={"pca": A.obsm["X_pca"], "x": A.X}, batch_size=100,
                         chunk_size=32, preload_nchunks=4, densify=True, return_index=True,
                         seed=4)
    ids, emb, x = _collect(DataLoader(ds, batch_size=None, num_workers=num_workers))
    assert sorted(ids.tolist()) == list(range(coll.n_obs))
    names = coll.obs_names_at(ids)
    adata = reference.copy()
    adata.obsm["emb"] = emb[pd.Index(names).get_indexer(adata.obs_names)]  # the docstring's
    np.testing.assert_array_equal(adata.obsm["emb"], reference.obsm["X_pca"])
    x_back = x[pd.Index(names).get_indexer(adata.obs_names)]
    np.testing.assert_array_equal(x_back, reference.X.toarray())


def test_padded_ranks_map_back_by_names(coll: Collection, reference: ad.AnnData) -> None:
    ids, emb, seen = [], [], 0
    for rank in range(3):  # every rank's predictions, padding dropped by the mask
        ds = AnnBatchDataset(coll, selector={"pca": A.obsm["X_pca"]}, batch_size=64,
                             return_index=True, even_batches="pad", rank=rank, world_size=3,
                             shuffle=False)
        for b in ds:
            keep = b["mask"].numpy()
            seen += len(keep)
            ids.append(b["index"].numpy()[keep])
            emb.append(b["pca"].numpy()[keep])
    assert seen > coll.n_obs  # some rows were padding
    assert sum(len(i) for i in ids) == coll.n_obs
    names = coll.obs_names_at(np.concatenate(ids))
    back = np.concatenate(emb)[pd.Index(names).get_indexer(reference.obs_names)]
    np.testing.assert_array_equal(back, reference.obsm["X_pca"])


class _NamesInWorker:
    """A batch_converter naming each batch's cells in the worker process."""

    def __init__(self, coll: Collection) -> None:
        self.coll = coll

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {"index": batch["index"].copy(), "pca": batch["pca"].copy(),
                "names": list(self.coll.obs_names_at(batch["index"]))}


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_obs_names_at_in_dataloader_workers(
    coll: Collection, reference: ad.AnnData, context: str
) -> None:
    if context not in mp.get_all_start_methods():
        pytest.skip(f"no {context}")
    coll.obs_names_at([0, 1500, 2600])  # the main process holds handles and names first
    ds = AnnBatchDataset(coll, selector={"pca": A.obsm["X_pca"]}, batch_size=128,
                         return_index=True, batch_converter=_NamesInWorker(coll), seed=2)
    names, emb = [], []
    for b in DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context):
        assert b["names"] == list(coll.obs_names_at(b["index"]))
        names.extend(b["names"])
        emb.append(b["pca"])
    order = pd.Index(names).get_indexer(reference.obs_names)
    assert (order >= 0).all()
    np.testing.assert_array_equal(np.concatenate(emb)[order], reference.obsm["X_pca"])
