"""Inputs read in place answer as the collection written from them (issue 29 items 6, 7, 8).

Gene identifiers that do not meet (an outer join of inputs sharing no genes is refused, one
sharing under 10% warned about; the zero-overlap inner join no longer recommends the outer
one), non-finite matrix values refused on the in-place path as the writer refuses them, and
one metadata API (``obs_names``, ``obs_names_at``, ``obs_at``, ``category_counts``) on both
kinds of source, compared with each other and with the inputs' AnnData.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest
from conftest import run_python

import annbatch_torch as abt
from annbatch_torch import A
from annbatch_torch.datasets import synthetic
from annbatch_torch.errors import InputError, SchemaError
from annbatch_torch.store.inputs.inplace import InPlaceSource

if TYPE_CHECKING:
    from conftest import WriteH5ads


def _write(adatas: list[Any], folder: Path, write_h5ads: WriteH5ads) -> list[Path]:
    return write_h5ads(adatas, folder)


def _with_genes(a: Any, genes: list[str]) -> Any:
    a = a.copy()
    a.var_names = genes
    return a


# -- item 6: gene identifiers ---------------------------------------------------------------
def _ensembl(n: int) -> list[str]:
    return [f"ENSG{i:011d}" for i in range(n)]


def _symbols(n: int) -> list[str]:
    return [f"GENE{i}" for i in range(n)]


def test_outer_join_of_inputs_sharing_no_gene_is_refused(tmp_path: Path,
                                                         write_h5ads: WriteH5ads) -> None:
    a = _with_genes(synthetic(40, 30, seed=1), _ensembl(30))
    b = _with_genes(synthetic(30, 30, seed=2, obs_prefix="b_"), _symbols(30))
    paths = _write([a, b], tmp_path / "in", write_h5ads)
    out = tmp_path / "store"
    with pytest.raises(InputError) as e:
        abt.create_anndata_collection(paths, out, var_join="outer", progress=False)
    msg = str(e.value)
    assert str(paths[0]) in msg
    assert str(paths[1]) in msg
    assert "share no genes" in msg
    assert "block matrix" in msg
    assert "'ENSG00000000000'" in msg
    assert "'GENE0'" in msg
    assert "Ensembl" in msg
    assert "symbols" in msg
    assert "var_names=" in msg
    assert "Fix:" in msg
    assert not out.exists()
    # the explicit gene list says the block matrix is meant: written
    genes = [*a.var_names, *b.var_names]
    coll = abt.create_anndata_collection(paths, out, var_names=genes, progress=False)
    assert list(coll.var_names) == genes


def test_outer_refusal_hints_at_case_mismatches(tmp_path: Path,
                                                write_h5ads: WriteH5ads) -> None:
    names = ["GAPDH", "ACTB", "CD3E", "MS4A1", "LYZ", "NKG7", "CD14", "FCGR3A"]
    a = _with_genes(synthetic(30, 8, seed=1), names)
    b = _with_genes(synthetic(30, 8, seed=2, obs_prefix="b_"), [n.lower() for n in names])
    paths = _write([a, b], tmp_path / "in", write_h5ads)
    with pytest.raises(InputError, match=r"share no genes") as e:
        abt.create_anndata_collection(paths, tmp_path / "store", var_join="outer",
                                      progress=False)
    msg = str(e.value)
    assert "8 genes match when case is ignored" in msg
    assert "'GAPDH' vs 'gapdh'" in msg


def test_outer_join_of_inputs_with_few_shared_genes_warns(
        tmp_path: Path, write_h5ads: WriteH5ads, caplog: pytest.LogCaptureFixture) -> None:
    shared = _symbols(2)
    a = _with_genes(synthetic(30, 40, seed=1), shared + [f"A{i}" for i in range(38)])
    b = _with_genes(synthetic(30, 50, seed=2, obs_prefix="b_"),
                    shared + [f"B{i}" for i in range(48)])
    paths = _write([a, b], tmp_path / "in", write_h5ads)
    with caplog.at_level(logging.WARNING, logger="annbatch_torch"):
        coll = abt.create_anndata_collection(paths, tmp_path / "store", var_join="outer",
                                             progress=False)
    assert coll.n_vars == 88
    warned = [r.getMessage() for r in caplog.records if "genes in common" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    msg = warned[0]
    assert str(paths[0]) in msg
    assert str(paths[1]) in msg
    assert "2 genes in common" in msg
    assert "5.0%" in msg
    assert "'A0'" in msg
    assert "'B0'" in msg


def test_outer_join_with_enough_shared_genes_is_quiet(
        tmp_path: Path, write_h5ads: WriteH5ads, caplog: pytest.LogCaptureFixture) -> None:
    # a targeted panel inside a whole transcriptome: every panel gene is shared
    a = _with_genes(synthetic(30, 60, seed=1), _symbols(60))
    b = _with_genes(synthetic(30, 6, seed=2, obs_prefix="b_"), _symbols(60)[10:16])
    paths = _write([a, b], tmp_path / "in", write_h5ads)
    with caplog.at_level(logging.WARNING, logger="annbatch_torch"):
        coll = abt.create_anndata_collection(paths, tmp_path / "store", var_join="outer",
                                             progress=False)
    assert coll.n_vars == 60
    assert not [r for r in caplog.records if "genes in common" in r.getMessage()]


def test_inner_join_without_genes_suggests_mapping_not_outer(tmp_path: Path,
                                                             write_h5ads: WriteH5ads) -> None:
    a = _with_genes(synthetic(40, 30, seed=1), _ensembl(30))
    b = _with_genes(synthetic(30, 30, seed=2, obs_prefix="b_"), _symbols(30))
    paths = _write([a, b], tmp_path / "in", write_h5ads)
    with pytest.raises(InputError, match=r"var_join='inner' leaves no genes") as e:
        abt.create_anndata_collection(paths, tmp_path / "store", progress=False)
    msg = str(e.value)
    assert "outer" not in msg
    assert "var_names=" in msg
    assert "Ensembl" in msg
    assert "Fix:" in msg


# -- item 7: non-finite values read in place ------------------------------------------------
def _with_bad_values(tmp_path: Path, write_h5ads: WriteH5ads) -> tuple[list[Path], Any]:
    a = synthetic(50, 20, seed=1, obsm_pca=4)
    b = synthetic(40, 20, seed=3, obs_prefix="b_", obsm_pca=4)
    x = b.X.tocsr()
    assert np.diff(x.indptr)[7] >= 2
    x.data[x.indptr[7] + 1] = np.nan  # row 7, its second stored entry
    b.X = x
    b.obsm["X_pca"][12, 3] = np.inf
    return _write([a, b], tmp_path / "in", write_h5ads), b


def _drain(ds: Any) -> None:
    for _ in ds:
        pass


def test_nan_in_x_read_in_place_is_refused_as_the_writer_refuses_it(
        tmp_path: Path, write_h5ads: WriteH5ads) -> None:
    paths, b = _with_bad_values(tmp_path, write_h5ads)
    col = int(b.X.indices[b.X.indptr[7] + 1])
    with pytest.raises(InputError, match=rf"field 'X' holds 1 non-finite.*row 7, column {col}"):
        abt.create_anndata_collection(paths, tmp_path / "store", progress=False)
    ds = abt.AnnBatchDataset(paths, selector={"x": A.X}, batch_size=16, shuffle=False)
    with pytest.raises(InputError) as e:  # as the writer: the input's fault, not damage
        _drain(ds)
    msg = str(e.value)
    assert str(paths[1]) in msg
    assert "field 'X'" in msg
    assert f"the first (nan) at row 7, column {col}" in msg
    assert "Fix:" in msg
    assert "nan_to_num" in msg
    assert "download" not in msg  # not read as damage
    # the good input alone reads
    _drain(abt.AnnBatchDataset(paths[:1], selector={"x": A.X}, batch_size=16))


def test_inf_in_obsm_and_dense_x_read_in_place_is_refused(tmp_path: Path,
                                                          write_h5ads: WriteH5ads) -> None:
    """Non-finite values of an input read in place are that input's fault (an InputError,
    as the writer says of them), not damage or a store failure (a ReadError)."""
    paths, b = _with_bad_values(tmp_path, write_h5ads)
    ds = abt.AnnBatchDataset(paths, selector={"pca": A.obsm["X_pca"]}, batch_size=16,
                             shuffle=False)
    with pytest.raises(InputError, match=r"field 'obsm/X_pca'.*the first \(inf\) at row 12, "
                                        r"column 3"):
        _drain(ds)
    dense = b.copy()
    dense.X = dense.X.toarray()
    dense.X[30, 5] = -np.inf
    for source in ([dense], write_h5ads([dense], tmp_path / "dense")):
        ds = abt.AnnBatchDataset(source, selector={"x": A.X}, batch_size=16, shuffle=False)
        with pytest.raises(InputError, match=r"field 'X' holds \d+ non-finite.*the first "
                                            r"\(nan\) at row 7, column"):
            _drain(ds)
        ds = abt.AnnBatchDataset(source, selector={"x": A.X}, batch_size=16, shuffle=True,
                                 seed=3)
        with pytest.raises(InputError, match=r"non-finite"):
            _drain(ds)


def test_finite_inputs_read_in_place_as_before(synthetic_h5ads: list[Path]) -> None:
    ds = abt.AnnBatchDataset(synthetic_h5ads, selector={"x": A.X, "pca": A.obsm["X_pca"]},
                             batch_size=500, shuffle=False, densify=True)
    xs = [b["x"].numpy() for b in ds]
    ref = np.concatenate([ad.read_h5ad(p).X.toarray() for p in synthetic_h5ads])
    np.testing.assert_array_equal(np.concatenate(xs), ref)


# -- item 7: one metadata API ---------------------------------------------------------------
def _inputs(paths: list[Path]) -> list[Any]:
    return [ad.read_h5ad(p) for p in paths]


def _concat_obs(adatas: list[Any]) -> pd.DataFrame:
    return pd.concat([a.obs for a in adatas])


def test_in_place_metadata_matches_the_collection_and_the_inputs(
        synthetic_h5ads: list[Path], small_collection: Any) -> None:
    coll = small_collection
    src = InPlaceSource(synthetic_h5ads)
    adatas = _inputs(synthetic_h5ads)
    names = np.concatenate([np.asarray(a.obs_names, dtype=object) for a in adatas])
    # obs_names on both kinds: in place the inputs' order, a collection its shuffled one
    assert isinstance(src.obs_names, pd.Index)
    assert isinstance(coll.obs_names, pd.Index)
    assert list(src.obs_names) == list(names)
    assert sorted(coll.obs_names) == sorted(names)
    np.testing.assert_array_equal(coll.obs_names, coll.obs_names_at(np.arange(coll.n_obs)))
    # rows of the collection mapped to rows of the inputs through the names
    rng = np.random.default_rng(0)
    coll_rows = rng.choice(coll.n_obs, 300, replace=True)
    ip_rows = pd.Index(names).get_indexer(coll.obs_names_at(coll_rows))
    assert (ip_rows >= 0).all()
    np.testing.assert_array_equal(src.obs_names_at(ip_rows), coll.obs_names_at(coll_rows))
    a = coll.obs_at(coll_rows)
    b = src.obs_at(ip_rows)
    assert list(a.columns) == list(b.columns) == list(adatas[0].obs.columns)
    pd.testing.assert_frame_equal(a, b)
    ref = _concat_obs(adatas).iloc[ip_rows]
    for c in ref.columns:
        np.testing.assert_array_equal(np.asarray(b[c]), np.asarray(ref[c]))
    pd.testing.assert_frame_equal(src.obs_at(ip_rows[:5], "cell_type"),
                                  coll.obs_at(coll_rows[:5], ["obs/cell_type"]))
    for col in ("cell_type", "batch"):
        pd.testing.assert_series_equal(src.category_counts(col), coll.category_counts(col))
        counts = _concat_obs(adatas)[col].value_counts()
        assert src.category_counts(col).to_dict() == counts.to_dict()
    with pytest.raises(SchemaError, match=r"'n_counts' is not a categorical obs column.*"
                                          r"cell_type"):
        src.category_counts("n_counts")
    with pytest.raises(IndexError, match=r"\[0, 2700\)"):
        src.obs_names_at([2700])


def test_category_codes_differing_per_input_are_global_in_place(
        tmp_path: Path, write_h5ads: WriteH5ads) -> None:
    a = synthetic(60, 10, seed=1)
    b = synthetic(50, 10, seed=2, obs_prefix="b_")
    a.obs["label"] = pd.Categorical(["x", "y", None] * 20, categories=["y", "x"])
    b.obs["label"] = pd.Categorical(["z", "x"] * 25, categories=["x", "z"])
    a.obs["donor"] = ["d1", "d2", "d3"] * 20  # strings: sorted distinct values
    b.obs["donor"] = ["d9", "d2"] * 25
    paths = _write([a, b], tmp_path / "in", write_h5ads)
    coll = abt.create_anndata_collection(paths, tmp_path / "store", seed=4, progress=False)
    for source in (InPlaceSource(paths), InPlaceSource([a, b])):
        for col in ("label", "donor"):
            pd.testing.assert_series_equal(source.category_counts(col),
                                           coll.category_counts(col))
        names = list(source.obs_names)
        rows = np.arange(coll.n_obs)
        ip_rows = pd.Index(names).get_indexer(coll.obs_names_at(rows))
        got = source.obs_at(ip_rows, ["label", "donor"])
        pd.testing.assert_frame_equal(got, coll.obs_at(rows, ["label", "donor"]))
        assert got["label"].isna().sum() == 20
        want = pd.concat([a.obs, b.obs])["label"].astype(object).iloc[ip_rows]
        assert list(got["label"].astype(object).fillna("NA")) == list(want.fillna("NA"))
    counts = InPlaceSource(paths).category_counts("label")
    assert counts.index[:3].tolist() == ["y", "x", "z"]
    assert np.isnan(counts.index[3])
    assert counts.tolist() == [20, 45, 25, 20]


# -- item 8: duplicate obs_names ------------------------------------------------------------
def test_duplicate_obs_names_come_back_repeated_from_both_sources(
        tmp_path: Path, write_h5ads: WriteH5ads) -> None:
    a = synthetic(20, 10, seed=1)
    b = synthetic(20, 10, seed=2)  # the same obs_names as a: cell_0 ... cell_19
    a.obs_names = [f"c{i % 10}" for i in range(20)]  # repeated within a too
    b.obs_names = [f"c{i}" for i in range(20)]
    paths = _write([a, b], tmp_path / "in", write_h5ads)
    coll = abt.create_anndata_collection(paths, tmp_path / "store", seed=0, progress=False)
    src = InPlaceSource(paths)
    want = [f"c{i % 10}" for i in range(20)] + [f"c{i}" for i in range(20)]
    assert list(src.obs_names) == want
    assert sorted(coll.obs_names) == sorted(want)
    for source in (src, coll):
        names = source.obs_names_at([0, 0, 39])
        assert len(names) == 3
        assert names[0] == names[1]
        frame = source.obs_at([0, 10], ["cell_type"])
        assert len(frame) == 2
    assert list(src.obs_names_at([0, 10, 20])) == ["c0", "c0", "c0"]
    assert list(src.obs_at([0, 10]).index) == ["c0", "c0"]
    assert "repeat" in (InPlaceSource.obs_names_at.__doc__ or "")
    assert InPlaceSource.obs_names_at.__doc__ == type(coll).obs_names_at.__doc__


def test_memory_inputs_answer_like_files(synthetic_h5ads: list[Path]) -> None:
    adatas = _inputs(synthetic_h5ads)
    disk, mem = InPlaceSource(synthetic_h5ads), InPlaceSource(adatas)
    rows = np.array([2699, 0, 1500, 1200, 5])
    np.testing.assert_array_equal(mem.obs_names_at(rows), disk.obs_names_at(rows))
    pd.testing.assert_frame_equal(mem.obs_at(rows), disk.obs_at(rows))
    pd.testing.assert_series_equal(mem.category_counts("batch"), disk.category_counts("batch"))


def test_inputs_read_in_place_from_paths_never_import_anndata(synthetic_h5ads: list[Path],
                                                             tmp_path: Path) -> None:
    """Paths are read with h5py / zarr: anndata (which imports dask where it is installed,
    ~1 s) is imported only by callers that pass AnnData objects, so a process that reads
    inputs in place (a DDP rank, a DataLoader worker) does not pay for it."""
    code = (
        "import sys, annbatch_torch as abt\n"
        f"ds = abt.AnnBatchDataset({[str(p) for p in synthetic_h5ads]!r}, batch_size=256,\n"
        "                          return_index=True)\n"
        "rows = sorted(int(i) for b in ds for i in b['index'])\n"
        "assert rows == list(range(2700)), rows[:10]\n"
        "assert 'anndata' not in sys.modules, 'anndata was imported'\n"
        "print('ok')\n"
    )
    assert run_python(code, tmp_path).strip().endswith("ok")


def test_a_path_is_an_input_while_another_thread_imports_anndata(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """While another thread imports anndata, ``sys.modules`` holds the module before its
    classes: a path is still a path (no AttributeError from the half-made module), and an
    AnnData is still an AnnData once the class is there."""
    import types

    from annbatch_torch.store.inputs.open import resolve_input

    half_made = types.ModuleType("anndata")  # bound, its body not run yet
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "anndata", half_made)
        assert resolve_input(str(tmp_path / "x.h5ad"), 0) == tmp_path / "x.h5ad"
    a = ad.AnnData(np.ones((2, 3), dtype=np.float32))
    assert resolve_input(a, 0) is a
