"""Inputs as users have them (issue 17 and an adversarial review of the input layer).

The writer (``create_anndata_collection``) and in-place reading (``AnnBatchDataset([...])``,
``InPlaceSource``) open, describe and harmonise inputs through one layer
(``store/inputs.py``: ``InputSource``, ``plan_fields``; ``store/harmonize.py``: the rules),
so every case here is checked on both paths: the same fields, kinds, dtypes, categories and
values, or the same refusal (input, field, fix), with nothing written on a refusal.

Each test failed on the code before this change (checked on a copy of it); what each pins:

* legacy ``.h5ad`` (anndata < 0.7: compound obs / var / obsm, categories in ``uns``): read on
  both paths, values equal ``anndata.read_h5ad``'s (scanpy's real ``pbmc68k_reduced`` and a
  file built here with h5py); a layout that cannot be read names the re-save command;
* damaged or truncated files: named, with the fix, in one message on both paths;
* X is None: the writer writes a collection without X; selecting X says it is absent;
* fields nobody asked for: left out with a warning and the reason in ``unavailable``, asked
  for: refused; inputs without cells: skipped, taking no part in dtypes or categories;
* the same input twice: refused; obs_names shared by inputs: a warning;
* in place reads like a collection: dense X as CSR, sparse obsm dense, string columns as
  categoricals, duplicate var names refused;
* values: complex numbers, dates, Timestamp / Interval categories, bools meeting numbers in
  categories, uint64 above int64: refused with the conversion; 1-D / 3-D obsm: one reason;
* duck-typed AnnData wrappers accepted; one label for a relative path; field names that
  cannot be folder names left out on both paths; the in-place "missing" refusal has a fix.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import annbatch_torch as abt
from annbatch_torch import A
from annbatch_torch.errors import InputError, ReadError, SchemaError
from annbatch_torch.store.inputs.inplace import InPlaceSource
from annbatch_torch.store.inputs.view import InputSource
from annbatch_torch.write.schema import resolve_schema

if TYPE_CHECKING:
    from conftest import WriteH5ads

RESAVE = (r"python -c \"import anndata as ad; ad\.read_h5ad\('{inp}'\)"
          r"\.write_h5ad\('{out}'\)\"")


# -- helpers -------------------------------------------------------------------------------
def _adata(n: int, tag: str, *, n_vars: int = 4, dense: bool = False, dtype: Any = np.float32,
           **obs: Any) -> ad.AnnData:
    x = sp.random(n, n_vars, density=0.5, format="csr", random_state=n + len(tag),
                  dtype=np.float64)
    x.data = np.round(x.data * 10) + 1
    xx: Any = x.toarray().astype(dtype) if dense else x.astype(dtype)
    a = ad.AnnData(xx, obs=pd.DataFrame(index=[f"{tag}{i}" for i in range(n)]),
                   var=pd.DataFrame(index=[f"g{k}" for k in range(n_vars)]))
    for k, v in obs.items():
        a.obs[k] = v
    return a




def _collect(coll: Any) -> ad.AnnData:
    """Every shard of a collection, concatenated (anndata.read_zarr)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parts = [ad.read_zarr(coll.shard_path(i)) for i in range(len(coll.shards))]
        return ad.concat(parts, merge="first")


def _dense(m: Any) -> np.ndarray:
    return m.toarray() if sp.issparse(m) else np.asarray(m)


def _one_batch(inputs: Any, selector: dict[str, Any], n: int, **kw: Any) -> dict[str, Any]:
    ds = abt.AnnBatchDataset(inputs, selector=selector, batch_size=n, shuffle=False, **kw)
    (b,) = list(ds)
    return b


def _problem(message: str) -> str:
    """A refusal without its fix (each path says how to leave a field out its own way)."""
    return message.split(" Fix:")[0]


def _schema(inputs: list[Any], **kw: Any) -> Any:
    sources = [InputSource(x, i) for i, x in enumerate(inputs)]
    try:
        return resolve_schema(sources, "inner", kw.get("obs_columns"), kw.get("layers"),
                              kw.get("obsm"))
    finally:
        for s in sources:
            s.close()


def _refused_by_both(inputs: list[Any], tmp_path: Path, field: str, match: str,
                     **asked: Any) -> str:
    """The writer refuses ``field`` when asked for it (nothing written), leaves it out with
    a warning otherwise, and in place it is not offered for the same reason."""
    out = tmp_path / "asked"
    with pytest.raises(InputError, match=match) as writer:
        abt.create_anndata_collection(inputs, out, progress=False, **asked)
    assert not out.exists()
    assert not list(tmp_path.glob("asked.tmp-*"))
    coll = abt.create_anndata_collection(inputs, tmp_path / "unasked", progress=False)
    assert field not in coll.fields
    assert _problem(coll.unavailable[field]) == _problem(str(writer.value))
    src = InPlaceSource(inputs)
    assert field not in src.fields
    assert _problem(src.unavailable[field]) == _problem(str(writer.value))
    with pytest.raises(SchemaError, match=match):
        abt.AnnBatchDataset(inputs, selector={"y": field})
    return str(writer.value)


