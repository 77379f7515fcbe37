"""What must not grow with the number of cells (issue 31), checked with in-process counters
(tracemalloc's blocks and bytes), never with wall time: opening a collection builds no
Python object per row and keeps about 2 bytes a row of an open shard, grouping rows by
class holds 4 bytes a row, and the writer's obs_names check keeps 8 bytes per name at most."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

import annbatch_torch as abt
from annbatch_torch.sampling.samplers import _ClassTable
from annbatch_torch.store.inputs.plan import InputNames, open_inputs


def _collection(n: int, path: Path) -> Path:
    rng = np.random.default_rng(n)
    x = sp.random(n, 30, density=0.2, format="csr", random_state=n, dtype=np.float32)
    obs = pd.DataFrame({"ct": pd.Categorical(rng.choice(list("abcdefgh"), n))},
                       index=[f"cell{i}" for i in range(n)])
    a = ad.AnnData(x, obs=obs, var=pd.DataFrame(index=[f"g{i}" for i in range(30)]))
    # chunks far smaller than either size: per-chunk buffers (a reading thread's scratch,
    # sized by the chunk) are then alike at both sizes, and what differs is per row
    abt.create_anndata_collection([a], path, progress=False, n_obs_per_shard=1 << 17,
                                  zarr_chunk_elems=1 << 12)
    return path


def _open_and_read_one_batch(path: Path) -> tuple[int, int]:
    """Blocks and bytes that opening ``path``, making a dataset and reading its first batch
    leave allocated (tracemalloc: numpy's buffers count as one block each)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        coll = abt.open_collection(path)
        ds = abt.AnnBatchDataset(coll, selector={"x": "X", "y": "obs/ct"}, batch_size=512,
                                chunk_size=256, preload_nchunks=4)  # pools below 10^4 rows
        batch = next(iter(ds))
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert batch["x"].shape[0] == 512
    diff = after.compare_to(before, "filename")
    return sum(d.count_diff for d in diff), sum(d.size_diff for d in diff)


def test_opening_a_collection_builds_no_python_object_per_row(tmp_path: Path) -> None:
    small, large = _collection(10_000, tmp_path / "small"), _collection(100_000, tmp_path / "large")
    _open_and_read_one_batch(small)  # one-time costs (imports, numba's load) out of both
    blocks_s, bytes_s = _open_and_read_one_batch(small)
    blocks_l, bytes_l = _open_and_read_one_batch(large)
    # 90,000 more rows: a str or int per row would be 90,000 more blocks
    assert blocks_l - blocks_s < 2_000, (blocks_s, blocks_l)
    # the shard's row offsets (about 2 bytes a row of an open shard: uint16 offsets from a
    # base every few rows, store/rowoffsets.py; int64 took 8) and nothing else
    assert bytes_l - bytes_s < 3 * 90_000 + 256_000, (bytes_s, bytes_l)
    offsets = abt.open_collection(large).element(0, "X").indptr
    assert offsets.nbytes <= 2.1 * len(offsets), offsets  # uint16 a row (4 would be uint32)


def _column_read_peak(path: Path) -> int:
    """Traced peak of reading the whole ``obs/ct`` column (what binding a sampler does)."""
    from annbatch_torch.read.reader import read_column

    coll = abt.open_collection(path)
    gc.collect()
    tracemalloc.start()
    try:
        codes = read_column(coll, "obs/ct")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(codes) == coll.n_obs
    return peak


def test_reading_a_whole_obs_column_holds_no_array_per_row_beside_the_codes(
        tmp_path: Path) -> None:
    """A sampler's column is read whole (10^7 rows for an atlas): the category check and
    the code maps work piece by piece; arrays per row (the shard of each row, its code
    limit, comparison masks) cost ~27 bytes a row beside 1-byte codes."""
    small, large = _collection(10_000, tmp_path / "small"), _collection(100_000, tmp_path / "large")
    _column_read_peak(small)  # one-time costs out of both
    grown = _column_read_peak(large) - _column_read_peak(small)
    # the int8 codes as read and as concatenated: 2 bytes a row (4 with slack)
    assert grown < 4 * 90_000, grown / 90_000


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-1, 6), max_size=3000), st.integers(7, 9),
       st.sampled_from([1, 7, 1 << 10]))
