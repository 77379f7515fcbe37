"""Narrow lossless dtypes (issue 30): the writer stores each sparse matrix's values and
column indices in the narrowest dtype that holds them exactly, and every reader delivers
what the wide layout delivers."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
import zarr
from conftest import run_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import annbatch_torch as abt
from annbatch_torch import InputError, ReadError, create_anndata_collection
from annbatch_torch.cli.main import main as cli_main
from annbatch_torch.read.reader import PoolReader
from annbatch_torch.store.manifest import FORMAT_VERSION
from annbatch_torch.write.narrow import ValueRange, stored_dtype

WIDE = {"data_dtype": "float32", "index_dtype": "int32"}
_INT_ORDER = [np.dtype(t) for t in ("uint8", "int8", "uint16", "int16", "uint32", "int32")]


def _expected_stored(values: np.ndarray, logical: np.dtype) -> np.dtype:
    """The narrowest lossless dtype, computed independently of annbatch_torch's code: the
    first of uint8, int8, uint16, int16, uint32, int32 whose range holds every value and
    through which every value goes and comes back unchanged; else float32 if that holds
    them exactly, else the logical dtype."""
    v = np.asarray(values)
    if not v.size:
        return np.dtype(np.uint8)
    as_f = v.astype(np.float64)
    whole = bool(np.all(np.trunc(as_f) == as_f)) and not bool(
        np.any((as_f == 0) & np.signbit(as_f)))
    if whole:
        for dt in _INT_ORDER:
            info = np.iinfo(dt)
            # compared as float64 (exact for every value here; float32 would round the bound)
            if dt.itemsize <= max(logical.itemsize, 4) and info.min <= as_f.min() and \
                    as_f.max() <= info.max:
                return dt
    if logical.kind == "f" and np.array_equal(v.astype(np.float32).astype(logical), v):
        return np.dtype(np.float32)
    return logical


def _inputs(values: list[np.ndarray], dtype: str, n_vars: int, seed: int) -> list[ad.AnnData]:
    """One AnnData per value array: a CSR X of ``n_vars`` genes holding ``values`` as its
    non-zeros (in row order), an obs column ``rid`` with a global row id."""
    rng = np.random.default_rng(seed)
    out, rid = [], 0
    for k, vals in enumerate(values):
        n_obs = max(1, -(-len(vals) // 3))
        rows = np.sort(rng.integers(0, n_obs, len(vals)))
        # distinct columns per row: each row's entries get ascending, distinct columns
        cols = np.zeros(len(vals), dtype=np.int64)
        for r in np.unique(rows):
            at = np.flatnonzero(rows == r)
            cols[at] = np.sort(rng.choice(n_vars, size=len(at), replace=False))
        m = sp.csr_matrix((np.asarray(vals, dtype=dtype), (rows, cols)), shape=(n_obs, n_vars))
        m.sort_indices()
        a = ad.AnnData(X=m)
        a.obs_names = [f"i{k}_c{j}" for j in range(n_obs)]
        a.var_names = [f"g{j}" for j in range(n_vars)]
        a.obs["rid"] = np.arange(rid, rid + n_obs, dtype=np.int64)
        rid += n_obs
        out.append(a)
    return out


def _rows(coll: Any, **kw: Any) -> dict[int, np.ndarray]:
    """Every row of one epoch as ``{rid: dense row}`` (each row once)."""
    ds = abt.AnnBatchDataset(coll, selector={"x": "X", "rid": "obs/rid"},
                             **{"batch_size": 7, "chunk_size": 4, "preload_nchunks": 3, **kw})
    out: dict[int, np.ndarray] = {}
    for b in ds:
        x = b["x"].to_dense() if b["x"].layout == torch.sparse_csr else b["x"]
        assert x.dtype == torch.float32  # sparse fields reach users as float32, always
        for r, row in zip(b["rid"].tolist(), x.numpy()):
            assert r not in out
            out[r] = row
    return out


def _source_rows(adatas: list[ad.AnnData]) -> dict[int, np.ndarray]:
    out = {}
    for a in adatas:
        dense = a.X.toarray()
        for r, row in zip(a.obs["rid"].tolist(), dense):
            out[r] = row
    return out


# -- the choice --------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_choice_is_the_narrowest_lossless_dtype(data: st.DataObject) -> None:
    logical = np.dtype(data.draw(st.sampled_from(["float32", "float64", "int32", "int64"])))
    edges = [0, 1, 127, 128, 255, 256, 32767, 32768, 65535, 65536, 2**31 - 1, 2**31,
             2**32 - 1, 2**32, -1, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1]
    if logical.kind == "f":
        elements = st.one_of(st.sampled_from([*edges, 0.5, -2.25, 1e-3, 2.0**40 + 0.5,
                                               0.1, 16777217.0, -0.0]),
                             st.floats(-1e6, 1e6, allow_nan=False, width=32))
    else:
        info = np.iinfo(logical)
        elements = st.one_of(st.sampled_from([e for e in edges if info.min <= e <= info.max]),
                             st.integers(int(info.min), int(info.max)))
    blocks = data.draw(st.lists(st.lists(elements, max_size=20), min_size=1, max_size=3))
    arrays = [np.array(b, dtype=logical) for b in blocks]
    if logical == np.float32:  # values float32 cannot hold are not float32 inputs
        arrays = [a.astype(np.float32) for a in arrays]
    seen = ValueRange()
    for a in arrays:
        seen.observe(a, "input")
    # the parallel writer merges what its tasks saw: the same choice
    merged = ValueRange()
    for a in arrays:
        part = ValueRange()
        part.observe(a, "task")
        merged.merge(part)
    everything = np.concatenate(arrays)
    expected = _expected_stored(everything, logical)
    assert stored_dtype("X", logical, seen, None) == expected
    assert stored_dtype("X", logical, merged, None) == expected
    got = stored_dtype("X", logical, seen, None)
    # lossless: every value goes through the stored dtype and comes back equal
    np.testing.assert_array_equal(everything.astype(got).astype(logical), everything)


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from([np.int32, np.int64, np.uint32, np.uint64]), data=st.data())
def test_whether_floats_hold_integers_exactly(dtype: type, data: st.DataObject) -> None:
    """``fits_float32`` / ``fits_float64`` of integer values (what mixed int/float inputs
    are settled by): each as a brute-force round trip says, near 2**24 and 2**53 too."""
    info = np.iinfo(dtype)
    top = min(int(info.max), 2**63 - 1)  # uint64 above int64 is refused before (check_int64)
    near = [s * (2**p + d) for p in (24, 53) for d in (-1, 0, 1, 3) for s in (1, -1)]
    elements = st.one_of(st.sampled_from([v for v in near if info.min <= v <= top]),
                         st.integers(int(info.min), top),
                         st.integers(-(2**25), 2**25).filter(
                             lambda v: info.min <= v <= top))
    blocks = data.draw(st.lists(st.lists(elements, min_size=1, max_size=20), min_size=1,
                                max_size=3))
    seen = ValueRange()
    for b in blocks:
        seen.observe(np.array(b, dtype=dtype), "input")
    values = [int(v) for b in blocks for v in b]
    for flt, got in ((np.float32, seen.fits_float32), (np.float64, seen.fits_float64)):
        with np.errstate(invalid="ignore"):
            exact = all(int(x) == v for x, v in zip(
                np.array(values, dtype=object).astype(flt), values, strict=True))
        assert got == exact, (flt, values)


def test_an_asked_dtype_that_cannot_hold_a_value_is_refused_naming_it() -> None:
    seen = ValueRange()
    seen.observe(np.array([1, 2, 3], np.float32), "a.h5ad")
    seen.observe(np.array([300], np.float32), "b.h5ad")
    with pytest.raises(InputError, match=r"in b\.h5ad, 300 is outside uint8's range.*"
                                         r"data_dtype='auto'.*'uint16'"):
        stored_dtype("X", np.dtype(np.float32), seen, np.dtype(np.uint8))
    seen.observe(np.array([0.5], np.float32), "c.h5ad")
    with pytest.raises(InputError, match=r"in c\.h5ad, 0\.5 is not a whole number.*'float32'"):
        stored_dtype("X", np.dtype(np.float32), seen, np.dtype(np.uint16))


# -- written and read back -----------------------------------------------------------------
_SCENARIOS = {
    # name: (input dtype, value arrays per input)
    "uint8 max": ("float32", [[1, 2, 255], [3, 4]]),
    "uint8 + 1": ("float32", [[1, 2, 255], [256]]),
    "uint16 max": ("int32", [[1, 65535], [7]]),
    "uint16 + 1": ("int32", [[65536, 1], [2]]),
    "uint32 max": ("int64", [[2**32 - 1, 5]]),
    "uint32 + 1": ("int64", [[2**32, 5]]),
    "int8 min": ("float32", [[-128, 127], [1]]),
    "int8 - 1": ("float32", [[-129, 5]]),
    "int16": ("int32", [[-32768, 32767]]),
    "fraction in one input": ("float32", [[1, 2, 3], [0.5, 2]]),
    "float64 exact": ("float64", [[0.5, 0.25, 3.0]]),
    "float64 inexact": ("float64", [[0.1, 3.0]]),
    "float64 counts": ("float64", [[1.0, 200.0], [3.0]]),
    "no values": ("float32", [[]]),
}


@pytest.mark.parametrize("scenario", sorted(_SCENARIOS))
def test_round_trip_stores_narrow_and_reads_what_the_wide_layout_reads(
        scenario: str, tmp_path: Path) -> None:
    dtype, values = _SCENARIOS[scenario]
    adatas = _inputs([np.array(v, dtype=np.float64) for v in values], dtype, 9, seed=3)
    narrow = create_anndata_collection(adatas, tmp_path / "narrow", progress=False,
                                       n_obs_per_shard=4)
    wide = create_anndata_collection(adatas, tmp_path / "wide", progress=False,
                                     n_obs_per_shard=4, data_dtype=narrow.fields["X"].dtype,
                                     index_dtype="int32")
    logical = np.dtype(narrow.fields["X"].dtype)
    everything = np.concatenate([np.asarray(a.X.data) for a in adatas]).astype(logical)
    expected = _expected_stored(everything, logical)
    for s in narrow.manifest.shards:
        assert s.stored == {"X/data": expected.name, "X/indices": "uint16"}, scenario
    for i in range(len(narrow.shards)):
        g = zarr.open_group(str(narrow.shard_path(i)), mode="r")
        assert g["X/data"].dtype == expected
        assert g["X/indices"].dtype == np.uint16
    # uint16 indices need format version 2; the wide layout stays version 1
    assert json.loads((tmp_path / "narrow" / "manifest.json").read_text())["format_version"] == 2
    assert json.loads((tmp_path / "wide" / "manifest.json").read_text())["format_version"] == 1
    src = _source_rows(adatas)
    for kw in ({"shuffle": False}, {"shuffle": True, "seed": 5}):
        got_n, got_w = _rows(narrow, **kw), _rows(wide, **kw)
        assert sorted(got_n) == sorted(src)
        for r, row in src.items():
            np.testing.assert_array_equal(got_n[r], row.astype(logical).astype(got_n[r].dtype))
            assert got_n[r].tobytes() == got_w[r].tobytes()  # bit-identical
    # anndata opens every shard as it is: the same numbers, stored narrow
    back = ad.concat([ad.read_zarr(narrow.shard_path(i)) for i in range(len(narrow.shards))])
    ref = ad.concat(adatas)[back.obs_names]
    np.testing.assert_array_equal(back.X.toarray().astype(logical), ref.X.toarray())


@pytest.mark.parametrize(("n_vars", "index"), [(65_536, "uint16"), (65_537, "int32")])
def test_the_index_dtype_follows_the_gene_count(n_vars: int, index: str, tmp_path: Path
                                                ) -> None:
    m = sp.csr_matrix((np.array([1, 2, 3, 4], np.float32),
                       (np.array([0, 0, 1, 2]), np.array([0, n_vars - 1, n_vars - 2, 7]))),
                      shape=(3, n_vars))
    a = ad.AnnData(X=m)
    a.obs_names = ["a", "b", "c"]
    a.var_names = [f"g{j}" for j in range(n_vars)]
    a.obs["rid"] = np.arange(3)
    coll = create_anndata_collection([a], tmp_path / "c", progress=False, shuffle=False)
    assert coll.manifest.shards[0].stored == {"X/data": "uint8", "X/indices": index}
    got = _rows(coll, shuffle=False)
    for r in range(3):
        np.testing.assert_array_equal(got[r], m[r].toarray().ravel())
    forced = create_anndata_collection([a], tmp_path / "i32", progress=False, shuffle=False,
                                       index_dtype="int32")
    assert forced.manifest.shards[0].stored["X/indices"] == "int32"


def test_an_append_may_store_another_dtype_and_pools_spanning_both_read_right(
        tmp_path: Path) -> None:
    small = _inputs([np.arange(1, 40) % 200 + 1], "float32", 11, seed=1)
    big = _inputs([np.arange(1, 40) * 1000.0], "float32", 11, seed=2)
    big[0].obs_names = [f"new_{n}" for n in big[0].obs_names]
    big[0].obs["rid"] = big[0].obs["rid"] + 1000
    coll = create_anndata_collection(small, tmp_path / "c", progress=False, n_obs_per_shard=5)
    coll = abt.append_to_collection(coll, big, progress=False)
    stored = {s.stored["X/data"] for s in coll.manifest.shards}
    assert stored == {"uint8", "uint16"}
    src = {**_source_rows(small), **_source_rows(big)}
    for kw in ({"shuffle": False}, {"shuffle": True, "seed": 1},
               {"sampler": abt.WeightedSampler(np.ones(coll.n_obs), num_samples=3 * coll.n_obs,
                                               replacement=True)}):
        ds = abt.AnnBatchDataset(coll, selector={"x": "X", "rid": "obs/rid"}, batch_size=9,
                                 chunk_size=4, preload_nchunks=4, **kw)
        n = 0
        for b in ds:
            x = b["x"].to_dense().numpy()
            assert b["x"].dtype == torch.float32
            for r, row in zip(b["rid"].tolist(), x):
                np.testing.assert_array_equal(row, src[r])
                n += 1
        assert n >= coll.n_obs - 9


def test_every_reader_path_gives_the_wide_layouts_values(synthetic_h5ads: list[Path],
                                                         tmp_path: Path) -> None:
    """Chunked (0 and 2 workers), sampling (balanced, weighted with repeats), the device pool
    code on the CPU, densified: the narrow collection gives the wide one's batches."""
    narrow = create_anndata_collection(synthetic_h5ads, tmp_path / "n", progress=False,
                                       n_obs_per_shard=1024, seed=3)
    wide = create_anndata_collection(synthetic_h5ads, tmp_path / "w", progress=False,
                                     n_obs_per_shard=1024, seed=3, **WIDE)
    stored = narrow.manifest.shards[0].stored
    assert stored["layers/counts/data"] in ("uint8", "uint16")  # counts
    assert stored["X/data"] == "float32"  # log1p values: no whole numbers
    assert stored["X/indices"] == stored["layers/counts/indices"] == "uint16"
    selector = {"x": "X", "counts": "layers/counts", "ct": "obs/cell_type"}
    weights = np.random.default_rng(0).random(narrow.n_obs)
    configs: list[dict[str, Any]] = [
        {"seed": 1}, {"seed": 2, "densify": True}, {"seed": 3, "device": "cpu"},
        {"seed": 4, "sampler": abt.ClassBalancedSampler("cell_type")},
        {"seed": 5, "sampler": abt.WeightedSampler(weights, num_samples=3000,
                                                   replacement=True)},
    ]
    for kw in configs:
        batches = []
        for coll in (narrow, wide):
            ds = abt.AnnBatchDataset(coll, selector=selector, batch_size=256, chunk_size=64,
                                     preload_nchunks=4, **kw)
            batches.append(list(ds))
        assert len(batches[0]) == len(batches[1]) > 0
        for bn, bw in zip(*batches):
            for key in selector:
                a, b = bn[key], bw[key]
                if a.layout == torch.sparse_csr:
                    a, b = a.to_dense(), b.to_dense()
                assert a.dtype == b.dtype, (kw, key)
                assert torch.equal(a, b), (kw, key)
    loaders = [torch.utils.data.DataLoader(
        abt.AnnBatchDataset(c, selector=selector, batch_size=256, chunk_size=64,
                            preload_nchunks=4, seed=9), batch_size=None, num_workers=2)
        for c in (narrow, wide)]
    got = [{} for _ in loaders]
    for out, loader in zip(got, loaders):
        for b in loader:
            for ct, counts in zip(b["ct"].tolist(), b["counts"].to_dense()):
                out.setdefault(ct, []).append(counts.sum().item())
    assert {k: sorted(v) for k, v in got[0].items()} == {k: sorted(v) for k, v in
                                                          got[1].items()}