# -- A1: legacy h5ad -----------------------------------------------------------------------
def _compare_with_anndata(path: Path, tmp_path: Path, obs_columns: list[str],
                          obsm: list[str], layers: list[str] = ()) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anndata's OldFormatWarning
        ref = ad.read_h5ad(path)
    coll = abt.create_anndata_collection([path], tmp_path / "coll", progress=False)
    got = _collect(coll)[ref.obs_names]
    np.testing.assert_array_equal(_dense(got.X), _dense(ref.X))
    for k in layers:
        np.testing.assert_array_equal(_dense(got.layers[k]), _dense(ref.layers[k]))
    for c in obs_columns:
        assert list(got.obs[c].astype(object).where(got.obs[c].notna(), None)) == \
            list(ref.obs[c].astype(object).where(ref.obs[c].notna(), None)), c
        if isinstance(ref.obs[c].dtype, pd.CategoricalDtype):
            assert coll.categories(c) == list(ref.obs[c].cat.categories), c
    for k in obsm:
        np.testing.assert_array_equal(got.obsm[k], ref.obsm[k])
    selector = {"x": A.X, **{f"m_{k}": A.obsm[k] for k in obsm},
                **{f"l_{k}": A.layers[k] for k in layers}, **{c: A.obs[c] for c in obs_columns}}
    ds = abt.AnnBatchDataset(path, selector=selector, batch_size=ref.n_obs, shuffle=False,
                             densify=True)
    (b,) = list(ds)
    np.testing.assert_array_equal(b["x"].numpy(), _dense(ref.X))
    for k in obsm:
        np.testing.assert_array_equal(b[f"m_{k}"].numpy(), ref.obsm[k].astype(np.float32))
    for k in layers:
        np.testing.assert_array_equal(b[f"l_{k}"].numpy(), _dense(ref.layers[k]))
    for c in obs_columns:
        values = b[c].numpy()
        if isinstance(ref.obs[c].dtype, pd.CategoricalDtype) or ref.obs[c].dtype == object:
            cats = ds.source.categories(c)
            assert cats == coll.categories(c), c
            labels = [None if v < 0 else cats[v] for v in values]
            assert labels == list(ref.obs[c].astype(object).where(ref.obs[c].notna(), None)), c
        else:
            np.testing.assert_array_equal(values, ref.obs[c].to_numpy().astype(values.dtype))


def test_the_legacy_pbmc68k_reduced_reads_on_both_paths(pbmc68k_reduced: Path,
                                                        tmp_path: Path) -> None:
    """scanpy's pbmc68k_reduced (anndata < 0.7): the writer crashed (`Field _index does not
    appear in this type`), in place too (`Cannot compare structured or void to non-void
    arrays`); now X, obs categories and obsm X_pca equal anndata.read_h5ad's on both."""
    with h5py.File(pbmc68k_reduced) as f:
        assert isinstance(f["obs"], h5py.Dataset)  # legacy indeed: a compound dataset
        assert f["obs"].dtype.names
    _compare_with_anndata(pbmc68k_reduced, tmp_path,
                          ["bulk_labels", "louvain", "phase", "n_genes", "percent_mito"],
                          ["X_pca", "X_umap"])


def _legacy_h5ad(path: Path, *, sparse_x: bool, x_format: str = "csr") -> None:
    """A small legacy file, as anndata < 0.7 wrote it: compound obs / var / obsm, codes in
    obs with their categories in uns, sparse groups tagged ``h5sparse_format``."""
    n, m = 12, 5
    rng = np.random.default_rng(0)
    x = (rng.random((n, m)) * (rng.random((n, m)) > 0.5)).astype(np.float32)

    def sparse_group(g: Any, matrix: np.ndarray) -> None:
        c = sp.csr_matrix(matrix) if x_format == "csr" else sp.csc_matrix(matrix)
        g["data"], g["indices"], g["indptr"] = c.data, c.indices, c.indptr
        g.attrs["h5sparse_format"] = x_format
        g.attrs["h5sparse_shape"] = np.array([n, m])

    with h5py.File(path, "w") as f:
        if sparse_x:
            sparse_group(f.create_group("X"), x)
        else:
            f["X"] = x
        obs = np.zeros(n, dtype=[("index", "S8"), ("cell_type", "i1"), ("score", "<f4"),
                                 ("flag", "?"), ("donor", "S4")])
        obs["index"] = [f"c{i}".encode() for i in range(n)]
        obs["cell_type"] = [0, 1, 2, -1] * 3  # -1: a missing label
        obs["score"] = np.linspace(0, 1, n)
        obs["flag"] = np.arange(n) % 2 == 0
        obs["donor"] = [b"d1", b"d2", b"d3"] * 4  # strings, no categories in uns
        f["obs"] = obs
        var = np.zeros(m, dtype=[("index", "S8"), ("mean", "<f4")])
        var["index"] = [f"g{k}".encode() for k in range(m)]
        f["var"] = var
        obsm = np.zeros(n, dtype=[("X_pca", "<f4", (3,))])
        obsm["X_pca"] = rng.random((n, 3))
        f["obsm"] = obsm
        f.create_group("uns")["cell_type_categories"] = np.array([b"B", b"T", b"NK"])
        sparse_group(f.create_group("layers").create_group("counts"), x * 10)


@pytest.mark.parametrize(("sparse_x", "x_format"), [(False, "csr"), (True, "csr"),
                                                    (True, "csc")])
def test_a_legacy_file_built_with_h5py_reads_on_both_paths(tmp_path: Path, sparse_x: bool,
                                                           x_format: str) -> None:
    p = tmp_path / "legacy.h5ad"
    _legacy_h5ad(p, sparse_x=sparse_x, x_format=x_format)
    _compare_with_anndata(p, tmp_path, ["cell_type", "score", "flag", "donor"], ["X_pca"],
                          ["counts"])


def test_a_legacy_matrix_that_cannot_be_read_names_the_resave_command(tmp_path: Path) -> None:
    p = tmp_path / "legacy.h5ad"
    _legacy_h5ad(p, sparse_x=True)
    with h5py.File(p, "r+") as f:
        f["X"].attrs["h5sparse_format"] = "bsr"  # a format neither path reads by rows
    cmd = RESAVE.format(inp=re.escape(str(p)), out=re.escape(str(p.with_name("legacy.resaved"
                                                                           ".h5ad"))))
    with pytest.raises(InputError, match=rf"legacy\.h5ad: X is stored as encoding None .*"
                       rf"anndata < 0\.7.*{cmd}"):
        abt.create_anndata_collection([p], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    src = InPlaceSource([p])
    assert "X" not in src.fields
    assert re.search(cmd, src.unavailable["X"])
    assert "obs/cell_type" in src.fields  # the rest of the file stays readable


# -- A2: damaged and truncated files -------------------------------------------------------
def test_a_truncated_h5ad_is_named_with_the_fix_on_both_paths(tmp_path: Path,
                                                              write_h5ads: WriteH5ads) -> None:
    (p,) = write_h5ads([_adata(200, "a", n_vars=30)], tmp_path)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) * 3 // 4])  # an interrupted download
    want = rf"{re.escape(str(p))}: cannot read the file .*truncated.*download or copy it again"
    with pytest.raises(InputError, match=want) as writer:
        abt.create_anndata_collection([p], tmp_path / "out", progress=False)
    with pytest.raises(InputError, match=want) as in_place:
        abt.AnnBatchDataset([p])
    assert str(writer.value) == str(in_place.value)
    assert not (tmp_path / "out").exists()


