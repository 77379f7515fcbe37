"""append_to_collection at its edges (issue 29): categorical codes wider than the new
inputs', raw and its own genes, integral float counts into an integer collection, and
duplicate obs_names (within an input, and against the collection) warned about."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

import annbatch_torch as abt
from annbatch_torch import A, InputError

N_GENES = 12


def _adata(tag: str, n: int, labels: Any, *, x: Any = None, seed: int = 0,
           names: list[str] | None = None) -> ad.AnnData:
    rng = np.random.default_rng(seed)
    if x is None:
        x = sp.random(n, N_GENES, density=0.3, format="csr", dtype=np.float32,
                      random_state=rng)
    obs = pd.DataFrame({"ct": labels},
                       index=names if names is not None else [f"{tag}{i}" for i in range(n)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anndata's own note on duplicate obs_names
        return ad.AnnData(x, obs=obs, var=pd.DataFrame(index=[f"g{g}" for g in range(N_GENES)]))


def _write(a: ad.AnnData, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a.write_h5ad(path)
    return path


def _read(path: Path) -> ad.AnnData:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ad.read_h5ad(path)


def _rows_equal(coll: abt.Collection, field: Any, want: dict[str, np.ndarray]) -> None:
    """Every cell of ``coll`` once, its ``field`` (densified) equal to ``want[obs_name]``."""
    ds = abt.AnnBatchDataset(coll, selector={"m": field}, batch_size=64, densify=True,
                             return_index=True)
    seen = []
    for b in ds:
        names = coll.obs_names_at(b["index"].numpy())
        for name, row in zip(names, b["m"].numpy()):
            np.testing.assert_array_equal(row, want[name])
        seen += b["index"].tolist()
    assert sorted(seen) == list(range(coll.n_obs)) == list(range(len(want)))


# -- 1: categorical codes -----------------------------------------------------------------
CATS = [f"c{k:03d}" for k in range(300)]  # int16 codes in the collection


@pytest.fixture
def wide_labels(tmp_path: Path) -> tuple[Path, Path, ad.AnnData]:
    """A collection whose ``ct`` has 300 categories, and an input whose ``ct`` has three
    (int8 codes in the file) that map to global codes 150 (int8: -106), 255 (int8: -1,
    "missing") and 300 (a new category; int8: 44, another category)."""
    a0 = _adata("a", 600, pd.Categorical(np.repeat(CATS, 2), categories=CATS))
    p0 = _write(a0, tmp_path / "in0.h5ad")
    a1 = _adata("b", 90, pd.Categorical(np.tile(["c150", "c255", "zz_new"], 30)), seed=1)
    p1 = _write(a1, tmp_path / "in1.h5ad")
    import h5py

    with h5py.File(p1) as f:  # what the bug needs: narrow codes in the input
        assert f["obs/ct/codes"].dtype == np.int8
    return p0, p1, a1


def _labels_equal(coll: abt.Collection, adatas: list[ad.AnnData]) -> None:
    whole = pd.concat([a.obs["ct"].astype(str) for a in adatas])
    got = coll.obs_at(np.arange(coll.n_obs), "ct")["ct"]
    assert not got.isna().any()
    assert list(got.astype(str)) == list(whole[got.index])
    # the loader decodes the stored codes with the collection's categories
    ds = abt.AnnBatchDataset(coll, selector={"y": A.obs["ct"]}, batch_size=128,
                             return_index=True, shuffle=False)
    cats = np.asarray(coll.categories("ct"), dtype=object)
    for b in ds:
        names = coll.obs_names_at(b["index"].numpy())
        assert list(cats[b["y"].numpy()]) == list(whole[names])


@pytest.mark.parametrize("how", ["serial", "threads", "prepare"])
def test_append_widens_narrow_category_codes(wide_labels: tuple[Path, Path, ad.AnnData],
                                             tmp_path: Path, how: str) -> None:
    p0, p1, a1 = wide_labels
    store = tmp_path / "store"
    if how == "prepare":
        abt.prepare_collection([p0], store, seed=0, progress=False)
        assert abt.prepare_collection([p0, p1], store, seed=0, progress=False)
        coll = abt.open_collection(store)
        assert len(coll.manifest.extra["appended"]) == 1  # appended, not rewritten
    else:
        abt.create_anndata_collection([p0], store, seed=0, progress=False)
        kw: dict[str, Any] = ({} if how == "serial" else {"scheduler": "threads",
                                                          "n_workers": 2})
        coll = abt.append_to_collection(store, [p1], progress=False, **kw)
    assert coll.categories("ct") == [*CATS, "zz_new"]
    assert coll.manifest.fields["obs/ct"].dtype == "int16"
    _labels_equal(coll, [_read(p0), a1])


@pytest.mark.parametrize("how", ["serial", "threads"])
def test_append_past_the_stored_code_width(tmp_path: Path, how: str) -> None:
    """A collection with 100 categories stores int8 codes; an append bringing 60 more needs
    int16: the new shard stores int16, the field widens, the old shard's codes are read
    widened, and every label (the loader's, obs_at's, a sampler's) stays right."""
    old_cats = [f"o{k:03d}" for k in range(100)]
    a0 = _adata("a", 300, pd.Categorical(np.tile(old_cats, 3), categories=old_cats))
    p0 = _write(a0, tmp_path / "in0.h5ad")
    new_cats = [f"n{k:03d}" for k in range(60)] + old_cats[:5]
    a1 = _adata("b", 130, pd.Categorical(np.tile(new_cats, 2)), seed=1)
    p1 = _write(a1, tmp_path / "in1.h5ad")
    store = tmp_path / "store"
    abt.create_anndata_collection([p0], store, seed=0, progress=False)
    assert abt.open_collection(store).manifest.fields["obs/ct"].dtype == "int8"
    kw: dict[str, Any] = {} if how == "serial" else {"scheduler": "threads", "n_workers": 2}
    coll = abt.append_to_collection(store, [p1], progress=False, **kw)
    assert coll.manifest.fields["obs/ct"].dtype == "int16"
    assert len(coll.categories("ct")) == 160
    _labels_equal(coll, [_read(p0), a1])
    # a sampler's view of the column (read shard by shard) agrees too
    ds = abt.AnnBatchDataset(coll, selector={"y": A.obs["ct"]}, batch_size=64,
                             return_index=True, sampler=abt.ClassBalancedSampler("ct"))
    cats = np.asarray(coll.categories("ct"), dtype=object)
    whole = pd.concat([a.obs["ct"].astype(str) for a in (_read(p0), a1)])
    seen = set()
    for b in ds:
        names = coll.obs_names_at(b["index"].numpy())
        assert list(cats[b["y"].numpy()]) == list(whole[names])
        seen.update(cats[b["y"].numpy()])
    assert {"n000", "o099"} <= seen
    # every shard opens in anndata as it is
    for s in coll.manifest.shards:
        got = ad.read_zarr(store / s.path)
        assert set(got.obs["ct"].astype(str)) <= set(cats)


# -- 2: raw ------------------------------------------------------------------------------
def _with_raw(tag: str, n: int, raw_genes: list[str], seed: int) -> ad.AnnData:
    """raw: integer counts of ``raw_genes``; X: the log of its first four genes (g0-g3)."""
    rng = np.random.default_rng(seed)
    counts = sp.random(n, len(raw_genes), density=0.4, format="csr", random_state=rng,
                       dtype=np.float64)
    counts.data = np.round(counts.data * 20) + 1
    full = ad.AnnData(counts.astype(np.float32),
                      obs=pd.DataFrame({"ct": pd.Categorical(rng.choice(["B", "T"], n))},
                                       index=[f"{tag}{i}" for i in range(n)]),
                      var=pd.DataFrame({"symbol": [f"sym_{g}" for g in raw_genes]},
                                       index=raw_genes))
    a = full[:, ["g0", "g1", "g2", "g3"]].copy()
    a.X = sp.csr_matrix(np.log1p(a.X.toarray()))
    a.raw = full
    return a


def _raw_rows(a: ad.AnnData, genes: pd.Index) -> dict[str, np.ndarray]:
    m = a.raw.X.toarray()
    out = np.zeros((a.n_obs, len(genes)), dtype=np.float32)
    cols = a.raw.var_names.get_indexer(genes)
    out[:, cols >= 0] = m[:, cols[cols >= 0]]
    return dict(zip(a.obs_names, out))


@pytest.mark.parametrize("var_join", ["inner", "outer"])
def test_append_aligns_raw_genes(tmp_path: Path, var_join: str) -> None:
    genes = [f"g{k}" for k in range(10)]
    a0 = _with_raw("a", 300, genes, 1)
    # the same raw genes in another order (inner: and one the collection lacks, dropped;
    # outer: two missing, zeros)
    other = [*genes[::-1], "extra"] if var_join == "inner" else genes[::-1][2:]
    a1 = _with_raw("b", 200, other, 2)
    p0, p1 = _write(a0, tmp_path / "in0.h5ad"), _write(a1, tmp_path / "in1.h5ad")
    store = tmp_path / "store"
    abt.create_anndata_collection([p0], store, seed=0, var_join=var_join, progress=False)
    coll = abt.append_to_collection(store, [p1], progress=False)
    assert "raw/X" in coll.fields
    assert list(coll.raw_var_names) == genes
    assert list(coll.raw_var["symbol"]) == [f"sym_{g}" for g in genes]
    want = {**_raw_rows(a0, pd.Index(genes)), **_raw_rows(a1, pd.Index(genes))}
    _rows_equal(coll, A.raw.X, want)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shard = ad.read_zarr(coll.shard_path(len(coll.shards) - 1))  # an appended shard
    assert list(shard.raw.var_names) == genes


def test_append_raw_refusals_name_the_fix(tmp_path: Path) -> None:
    genes = [f"g{k}" for k in range(10)]
    p0 = _write(_with_raw("a", 100, genes, 1), tmp_path / "in0.h5ad")
    store = tmp_path / "store"
    abt.create_anndata_collection([p0], store, seed=0, progress=False)
    manifest = (store / "manifest.json").read_bytes()
    fewer = _write(_with_raw("b", 50, genes[:8], 2), tmp_path / "in1.h5ad")
    with pytest.raises(InputError, match=r"in1\.h5ad: lacks 2 of the 10 raw genes.*"
                       r"var_join='inner'.*Fix.*raw=False"):
        abt.append_to_collection(store, [fewer], progress=False)
    no_raw = _with_raw("c", 50, genes, 3)
    del no_raw.raw
    with pytest.raises(InputError, match=r"in2\.h5ad: has no raw .*Fix.*raw=False"):
        abt.append_to_collection(store, [_write(no_raw, tmp_path / "in2.h5ad")],
                                 progress=False)
    assert (store / "manifest.json").read_bytes() == manifest


# -- 3: dtypes ---------------------------------------------------------------------------
def test_append_casts_integral_floats_into_an_integer_collection(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    ints = sp.random(200, N_GENES, density=0.3, format="csr", random_state=rng)
    ints.data = np.round(ints.data * 50) + 1
    p0 = _write(_adata("a", 200, pd.Categorical(["A"] * 200), x=ints.astype(np.int64)),
                tmp_path / "in0.h5ad")
    floats = sp.random(150, N_GENES, density=0.3, format="csr", random_state=rng)
    floats.data = np.round(floats.data * 50) + 1
    a1 = _adata("b", 150, pd.Categorical(["B"] * 150), x=floats.astype(np.float32))
    p1 = _write(a1, tmp_path / "in1.h5ad")
    store = tmp_path / "store"
    coll = abt.create_anndata_collection([p0], store, seed=0, progress=False)
    assert coll.manifest.fields["X"].dtype == "int64"
    half = a1.copy()
    half.obs_names = [f"h{i}" for i in range(half.n_obs)]
    half.X.data[3] = 2.5
    p2 = _write(half, tmp_path / "half.h5ad")
    with pytest.raises(InputError,
                       match=r"half\.h5ad: X holds float32 .*2\.5.*stores X as int64"):
        abt.append_to_collection(store, [p2], progress=False)
    coll = abt.append_to_collection(store, [p1], progress=False)
    assert coll.manifest.fields["X"].dtype == "int64"
    want = {**dict(zip(_read(p0).obs_names, ints.toarray())),
            **dict(zip(a1.obs_names, floats.toarray()))}
    _rows_equal(coll, A.X, want)


@pytest.mark.parametrize(("dtype", "value", "stored_as"), [
    (np.int64, 16_777_217, "16777216.0"), (np.float64, 0.1, "0.10000000149"),
    (np.float64, 16_777_221.25, "16777222.0")])
def test_values_a_float32_collection_would_round_are_refused(
        tmp_path: Path, dtype: type, value: float, stored_as: str) -> None:
    """A float32 collection appended int64 counts beyond 2**24 or float64 values that
    float32 rounds: refused naming the input, the value, what it would become and the fix,
    and nothing is written; float64 values float32 holds exactly are appended as they
    are."""
    x0 = sp.random(100, N_GENES, density=0.3, format="csr", dtype=np.float32,
                   random_state=np.random.default_rng(0))
    p0 = _write(_adata("a", 100, pd.Categorical(["A"] * 100), x=x0), tmp_path / "in0.h5ad")
    store = tmp_path / "store"
    coll = abt.create_anndata_collection([p0], store, seed=0, progress=False)
    assert coll.manifest.fields["X"].dtype == "float32"
    before = (store / "manifest.json").read_bytes()
    x1 = sp.random(60, N_GENES, density=0.3, format="csr", random_state=np.random.default_rng(1))
    x1.data = np.round(x1.data * 64) / 4 + 1  # quarters: float32 holds them exactly
    x1 = x1.astype(dtype)
    bad = x1.copy()
    bad.data[5] = value
    p1 = _write(_adata("b", 60, pd.Categorical(["B"] * 60), x=bad), tmp_path / "bad.h5ad")
    with pytest.raises(InputError, match=rf"bad\.h5ad: X holds {np.dtype(dtype).name} values "
                       rf"that float32 does not hold exactly .*{stored_as}.*astype"):
        abt.append_to_collection(store, [p1], progress=False)
    assert (store / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in store.iterdir() if p.name.startswith("shard_")) == sorted(
        s.path for s in coll.manifest.shards)
    a2 = _adata("c", 60, pd.Categorical(["C"] * 60), x=x1)
    coll = abt.append_to_collection(store, [_write(a2, tmp_path / "ok.h5ad")],
                                    progress=False)
    want = {**dict(zip(_read(p0).obs_names, x0.toarray())),
            **dict(zip(a2.obs_names, x1.toarray().astype(np.float32)))}
    _rows_equal(coll, A.X, want)


@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from([np.int64, np.uint64, np.int32, np.uint32]),
       stored=st.sampled_from([np.float32, np.float16, np.float64]),
       values=st.lists(st.integers(-2**33, 2**33) | st.sampled_from(
           [2**24, 2**24 + 1, -2**24, -2**24 - 1, 2**11, 2**11 + 1, 2**53, 2**53 + 1]),
           min_size=1, max_size=8))
def test_integers_into_a_float_collection_are_refused_exactly_when_they_would_round(
        dtype: type, stored: type, values: list[int]) -> None:
    """The append's value check on integers into a float field: refused if and only if
    some value does not survive the cast to the stored float and back (values that
    overflow float16 are refused as beyond it); integers inside the float's exact range
    skip the cast."""
    from annbatch_torch.write.append import FitsStored

    info = np.iinfo(dtype)
    x = np.array([min(max(v, info.min), info.max) for v in values], dtype=dtype)
    block = sp.csr_matrix(x[None, :])
    check = FitsStored({"X": np.dtype(stored)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # float16 overflow to inf
        back = x.astype(stored)
        kept = np.isfinite(back).all() and bool((back.astype(dtype) == x).all()) and all(
            int(b) == int(v) for b, v in zip(back.astype(np.float64), x.tolist()))
    if kept:
        check("in.h5ad", "X", block)
    else:
        with pytest.raises(InputError, match=r"in\.h5ad: X holds"):
            check("in.h5ad", "X", block)


@pytest.mark.parametrize(("values", "stored", "refused"), [
    (np.array([1.5, 2.0], np.float32), np.float64, False),  # no overflow warning
    (np.array([1.0, 2.0], np.float16), np.int32, False),  # no overflow warning
    (np.array([True, False]), np.uint64, False),  # no OverflowError
    (np.array([np.inf], np.float32), np.float32, True),
    (np.array([np.nan, np.inf], np.float32), np.float32, True),  # NaN hides no inf
    (np.array([np.nan, 4e38], np.float64), np.float32, True),
    (np.array([np.nan, 1.0], np.float32), np.float32, False),  # NaN: the caller's check
])
def test_the_value_check_judges_every_dtype_without_numpy_warnings(
        values: np.ndarray, stored: type, refused: bool) -> None:
    """The append's value check compares a block's extremes with the stored dtype's as
    Python numbers: no numpy overflow warning for narrow inputs into wide fields, bool
    into uint64 accepted, and an inf or huge value refused also beside a NaN."""
    from annbatch_torch.write.append import FitsStored

    check = FitsStored({"X": np.dtype(stored)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for block in (values[None, :], sp.csr_matrix(values[None, :].astype(
                values.dtype if values.dtype != np.float16 else np.float32))):
            if refused:
                with pytest.raises(InputError, match=r"in\.h5ad: X holds values in"):
                    check("in.h5ad", "X", block)
            else:
                check("in.h5ad", "X", block)


# -- 8: duplicate obs_names ----------------------------------------------------------------
def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_duplicate_obs_names_within_an_input_are_warned(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    names = [f"cell{i % 40}" for i in range(100)]  # 40 names, each 2-3 times
    p0 = _write(_adata("a", 100, pd.Categorical(["A"] * 100), names=names),
                tmp_path / "dup.h5ad")
    store = tmp_path / "store"
    caplog.set_level(logging.WARNING, logger="annbatch_torch")
    abt.create_anndata_collection([p0], store, seed=0, progress=False)
    (msg,) = [m for m in _warnings(caplog) if "dup.h5ad" in m and "obs_names" in m]
    assert "40 obs_names appear more than once" in msg
    assert "'cell0', 'cell1'" in msg
    # on append: names the collection has already, and names repeated in one new input
    caplog.clear()
    again = [f"cell{i}" for i in range(5)] + [f"new{i % 10}" for i in range(45)]
    p1 = _write(_adata("b", 50, pd.Categorical(["B"] * 50), names=again),
                tmp_path / "more.h5ad")
    abt.append_to_collection(store, [p1], progress=False)
    found = [m for m in _warnings(caplog) if "more.h5ad" in m and "obs_names" in m]
    assert any("10 obs_names" in m and "'new0'" in m for m in found), found
    assert any("5 obs_names" in m and "'cell0'" in m and str(store) in m for m in found), found
    # unique names: no warning
    caplog.clear()
    p2 = _write(_adata("c", 20, pd.Categorical(["C"] * 20)), tmp_path / "clean.h5ad")
    abt.append_to_collection(store, [p2], progress=False)
    assert not [m for m in _warnings(caplog) if "obs_names" in m]


@pytest.mark.parametrize("reorder", [False, True])
def test_genes_in_the_collections_order_are_appended_without_the_compiled_remap(
        tmp_path: Path, reorder: bool) -> None:
    """An input whose genes keep the collection's order (every other gene of an outer
    collection, in order) is renumbered by a numpy gather: the append, in a fresh process,
    loads no compiled gene remap (numba's start spared); in another order (reversed) the
    compiled loop sorts its rows. Either way the collection holds the input's values,
    zeros for the genes it lacks."""
    import subprocess
    import sys

    base = _adata("base", 30, pd.Categorical(["x"] * 30))
    coll = abt.create_anndata_collection([_write(base, tmp_path / "base.h5ad")],
                                         tmp_path / "coll", var_join="outer", progress=False)
    genes = [f"g{g}" for g in range(0, N_GENES, 2)]
    new = _adata("n", 40, pd.Categorical(["y"] * 40), seed=3)[:, genes[::-1] if reorder
                                                               else genes].copy()
    path = _write(new, tmp_path / "new.h5ad")
    code = ("import annbatch_torch as abt\n"
            "from annbatch_torch.write import remap\n"
            f"abt.append_to_collection({str(coll.path)!r}, [{str(path)!r}], progress=False)\n"
            "print(len(remap._remap.signatures))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (int(done.stdout.split()[-1]) > 0) == reorder
    every = [f"g{g}" for g in range(N_GENES)]
    want = {n: row for n, row in zip(base.obs_names, base.X.toarray())}
    dense = pd.DataFrame(new.X.toarray(), index=new.obs_names, columns=new.var_names)
    want |= {n: row.to_numpy(np.float32) for n, row in
             dense.reindex(columns=every, fill_value=0.0).iterrows()}
    _rows_equal(abt.open_collection(coll.path), A.X, want)


# -- inputs without cells among the new ones -----------------------------------------------
@pytest.mark.parametrize("scheduler", [None, "threads"])
def test_append_with_an_empty_input_first_keeps_each_inputs_genes(tmp_path: Path,
                                                                 scheduler: Any) -> None:
    """Gene maps are indexed by input: an empty input before the others (it takes no part)
    must not shift them (pass 1 looked up the next input's map, then ran off the list)."""
    base = _adata("base", 30, pd.Categorical(["x"] * 30))
    coll = abt.create_anndata_collection([_write(base, tmp_path / "base.h5ad")],
                                         tmp_path / "coll", progress=False)
    empty = _adata("e", 0, pd.Categorical([], categories=["x"]))
    new = []
    for k, order in enumerate([N_GENES - 1 - np.arange(N_GENES), np.roll(np.arange(N_GENES), 5)]):
        a = _adata(f"n{k}_", 20 + k, pd.Categorical(["x"] * (20 + k)), seed=k + 1)
        new.append(a[:, order].copy())  # each its own gene order
    paths = [_write(a, tmp_path / f"new{k}.h5ad") for k, a in enumerate([empty, *new])]
    abt.append_to_collection(coll.path, paths, progress=False, scheduler=scheduler,
                             **({"n_workers": 1} if scheduler else {}))
    genes = [f"g{g}" for g in range(N_GENES)]
    want = {n: row for a in (base, *new)
            for n, row in zip(a.obs_names, a[:, genes].X.toarray())}
    _rows_equal(abt.open_collection(coll.path), A.X, want)


@pytest.mark.parametrize("refusal", ["missing input", "input already there",
                                     "value beyond the stored dtype"])
def test_a_refused_append_leaves_no_thread_in_the_compiler(
        small_collection: Any, synthetic_h5ads: list[Path], tmp_path: Path,
        refusal: str) -> None:
    """An append whose genes change order (here reversed) loads the compiled gene remap in
    the caller's thread before its shards' first pass, no thread of its own: when it is
    refused (an input that does not exist, or one the collection holds already: before
    the load; a value the stored dtype cannot hold: in the first pass, after it) no thread
    of the append runs on, so a caller forking next (DataLoader workers) forks no thread
    holding numba's compiler lock. In a fresh process, where the load takes a while."""
    import subprocess
    import sys

    path = {"missing input": tmp_path / "missing.h5ad",
            "input already there": synthetic_h5ads[0]}.get(refusal)
    if path is None:
        a = ad.read_h5ad(synthetic_h5ads[0])
        a = a[:, a.var_names[::-1]].copy()  # genes reordered: the compiled remap sorts
        a.obs_names = [f"new{i}" for i in range(a.n_obs)]
        a.X = a.X.astype(np.float64)
        a.X.data[0] = 1e39  # beyond float32 and any narrower stored dtype
        path = tmp_path / "beyond.h5ad"
        a.write_h5ad(path)
    code = (
        "import threading, anndata, annbatch_torch as abt\n"
        "from annbatch_torch.write import append, remap\n"
        "ran = []\n"
        "def load():\n    ran.append(threading.current_thread() is threading.main_thread())\n"
        "    return remap.load_remap()\n"
        "append.load_remap = load\n"
        f"try:\n    abt.append_to_collection({str(small_collection.path)!r}, "
        f"[{str(path)!r}], progress=False)\n"
        "except abt.InputError:\n    pass\nelse:\n    raise SystemExit('not refused')\n"
        f"assert ran == ([True] if {refusal.startswith('value')} else []), ran\n"
        "alive = [t.name for t in threading.enumerate() if 'annbatch' in t.name]\n"
        "raise SystemExit(f'still running: {alive}' if alive else 0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Exception in thread" not in done.stderr
