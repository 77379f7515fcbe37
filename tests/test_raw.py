"""AnnData's ``raw``: carried by the writer (its own genes, joined like X's), selectable as
``A.raw.X`` / ``"raw/X"`` from a collection and in place, cut by ``var_names=``; inputs
without raw and raw genes that differ follow the one rule for fields."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import annbatch_torch as abt
from annbatch_torch import A, CollectionError, InputError, SchemaError
from annbatch_torch.fields import Field
from annbatch_torch.write.prepare import prepare_collection

if TYPE_CHECKING:
    from conftest import WriteH5ads


def _with_raw(tag: str, n: int, raw_genes: list[str], hv: list[str], seed: int) -> ad.AnnData:
    """Counts of ``raw_genes`` in raw; X: the log of the ``hv`` genes (dense)."""
    rng = np.random.default_rng(seed)
    counts = sp.random(n, len(raw_genes), density=0.3, format="csr", random_state=rng,
                       dtype=np.float64)
    counts.data = np.round(counts.data * 20) + 1
    counts = counts.astype(np.float32)
    full = ad.AnnData(counts, obs=pd.DataFrame(index=[f"{tag}{i}" for i in range(n)]),
                      var=pd.DataFrame({"symbol": [f"sym_{g}" for g in raw_genes]},
                                       index=raw_genes))
    full.obs["ct"] = pd.Categorical(rng.choice(["B", "T"], n))
    a = full[:, hv].copy()
    a.X = np.log1p(a.X.toarray())
    a.raw = full
    return a


def _raw_rows(a: ad.AnnData, genes: pd.Index) -> np.ndarray:
    """``a.raw.X`` in the columns ``genes`` (zeros where ``a`` has no such raw gene)."""
    m = a.raw.X.toarray()
    out = np.zeros((a.n_obs, len(genes)), dtype=np.float32)
    cols = a.raw.var_names.get_indexer(genes)
    out[:, cols >= 0] = m[:, cols[cols >= 0]]
    return out




def _values(ds: abt.AnnBatchDataset, key: str) -> dict[int, np.ndarray]:
    out = {}
    for b in ds:
        v = b[key]
        v = (v.to_dense() if v.layout == torch_sparse_csr() else v).numpy()
        for i, row in zip(b["index"].numpy(), v):
            out[int(i)] = row
    return out


def torch_sparse_csr() -> Any:
    import torch

    return torch.sparse_csr


@pytest.fixture(scope="module")
def two_with_raw(tmp_path_factory: pytest.TempPathFactory, write_h5ads: WriteH5ads) -> list[Path]:
    """Two inputs whose raw genes differ (g0-g9 and g3-g12) and whose X are 4 of them."""
    a = _with_raw("a", 40, [f"g{k}" for k in range(10)], ["g3", "g5", "g7", "g9"], 1)
    b = _with_raw("b", 30, [f"g{k}" for k in range(3, 13)], ["g3", "g5", "g7", "g9"], 2)
    return write_h5ads([a, b], tmp_path_factory.mktemp("raw_inputs"))


@pytest.mark.parametrize("var_join", ["inner", "outer"])
def test_raw_is_carried_with_its_own_genes(two_with_raw: list[Path], tmp_path: Path,
                                           var_join: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adatas = [ad.read_h5ad(p) for p in two_with_raw]
    coll = abt.create_anndata_collection(two_with_raw, tmp_path / "store", var_join=var_join,
                                         progress=False, n_obs_per_shard=32)
    assert "raw/X" in coll.fields
    assert list(coll.var_names) == ["g3", "g5", "g7", "g9"]
    want_raw = ([f"g{k}" for k in range(3, 10)] if var_join == "inner"
                else [f"g{k}" for k in range(13)])
    assert list(coll.raw_var_names) == want_raw
    assert coll.fields["raw/X"].shape == (None, len(want_raw))
    raw_var = coll.raw_var
    assert raw_var is not None
    assert list(raw_var["symbol"]) == [f"sym_{g}" for g in want_raw]
    # each shard is an AnnData store with raw, as anndata reads it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shards = [ad.read_zarr(coll.shard_path(i)) for i in range(len(coll.shards))]
    for s in shards:
        assert s.raw is not None
        assert list(s.raw.var_names) == want_raw
    by_name = {n: r for a in adatas
               for n, r in zip(a.obs_names, _raw_rows(a, pd.Index(want_raw)))}
    for s in shards:
        for n, row in zip(s.obs_names, s.raw.X.toarray()):
            np.testing.assert_array_equal(row, by_name[n])
    # the loader: raw/X beside X, values equal to the inputs' raw
    ds = abt.AnnBatchDataset(coll, selector={"counts": A.raw.X, "x": A.X}, batch_size=16,
                             return_index=True)
    names = coll.obs_names_at(np.arange(coll.n_obs))
    got = _values(ds, "counts")
    assert len(got) == coll.n_obs
    for i, row in got.items():
        np.testing.assert_array_equal(row, by_name[names[i]])


def test_the_legacy_example_reads_raw_on_both_paths_with_workers(pbmc68k_reduced: Path,
                                                                 tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = ad.read_h5ad(pbmc68k_reduced)
    want = a.raw.X.toarray()
    coll = abt.create_anndata_collection([pbmc68k_reduced], tmp_path / "store",
                                         progress=False)
    assert list(coll.raw_var_names) == list(a.raw.var_names)
    for source in (coll, [pbmc68k_reduced]):
        ds = abt.AnnBatchDataset(source, selector={"r": "raw/X"}, batch_size=64,
                                 return_index=True, densify=True)
        rows = np.concatenate([b["index"].numpy() for b in
                               abt.AnnBatchDataLoader(ds, num_workers=2)])
        got = np.concatenate([b["r"].numpy() for b in abt.AnnBatchDataLoader(ds, num_workers=2)])
        assert sorted(rows.tolist()) == list(range(a.n_obs))
        names = (coll.obs_names_at(rows) if source is coll else a.obs_names[rows])
        np.testing.assert_array_equal(got, want[a.obs_names.get_indexer(names)])


def test_inputs_without_raw_follow_the_field_rule(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture,
                                                  write_h5ads: WriteH5ads) -> None:
    a = _with_raw("a", 20, ["g0", "g1", "g2"], ["g0", "g1"], 1)
    b = a.copy()
    b.obs_names = [f"b{i}" for i in range(b.n_obs)]
    del b.raw
    paths = write_h5ads([a, b], tmp_path / "in")
    with caplog.at_level(logging.WARNING, logger="annbatch_torch"):
        coll = abt.create_anndata_collection(paths, tmp_path / "s1", progress=False)
    assert "raw/X" not in coll.fields
    assert coll.raw_var_names is None
    assert coll.raw_var is None
    assert str(paths[1]) in coll.unavailable["raw/X"]
    assert "raw/X is not carried" in caplog.text
    with pytest.raises(InputError, match=rf"{paths[1]}.*no raw.*raw=False"):
        abt.create_anndata_collection(paths, tmp_path / "s2", progress=False, raw=True)
    assert not (tmp_path / "s2").exists()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="annbatch_torch"):
        coll = abt.create_anndata_collection(paths, tmp_path / "s3", progress=False, raw=False)
    assert "raw/X" not in coll.fields
    assert "raw" not in caplog.text
    with pytest.raises(InputError, match=r"raw=.yes. must be None"):
        abt.create_anndata_collection(paths, tmp_path / "s4", progress=False, raw="yes")
    # in place: selecting raw gives the reason
    with pytest.raises(SchemaError, match=str(paths[1])):
        abt.AnnBatchDataset(paths, selector={"r": A.raw.X})


def test_in_place_raw_needs_one_raw_gene_order(two_with_raw: list[Path]) -> None:
    ds = abt.AnnBatchDataset(two_with_raw[:1], selector={"r": A.raw.X})
    assert list(ds.source.raw_var_names) == [f"g{k}" for k in range(10)]
    with pytest.raises(SchemaError, match=r"raw\.var_names differ"):
        abt.AnnBatchDataset(two_with_raw, selector={"r": A.raw.X})
    assert len(list(abt.AnnBatchDataset(two_with_raw, batch_size=10))) == 7  # X still reads


def test_var_names_cut_raw_by_its_own_genes(two_with_raw: list[Path], tmp_path: Path) -> None:
    coll = abt.create_anndata_collection(two_with_raw, tmp_path / "store", var_join="outer",
                                         progress=False)
    genes = ["g9", "g3"]
    kw: dict[str, Any] = dict(batch_size=16, return_index=True, densify=True, seed=1)
    full = abt.AnnBatchDataset(coll, selector={"r": A.raw.X, "x": A.X}, **kw)
    cut = abt.AnnBatchDataset(coll, selector={"r": A.raw.X, "x": A.X}, var_names=genes, **kw)
    raw_cols = coll.raw_var_names.get_indexer(genes)
    x_cols = coll.var_names.get_indexer(genes)
    for f, c in zip(full, cut):
        np.testing.assert_array_equal(c["r"].numpy(), f["r"].numpy()[:, raw_cols])
        np.testing.assert_array_equal(c["x"].numpy(), f["x"].numpy()[:, x_cols])
    with pytest.raises(SchemaError, match=r"\(raw\).*not among"):
        abt.AnnBatchDataset(coll, selector={"r": A.raw.X}, var_names=["g3", "nope"])


def test_a_reference_gene_list_aligns_raw_too(two_with_raw: list[Path], tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adatas = [ad.read_h5ad(p) for p in two_with_raw]
    reference = ["g12", "g0", "g5", "NEW"]
    coll = abt.create_anndata_collection(two_with_raw, tmp_path / "store", var_names=reference,
                                         progress=False)
    assert list(coll.var_names) == reference
    assert list(coll.raw_var_names) == reference
    by_name = {n: r for a in adatas for n, r in zip(a.obs_names,
                                                     _raw_rows(a, pd.Index(reference)))}
    ds = abt.AnnBatchDataset(coll, selector={"r": "raw/X"}, batch_size=16, return_index=True)
    names = coll.obs_names_at(np.arange(coll.n_obs))
    for i, row in _values(ds, "r").items():
        np.testing.assert_array_equal(row, by_name[names[i]])


def test_prepare_collection_wants_raw_when_asked(tmp_path: Path, write_h5ads: WriteH5ads) -> None:
    a = _with_raw("a", 20, ["g0", "g1", "g2"], ["g0", "g1"], 1)
    paths = write_h5ads([a], tmp_path / "in")
    store = tmp_path / "store"
    assert prepare_collection(paths, store, raw=False, progress=False)
    assert "raw/X" not in abt.open_collection(store).fields
    assert not prepare_collection(paths, store, progress=False)
    assert prepare_collection(paths, store, raw=True, progress=False)
    assert "raw/X" in abt.open_collection(store).fields
    assert not prepare_collection(paths, store, raw=True, progress=False)


def test_the_manifest_guards_raw_genes(two_with_raw: list[Path], tmp_path: Path) -> None:
    store = tmp_path / "store"
    abt.create_anndata_collection(two_with_raw[:1], store, progress=False)
    names = json.loads((store / "raw_var_names.json").read_text())
    (store / "raw_var_names.json").write_text(json.dumps(names[:-1]))
    with pytest.raises(CollectionError, match="raw var names"):
        abt.open_collection(store)
    (store / "raw_var_names.json").write_text(json.dumps([*names[:-1], "other"]))
    with pytest.raises(CollectionError, match="digest"):
        abt.open_collection(store)
    (store / "raw_var_names.json").unlink()
    with pytest.raises(CollectionError, match="raw var names"):
        abt.open_collection(store)


def test_raw_selectors() -> None:
    assert A.raw.X == Field.parse("raw/X") == Field("raw", "X")
    assert str(A.raw.X) == "raw/X"
    assert repr(A.raw.X) == "A.raw.X"
    with pytest.raises(ValueError, match="raw holds one matrix"):
        Field.parse("raw/counts")
    with pytest.raises(ValueError, match="'raw/X'"):
        Field.parse("rawX")


def test_duplicate_raw_genes_follow_the_field_rule(tmp_path: Path,
                                                   write_h5ads: WriteH5ads) -> None:
    """The writer crashed in pandas (InvalidIndexError) with the default inner join."""
    a = _with_raw("a", 12, ["g0", "g1", "g2", "g3"], ["g0", "g1"], 1)
    raw = a.raw.to_adata()
    raw.var_names = ["g0", "g1", "g1", "g3"]
    a.raw = raw
    for inputs in ([a], write_h5ads([a], tmp_path / "in")):
        coll = abt.create_anndata_collection(inputs, tmp_path / "out", progress=False,
                                             overwrite=True)
        assert "raw/X" not in coll.fields
        assert "raw.var_names are not unique" in coll.unavailable["raw/X"]
        with pytest.raises(InputError, match=r"raw\.var_names are not unique"):
            abt.create_anndata_collection(inputs, tmp_path / "asked", progress=False,
                                          raw=True)
        assert not (tmp_path / "asked").exists()