def test_class_table_groups_rows_as_a_stable_sort(codes: list[int], n_classes: int,
                                                  block: int) -> None:
    arr = np.asarray(codes, dtype=np.int16)
    import annbatch_torch.sampling.samplers as samplers

    old, samplers._GROUP_BLOCK = samplers._GROUP_BLOCK, block
    try:
        table = _ClassTable(arr, n_classes)
    finally:
        samplers._GROUP_BLOCK = old
    order = np.argsort(arr, kind="stable")
    want = order[arr[order] >= 0]
    np.testing.assert_array_equal(table.rows, want)
    np.testing.assert_array_equal(table.counts, np.bincount(arr[arr >= 0], minlength=n_classes))
    assert table.rows.dtype == np.int32


def test_class_table_holds_four_bytes_a_row() -> None:
    n = 3_000_000
    codes = np.random.default_rng(0).integers(-1, 500, n).astype(np.int16)
    tracemalloc.start()
    try:
        table = _ClassTable(codes, 500)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert table.rows.nbytes <= 4 * n
    # the rows and one block's temporaries (~40 bytes a row of the block: 64 with slack)
    assert peak < 4 * n + 64 * (1 << 18), peak / n


@pytest.mark.parametrize("repeats", [False, True])
def test_input_names_keep_eight_bytes_a_name(tmp_path: Path, repeats: bool) -> None:
    n = 200_000
    names = [f"cell_{i}" for i in range(n)]
    if repeats:
        names[5:10] = names[:5]
    a = ad.AnnData(sp.csr_matrix((n, 3), dtype=np.float32),
                   obs=pd.DataFrame(index=names), var=pd.DataFrame(index=["a", "b", "c"]))
    a.write_h5ad(tmp_path / "a.h5ad")
    (src,) = open_inputs([tmp_path / "a.h5ad"])
    try:
        tracemalloc.start()
        try:
            got = InputNames.read([src])
            kept = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert kept < 8 * n + 64_000, kept / n
        assert got.unique[0].size == n - 5 * repeats
        assert got.repeated[0][0].size == 5 * repeats
        if repeats:
            assert got.examples(0, got.repeated[0][0]) == names[:3]
        # the input reads as before once its index was refreshed
        assert list(src.names(n - 2, n)) == names[-2:]
    finally:
        src.close()


def test_interned_names_decode_as_read_index_does_with_one_str_per_name() -> None:
    """Names decoded as ``read_index`` decodes them (bytes and str as text, anything else
    through ``str``, numbers left alone), each distinct name one str object, also across
    calls and between bytes and str storage."""
    from annbatch_torch.store.elements import _decode_strings, interned_names

    ints = np.arange(3)
    assert interned_names(ints) is ints
    mixed = np.array(["g" + "1", b"g2", 3, None, True], dtype=object)
    got = interned_names(mixed)
    assert got.tolist() == _decode_strings(mixed).tolist() == ["g1", "g2", "3", "None",
                                                               "True"]
    a = interned_names(np.array(["gene" + str(7)], object))
    b = interned_names(np.array([b"gene7"], object))
    c = interned_names(np.array(["gene7"], dtype="U"))
    assert a[0] is b[0] is c[0]  # one str per distinct name
    assert interned_names(np.array([], dtype=object)).shape == (0,)


def test_a_pass1_task_carries_only_its_own_gene_map() -> None:
    import pickle

    from annbatch_torch.write.schema import resolve_schema

    rng = np.random.default_rng(0)
    genes = [f"g{i}" for i in range(2000)]
    adatas = []
    for k in range(12):  # each input its own gene order: twelve maps of 2,000 columns
        order = rng.permutation(2000)
        adatas.append(ad.AnnData(sp.random(5, 2000, density=0.01, format="csr",
                                           dtype=np.float32, random_state=k),
                                 obs=pd.DataFrame(index=[f"c{k}_{j}" for j in range(5)]),
                                 var=pd.DataFrame(index=[genes[i] for i in order])))
    sources = open_inputs(adatas)
    schema = resolve_schema(sources, "outer", None, None, None, None, None)
    whole = len(pickle.dumps(schema))
    for i in (0, 7):
        task = schema.for_inputs([i])
        assert len(pickle.dumps(task)) < whole / 4
        own = schema.genes.maps[i]
        np.testing.assert_array_equal(task.genes.maps[i], own)
        others = [m for k, m in enumerate(task.genes.maps) if k != i]
        assert all(m is not None and m.size == 0 for m in others)  # never "identity"
    assert all(m.size == 0 for m in schema.for_inputs(()).genes.maps)
    assert schema.genes.maps[3].size == 2000  # the writer's own schema is untouched