def test_a_damaged_narrow_chunk_is_a_read_error(synthetic_h5ads: list[Path],
                                                tmp_path: Path) -> None:
    coll = create_anndata_collection(synthetic_h5ads, tmp_path / "c", progress=False)
    assert coll.manifest.shards[0].stored["layers/counts/data"] in ("uint8", "uint16")
    for array in ("layers/counts/data", "layers/counts/indices"):
        files = [p for p in (coll.shard_path(0) / array / "c").rglob("*") if p.is_file()]
        raw = bytearray(files[0].read_bytes())
        keep = bytes(raw)
        raw[100:104] = bytes(b ^ 0x5A for b in raw[100:104])
        files[0].write_bytes(bytes(raw))
        try:
            ds = abt.AnnBatchDataset(abt.open_collection(tmp_path / "c"),
                                     selector={"c": "layers/counts"}, batch_size=128)
            with pytest.raises(ReadError, match=r"shard_00000.*layers/counts.*checksum"):
                list(ds)
        finally:
            files[0].write_bytes(keep)


def test_bad_dtype_options_are_refused_before_anything_is_written(
        synthetic_h5ads: list[Path], tmp_path: Path, write_h5ads: Any) -> None:
    for kw, msg in (({"data_dtype": "complex64"}, "data_dtype='complex64'"),
                    ({"data_dtype": "float16"}, "data_dtype='float16'"),
                    ({"data_dtype": "nope"}, "data_dtype='nope'"),
                    ({"index_dtype": "int16"}, r"index_dtype='int16'.*'auto'.*'int32'"),
                    ({"index_dtype": "uint16"}, r"index_dtype='uint16'")):
        with pytest.raises(InputError, match=msg):
            create_anndata_collection(synthetic_h5ads, tmp_path / "x", progress=False, **kw)
        assert not (tmp_path / "x").exists()
    # a count above 255 does not fit uint8: the input is named, nothing is left behind
    paths = write_h5ads(_inputs([np.array([1.0, 2.0]), np.array([300.0, 4.0])], "float32", 5,
                                seed=0), tmp_path / "in")
    with pytest.raises(InputError, match=r"X cannot be stored as data_dtype='uint8': in "
                                         r".*in1\.h5ad, 300 is outside uint8's range"):
        create_anndata_collection(paths, tmp_path / "x", progress=False, data_dtype="uint8")
    # log1p values are no whole numbers: the input holding the first is named
    with pytest.raises(InputError, match=r"X cannot be stored as data_dtype='uint16': in "
                                         r".*part0\.h5ad, [0-9.]+ is not a whole number"):
        create_anndata_collection(synthetic_h5ads, tmp_path / "x", progress=False,
                                  data_dtype="uint16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_a_manifest_naming_the_stored_dtype_of_no_field_is_refused(
        synthetic_h5ads: list[Path], tmp_path: Path) -> None:
    create_anndata_collection(synthetic_h5ads, tmp_path / "c", progress=False)
    path = tmp_path / "c" / "manifest.json"
    obj = json.loads(path.read_text())
    assert obj["format_version"] == FORMAT_VERSION == 2
    obj["shards"][0]["stored"]["obsm/X_pca/data"] = "uint8"
    path.write_text(json.dumps(obj))
    with pytest.raises(abt.CollectionError, match=r"obsm/X_pca/data.*not a sparse field"):
        abt.open_collection(tmp_path / "c")
    obj["shards"][0]["stored"] = {"X/data": "object"}
    path.write_text(json.dumps(obj))
    with pytest.raises(abt.CollectionError, match="malformed"):
        abt.open_collection(tmp_path / "c")


