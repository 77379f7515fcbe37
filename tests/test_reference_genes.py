"""create_anndata_collection(..., var_names=[...]): every input aligned to a reference gene
list (genes it lacks are zeros, its other genes dropped, counts logged), recorded for
prepare_collection, spoken by the CLI; and var columns kept where the inputs agree."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import annbatch_torch as abt
from annbatch_torch import InputError
from annbatch_torch.write.prepare import prepare_collection

if TYPE_CHECKING:
    from conftest import WriteH5ads


def _adata(tag: str, genes: list[str], n: int, *, dense: bool = False, seed: int = 0
           ) -> ad.AnnData:
    rng = np.random.default_rng(seed)
    x = sp.random(n, len(genes), density=0.4, format="csr", random_state=rng,
                  dtype=np.float64)
    x.data = np.round(x.data * 9) + 1
    xx: Any = x.toarray().astype(np.float32) if dense else x.astype(np.float32)
    a = ad.AnnData(xx, obs=pd.DataFrame(index=[f"{tag}{i}" for i in range(n)]),
                   var=pd.DataFrame(index=genes))
    a.layers["counts"] = xx.copy() * 2
    return a




def _aligned(a: ad.AnnData, reference: list[str], layer: str | None = None) -> np.ndarray:
    """``a``'s matrix with the reference's columns (zeros where ``a`` lacks the gene)."""
    m = a.X if layer is None else a.layers[layer]
    m = m.toarray() if sp.issparse(m) else np.asarray(m)
    out = np.zeros((a.n_obs, len(reference)), dtype=np.float32)
    cols = a.var_names.get_indexer(reference)
    out[:, cols >= 0] = m[:, cols[cols >= 0]]
    return out


def _by_name(coll: abt.Collection) -> ad.AnnData:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parts = [ad.read_zarr(coll.shard_path(i)) for i in range(len(coll.shards))]
    return ad.concat(parts, merge="first")


def _check(coll: abt.Collection, adatas: list[ad.AnnData], reference: list[str]) -> None:
    assert list(coll.var_names) == reference
    assert coll.manifest.var_join == "reference"
    got = _by_name(coll)
    assert list(got.var_names) == reference
    for a in adatas:
        rows = got[list(a.obs_names)]
        for layer in (None, "counts"):
            m = rows.X if layer is None else rows.layers[layer]
            assert sp.issparse(m)
            np.testing.assert_array_equal(m.toarray(), _aligned(a, reference, layer))
    # and the loader reads the same values
    ds = abt.AnnBatchDataset(coll, batch_size=64, densify=True, return_index=True)
    names = coll.obs_names_at(np.arange(coll.n_obs))
    want = {n: r for a in adatas for n, r in zip(a.obs_names, _aligned(a, reference))}
    seen = 0
    for b in ds:
        for i, row in zip(b["index"].numpy(), b["X"].numpy()):
            np.testing.assert_array_equal(row, want[names[i]])
            seen += 1
    assert seen == coll.n_obs


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_inputs_are_aligned_to_any_reference(tmp_path_factory: pytest.TempPathFactory,
                                             data: st.DataObject, write_h5ads: WriteH5ads) -> None:
    pool = [f"G{k}" for k in range(14)]
    genes_a = data.draw(st.permutations(pool[:8]))[: data.draw(st.integers(2, 8))]
    genes_b = data.draw(st.permutations(pool[4:]))[: data.draw(st.integers(2, 10))]
    reference = data.draw(st.lists(st.sampled_from([*pool, "NEW1", "NEW2"]), min_size=1,
                                   max_size=16, unique=True))
    adatas = [_adata("a", list(genes_a), 37, seed=1),
              _adata("b", list(genes_b), 29, dense=data.draw(st.booleans()), seed=2)]
    known = set(genes_a) | set(genes_b)
    folder = tmp_path_factory.mktemp("ref")
    paths = write_h5ads(adatas, folder / "in")
    if any(not set(reference) & set(a.var_names) for a in adatas):
        with pytest.raises(InputError, match="none of its"):
            abt.create_anndata_collection(paths, folder / "store", var_names=reference,
                                          progress=False, n_obs_per_shard=32)
        assert not (folder / "store").exists()
        return
    coll = abt.create_anndata_collection(paths, folder / "store", var_names=reference,
                                         progress=False, n_obs_per_shard=32)
    _check(coll, adatas, reference)
    # genes no input has are all-zero columns
    absent = [j for j, g in enumerate(reference) if g not in known]
    assert coll.n_obs == 66
    assert (_by_name(coll).X[:, absent].nnz == 0)


def test_counts_are_logged_and_a_thin_match_warns(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture,
                                                  write_h5ads: WriteH5ads) -> None:
    a = _adata("a", ["G0", "G1", "G2", "G3"], 20)
    b = _adata("b", ["G3", "X1", "X2"], 20, seed=1)
    paths = write_h5ads([a, b], tmp_path / "in")
    reference = ["G0", "G1", "G2", "G3", "G9"]
    with caplog.at_level(logging.INFO, logger="annbatch_torch"):
        coll = abt.create_anndata_collection(paths, tmp_path / "store", var_names=reference,
                                             progress=False)
    _check(coll, [a, b], reference)
    lines = {r.getMessage(): r.levelno for r in caplog.records if "reference genes" in r.message}
    assert lines == {
        f"{paths[0]}: 4 of the 5 reference genes present; 1 missing (written as zeros), 0 "
        "not in the reference (dropped).": logging.INFO,
        f"{paths[1]}: 1 of the 5 reference genes present; 4 missing (written as zeros), 2 "
        "not in the reference (dropped).": logging.WARNING,
    }


@pytest.mark.parametrize(("bad", "match"), [
    ("G0", "list of gene names"), ([], "names no gene"), (["G0", "G0", "G1"], "more than once"),
    (["G0", 3], "not a gene name"), (["G0", ""], "not a gene name"),
])
def test_a_bad_reference_is_refused_before_anything_is_written(tmp_path: Path, bad: Any,
                                                               match: str,
                                                               write_h5ads: WriteH5ads) -> None:
    paths = write_h5ads([_adata("a", ["G0", "G1"], 10)], tmp_path / "in")
    with pytest.raises(InputError, match=match):
        abt.create_anndata_collection(paths, tmp_path / "store", var_names=bad, progress=False)
    assert not (tmp_path / "store").exists()
    assert list(tmp_path.iterdir()) == [tmp_path / "in"]


def test_prepare_collection_rewrites_for_another_reference_only(tmp_path: Path,
                                                                write_h5ads: WriteH5ads) -> None:
    paths = write_h5ads([_adata("a", ["G0", "G1", "G2"], 30)], tmp_path / "in")
    store = tmp_path / "store"
    assert prepare_collection(paths, store, var_names=["G2", "G0"], progress=False)
    assert not prepare_collection(paths, store, var_names=["G2", "G0"], progress=False)
    # var_join is moot with a reference: giving it too keeps the store
    assert not prepare_collection(paths, store, var_names=["G2", "G0"], var_join="inner",
                                  progress=False)
    # a generator is read once (the staleness check emptied it before the writer ran)
    assert prepare_collection(paths, store, var_names=(g for g in ["G0", "G2"]),
                              progress=False)
    assert list(abt.open_collection(store).var_names) == ["G0", "G2"]
    assert prepare_collection(paths, store, var_join="inner", progress=False)
    assert list(abt.open_collection(store).var_names) == ["G0", "G1", "G2"]
    assert prepare_collection(paths, store, var_names=["G0", "G1", "G2"], progress=False)


def test_the_cli_takes_a_gene_list_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        write_h5ads: WriteH5ads
                                        ) -> None:
    from annbatch_torch.cli.main import main

    a = _adata("a", ["G0", "G1", "G2"], 30)
    paths = write_h5ads([a], tmp_path / "in")
    genes = tmp_path / "genes.txt"
    # saved by Excel or Notepad: a byte-order mark first (it became part of 'G2')
    genes.write_bytes("\ufeff# a foundation model's genes\nG2\n\nG7\n G0 \n".encode())
    assert main(["-q", "shuffle", *map(str, paths), "-o", str(tmp_path / "store"),
                 "--var-names", str(genes), "--no-progress"]) == 0
    coll = abt.open_collection(tmp_path / "store")
    _check(coll, [a], ["G2", "G7", "G0"])
    for content, match in ((None, "cannot read the gene list"), ("# only\n\n", "names no gene")):
        if content is None:
            genes.unlink()
        else:
            genes.write_text(content)
        assert main(["shuffle", str(paths[0]), "-o", str(tmp_path / "s2"), "--var-names",
                     str(genes)]) == 2
        err = capsys.readouterr().err
        assert "error: argument --var-names" in err
        assert match in err
        assert len(err.strip().splitlines()) == 1


def test_the_writer_logs_rows_per_shard_not_the_capacity() -> None:
    from annbatch_torch.write.writer import shard_layout

    assert shard_layout(700, 446464) == "1 shard of 700 rows"
    assert shard_layout(2700, 1024) == "3 shards of 1,024 rows (the last 652)"
    assert shard_layout(2048, 1024) == "2 shards of 1,024 rows"


# -- var columns ------------------------------------------------------------------------
def _with_var(a: ad.AnnData, **cols: Any) -> ad.AnnData:
    for k, v in cols.items():
        a.var[k] = v
    return a


def test_var_columns_the_inputs_agree_on_are_kept(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture,
                                                  write_h5ads: WriteH5ads) -> None:
    symbols = {f"G{k}": f"SYM{k}" for k in range(8)}
    ga, gb = ["G0", "G1", "G2", "G3", "G4"], ["G6", "G4", "G2", "G5", "G7"]  # G2, G4 shared
    a = _with_var(_adata("a", ga, 20), symbol=[symbols[g] for g in ga],
                  feature_types=pd.Categorical(["Gene Expression"] * 4 + ["Antibody"],
                                               categories=["Gene Expression", "Antibody"]),
                  n_cells=[1, 2, 3, 4, 5], highly_variable=[True, False, True, True, False],
                  only_a=np.arange(5.0))
    b = _with_var(_adata("b", gb, 20, seed=1), symbol=[symbols[g] for g in gb],
                  feature_types=pd.Categorical(["Gene Expression", "Antibody",
                                                "Gene Expression", "Peaks", "Antibody"]),
                  n_cells=[9, 5, 7, 1, 1], highly_variable=[True, False, False, True, True])
    paths = write_h5ads([a, b], tmp_path / "in")
    with caplog.at_level(logging.WARNING, logger="annbatch_torch"):
        coll = abt.create_anndata_collection(paths, tmp_path / "store", var_join="outer",
                                             progress=False)
    genes = ["G0", "G1", "G2", "G3", "G4", "G6", "G5", "G7"]
    assert list(coll.var_names) == genes
    var = coll.var
    assert list(var.columns) == ["symbol", "feature_types"]
    assert list(var["symbol"]) == [symbols[g] for g in genes]
    assert list(var["feature_types"].astype(str)) == ["Gene Expression"] * 4 + [
        "Antibody", "Gene Expression", "Peaks", "Antibody"]
    # categories: the first input's, then new ones as first seen
    assert list(var["feature_types"].cat.categories) == ["Gene Expression", "Antibody", "Peaks"]
    assert coll.unavailable == {
        "var/only_a": f"not in {paths[1]}'s var",
        "var/n_cells": f"{paths[0]} and {paths[1]} disagree on gene 'G2' (3 vs 7)",
        "var/highly_variable": f"{paths[0]} and {paths[1]} disagree on gene 'G2' (True vs "
                               "False)",
    }
    warned = [r for r in caplog.records if "var columns not carried" in r.getMessage()]
    assert len(warned) == 1
    assert "n_cells" in warned[0].getMessage()
    # each shard is an AnnData store whose var anndata reads as Collection.var does
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shard_var = ad.read_zarr(coll.shard_path(0)).var
    pd.testing.assert_frame_equal(shard_var, var, check_names=False)


def test_genes_no_input_holds_have_missing_metadata(tmp_path: Path) -> None:
    a = _with_var(_adata("a", ["G0", "G1", "G2"], 12), symbol=["S0", "S1", "S2"],
                  highly_variable=[True, False, True], n_cells=np.array([4, 0, 7], np.int32),
                  mean=[0.5, 0.0, 1.5],
                  kind=pd.Categorical(["a", "b", "a"]))
    coll = abt.create_anndata_collection([a], tmp_path / "store", progress=False,
                                         var_names=["G2", "NEW", "G0"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        var = ad.read_zarr(coll.shard_path(0)).var  # as anndata reads it
    assert list(var.index) == ["G2", "NEW", "G0"]
    assert list(var["symbol"].astype(object).where(var["symbol"].notna(), None)) == [
        "S2", None, "S0"]
    assert var["highly_variable"].dtype == "boolean"
    assert list(var["highly_variable"].astype(object)) == [True, pd.NA, True]
    assert var["n_cells"].dtype == "Int64"
    assert list(var["n_cells"].astype(object)) == [7, pd.NA, 4]
    np.testing.assert_array_equal(var["mean"].to_numpy(), [1.5, np.nan, 0.5])
    assert list(var["kind"].astype(object).where(var["kind"].notna(), None)) == ["a", None, "a"]
    assert coll.unavailable == {}
    # Collection.var reads the same values (nullable ones as float64 with NaN)
    cv = coll.var
    np.testing.assert_array_equal(cv["n_cells"].to_numpy(dtype=float), [7.0, np.nan, 4.0])
    assert list(cv["symbol"].astype(object).where(cv["symbol"].notna(), None)) == [
        "S2", None, "S0"]


def test_a_single_input_keeps_all_its_var_columns_legacy_files_too(
        pbmc68k_reduced: Path, tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = ad.read_h5ad(pbmc68k_reduced).var
    coll = abt.create_anndata_collection([pbmc68k_reduced], tmp_path / "store", progress=False)
    assert list(want.columns) == ["n_counts", "means", "dispersions", "dispersions_norm",
                                  "highly_variable"]
    pd.testing.assert_frame_equal(coll.var, want, check_names=False)


# -- found in review --------------------------------------------------------------------
def test_a_categorical_and_a_string_var_column_merge(tmp_path: Path,
                                                     write_h5ads: WriteH5ads) -> None:
    """The writer crashed (.cat on the string column)."""
    a = _with_var(_adata("a", ["G0", "G1", "G2"], 10), symbol=pd.Categorical(["A", "B", "C"],
                                                                            ordered=True))
    b = _with_var(_adata("b", ["G0", "G1", "G2"], 10, seed=1), symbol=["A", "B", "C"])
    for inputs in ([a, b], write_h5ads([a, b], tmp_path / "in")):
        coll = abt.create_anndata_collection(inputs, tmp_path / "out", progress=False,
                                             overwrite=True)
        sym = coll.var["symbol"]
        assert list(sym.astype(str)) == ["A", "B", "C"]
        assert isinstance(sym.dtype, pd.CategoricalDtype)
        assert not sym.cat.ordered  # one input has no order


def test_nullable_and_wide_integer_var_columns(tmp_path: Path) -> None:
    """pandas' nullable Int64 / Float64 (what anndata reads from a file) crashed the writer
    from memory; uint64 above int64 crashed it once a gene was missing; nullable columns
    came back from Collection.var as float64 although the shards hold them nullable."""
    a = _with_var(_adata("a", ["G0", "G1", "G2"], 10),
                  n=pd.array([1, None, 3], dtype="Int64"),
                  f=pd.array([0.5, None, 1.5], dtype="Float64"),
                  flag=pd.array([True, None, False], dtype="boolean"),
                  big=np.array([2**63 + 5, 1, 2], dtype=np.uint64),
                  small=np.array([7, 8, 9], dtype=np.uint64))
    coll = abt.create_anndata_collection([a], tmp_path / "out", progress=False,
                                         var_names=["G2", "NEW", "G0", "G1"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shard_var = ad.read_zarr(coll.shard_path(0)).var
    var = coll.var
    pd.testing.assert_frame_equal(var, shard_var, check_names=False)
    assert list(var["n"].astype(object)) == [3, pd.NA, 1, pd.NA]
    assert list(var["flag"].astype(object)) == [False, pd.NA, True, pd.NA]
    np.testing.assert_array_equal(var["f"].to_numpy(dtype=float, na_value=np.nan),
                                  [1.5, np.nan, 0.5, np.nan])
    assert list(var["small"].astype(object)) == [9, pd.NA, 7, 8]
    assert list(var["big"].astype(object)) == [2, pd.NA, 2**63 + 5, 1]  # UInt64