def test_a_damaged_chunk_is_named_with_the_fix_on_both_paths(tmp_path: Path) -> None:
    """Bytes damaged inside a compressed chunk of X: h5py's OSError named neither the file
    nor the fix (the writer raised it bare)."""
    a = _adata(400, "a", n_vars=50)
    p = tmp_path / "gz.h5ad"
    a.write_h5ad(p, compression="gzip")
    with h5py.File(p, "r") as f:
        ds = f["X/data"]
        assert ds.compression == "gzip"
        chunk = ds.id.get_chunk_info(0)
        offset, size = int(chunk.byte_offset), int(chunk.size)
    with open(p, "r+b") as fh:
        fh.seek(offset + size // 3)
        fh.write(b"\xff" * 64)
    want = (rf"{re.escape(str(p))}: cannot read '/X/data' .*damaged or truncated.*download or "
            r"copy it again")
    with pytest.raises(InputError, match=want) as writer:
        abt.create_anndata_collection([p], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ReadError) as in_place:
        list(abt.AnnBatchDataset([p], batch_size=400, shuffle=False))
    assert str(writer.value) in str(in_place.value)  # one message for both


# -- A3: X is None ------------------------------------------------------------------------
def _no_x(n: int, tag: str) -> ad.AnnData:
    counts = sp.random(n, 6, density=0.4, format="csr", dtype=np.float32, random_state=n)
    a = ad.AnnData(obs=pd.DataFrame({"ct": pd.Categorical(["u", "v"] * (n // 2))},
                                    index=[f"{tag}{i}" for i in range(n)]),
                   var=pd.DataFrame(index=[f"g{k}" for k in range(6)]))
    a.layers["counts"] = counts
    a.obsm["emb"] = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    return a


def test_a_damaged_chunk_of_a_zarr_input_is_named_with_the_inputs_fix(tmp_path: Path) -> None:
    """The writer raised blosc's bare RuntimeError (no file, no field); in place advised
    rewriting the input as a collection (found in review)."""
    a = _adata(3000, "a", n_vars=300)
    p = tmp_path / "in.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a.write_zarr(p)
    chunk = sorted(f for f in (p / "X" / "indices").rglob("*")
                   if f.is_file() and not f.name.startswith((".", "zarr")))[0]
    chunk.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(InputError, match=rf"{p}: cannot read X rows .*damaged or truncated"
                                         r".*Fix: download or copy it again"):
        abt.create_anndata_collection([p], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(abt.ReadError) as e:
        list(abt.AnnBatchDataset([p], batch_size=1000))
    msg = str(e.value)
    assert f"{p}: failed reading field 'X', input rows" in msg
    assert "download or copy it again" in msg
    assert "create_anndata_collection" not in msg


def test_inputs_whose_x_is_none_are_written_with_their_layers(tmp_path: Path,
                                                              write_h5ads: WriteH5ads) -> None:
    a, b = _no_x(20, "a"), _no_x(10, "b")
    paths = write_h5ads([a, b], tmp_path)
    coll = abt.create_anndata_collection(paths, tmp_path / "out", progress=False)
    assert set(coll.fields) == {"layers/counts", "obsm/emb", "obs/ct"}
    got = _collect(coll)[[*a.obs_names, *b.obs_names]]
    np.testing.assert_array_equal(_dense(got.layers["counts"]),
                                  np.concatenate([a.layers["counts"].toarray(),
                                                  b.layers["counts"].toarray()]))
    np.testing.assert_array_equal(got.obsm["emb"], np.concatenate([a.obsm["emb"],
                                                                   b.obsm["emb"]]))
    for source in (coll, paths):
        with pytest.raises(SchemaError, match=r"'X' cannot be selected: .*in0\.h5ad has no X "
                           r"\(it is None\); select obsm, layers or obs fields"):
            abt.AnnBatchDataset(source)
        (batch,) = list(abt.AnnBatchDataset(source, selector={"c": A.layers["counts"]},
                                            batch_size=30, densify=True))
        assert batch["c"].shape == (30, 6)


def test_x_in_some_inputs_only_is_refused_by_the_writer_with_the_fix(tmp_path: Path) -> None:
    a, b = _adata(10, "a", n_vars=6), _no_x(10, "b")
    a.layers["counts"] = a.X.copy()
    a.obsm["emb"] = np.ones((10, 2), np.float32)
    with pytest.raises(InputError, match=r"<AnnData #1>: has no X \(it is in <AnnData #0>\).*"
                       r"Fix: set it there \(e\.g\. adata\.X = adata\.layers\['counts'\]\).*"
                       r"del adata\.X"):
        abt.create_anndata_collection([a, b], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    src = InPlaceSource([a, b])
    assert "X" not in src.fields
    assert "<AnnData #1>: has no X" in src.unavailable["X"]
    assert "layers/counts" in src.fields


# -- A4: one rule for fields nobody asked for ----------------------------------------------
def test_fields_nobody_asked_for_are_left_out_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An inf in an obsm entry, a column categorical in one input and numeric in another,
    a layer only one input has: the writer aborted the whole write; now each is left out
    with a warning and the reason, and refused when asked for."""
    a = _adata(30, "a", kind=pd.Categorical(["x", "y", "z"] * 10), keep=np.arange(30.0))
    b = _adata(30, "b", kind=np.linspace(0, 1, 30), keep=np.arange(30.0))
    a.obsm["bad"] = np.ones((30, 2), np.float32)
    a.obsm["bad"][25, 1] = np.inf
    b.obsm["bad"] = np.ones((30, 2), np.float32)
    a.layers["only_a"] = a.X.copy()
    caplog.set_level(logging.WARNING, logger="annbatch_torch")
    coll = abt.create_anndata_collection([a, b], tmp_path / "out", progress=False)
    assert set(coll.fields) == {"X", "obs/keep"}
    why = coll.manifest.extra["unavailable"]
    assert "field 'obsm/bad' holds 1 non-finite value" in why["obsm/bad"]
    assert "is categorical there but numeric" in why["obs/kind"]
    assert "<AnnData #1>: has no layer 'only_a' (it is in <AnnData #0>)" in why["layers/only_a"]
    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for field in ("obsm/bad", "obs/kind", "layers/only_a"):
        assert f"{field} is not carried" in warned
    np.testing.assert_array_equal(_collect(coll)[[*a.obs_names, *b.obs_names]].obs["keep"],
                                  np.r_[np.arange(30.0), np.arange(30.0)])
    for kw, match in (({"obsm": ["bad"]}, "non-finite"),
                      ({"obs_columns": ["kind"]}, "is categorical there but numeric"),
                      ({"layers": ["only_a"]}, "has no layer 'only_a'")):
        with pytest.raises(InputError, match=match):
            abt.create_anndata_collection([a, b], tmp_path / "asked", progress=False, **kw)
        assert not (tmp_path / "asked").exists()


def test_an_input_without_cells_is_skipped_and_decides_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, write_h5ads: WriteH5ads) -> None:
    """A 0-cell input: the writer refused the whole write; in place its float64 X, its
    categories and its other order made X float64, added a category and dropped
    ``ordered``. Now it is skipped (a warning) on both paths."""
    a = _adata(6, "a", c=pd.Categorical(list("uv") * 3, categories=["u", "v"], ordered=True))
    z = _adata(0, "z", dtype=np.float64,
               c=pd.Categorical([], categories=["v", "u", "q"], ordered=True))
    caplog.set_level(logging.WARNING, logger="annbatch_torch")
    for inputs in ([a, z], [z, a], write_h5ads([a, z], tmp_path)):
        coll = abt.create_anndata_collection(inputs, tmp_path / "out", progress=False,
                                             overwrite=True)
        src = InPlaceSource(inputs)
        for fields in (coll.fields, src.fields):
            assert fields["X"].dtype == "float32"
            assert list(fields["obs/c"].categories) == ["u", "v"]
            assert fields["obs/c"].ordered is True
        assert coll.n_obs == src.n_obs == 6
        assert len(coll.manifest.inputs) == 2  # still recorded (staleness compares them)
    assert "has no cells (n_obs == 0); skipped" in caplog.text
    with pytest.raises(InputError, match="no input has cells"):
        abt.create_anndata_collection([z], tmp_path / "none", progress=False)


def test_an_input_without_cells_may_lack_the_fields_the_others_have(
        tmp_path: Path, write_h5ads: WriteH5ads) -> None:
    """The writer crashed (KeyError in pass 1 and in the shard sizing) when a 0-cell input
    lacked an obs column or X that the inputs with cells carry (found in review)."""
    a = _adata(6, "a", ct=pd.Categorical(list("xy") * 3))
    no_column = _adata(0, "e")
    no_x = _adata(0, "f", ct=pd.Categorical([]))
    no_x.X = None
    for empty in (no_column, no_x):
        for inputs in ([a, empty], write_h5ads([a, empty], tmp_path / "files")):
            coll = abt.create_anndata_collection(inputs, tmp_path / "out", progress=False,
                                                 overwrite=True)
            assert coll.n_obs == 6
            assert {"X", "obs/ct"} <= set(coll.fields)
            src = InPlaceSource(inputs)
            assert {"X", "obs/ct"} <= set(src.fields)


def test_an_obs_column_named_index_follows_the_field_rule(tmp_path: Path) -> None:
    """anndata refuses to write an obs column named '_index' (its index's name): the writer
    failed after pass 1 with anndata's bare ValueError; in place offered it (review)."""
    a = _adata(4, "a", _index=pd.Categorical(list("xyxy")), ct=pd.Categorical(list("uvuv")))
    coll = abt.create_anndata_collection([a], tmp_path / "out", progress=False)
    src = InPlaceSource([a])
    for fields, unavailable in ((coll.fields, coll.unavailable), (src.fields, src.unavailable)):
        assert "obs/_index" not in fields
        assert "obs/ct" in fields
        assert "'_index' is the name AnnData stores the obs index under" in unavailable[
            "obs/_index"]
    with pytest.raises(InputError, match="'_index' is the name AnnData stores"):
        abt.create_anndata_collection([a], tmp_path / "asked", obs_columns=["_index"],
                                      progress=False)
    assert not (tmp_path / "asked").exists()


def test_a_float32_column_with_nan_stays_float32_from_memory(tmp_path: Path,
                                                             write_h5ads: WriteH5ads) -> None:
    """From an in-memory AnnData it became float64 (twice the bytes), from its file float32
    (found in review); nullable integers with missing values still become float64."""
    v = np.array([0.5, np.nan, 2.0, 3.0], dtype=np.float32)
    a = _adata(4, "a", v=v, k=pd.array([1, None, 3, 4], dtype="Int64"))
    for inputs in ([a], write_h5ads([a], tmp_path / "files")):
        coll = abt.create_anndata_collection(inputs, tmp_path / "out", progress=False,
                                             overwrite=True)
        src = InPlaceSource(inputs)
        for fields in (coll.fields, src.fields):
            assert fields["obs/v"].dtype == "float32"
            assert fields["obs/k"].dtype == "float64"


def test_a_shard_size_past_the_cells_is_one_shard(tmp_path: Path) -> None:
    """--shard-size 99999999999999999999 overflowed int64 in pass 1 (found in review)."""
    coll = abt.create_anndata_collection([_adata(30, "a")], tmp_path / "out", progress=False,
                                         n_obs_per_shard=10**20)
    assert coll.shard_sizes == [30]


def test_a_collection_given_as_an_input_is_named_as_one(small_collection: Any,
                                                        tmp_path: Path) -> None:
    """It was read as a zarr store without obs (GroupNotFoundError's text; review)."""
    for call in (lambda: abt.create_anndata_collection([small_collection.path],
                                                       tmp_path / "out", progress=False),
                 lambda: InPlaceSource([small_collection.path])):
        with pytest.raises(InputError, match=r"is an annbatch_torch collection, not an "
                                             r"AnnData input\. Read it with AnnBatchDataset"):
            call()


# -- A5: the same input twice, shared obs_names --------------------------------------------
def test_the_same_input_twice_is_refused_on_both_paths(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       write_h5ads: WriteH5ads) -> None:
    a, b = _adata(10, "a"), _adata(10, "b")
    pa, pb = write_h5ads([a, b], tmp_path)
    link = tmp_path / "link.h5ad"
    link.symlink_to(pa)
    hard = tmp_path / "hard.h5ad"
    os.link(pa, hard)
    monkeypatch.chdir(tmp_path)
    backed = ad.read_h5ad(pb, backed="r")
    cases = [([pa, pb, "in0.h5ad"], r"input #0 \(.*in0\.h5ad\) and input #2 .* are the same "
                                    r"file"),
             ([pa, link], r"input #0 .* and input #1 .* are the same file"),
             # each named by its own path (both were named by the second: review)
             ([pa, hard], r"input #0 \(.*in0\.h5ad\) and input #1 \(.*hard\.h5ad\) are the "
                          r"same file"),
             ([pb, backed], r"input #0 .* and input #1 .* are the same file"),
             ([a, b, a], r"input #0 \(<AnnData #0>\) and input #2 \(<AnnData #2>\) are the "
                         r"same AnnData object")]
    for inputs, match in cases:
        with pytest.raises(InputError, match=match + r".*read twice\. Fix: pass each input"):
            abt.create_anndata_collection(inputs, tmp_path / "out", progress=False)
        with pytest.raises(InputError, match=match):
            InPlaceSource(inputs)
    assert not (tmp_path / "out").exists()
    backed.file.close()


@pytest.mark.parametrize("scheduler", [None, "threads"])
def test_obs_names_shared_by_inputs_are_a_warning(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture,
                                                  scheduler: str | None) -> None:
    """Serially before the write; on Dask in a thread of the caller while its workers
    write (the same warning, once)."""
    a, b = _adata(10, "c"), _adata(8, "d")
    b.obs_names = ["c1", "c2", "c3", *[f"d{i}" for i in range(5)]]
    caplog.set_level(logging.WARNING, logger="annbatch_torch")
    kw = {"scheduler": scheduler, "n_workers": 2} if scheduler else {}
    coll = abt.create_anndata_collection([a, b], tmp_path / "out", progress=False, **kw)
    src = InPlaceSource([a, b])
    assert coll.n_obs == src.n_obs == 18
    warned = [r.getMessage() for r in caplog.records if "obs_names appear" in r.getMessage()]
    assert len(warned) == 2  # once by the writer, once in place
    for w in warned:
        assert re.search(r"^3 obs_names appear in more than one input \(e\.g\. 'c[123]' in "
                         r"<AnnData #0> and <AnnData #1>\).*row ids", w)


def test_obs_names_repeated_in_an_input_are_a_warning_with_distinct_examples(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a, b = _adata(10, "c"), _adata(8, "d")
    # c5 three times, c2 twice: 2 names, 5 rows; the examples in row order, each once
    a.obs_names = ["c0", "c5", "c2", "c5", "c4", "c2", "c6", "c5", "c8", "c9"]
    caplog.set_level(logging.WARNING, logger="annbatch_torch")
    coll = abt.create_anndata_collection([a, b], tmp_path / "out", progress=False)
    assert sorted(coll.obs_names_at(np.arange(18))) == sorted([*a.obs_names, *b.obs_names])
    warned = [r.getMessage() for r in caplog.records if "more than once" in r.getMessage()]
    assert len(warned) == 1
    assert re.search(r"<AnnData #0>: 2 obs_names appear more than once in this input \(5 "
                     r"rows share them; e\.g\. 'c5', 'c2'\)", warned[0]), warned[0]
    assert not [r for r in caplog.records if "more than one input" in r.getMessage()]


# -- A6: in place reads like a collection -------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32])
def test_a_dense_x_reads_in_place_as_csr_like_a_collection(tmp_path: Path, dtype: Any,
                                                           write_h5ads: WriteH5ads) -> None:
    a, b = _adata(12, "a", dense=True, dtype=dtype), _adata(8, "b", dense=True, dtype=dtype)
    # sparse in one input (scipy has no float16), dense in the other
    a.layers["L"] = sp.csr_matrix(a.X.astype(np.float32) if dtype == np.float16 else a.X)
    b.layers["L"] = b.X.copy()
    paths = write_h5ads([a, b], tmp_path)
    for inputs in ([a, b], paths):
        coll = abt.create_anndata_collection(inputs, tmp_path / "out", progress=False,
                                             overwrite=True, shuffle=False)  # rows in order
        src = InPlaceSource(inputs)
        for f in ("X", "layers/L"):
            assert (src.fields[f].kind, src.fields[f].dtype) == \
                (coll.fields[f].kind, coll.fields[f].dtype) == \
                ("csr", "float32" if dtype == np.float16 else np.dtype(dtype).name)
        want = np.concatenate([a.X, b.X]).astype(np.float32)
        for source in (coll, inputs):
            batch = _one_batch(source, {"x": A.X, "l": A.layers["L"]}, 20, return_index=True)
            assert batch["x"].layout == batch["l"].layout == torch.sparse_csr
            rows = batch["index"].numpy()
            np.testing.assert_array_equal(batch["x"].to_dense().numpy(), want[rows])
            np.testing.assert_array_equal(batch["l"].to_dense().numpy(), want[rows])


def test_a_sparse_obsm_reads_in_place_as_dense_like_a_collection(tmp_path: Path) -> None:
    a, b = _adata(6, "a"), _adata(6, "b")
    a.obsm["s"] = sp.random(6, 3, density=0.5, format="csr", random_state=1)
    b.obsm["s"] = sp.random(6, 3, density=0.5, format="csr", random_state=2).toarray()
    coll = abt.create_anndata_collection([a, b], tmp_path / "out", progress=False,
                                         shuffle=False)  # rows in input order
    src = InPlaceSource([a, b])
    assert (src.fields["obsm/s"].kind, src.fields["obsm/s"].dtype) == \
        (coll.fields["obsm/s"].kind, coll.fields["obsm/s"].dtype) == ("dense", "float64")
    want = np.concatenate([a.obsm["s"].toarray(), b.obsm["s"]]).astype(np.float32)
    for source in (coll, [a, b]):
        batch = _one_batch(source, {"s": A.obsm["s"]}, 12, return_index=True)
        assert batch["s"].layout == torch.strided
        np.testing.assert_array_equal(batch["s"].numpy(), want[batch["index"].numpy()])


@pytest.mark.parametrize("on_disk", [False, True])
def test_a_string_column_reads_in_place_as_the_writers_categorical(
        tmp_path: Path, on_disk: bool, caplog: pytest.LogCaptureFixture,
        write_h5ads: WriteH5ads) -> None:
    a = _adata(12, "a", donor=np.array(["d2", "d1", None, "d3"] * 3, dtype=object))
    b = _adata(6, "b", donor=pd.Categorical(["d4", "d1"] * 3))
    inputs: list[Any] = write_h5ads([a, b], tmp_path) if on_disk else [a, b]
    if on_disk:  # anndata writes repeated strings as a categorical: store strings instead
        with h5py.File(inputs[0], "r+") as f, \
                ad.settings.override(allow_write_nullable_strings=True):
            del f["obs/donor"]
            ad.io.write_elem(f["obs"], "donor", pd.array(a.obs["donor"], dtype="string"))
            assert f["obs/donor"].attrs["encoding-type"] == "nullable-string-array"
    coll = abt.create_anndata_collection(inputs, tmp_path / "out", progress=False,
                                         shuffle=False)  # rows in input order
    src = InPlaceSource(inputs)
    assert src.fields["obs/donor"].kind == coll.fields["obs/donor"].kind == "categorical"
    assert src.categories("donor") == coll.categories("donor") == ["d1", "d2", "d3", "d4"]
    want = [None if pd.isna(v) else v for v in [*a.obs["donor"], *b.obs["donor"]]]
    cats = src.categories("donor")
    for source in (coll, inputs):
        batch = _one_batch(source, {"y": A.obs["donor"]}, 18, return_index=True)
        got = {int(r): None if c < 0 else cats[c]
               for r, c in zip(batch["index"].numpy(), batch["y"].numpy())}
        assert [got[r] for r in range(18)] == want


def test_string_ids_warn_alike_on_both_paths(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    a = _adata(10_500, "a", n_vars=2)
    a.obs["barcode"] = [f"bc{i}" for i in range(10_500)]
    caplog.set_level(logging.WARNING, logger="annbatch_torch")
    abt.create_anndata_collection([a], tmp_path / "out", progress=False)
    src = InPlaceSource([a])
    assert src.fields["obs/barcode"].kind == "categorical"
    warned = [r.getMessage() for r in caplog.records if "looks like per-cell IDs" in
              r.getMessage()]
    assert len(warned) == 2
    assert warned[0] == warned[1]


def test_duplicate_var_names_are_refused_in_place_too(tmp_path: Path,
                                                      write_h5ads: WriteH5ads) -> None:
    a = _adata(6, "a")
    a.var_names = ["g0", "g1", "g0", "g3"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (p,) = write_h5ads([a], tmp_path)
    match = r"var_names are not unique \(e\.g\. \['g0'\]\).*var_names_make_unique"
    for inputs in ([a], [p]):
        with pytest.raises(InputError, match=match) as writer:
            abt.create_anndata_collection(inputs, tmp_path / "out", progress=False)
        with pytest.raises(InputError, match=match) as in_place:
            InPlaceSource(inputs)
        assert str(writer.value) == str(in_place.value)


@pytest.mark.parametrize("var_join", ["outer", "inner"])
def test_missing_var_names_are_refused(tmp_path: Path, var_join: str) -> None:
    """A gene named None: the outer join wrote it as 'nan', all zeros, its values dropped
    (a review's finding); the writer and in-place reading refuse it, naming the input."""
    a, b = _adata(4, "a"), _adata(4, "b")
    a.var_names = pd.Index(["g0", None, "g2", "g3"], dtype=object)
    match = r"<AnnData #0>: var_names hold 1 missing value\(s\).*position 1.*name every gene"
    with pytest.raises(InputError, match=match):
        abt.create_anndata_collection([a, b], tmp_path / "out", var_join=var_join,
                                      progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match=match):
        InPlaceSource([a, b])


# -- B1, B2, B8: values that are no numbers, labels that are no plain scalars ---------------
@pytest.mark.parametrize("on_disk", [False, True])
def test_complex_numbers_are_refused_before_anything_is_written(tmp_path: Path,
                                                                on_disk: bool,
                                                                write_h5ads: WriteH5ads) -> None:
    """The writer wrote every shard and the manifest, then failed opening its own output
    ("manifest is damaged"); in place offered complex fields."""
    a = _adata(6, "a", z=np.arange(6) * (1 + 1j))
    inputs: list[Any] = write_h5ads([a], tmp_path) if on_disk else [a]
    _refused_by_both(inputs, tmp_path, "obs/z", r"obs column 'z' holds complex numbers "
                     r"\(complex128\).*Fix: keep the real part.*numpy\.abs",
                     obs_columns=["z"])
    b = _adata(6, "b", dtype=np.complex64)
    with pytest.raises(InputError, match=r"<AnnData #0>: X holds complex numbers \(complex64\)"
                       r".*adata\.X = numpy\.abs\(adata\.X\)"):
        abt.create_anndata_collection([b], tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()
    assert "X" not in InPlaceSource([b]).fields


@pytest.mark.parametrize("values", [
    pd.date_range("2020-01-01", periods=6).values,
    pd.to_timedelta(np.arange(6), unit="h").values,
    pd.date_range("2020-01-01", periods=6, tz="UTC"),
])
def test_dates_and_durations_get_one_reason(tmp_path: Path, values: Any) -> None:
    a = _adata(6, "a", t=values)
    _refused_by_both([a], tmp_path, "obs/t", r"obs column 't' holds dates or durations "
                     r".*astype\(str\)\.astype\('category'\)", obs_columns=["t"])


@pytest.mark.parametrize("cats", [pd.date_range("2020-01-01", periods=2).tolist(),
                                  pd.interval_range(0, 2).tolist(),
                                  [pd.Period("2020-01", "M"), pd.Period("2020-02", "M")]])
def test_categories_that_are_no_plain_labels_are_refused(tmp_path: Path, cats: list[Any]) -> None:
    """Timestamp / Interval categories: the writer raised a bare `Object of type Timestamp
    is not JSON serializable`; in place offered them."""
    a = _adata(6, "a", c=pd.Categorical(cats * 3))
    _refused_by_both([a], tmp_path, "obs/c", rf"obs column 'c' has categories of type "
                     rf"{type(cats[0]).__name__} .*adata\.obs\['c'\]\.astype\(str\)"
                     r"\.astype\('category'\)", obs_columns=["c"])


# -- B3: obsm shapes ----------------------------------------------------------------------
def test_obsm_entries_that_are_not_2d_get_one_reason(tmp_path: Path,
                                                     write_h5ads: WriteH5ads) -> None:
    a, b = _adata(6, "a"), _adata(6, "b")
    a.obsm["t"], b.obsm["t"] = np.ones((6, 2, 3), np.float32), np.ones((6, 2, 3), np.float32)
    (tmp_path / "3d").mkdir()
    _refused_by_both([a, b], tmp_path / "3d", "obsm/t", r"obsm entry 't' is a 3-D array.*"
                     r"must be 2-D.*reshape\(adata\.n_obs, -1\)", obsm=["t"])
    (p,) = write_h5ads([_adata(6, "c")], tmp_path)
    with h5py.File(p, "r+") as f:
        f["obsm"]["v"] = np.arange(6.0)
        f["obsm/v"].attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
    (tmp_path / "1d").mkdir()
    _refused_by_both([p], tmp_path / "1d", "obsm/v", r"obsm entry 'v' is a 1-D array.*"
                     r"must be 2-D", obsm=["v"])


# -- B5: booleans meeting numbers ---------------------------------------------------------
def test_booleans_and_numbers_in_one_column_are_refused(tmp_path: Path) -> None:
    """``[True, 'x']`` + ``[1, 'y']``: both paths accepted them and 1 became True."""
    a = _adata(4, "a", c=pd.Categorical.from_codes([0, 1, 0, 1],
                                                   categories=pd.Index([True, "x"], dtype=object)))
    b = _adata(4, "b", c=pd.Categorical.from_codes([0, 1, 0, 1],
                                                   categories=pd.Index([1, "y"], dtype=object)))
    _refused_by_both([a, b], tmp_path, "obs/c", r"obs column 'c' has the boolean category "
                     r"True there and the number 1 in <AnnData #1>.*would silently become True",
                     obs_columns=["c"])


_POOLS: dict[str, list[Any]] = {"bool": [True, False], "int": [0, 1, 2], "float": [0.0, 1.5],
                                "str": ["0", "1", "a"]}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_no_category_merges_into_another_of_another_type(data: st.DataObject) -> None:
    """Random category sets mixing booleans, integers, floats and strings in 2-3 inputs:
    both paths refuse alike, or every label keeps its value *and* its type class (a bool
    never becomes a number, nor 1 True)."""
    inputs = []
    for i in range(data.draw(st.integers(2, 3))):
        kinds = data.draw(st.lists(st.sampled_from(sorted(_POOLS)), min_size=1, max_size=3,
                                   unique=True))
        pool = [v for k in kinds for v in _POOLS[k]]
        cats = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4, unique=True))
        index = pd.Index(cats, dtype=object)
        if not index.is_unique:  # pandas: True == 1
            continue
        codes = data.draw(st.lists(st.integers(-1, len(cats) - 1), min_size=2, max_size=2))
        inputs.append(_adata(2, f"i{i}_", c=pd.Categorical.from_codes(codes, categories=index)))
    if len(inputs) < 2:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = InPlaceSource(inputs)
        try:
            schema = _schema(inputs, obs_columns=["c"], layers=[], obsm=[])
        except InputError as e:
            refused: str | None = str(e)
        else:
            refused = None
    if refused is not None:
        assert "obs/c" not in src.fields
        assert _problem(src.unavailable["obs/c"]) == _problem(refused)
        return
    out = next(f for f in schema.fields if f.key == "obs/c")

    def cls(v: Any) -> str:
        return "bool" if isinstance(v, bool | np.bool_) else "str" if isinstance(v, str) \
            else "number"

    assert list(src.fields["obs/c"].categories or ()) == out.categories
    for shard, a in enumerate(inputs):
        local = list(a.obs["c"].cat.categories)
        table = src.code_map(shard, "obs/c")
        for code, v in enumerate(local):
            g = out.categories[table[code]]
            assert g == v, (local, out.categories)
            assert cls(g) == cls(v), (local, out.categories)


# -- B6: AnnData-like wrappers -------------------------------------------------------------
class _Wrapper:
    """An AnnData-like object that is no AnnData subclass (a proxy forwarding attributes)."""

    def __init__(self, a: ad.AnnData) -> None:
        self._a = a

    def __getattr__(self, k: str) -> Any:
        return getattr(self._a, k)


def test_anndata_like_wrappers_are_read_on_both_paths(tmp_path: Path) -> None:
    a = _adata(6, "a", c=pd.Categorical(list("uv") * 3))
    batch = _one_batch(_Wrapper(a), {"c": A.obs["c"], "x": A.X}, 6, densify=True)
    assert batch["c"].tolist() == [0, 1] * 3
    np.testing.assert_array_equal(batch["x"].numpy(), a.X.toarray())
    coll = abt.create_anndata_collection(_Wrapper(a), tmp_path / "out", progress=False)
    assert coll.n_obs == 6
    assert coll.categories("c") == ["u", "v"]
    with pytest.raises(InputError, match=r"input #0: got a object"):
        InPlaceSource([object()])


# -- B7: one label for a relative path ----------------------------------------------------
def test_a_relative_path_has_one_label_on_both_paths(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _adata(6, "r", c=pd.Categorical(["1", "2"] * 3)).write_h5ad("rel.h5ad")
    b = _adata(6, "s", c=pd.Categorical([1, 2] * 3))
    with pytest.raises(InputError) as writer:
        abt.create_anndata_collection(["rel.h5ad", b], tmp_path / "o", obs_columns=["c"],
                                      progress=False)
    src = InPlaceSource(["rel.h5ad", b])
    label = str(tmp_path.resolve() / "rel.h5ad")
    assert str(writer.value).startswith(f"{label}: obs column 'c'")
    assert src.unavailable["obs/c"].startswith(f"{label}: obs column 'c'")
    assert src.shard_name(0) == label


# -- B9: uint64 ---------------------------------------------------------------------------
def test_uint64_values_that_do_not_fit_int64_are_refused(tmp_path: Path) -> None:
    """Values >= 2**63 wrapped to negative int64 numbers on both paths."""
    big = _adata(4, "a", u=np.array([2**63 + k for k in range(4)], dtype=np.uint64))
    _refused_by_both([big], tmp_path, "obs/u", r"obs column 'u' holds 9223372036854775811 "
                     r"\(uint64\), above 2\*\*63 - 1.*astype\('float64'\)", obs_columns=["u"])
    fits = _adata(4, "b", u=np.array([0, 1, 2**62, 2**63 - 1], dtype=np.uint64))
    coll = abt.create_anndata_collection([fits], tmp_path / "fits", progress=False)
    for source in (coll, [fits]):
        batch = _one_batch(source, {"u": A.obs["u"]}, 4, return_index=True)
        assert sorted(batch["u"].tolist()) == [0, 1, 2**62, 2**63 - 1]
    assert coll.fields["obs/u"].dtype == InPlaceSource([fits]).fields["obs/u"].dtype == "int64"
    x = _adata(4, "c", dtype=np.uint64)
    x.X.data[0] = 2**63 + 5
    with pytest.raises(InputError, match=r"field 'X' holds 9223372036854775813 \(uint64\) at "
                       r"row 0, above 2\*\*63 - 1.*float64"):
        abt.create_anndata_collection([x], tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()


# -- B10: the in-place "missing" refusal has a fix -----------------------------------------
def test_a_field_missing_from_an_input_says_which_and_how_on_both_paths(tmp_path: Path) -> None:
    a, b = _adata(6, "a"), _adata(6, "b")
    a.layers["counts"] = a.X.copy()
    writer = _refused_by_both([a, b], tmp_path, "layers/counts",
                              r"<AnnData #1>: has no layer 'counts' \(it is in <AnnData #0>\)"
                              r".*Fix: add it to that input, or ", layers=["counts"])
    assert writer.endswith("or leave it out with layers=[...].")
    assert InPlaceSource([a, b]).unavailable["layers/counts"].endswith(
        "Fix: add it to that input, or leave it out of the selector.")


# -- B11: field names that cannot be folder names -----------------------------------------
def test_obs_names_that_cannot_be_folder_names_are_left_out_on_both_paths(
        tmp_path: Path) -> None:
    a = _adata(6, "a", fine=np.arange(6.0))
    a.obs["CD4/CD8"] = 1.0
    a.obs[""] = 2.0
    coll = abt.create_anndata_collection([a], tmp_path / "out", progress=False)
    src = InPlaceSource([a])
    for name in ("obs/CD4/CD8", "obs/"):
        assert name not in coll.fields
        assert name not in src.fields
        assert "its name cannot be stored" in coll.unavailable[name]
        assert src.unavailable[name] == coll.unavailable[name].replace(
            "leave it out with obs_columns=[...]", "leave it out of the selector")
    assert "obs/fine" in src.fields
    assert "obs/fine" in coll.fields


def test_nothing_on_the_unasked_path_writes_half_a_collection(tmp_path: Path) -> None:
    """A field asked for that fails in pass 1 (an inf in a named obsm) leaves no output and
    no temporary folder; the same field unasked is dropped and the collection opens."""
    a = _adata(50, "a")
    a.obsm["p"] = np.ones((50, 3), np.float32)
    a.obsm["p"][40, 0] = -np.inf
    with pytest.raises(InputError, match=r"'obsm/p' holds 1 non-finite value.*row 40"):
        abt.create_anndata_collection([a], tmp_path / "out", obsm=["p"], progress=False,
                                      n_obs_per_shard=16)
    assert sorted(os.listdir(tmp_path)) == []
    coll = abt.create_anndata_collection([a], tmp_path / "out", progress=False,
                                         n_obs_per_shard=16)
    assert "obsm/p" not in coll.fields
    assert "obsm/p" in coll.unavailable
    assert abt.open_collection(tmp_path / "out").n_obs == 50
