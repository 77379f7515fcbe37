"""The writer and in-place reading open inputs and harmonise fields by the same rules.

Each test here failed before the two paths shared one input layer (``store/inputs.py``) and
one set of rules (``store/harmonize.py``): the writer (``create_anndata_collection``) is the
reference, in-place reading (``AnnBatchDataset([...])`` through ``InPlaceSource``) must
offer the same kind, dtype, categories, codes and ``ordered`` flag, or refuse with the same
reason. Divergences they pin:

* categories of different kinds (``1`` vs ``"1"``, ``True`` vs ``1``): the writer refused,
  in place they were unioned into two classes per label (or silently merged);
* the union's values: in place ``[1, 2, 1.5]`` where the writer stores ``[1.0, 2.0, 1.5]``;
* ``ordered``: always False in place;
* an obs column bool in one input, numeric in another: numeric for the writer, refused in
  place; float16 CSR: float32 for the writer, a read error in place;
* refusals in place gave the fix for X (``csr_matrix``) for an obs column or obsm width;
* opening: a non-AnnData HDF5 file was a KeyError in place, ``~`` was not expanded in place,
  bad inputs were named differently; an ``.h5ad`` without X was "not an AnnData store" to
  the writer (an in-memory one: "X is None"); a non-string obs column name crashed in-place
  reading.
"""

from __future__ import annotations

import logging
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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import annbatch_torch as abt
from annbatch_torch import A
from annbatch_torch.errors import InputError, SchemaError
from annbatch_torch.store.inputs.inplace import InPlaceSource
from annbatch_torch.store.inputs.view import InputSource
from annbatch_torch.write.schema import resolve_schema

if TYPE_CHECKING:
    from conftest import WriteH5ads

N_VARS = 5


def _adata(n: int, tag: str, **obs: Any) -> ad.AnnData:
    rng = np.random.default_rng(len(tag) + n)
    x = sp.random(n, N_VARS, density=0.5, format="csr", dtype=np.float32, random_state=rng)
    a = ad.AnnData(x, obs=pd.DataFrame(index=[f"{tag}{i}" for i in range(n)]),
                   var=pd.DataFrame(index=[f"g{k}" for k in range(N_VARS)]))
    for name, values in obs.items():
        a.obs[name] = values
    return a


def _writer_schema(inputs: list[Any], **kw: Any) -> Any:
    sources = [InputSource(x, i) for i, x in enumerate(inputs)]
    try:
        return resolve_schema(sources, "inner", kw.get("obs_columns"), kw.get("layers"),
                              kw.get("obsm"))
    finally:
        for s in sources:
            s.close()


def _field(schema: Any, key: str) -> Any:
    return next(f for f in schema.fields if f.key == key)


def _problem(message: str) -> str:
    """A refusal without its fix (the writer and in-place reading say how to leave a field
    out in their own terms)."""
    return message.split(" Fix:")[0]


def _labels(ds: abt.AnnBatchDataset, key: str, cats: list[Any],
            row_names: np.ndarray) -> dict[str, Any]:
    """obs_name -> label of every row the dataset yields (codes looked up in ``cats``;
    ``row_names`` holds the name of each global row)."""
    out: dict[str, Any] = {}
    for b in ds:
        for row, code in zip(b["index"].numpy(), b[key].numpy()):
            out[str(row_names[row])] = None if code < 0 else cats[int(code)]
    return out