def test_the_cli_and_the_parallel_writer_take_the_options(
        synthetic_h5ads: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["shuffle", *map(str, synthetic_h5ads), "-o", str(tmp_path / "cli"), "--no-progress",
            "--data-dtype", "float32", "--index-dtype", "int32", "-q"]
    assert cli_main(args) == 0
    cli = abt.open_collection(tmp_path / "cli")
    assert {v for s in cli.manifest.shards for v in s.stored.values()} == {"float32", "int32"}
    assert cli.manifest.extra["writer"]["data_dtype"] == "float32"
    serial = create_anndata_collection(synthetic_h5ads, tmp_path / "s", progress=False)
    threads = create_anndata_collection(synthetic_h5ads, tmp_path / "t", progress=False,
                                        scheduler="threads", n_workers=2)
    assert [s.stored for s in serial.manifest.shards] == [s.stored for s in
                                                          threads.manifest.shards]
    assert cli_main(["shuffle", str(synthetic_h5ads[0]), "-o", str(tmp_path / "bad"),
                     "--index-dtype", "int64"]) != 0
    assert "--index-dtype" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_round_trips_of_drawn_values(data: st.DataObject, tmp_path: Path) -> None:
    dtype = data.draw(st.sampled_from(["float32", "int32", "int64", "float64"]))
    pick = st.sampled_from([1, 2, 255, 256, 65535, 65536, -1, -128, -129, 2**31 - 1])
    if dtype.startswith("float"):
        pick = st.one_of(pick, st.sampled_from([0.5, 1.25, 2.0**-3]))
    values = data.draw(st.lists(st.lists(pick, min_size=1, max_size=12), min_size=1,
                                max_size=3))
    adatas = _inputs([np.array(v, dtype=np.float64) for v in values], dtype, 13,
                     seed=data.draw(st.integers(0, 100)))
    out = tmp_path / f"c{np.random.default_rng().integers(1 << 30)}"
    coll = create_anndata_collection(adatas, out, progress=False, n_obs_per_shard=3)
    logical = np.dtype(coll.fields["X"].dtype)
    got = _rows(coll, shuffle=True, seed=2)
    src = _source_rows(adatas)
    assert sorted(got) == sorted(src)
    for r, row in src.items():
        np.testing.assert_array_equal(got[r], row.astype(logical).astype(got[r].dtype))


def test_collections_written_before_are_read_as_before(synthetic_h5ads: list[Path],
                                                      tmp_path: Path) -> None:
    """A manifest without ``stored`` entries, format version 1 (written before the
    options): its float32 / int32 arrays read as the narrow collection's values."""
    old = create_anndata_collection(synthetic_h5ads, tmp_path / "old", progress=False,
                                    seed=4, **WIDE)
    path = old.path / "manifest.json"
    obj = json.loads(path.read_text())
    for s in obj["shards"]:
        del s["stored"]
    for key in ("data_dtype", "index_dtype"):
        del obj["extra"]["writer"][key]
    assert obj["format_version"] == 1
    path.write_text(json.dumps(obj))
    new = create_anndata_collection(synthetic_h5ads, tmp_path / "new", progress=False, seed=4)
    selector = {"counts": "layers/counts"}
    for a, b in zip(abt.AnnBatchDataset(abt.open_collection(old.path), selector=selector,
                                        batch_size=300),
                    abt.AnnBatchDataset(new, selector=selector, batch_size=300)):
        assert torch.equal(a["counts"].to_dense(), b["counts"].to_dense())
    # an append to it stores as it was written (each field's dtype, int32 indices): the
    # versions that wrote it still read it (format version 1); asked, it stores narrow
    extra = ad.read_h5ad(synthetic_h5ads[0])
    extra.obs_names = [f"more_{n}" for n in extra.obs_names]
    grown = abt.append_to_collection(old.path, [extra], progress=False)
    assert grown.manifest.shards[-1].stored == {
        "X/data": "float32", "X/indices": "int32", "layers/counts/data": "float32",
        "layers/counts/indices": "int32"}
    assert json.loads(path.read_text())["format_version"] == 1
    extra.obs_names = [f"again_{n}" for n in extra.obs_names]
    grown = abt.append_to_collection(old.path, [extra], progress=False, data_dtype="auto",
                                     index_dtype="auto")
    assert grown.manifest.shards[-1].stored["layers/counts/indices"] == "uint16"
    assert json.loads(path.read_text())["format_version"] == 2
    for a, b in zip(abt.AnnBatchDataset(grown, selector=selector, batch_size=500, shuffle=False),
                    abt.AnnBatchDataset(abt.open_collection(old.path), selector=selector,
                                        batch_size=500, shuffle=False)):
        assert torch.equal(a["counts"].to_dense(), b["counts"].to_dense())


def test_field_keeps_each_fields_dtype_and_the_old_format(tmp_path: Path) -> None:
    """``data_dtype="field"`` (with int32 indices) writes the layout of earlier collections
    whatever the fields' dtypes: format version 1; ``"float32"`` is a dtype like any other."""
    adatas = _inputs([np.array([1.0, 2.0, 3.0])], "int32", 5, seed=0)
    old = create_anndata_collection(adatas, tmp_path / "f", progress=False,
                                    data_dtype="field", index_dtype="int32")
    assert old.manifest.shards[0].stored == {"X/data": "int32", "X/indices": "int32"}
    assert json.loads((old.path / "manifest.json").read_text())["format_version"] == 1
    assert old.manifest.extra["writer"]["data_dtype"] == "field"
    as_f32 = create_anndata_collection(adatas, tmp_path / "f32", progress=False,
                                       data_dtype="float32", index_dtype="int32")
    assert as_f32.manifest.shards[0].stored["X/data"] == "float32"  # int32 field: narrow
    assert json.loads((as_f32.path / "manifest.json").read_text())["format_version"] == 2
    with pytest.raises(InputError, match=r"data_dtype=None.*'auto'.*'field'"):
        create_anndata_collection(adatas, tmp_path / "n", progress=False, data_dtype=None)


def test_large_integers_keep_every_bit(tmp_path: Path) -> None:
    """int64 values above 2**53: stored int64 by "auto", refused as float64 when asked, and a
    pool spanning an int64 shard and an appended float32 one keeps them exact."""
    seen = ValueRange()
    seen.observe(np.array([2**53 + 1, 3], dtype=np.int64), "big.h5ad")
    with pytest.raises(InputError, match=r"in big\.h5ad, float64 cannot hold 9007199254740993"):
        stored_dtype("X", np.dtype(np.int64), seen, np.dtype(np.float64))
    assert stored_dtype("X", np.dtype(np.int64), seen, None) == np.int64
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning for floats beyond float32
        wide = ValueRange()
        wide.observe(np.array([1e300, 2.5]), "x")
    assert not wide.fits_float32
    big = _inputs([np.array([2.0**60 + 1, 2.0**60 + 3, 5, 7])], "int64", 4, seed=0)
    big[0].X.data[:2] = np.array([2**60 + 1, 2**60 + 3], dtype=np.int64)  # exact
    coll = create_anndata_collection(big, tmp_path / "c", progress=False, shuffle=False)
    assert coll.manifest.shards[0].stored["X/data"] == "int64"
    small = _inputs([np.array([1.0, 2.0, 3.0])], "int64", 4, seed=1)
    small[0].obs_names = [f"s_{n}" for n in small[0].obs_names]
    coll = abt.append_to_collection(coll, small, progress=False, data_dtype="float32")
    assert coll.manifest.shards[1].stored["X/data"] == "float32"
    reader = PoolReader(coll, ["X"])
    try:
        got = reader.read(np.array([[0, coll.n_obs]]), np.arange(coll.n_obs)[::-1].copy())["X"]
    finally:
        reader.close()
    assert got.dtype == np.int64
    ref = sp.vstack([big[0].X, small[0].X]).tocsr()[::-1]
    np.testing.assert_array_equal(got.toarray(), ref.toarray())
    assert {2**60 + 1, 2**60 + 3} <= set(got.data.tolist())


def test_an_asked_dtype_stops_pass_one_at_the_first_block_it_cannot_hold(
        tmp_path: Path) -> None:
    adatas = _inputs([np.array([300.0, 1.0]), np.array([2.0, 3.0])], "float32", 5, seed=0)
    blocks: list[str] = []
    with pytest.raises(InputError, match=r"300 is outside uint8's range"):
        create_anndata_collection(adatas, tmp_path / "c", progress=False, data_dtype="uint8",
                                  value_check=lambda label, key, block: blocks.append(label))
    assert len(blocks) == 1  # the second input was never read


def test_shard_infos_hash_and_a_version_below_the_shards_needs_is_refused(
        synthetic_h5ads: list[Path], tmp_path: Path) -> None:
    coll = create_anndata_collection(synthetic_h5ads, tmp_path / "c", progress=False)
    assert len({*coll.shards, *coll.shards}) == len(coll.shards)
    path = coll.path / "manifest.json"
    obj = json.loads(path.read_text())
    obj["format_version"] = 1
    path.write_text(json.dumps(obj))
    with pytest.raises(abt.CollectionError, match=r"'format_version' is 1 but its shards "
                                                  r"store narrow dtypes"):
        abt.open_collection(coll.path)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_scatter_rows_puts_each_row_in_place_cast(data: st.DataObject) -> None:
    """The compiled scatter against numpy: every row at its destination, cast; rows out of
    bounds are refused before the loop (which does not check)."""
    from annbatch_torch.read.scatter import scatter_rows

    lens = np.array(data.draw(st.lists(st.integers(0, 9), max_size=30)), dtype=np.int64)
    src_dtype = data.draw(st.sampled_from(["uint8", "uint16", "uint32", "int8", "float32"]))
    out_dtype = data.draw(st.sampled_from(["float32", "int32", "int64", "float64"]))
    starts = np.zeros(len(lens), np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    src = np.arange(int(lens.sum()), dtype=np.int64).astype(src_dtype)
    order = np.random.default_rng(data.draw(st.integers(0, 99))).permutation(len(lens))
    out_lens = lens[order]
    dests_sorted = np.zeros(len(lens), np.int64)
    np.cumsum(out_lens[:-1], out=dests_sorted[1:])
    dests = np.empty(len(lens), np.int64)
    dests[order] = dests_sorted
    out = np.full(int(lens.sum()), -1, dtype=out_dtype)
    scatter_rows(src, starts, lens, out, dests)
    want = np.concatenate([src[starts[r] : starts[r] + lens[r]] for r in order] or
                          [np.zeros(0, src_dtype)]).astype(out_dtype)
    np.testing.assert_array_equal(out, want)
    if len(lens) and lens.sum():
        with pytest.raises(ValueError, match="outside"):
            scatter_rows(src, starts, lens, out[:-1], dests)
        with pytest.raises(ValueError, match="outside"):
            scatter_rows(src[:-1], starts, lens, out, dests)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_scatter_rows_range_copies_and_finds_the_least_and_greatest(data: st.DataObject) -> None:
    """The checked copy puts the same items in place as scatter_rows and returns the least
    and the greatest item of the rows copied (not of the rest of the source), signed or
    not; None when no item is copied."""
    from annbatch_torch.read.scatter import scatter_rows, scatter_rows_range

    dtype = np.dtype(data.draw(st.sampled_from(["uint8", "uint16", "uint32", "int16",
                                                "int32", "int64"])))
    info = np.iinfo(dtype)
    lens = np.array(data.draw(st.lists(st.integers(0, 9), max_size=20)), dtype=np.int64)
    n = int(lens.sum())
    src = np.array(data.draw(st.lists(st.integers(int(info.min), int(info.max)),
                                      min_size=n + 3, max_size=n + 3)), dtype=dtype)
    starts = np.zeros(len(lens), np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    starts += 2  # items before and after the rows are not copied
    dests = np.zeros(len(lens), np.int64)
    np.cumsum(lens[::-1][:-1], out=dests[1:])
    dests = dests[::-1].copy()
    out, want = np.zeros(n, np.int64), np.zeros(n, np.int64)
    got = scatter_rows_range(src, starts, lens, out, dests)
    scatter_rows(src, starts, lens, want, dests)
    np.testing.assert_array_equal(out, want)
    copied = src[2 : 2 + n]
    assert got == (None if not n else (int(copied.min()), int(copied.max())))
    with pytest.raises(ValueError, match="integers"):
        scatter_rows_range(src.astype(np.float32), starts, lens, out.astype(np.float32), dests)


def test_scatter_rows_refuses_what_the_loop_cannot_do() -> None:
    from annbatch_torch.read.scatter import scatter_rows

    src, out = np.zeros(4, np.uint16), np.zeros(4, np.int32)
    with pytest.raises(ValueError, match="outside"):  # sums that would wrap past int64
        scatter_rows(src, [2**62], [2**62], out, [2**62])
    with pytest.raises(ValueError, match="float16"):
        scatter_rows(np.zeros(4, np.float16), [0], [2], np.zeros(4, np.float32), [0])
    with pytest.raises(ValueError, match="native byte order"):
        scatter_rows(np.zeros(4, ">u2"), [0], [2], out, [0])


def _scatter_in_child() -> None:
    from annbatch_torch.read.scatter import scatter_rows

    out = np.zeros(3, np.int16)
    scatter_rows(np.arange(3, dtype=np.int16), [0], [3], out, [0])  # a pair compiled here
    assert out.tolist() == [0, 1, 2]


def test_a_child_forked_while_numba_compiles_does_not_hang() -> None:
    """numba's compiler lock held by another thread at the fork (a read thread meeting a
    new dtype pair): the forking thread waits for it, the child compiles freely."""
    import multiprocessing
    import threading
    import time

    from numba.core.compiler_lock import global_compiler_lock

    import annbatch_torch.read.scatter  # noqa: F401  (its fork hook)

    held = threading.Event()

    def hold() -> None:
        with global_compiler_lock:
            held.set()
            time.sleep(1.0)

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    child = multiprocessing.get_context("fork").Process(target=_scatter_in_child)
    child.start()
    child.join(60)
    t.join()
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0


def test_a_fork_waits_for_numbas_lock_before_taking_h5pys(tmp_path: Path) -> None:
    """A thread holding numba's compiler lock (loading a compiled loop) whose garbage
    collection frees an h5py object, which takes h5py's lock, while another thread forks:
    the fork must take numba's lock first (h5py's fork handler takes h5py's), else each
    waits on the other; whatever the order a program imports the two in (here h5py
    after the package, as a writer's inputs bring it). A hang ends in the timeout."""
    out = run_python(f"""
import os, threading, time
import numpy as np
import pandas as pd
from numba.core.compiler_lock import global_compiler_lock
import annbatch_torch.store.native  # noqa: F401  (its fork handler)
import h5py
path = {str(tmp_path / "x.h5")!r}
with h5py.File(path, "w") as f:
    f["x"] = np.arange(3)
held = threading.Event()
def hold():
    with global_compiler_lock:
        held.set()
        time.sleep(1.0)  # the fork's handlers start meanwhile
        with h5py.File(path, "r") as f:  # h5py's lock, as a freed h5py object takes it
            f["x"][:]
t = threading.Thread(target=hold)
t.start()
held.wait()
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
t.join()
print("forked")
""", tmp_path, timeout=30)
    assert out.strip() == "forked"


def test_bool_matrices_keep_their_dtype_and_open(tmp_path: Path) -> None:
    m = sp.random(40, 12, density=0.3, format="csr", random_state=0).astype(bool)
    a = ad.AnnData(X=m)
    a.obs_names = [f"c{i}" for i in range(40)]
    a.var_names = [f"g{j}" for j in range(12)]
    for mode in ("field", "auto"):
        coll = create_anndata_collection([a], tmp_path / mode, progress=False, shuffle=False,
                                         data_dtype=mode)
        assert coll.manifest.shards[0].stored["X/data"] == ("bool" if mode == "field"
                                                            else "uint8")
        again = abt.open_collection(tmp_path / mode)
        got = torch.cat([b["X"].to_dense() for b in abt.AnnBatchDataset(
            again, batch_size=40, shuffle=False)])
        np.testing.assert_array_equal(got.numpy(), m.toarray().astype(np.float32))
    b = a.copy()
    b.obs_names = [f"d{i}" for i in range(40)]
    grown = abt.append_to_collection(tmp_path / "field", [b], progress=False)
    assert abt.open_collection(grown.path).n_obs == 80


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_compressed_shard_files_read_as_raw_ones(synthetic_h5ads: list[Path], tmp_path: Path,
                                                 codec: str) -> None:
    """Blosc-compressed inner chunks of zarr shard files (the writer's lz4 / zstd) are read
    by the raw reader: verified, decoded and scattered like raw chunks, the same batches;
    a damaged chunk is a ReadError, even one whose checksum was made to match."""
    from annbatch_torch.store.rawzarr import RawZarrArray

    raw = create_anndata_collection(synthetic_h5ads, tmp_path / "raw", progress=False, seed=2,
                                    zarr_chunk_elems=4096)
    packed = create_anndata_collection(synthetic_h5ads, tmp_path / codec, progress=False,
                                       seed=2, zarr_chunk_elems=4096, compressor=codec)
    data = packed.element(0, "layers/counts").data
    assert isinstance(data, RawZarrArray)
    assert data.blosc
    selector = {"c": "layers/counts", "x": "X"}
    weights = np.random.default_rng(1).random(raw.n_obs)
    for kw in ({"seed": 3}, {"seed": 4, "sampler": abt.WeightedSampler(
            weights, num_samples=2000, replacement=True)}):
        got = [list(abt.AnnBatchDataset(c, selector=selector, batch_size=200, chunk_size=50,
                                        preload_nchunks=4, **kw)) for c in (raw, packed)]
        assert len(got[0]) == len(got[1])
        for a, b in zip(*got):
            for key in selector:
                assert torch.equal(a[key].to_dense(), b[key].to_dense())
    shard_file = next((packed.shard_path(0) / "layers" / "counts" / "data" / "c").rglob("*"))
    index = data._index(0)
    assert index is not None
    off, size = (int(v) for v in index[1])
    body = bytearray(shard_file.read_bytes())
    keep = bytes(body)
    body[off + size // 2] ^= 0xFF  # inside the compressed bytes: the CRC catches it
    shard_file.write_bytes(bytes(body))
    ds = abt.AnnBatchDataset(abt.open_collection(packed.path), selector={"c": "layers/counts"},
                             batch_size=300)
    with pytest.raises(ReadError, match=r"layers/counts.*checksum mismatch"):
        list(ds)
    # a Blosc header claiming another size, its CRC made right: still refused
    body = bytearray(keep)
    body[off + 4] ^= 0x01  # the uncompressed size in the header
    payload = bytes(body[off : off + size - 4])
    import google_crc32c

    body[off + size - 4 : off + size] = google_crc32c.value(payload).to_bytes(4, "little")
    shard_file.write_bytes(bytes(body))
    ds = abt.AnnBatchDataset(abt.open_collection(packed.path), selector={"c": "layers/counts"},
                             batch_size=300)
    with pytest.raises(ReadError, match=r"Blosc header says"):
        list(ds)


@pytest.mark.parametrize("scheduler", [None, "threads"])
def test_an_outlier_widens_only_the_shard_it_lands_in(
        tmp_path: Path, scheduler: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    values = [np.arange(1, 31, dtype=np.float64), np.arange(1, 31, dtype=np.float64)]
    values[1][-1] = 70_000.0  # above 65,535: in the last rows (shuffle=False: last shard)
    adatas = _inputs(values, "float32", 7, seed=0)
    n_obs = sum(a.n_obs for a in adatas)
    coll = create_anndata_collection(adatas, tmp_path / "c", progress=False, shuffle=False,
                                     n_obs_per_shard=-(-n_obs // 3), scheduler=scheduler,
                                     **({"n_workers": 2} if scheduler else {}))
    stored = [s.stored["X/data"] for s in coll.manifest.shards]
    assert stored == ["uint8", "uint8", "uint32"]
    assert cli_main(["info", str(coll.path)]) == 0  # what each shard stores, told
    assert ("stored as uint8 values / uint16 indices (2 shards), uint32 / uint16 (1)"
            in capsys.readouterr().out)
    src = _source_rows(adatas)
    got = _rows(coll, shuffle=True, seed=1)
    for r, row in src.items():
        np.testing.assert_array_equal(got[r], row.astype(np.float32))


@pytest.mark.parametrize("scheduler", [None, "threads"])
def test_integer_inputs_beside_float32_ones_are_delivered_as_float32(
        tmp_path: Path, scheduler: str | None) -> None:
    """Counts saved as int32 in one input and float32 in another: np.result_type says
    float64, which doubled every pool and dense batch; the writer sees every value exact
    in float32 and records float32. A count float32 cannot hold keeps float64."""
    small = _inputs([np.arange(1, 40, dtype=np.int64)], "int32", 50, seed=0)[0]
    other = _inputs([np.arange(1, 30, dtype=np.int64) * 3], "float32", 50, seed=1)[0]
    other.obs_names = [f"o{j}" for j in range(other.n_obs)]
    other.obs["rid"] += 1000
    kw: dict[str, Any] = {"progress": False}
    if scheduler:
        kw.update(scheduler=scheduler, n_workers=2)
    coll = create_anndata_collection([small, other], tmp_path / "c", **kw)
    assert coll.manifest.fields["X"].dtype == "float32"
    got, want = _rows(coll), _source_rows([small, other])
    assert sorted(got) == sorted(want)
    for r in want:
        np.testing.assert_array_equal(got[r], want[r])
    # dense batches come in float32 straight from a float32 pool
    ds = abt.AnnBatchDataset(coll, selector={"x": "X"}, batch_size=16, densify=True)
    assert all(b["x"].dtype == torch.float32 for b in ds)
    big = _inputs([np.array([2**24 + 1, 5])], "int32", 50, seed=2)[0]
    big.obs_names = [f"b{j}" for j in range(big.n_obs)]
    wide = create_anndata_collection([big, other], tmp_path / "w", **kw)
    assert wide.manifest.fields["X"].dtype == "float64"  # 2**24 + 1 is not a float32
    only_float = create_anndata_collection([other], tmp_path / "f", **kw)
    assert only_float.manifest.fields["X"].dtype == "float32"


def test_mixed_inputs_append_to_a_float64_collection(tmp_path: Path) -> None:
    """A float64 collection takes an append of int32 + float32 inputs: the stored dtype wins
    (the new shards are not settled to float32, which the dtype check would refuse)."""
    base = _inputs([np.array([0.5, 2.0, 3.25])], "float64", 50, seed=0)[0]
    coll = create_anndata_collection([base], tmp_path / "c", progress=False)
    assert coll.manifest.fields["X"].dtype == "float64"
    ints = _inputs([np.arange(1, 20, dtype=np.int64)], "int32", 50, seed=1)[0]
    flts = _inputs([np.arange(1, 10, dtype=np.int64) * 2], "float32", 50, seed=2)[0]
    for k, a in enumerate((ints, flts)):
        a.obs_names = [f"n{k}_{j}" for j in range(a.n_obs)]
        a.obs["rid"] += 100 * (k + 1)
    coll = abt.append_to_collection(coll, [ints, flts], progress=False)
    assert coll.manifest.fields["X"].dtype == "float64"
    got, want = _rows(coll), _source_rows([base, ints, flts])
    assert sorted(got) == sorted(want)
    for r in want:
        np.testing.assert_array_equal(got[r], want[r])


def _dense_batches(loader: Any, key: str = "x") -> dict[int, np.ndarray]:
    """``{rid: row}`` of one epoch of densified batches (each row once)."""
    out: dict[int, np.ndarray] = {}
    for b in loader:
        x = b[key]
        assert x.layout == torch.strided
        for r, row in zip(b["rid"].tolist(), x.numpy()):
            assert r not in out
            out[r] = row
    return out


def test_densified_pools_keep_the_stored_dtypes_and_deliver_the_source_values(
        tmp_path: Path) -> None:
    """Pools that are only densified keep what the shards store (uint8 / uint16 / uint32
    counts, uint16 column indices: less memory, in a worker's shared slots too) and are
    cast as they are densified: in-process, through 2 workers of an AnnBatchDataLoader and
    of a plain DataLoader (batches sent by reference), into float32 or out_dtype float64,
    cut to a gene subset; every row equals the source AnnData's. Pools not only densified
    hold the field's dtype and int32 indices."""
    rng = np.random.default_rng(4)
    values = [rng.integers(1, 200, 900), rng.integers(1, 60_000, 700),
              np.r_[rng.integers(1, 1000, 500), [2**24 - 1, 4_000_000_000]]]
    adatas = _inputs([v.astype(np.float64) for v in values], "int64", 300, seed=4)
    coll = create_anndata_collection(adatas, tmp_path / "c", progress=False,
                                     n_obs_per_shard=256, seed=1)
    stored = {s.stored["X/data"] for s in coll.manifest.shards}
    assert {"uint32", "uint16"} <= stored, stored  # shards of two widths in one pool
    src = _source_rows(adatas)
    genes = [f"g{j}" for j in range(0, 300, 7)][::-1]
    kw = dict(selector={"x": "X", "rid": "obs/rid"}, batch_size=64, chunk_size=32,
              preload_nchunks=4, densify=True, seed=2)
    reader = PoolReader(coll, ["X"], stored_dtypes=True)
    pool = reader.read(np.array([[0, coll.n_obs]]))["X"]
    assert (pool.dtype, pool.indices.dtype) == (np.uint32, np.uint16)
    wide = PoolReader(coll, ["X"]).read(np.array([[0, coll.n_obs]]))["X"]
    assert (wide.dtype, wide.indices.dtype) == (np.int64, np.int32)  # the field's
    reader.close()
    cases: list[tuple[str, Any, np.dtype, list[str] | None]] = [
        ("in-process", lambda ds: ds, np.dtype(np.float32), None),
        ("AnnBatchDataLoader", lambda ds: abt.AnnBatchDataLoader(ds, num_workers=2),
         np.dtype(np.float32), None),
        ("DataLoader", lambda ds: torch.utils.data.DataLoader(ds, batch_size=None,
                                                              num_workers=2),
         np.dtype(np.float32), None),
        ("float64", lambda ds: abt.AnnBatchDataLoader(ds, num_workers=2),
         np.dtype(np.float64), None),
        ("genes", lambda ds: abt.AnnBatchDataLoader(ds, num_workers=2),
         np.dtype(np.float32), genes),
    ]
    cols = [int(g[1:]) for g in genes]
    for name, make, dtype, var_names in cases:
        ds = abt.AnnBatchDataset(coll, **kw, var_names=var_names,
                                 out_dtype=None if dtype == np.float32 else dtype)
        got = _dense_batches(make(ds))
        assert sorted(got) == sorted(src), name
        for r, row in src.items():
            want = row.astype(dtype)
            if var_names is not None:
                want = want[cols]
            assert got[r].dtype == dtype, name
            np.testing.assert_array_equal(got[r], want, err_msg=name)


@pytest.mark.parametrize("genes_reordered", [False, True])
def test_duplicate_entries_are_stored_once_as_their_sum(tmp_path: Path,
                                                        genes_reordered: bool) -> None:
    """An input CSR holding a column twice in a row (scipy's value: the sum) is stored
    canonical, each cell once, its value the sum, and the narrow dtype chosen for the sum
    (200 + 100 does not fit uint8); in the input's gene order and remapped to another."""
    data = np.array([200, 100, 3, 7, 7, 7], np.float32)
    indices = np.array([1, 1, 0, 2, 2, 2])
    m = sp.csr_matrix((data, indices, np.array([0, 2, 3, 6])), shape=(3, 3))
    assert not m.has_canonical_format
    genes = ["g0", "g1", "g2"]
    a = ad.AnnData(X=m, var=pd.DataFrame(index=genes[::-1] if genes_reordered else genes))
    a.obs_names = ["a", "b", "c"]
    other = ad.AnnData(X=sp.csr_matrix(np.eye(3, dtype=np.float32)),
                       var=pd.DataFrame(index=genes))
    other.obs_names = ["d", "e", "f"]
    coll = create_anndata_collection([other, a], tmp_path / "c", shuffle=False,
                                     progress=False)
    np.testing.assert_array_equal(a.X.data, data)  # the input in memory is left as it was
    np.testing.assert_array_equal(a.X.indices, indices)
    z = ad.read_zarr(coll.shard_path(0)).X
    assert z.has_canonical_format
    assert z.dtype == np.uint16  # the sum 300, not the entries
    got = z.toarray()[3:]
    want = m.toarray()[:, ::-1] if genes_reordered else m.toarray()
    np.testing.assert_array_equal(got, want)
    assert got[0].max() == 300
    assert got[2].max() == 21
    # the checks of an append see the sum too: 1e8 + 1 in one cell of a float64 input is
    # a value the float32 collection would round (each entry alone it holds exactly)
    two = sp.csr_matrix((np.array([1e8, 1.0]), np.array([0, 0]), np.array([0, 2])),
                        shape=(1, 3))
    late = ad.AnnData(X=two, var=pd.DataFrame(index=genes))
    late.obs_names = ["g"]
    with pytest.raises(InputError, match=r"float32 does not hold exactly .*100000001\.0"):
        abt.append_to_collection(coll.path, [late], progress=False)