# --------------------------------------------------------------------------------------
# categories
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("first", "second", "kinds"), [
    ([1, 2], ["1", "2"], "numeric categories there but string ones"),
    ([True, False], [1, 0], "other categories there but numeric ones"),
])
@pytest.mark.parametrize("on_disk", [False, True])
def test_categories_of_two_kinds_are_refused_by_both_paths(
        tmp_path: Path, first: list[Any], second: list[Any], kinds: str, on_disk: bool,
        write_h5ads: WriteH5ads) -> None:
    a = _adata(20, "a", c=pd.Categorical(first * 10))
    b = _adata(20, "b", c=pd.Categorical(second * 10))
    inputs: list[Any] = write_h5ads([a, b], tmp_path) if on_disk else [a, b]
    second_name = re.escape(str(inputs[1]) if on_disk else "<AnnData #1>")
    want = rf"obs column 'c' has {kinds} in {second_name}.*two classes.*astype\(str\)"
    with pytest.raises(InputError, match=want) as writer:
        # asked for by name: a column nobody asks for is now left out with a warning (A4)
        abt.create_anndata_collection(inputs, tmp_path / "out", obs_columns=["c"],
                                      progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(SchemaError, match=rf"'obs/c' cannot be selected: .*{want}"):
        abt.AnnBatchDataset(inputs, selector={"y": A.obs["c"]})
    src = InPlaceSource(inputs)
    assert "obs/c" not in src.fields
    assert _problem(src.unavailable["obs/c"]) == _problem(str(writer.value))
    assert "X" in src.fields  # the other fields stay readable in place


def test_the_union_of_int_and_float_categories_has_the_writers_values(tmp_path: Path) -> None:
    a = _adata(20, "a", c=pd.Categorical([1, 2] * 10))
    b = _adata(20, "b", c=pd.Categorical([1.5, 2.0] * 10))
    coll = abt.create_anndata_collection([a, b], tmp_path / "out", progress=False)
    src = InPlaceSource([a, b])
    assert coll.categories("c") == [1.0, 2.0, 1.5]
    assert [type(v) for v in coll.categories("c")] == [float] * 3  # one pandas Index's values
    assert src.categories("c") == coll.categories("c")
    assert [type(v) for v in src.categories("c")] == [type(v) for v in coll.categories("c")]


def test_in_place_batches_carry_the_writers_labels_and_order(tmp_path: Path) -> None:
    """An ordered categorical with missing values, its categories in one order in both
    inputs but only some used in each: in place, the writer's categories, ``ordered`` flag
    and, for every cell, its label."""
    levels = ["lo", "mid", "hi"]
    a = _adata(30, "a", c=pd.Categorical(["lo", "hi", None] * 10, categories=levels,
                                         ordered=True))
    b = _adata(24, "b", c=pd.Categorical(["mid", "lo"] * 12, categories=levels, ordered=True))
    coll = abt.create_anndata_collection([a, b], tmp_path / "out", progress=False)
    kw = {"selector": {"y": A.obs["c"]}, "batch_size": 8, "return_index": True}
    ds_coll = abt.AnnBatchDataset(coll, **kw)
    ds_place = abt.AnnBatchDataset([a, b], **kw)
    assert ds_place.source.categories("c") == coll.categories("c") == levels
    assert ds_place.source.fields["obs/c"].ordered is coll.fields["obs/c"].ordered is True
    want = {**dict(zip(a.obs_names, a.obs["c"].astype(object).where(a.obs["c"].notna(), None))),
            **dict(zip(b.obs_names, b.obs["c"].astype(object)))}
    in_place_rows = np.concatenate([a.obs_names, b.obs_names])
    shard_rows = np.concatenate([ad.read_zarr(coll.shard_path(i)).obs_names
                                 for i in range(len(coll.shards))])
    assert _labels(ds_place, "y", levels, in_place_rows) == want
    assert _labels(ds_coll, "y", levels, shard_rows) == want


def test_ordered_categoricals_read_in_place_as_the_writer_stores_them(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, write_h5ads: WriteH5ads) -> None:
    grade = pd.Categorical(["lo", "hi"] * 10, categories=["lo", "hi"], ordered=True)
    a, b = _adata(20, "a", g=grade), _adata(20, "b", g=grade)
    coll = abt.create_anndata_collection([a, b], tmp_path / "same", progress=False)
    assert coll.fields["obs/g"].ordered is True
    for inputs in ([a, b], write_h5ads([a, b], tmp_path)):
        assert InPlaceSource(inputs).fields["obs/g"].ordered is True
    b.obs["g"] = pd.Categorical(["lo", "hi"] * 10, categories=["hi", "lo"], ordered=True)
    caplog.set_level(logging.WARNING, logger="annbatch_torch")
    coll = abt.create_anndata_collection([a, b], tmp_path / "differ", progress=False)
    src = InPlaceSource([a, b])
    for info in (coll.fields["obs/g"], src.fields["obs/g"]):
        assert (info.ordered, list(info.categories or ())) == (False, ["lo", "hi"])
    warned = [r for r in caplog.records if "category order differs" in r.getMessage()]
    assert len(warned) == 2  # once by the writer, once in place


def _category_sets() -> st.SearchStrategy[list[Any]]:
    pools: dict[str, list[Any]] = {
        "int": [0, 1, 2, 3], "float": [0.5, 1.0, 2.5], "str": ["0", "1", "a", "b"],
        "bool": [True, False], "mixed": [1, 2, "a", "b"],
    }
    return st.sampled_from(sorted(pools)).flatmap(
        lambda k: st.lists(st.sampled_from(pools[k]), min_size=0, max_size=len(pools[k]),
                           unique=True))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_category_sets_get_the_writers_categories_and_codes(data: st.DataObject) -> None:
    """2-3 in-memory inputs with random categories (kinds mixed at random), codes and
    ``ordered`` flags: in place, the same refusal or the same categories (values and
    types), ``ordered`` and local-to-global code tables as the writer's schema."""
    n_inputs = data.draw(st.integers(2, 3))
    inputs = []
    for i in range(n_inputs):
        cats = data.draw(_category_sets())
        n = data.draw(st.integers(1, 6))
        codes = data.draw(st.lists(st.integers(-1, len(cats) - 1), min_size=n, max_size=n))
        ordered = data.draw(st.booleans())
        index = pd.Index(cats) if cats else pd.Index([], dtype=object)
        column = pd.Categorical.from_codes(codes, categories=index, ordered=ordered)
        inputs.append(_adata(n, f"i{i}_", c=column))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = InPlaceSource(inputs)
        try:
            schema = _writer_schema(inputs, obs_columns=["c"], layers=[], obsm=[])
        except InputError as e:
            refused = str(e)
        else:
            refused = None
    if refused is not None:
        assert "obs/c" not in src.fields
        assert _problem(src.unavailable["obs/c"]) == _problem(refused)
        return
    out = _field(schema, "obs/c")
    info = src.fields["obs/c"]
    assert list(info.categories or ()) == out.categories
    assert [type(v) for v in info.categories or ()] == [type(v) for v in out.categories]
    assert info.ordered == out.ordered
    for shard, lut in enumerate(out.luts):
        np.testing.assert_array_equal(src.code_map(shard, "obs/c"), lut)


# --------------------------------------------------------------------------------------
# numeric columns and matrices
# --------------------------------------------------------------------------------------


_COLUMNS: dict[str, Any] = {
    "bool": lambda n: np.arange(n) % 2 == 0,
    "int8": lambda n: np.arange(n, dtype=np.int8),
    "int32": lambda n: np.arange(n, dtype=np.int32) - 3,
    "uint64": lambda n: np.arange(n, dtype=np.uint64),
    "float32": lambda n: np.linspace(0, 1, n, dtype=np.float32),
    "float64": lambda n: np.linspace(-1, 1, n),
    "Int64": lambda n: pd.array(np.arange(n), dtype="Int64"),
    "Int64+NA": lambda n: pd.array([1, None] * (n // 2), dtype="Int64"),
    "boolean": lambda n: pd.array([True, False] * (n // 2), dtype="boolean"),
    "boolean+NA": lambda n: pd.array([True, None] * (n // 2), dtype="boolean"),
}


@settings(max_examples=40, deadline=None)
@given(kinds=st.lists(st.sampled_from(sorted(_COLUMNS)), min_size=2, max_size=3))
def test_numeric_and_bool_columns_promote_alike(kinds: list[str]) -> None:
    """Any mix of bool, integer, float and nullable obs columns: one kind and dtype, the
    writer's, in place too."""
    inputs = [_adata(8, f"i{i}_", v=_COLUMNS[k](8)) for i, k in enumerate(kinds)]
    out = _field(_writer_schema(inputs, obs_columns=["v"], layers=[], obsm=[]), "obs/v")
    info = InPlaceSource(inputs).fields["obs/v"]
    assert (info.kind, np.dtype(info.dtype)) == (out.kind, out.dtype)


def test_a_bool_and_a_numeric_column_read_in_place_as_numbers(tmp_path: Path,
                                                              write_h5ads: WriteH5ads) -> None:
    a = _adata(10, "a", v=np.arange(10) % 3 == 0)
    b = _adata(10, "b", v=np.arange(10, dtype=np.int32) * 7)
    inputs = write_h5ads([a, b], tmp_path)
    coll = abt.create_anndata_collection(inputs, tmp_path / "out", progress=False)
    ds = abt.AnnBatchDataset(inputs, selector={"v": A.obs["v"]}, batch_size=20,
                             shuffle=False)
    assert ds.source.fields["obs/v"].dtype == coll.fields["obs/v"].dtype == "int32"
    (batch,) = list(ds)
    want = np.concatenate([a.obs["v"].to_numpy(dtype=np.int32), b.obs["v"].to_numpy()])
    np.testing.assert_array_equal(batch["v"].numpy(), want)


def test_a_float16_csr_file_reads_in_place_as_float32(tmp_path: Path,
                                                      write_h5ads: WriteH5ads) -> None:
    """scipy.sparse has no float16: the writer stores such X as float32, and so must
    in-place reading (it failed in the first batch)."""
    a = _adata(12, "a")
    (p,) = write_h5ads([a], tmp_path)
    with h5py.File(p, "r+") as f:
        half = f["X/data"][...].astype(np.float16)
        del f["X/data"]
        f["X/data"] = half
    coll = abt.create_anndata_collection([p], tmp_path / "out", progress=False)
    ds = abt.AnnBatchDataset(p, batch_size=12, shuffle=False, densify=True)
    assert ds.source.fields["X"].dtype == coll.fields["X"].dtype == "float32"
    (batch,) = list(ds)
    want = sp.csr_matrix((half.astype(np.float32), a.X.indices, a.X.indptr), shape=a.shape)
    np.testing.assert_array_equal(batch["X"].numpy(), want.toarray())


def test_in_place_refusals_give_the_writers_reason(tmp_path: Path) -> None:
    """An obs column categorical in one input and numeric in another, an obsm entry of two
    widths: in place the field is not offered, for the writer's reason (not the fix for a
    sparse/dense X)."""
    a = _adata(10, "a", c=pd.Categorical(["u", "v"] * 5))
    b = _adata(10, "b", c=np.linspace(0, 1, 10))
    a.obsm["p"], b.obsm["p"] = np.ones((10, 2), np.float32), np.ones((10, 3), np.float32)
    src = InPlaceSource([a, b])
    # each named: fields nobody asks for are now left out with a warning instead (A4)
    for field, kw in (("obs/c", {"obsm": [], "obs_columns": ["c"]}),
                      ("obsm/p", {"obs_columns": [], "obsm": ["p"]})):
        with pytest.raises(InputError) as writer:
            _writer_schema([a, b], layers=[], **kw)
        assert field not in src.fields
        assert _problem(src.unavailable[field]) == _problem(str(writer.value))
        assert "csr_matrix" not in src.unavailable[field]
    assert "categorical there but numeric (float64) in <AnnData #1>" in src.unavailable["obs/c"]
    assert "astype('category')" in src.unavailable["obs/c"]
    assert "obsm/p has ['2', '3'] columns across inputs" in src.unavailable["obsm/p"]


# --------------------------------------------------------------------------------------
# opening inputs
# --------------------------------------------------------------------------------------


def _bad_input(tmp_path: Path, what: str) -> tuple[Any, str]:
    if what == "missing":
        return tmp_path / "nope.h5ad", r"nope\.h5ad: no such file or folder"
    if what == "text":
        p = tmp_path / "notes.txt"
        p.write_text("hello")
        return p, r"notes\.txt: is neither an HDF5 \(\.h5ad\) file nor a zarr store"
    if what == "plain_hdf5":
        p = tmp_path / "plain.h5"
        with h5py.File(p, "w") as f:
            f["data"] = np.arange(3)
        return p, r"plain\.h5: not an AnnData store \(no \['X', 'obs', 'var'\] at its root\)"
    if what == "folder":
        p = tmp_path / "folder"
        p.mkdir()
        (p / "x.txt").write_text("x")
        return p, r"folder: is a folder but not a zarr store"
    return 42, r"input #1: got a int; pass \.h5ad files, AnnData zarr stores or anndata"


@pytest.mark.parametrize("what", ["missing", "text", "plain_hdf5", "folder", "object"])
def test_inputs_that_are_not_anndata_are_refused_alike(tmp_path: Path, what: str,
                                                       write_h5ads: WriteH5ads) -> None:
    tmp_path = tmp_path.resolve()  # the writer names inputs by their resolved path
    good = write_h5ads([_adata(10, "a")], tmp_path)[0]
    bad, match = _bad_input(tmp_path, what)
    with pytest.raises(InputError, match=match) as writer:
        abt.create_anndata_collection([good, bad], tmp_path / "out", progress=False)
    with pytest.raises(InputError, match=match) as in_place:
        InPlaceSource([good, bad])
    assert str(in_place.value) == str(writer.value)


def test_a_home_relative_path_reads_in_place(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             write_h5ads: WriteH5ads) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    write_h5ads([_adata(10, "a")], tmp_path)
    assert abt.AnnBatchDataset("~/in0.h5ad").source.n_obs == 10
    assert InPlaceSource(["~/in0.h5ad"]).n_obs == 10
    coll = abt.create_anndata_collection("~/in0.h5ad", tmp_path / "out", progress=False)
    assert abt.AnnBatchDataset("~/out").source.n_obs == coll.n_obs == 10


def test_an_h5ad_without_x_is_written_as_a_collection_without_x(tmp_path: Path,
                                                                write_h5ads: WriteH5ads) -> None:
    # was test_an_h5ad_without_x_is_refused_by_the_writer_as_x_is_none: the writer now
    # writes such inputs (issue 17, A3), and selecting X says why it is absent
    a = ad.AnnData(obs=pd.DataFrame(index=[f"c{i}" for i in range(10)]),
                   obsm={"e": np.ones((10, 2), np.float32)})
    (p,) = write_h5ads([a], tmp_path)
    for inputs, name in (([a], "<AnnData #0>"), ([p], re.escape(str(p.resolve())))):
        coll = abt.create_anndata_collection(inputs, tmp_path / "out", progress=False,
                                             overwrite=True)
        assert "X" not in coll.fields
        assert coll.fields["obsm/e"].shape == (None, 2)
        with pytest.raises(SchemaError, match=rf"{name} has no X \(it is None\)"):
            abt.AnnBatchDataset(coll)
    assert InPlaceSource([p]).fields["obsm/e"].shape == (None, 2)


def test_a_non_string_obs_column_name_is_left_out_in_place(tmp_path: Path) -> None:
    a = _adata(10, "a", fine=np.arange(10.0))
    a.obs[7] = 1.0
    coll = abt.create_anndata_collection([a], tmp_path / "out", progress=False)
    src = InPlaceSource([a])
    for fields in (coll.fields, src.fields):
        assert "obs/fine" in fields
        assert "obs/7" not in fields
    assert "7 is not a string" in src.unavailable["obs/7"]
    assert "7 is not a string" in coll.unavailable["obs/7"]


def test_numeric_var_names_are_their_strings_as_anndata_reads_them(tmp_path: Path) -> None:
    """An .h5ad whose var index is stored as integers (anndata reads it back as the
    strings '10', '11', ...) lines up with inputs naming the same genes as strings, on
    create and on append, in any gene order; the collection's var_names are strings."""
    def write(names: list[Any], tag: str, x: np.ndarray) -> Path:
        a = ad.AnnData(X=sp.csr_matrix(x.astype(np.float32)),
                       var=pd.DataFrame(index=[str(n) for n in names]))
        a.obs_names = [f"{tag}{i}" for i in range(x.shape[0])]
        a.var.index = pd.Index(names)  # integers, written as such
        path = tmp_path / f"{tag}.h5ad"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a.write_h5ad(path)
        return path

    x = np.arange(12).reshape(4, 3) + 1
    ints = write([10, 11, 12], "a", x)
    with h5py.File(ints) as f:
        assert f["var/_index"].dtype.kind == "i"
    strs = write(["12", "10", "11"], "b", x)  # the same genes as strings, another order
    coll = abt.create_anndata_collection([ints, strs], tmp_path / "s", shuffle=False,
                                         progress=False)
    assert list(coll.var_names) == ["10", "11", "12"]
    coll = abt.append_to_collection(coll.path, [write([12, 11, 10], "c", x)],
                                    progress=False)
    got = ad.concat([ad.read_zarr(coll.shard_path(i)) for i in range(len(coll.shards))])
    by_name = {n: got.X[i].toarray()[0] for i, n in enumerate(got.obs_names)}
    for i in range(4):
        np.testing.assert_array_equal(by_name[f"a{i}"], x[i])
        np.testing.assert_array_equal(by_name[f"b{i}"], x[i][[1, 2, 0]])
        np.testing.assert_array_equal(by_name[f"c{i}"], x[i][::-1])
