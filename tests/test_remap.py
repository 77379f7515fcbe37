"""The writer's compiled remap of a block (write/remap.py) against scipy's three steps: the
same rows, columns, values and dtype, duplicates and dropped genes included."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from annbatch_torch.write import remap as remap_module
from annbatch_torch.write.passes import _remap
from annbatch_torch.write.remap import needs_compiled_remap, remap_rows, rows_increase


def _reference(m: sp.csr_matrix, col_map: np.ndarray, n_out: int, dtype: np.dtype,
               order: np.ndarray | None) -> sp.csr_matrix:
    coo = m.tocoo()
    cols = col_map[coo.col]
    keep = cols >= 0
    out = sp.csr_matrix((coo.data[keep].astype(dtype), (coo.row[keep], cols[keep])),
                        shape=(m.shape[0], n_out))
    out.sort_indices()
    return out if order is None else out[order]


@st.composite
def _blocks(draw: st.DrawFn) -> tuple[sp.csr_matrix, np.ndarray, int, np.dtype, np.ndarray | None]:
    n_rows = draw(st.integers(0, 40))
    n_in = draw(st.integers(1, 150))
    # panels of one digit, of two, and of three (above 65,536 columns: the radix sort's
    # digits change with the panel's width)
    n_out = draw(st.one_of(st.integers(n_in, 300), st.integers(60_000, 1 << 25)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    density = draw(st.floats(0, 1))
    in_dtype = np.dtype(draw(st.sampled_from(
        [np.float32, np.float64, np.int32, np.int64, np.uint16, np.int8, np.uint64, np.bool_])))
    values = (rng.standard_normal((n_rows, n_in)) * 1e3 if in_dtype.kind == "f"
              else rng.integers(1, 120, (n_rows, n_in)))  # floats that round in float32
    dense = (rng.random((n_rows, n_in)) < density) * values
    m = sp.csr_matrix(dense.astype(in_dtype))
    if draw(st.booleans()):
        m.indices, m.indptr = m.indices.astype(np.int64), m.indptr.astype(np.int64)
    if draw(st.booleans()):  # each row's entries in a random order, as some inputs store
        for r in range(n_rows):
            lo, hi = m.indptr[r], m.indptr[r + 1]
            p = lo + rng.permutation(hi - lo)
            m.indices[lo:hi], m.data[lo:hi] = m.indices[p], m.data[p]
        m.has_sorted_indices = False
    col_map = rng.choice(n_out, n_in, replace=False).astype(
        draw(st.sampled_from([np.int32, np.int64])))
    if draw(st.booleans()):  # the input's genes in the collection's order: no sort needed
        col_map.sort()
    col_map[rng.random(n_in) < draw(st.floats(0, 0.5))] = -1  # genes the collection drops
    dtype = np.dtype(draw(st.sampled_from([np.float32, np.float64, np.int32, np.int64])))
    order = rng.permutation(n_rows) if draw(st.booleans()) else None
    return m, col_map, n_out, dtype, order


@settings(max_examples=200, deadline=None)
@given(_blocks(), st.sampled_from([1, 2]))
def test_remap_rows_equals_scipy(block: tuple, threads: int) -> None:
    """One thread, or two (the second half of the rows by a helper thread; split from any
    size here), give scipy's rows."""
    m, col_map, n_out, dtype, order = block
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(remap_module, "SPLIT_NNZ", 0)
        mp.setattr(remap_module, "usable_cpus", lambda: 2)
        got = remap_rows(m, col_map, n_out, dtype, order, threads=threads)
    want = _reference(m, col_map, n_out, dtype, order)
    assert got is not None
    assert got.has_sorted_indices
    assert got.shape == want.shape
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.indptr, want.indptr)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.data, want.data)


@settings(max_examples=200, deadline=None)
@given(_blocks())
def test_pass_ones_remap_equals_scipy_on_either_path(block: tuple) -> None:
    """``_remap`` as pass 1 calls it: the compiled loop where the genes change order, some
    are dropped or a row is not sorted, else (genes renumbered in order) a numpy gather and
    scipy's row index; scipy's rows either way."""
    m, col_map, n_out, dtype, order = block
    kept = col_map[col_map >= 0]
    is_sorted = bool(np.all(kept[1:] > kept[:-1]))
    got = _remap(m, col_map, is_sorted, n_out, dtype, order)
    want = _reference(m, col_map, n_out, dtype, order)
    assert got.shape == want.shape
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.indptr, want.indptr)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.data, want.data)
    assert remap_module.rows_increase(got)


def test_which_maps_need_the_compiled_loop_and_which_rows_increase() -> None:
    assert not needs_compiled_remap(None, True)
    assert not needs_compiled_remap(np.array([0, 2, 5]), True)  # renumbered in order
    assert needs_compiled_remap(np.array([0, -1, 5]), True)  # a gene dropped
    assert needs_compiled_remap(np.array([2, 0, 5]), False)  # another order
    rows = sp.csr_matrix((np.ones(6, np.float32), np.array([0, 2, 1, 3, 0, 0]),
                          np.array([0, 2, 2, 4, 6])), shape=(4, 4))
    rows.has_sorted_indices = True  # a lie: the last row holds column 0 twice
    assert not rows_increase(rows)
    rows.indices[5] = 3
    assert rows_increase(rows)  # a row may start below the row before's last column
    rows.indices[3] = 1
    assert not rows_increase(rows)
    assert rows_increase(sp.csr_matrix((3, 3), dtype=np.float32))


def test_a_column_twice_in_a_row_is_left_to_scipy_which_keeps_both() -> None:
    m = sp.csr_matrix((np.array([1.0, 2.0, 5.0], np.float32), np.array([3, 1, 3]),
                       np.array([0, 3])), shape=(1, 4))
    col_map = np.array([3, 2, 1, 0])
    assert remap_rows(m, col_map, 4, np.dtype(np.float32)) is None
    with pytest.MonkeyPatch.context() as mp:  # in the half the helper thread remaps
        mp.setattr(remap_module, "SPLIT_NNZ", 0)
        mp.setattr(remap_module, "usable_cpus", lambda: 2)
        ok = sp.csr_matrix(np.array([[0, 7, 0, 9]], np.float32))
        for rows in ([ok, m], [m, ok]):
            assert remap_rows(sp.vstack(rows).tocsr(), col_map, 4, np.dtype(np.float32),
                              threads=2) is None
    # the writer's path falls back to scipy: both entries kept, columns sorted, rows in order
    two = sp.vstack([sp.csr_matrix(np.array([[0, 7, 0, 9]], np.float32)), m]).tocsr()
    two.has_canonical_format = False
    out = _remap(two, col_map, False, 4, np.dtype(np.float32), np.array([1, 0]))
    assert out.indptr.tolist() == [0, 3, 5]
    assert out.indices.tolist() == [0, 0, 2, 0, 2]
    assert sorted(out.data.tolist()[:2]) == [1.0, 5.0]
    assert out.data.tolist()[2:] == [2, 9, 7]


def test_bad_order_or_col_map_is_refused_before_the_compiled_loop() -> None:
    m = sp.csr_matrix(np.array([[1, 0, 2], [0, 3, 0]], np.float32))
    with pytest.raises(ValueError, match="order"):
        remap_rows(m, np.array([0, 1, 2]), 3, np.dtype(np.float32), np.array([0, 2]))
    with pytest.raises(ValueError, match="col_map"):
        remap_rows(m, np.array([0, 1, 3]), 3, np.dtype(np.float32))
    with pytest.raises(ValueError, match="col_map"):
        remap_rows(m, np.array([0, 1]), 3, np.dtype(np.float32))
    # pass 1's numpy path for genes renumbered in order checks the map alike
    with pytest.raises(ValueError, match="col_map"):
        _remap(m, np.array([0, 1, 3]), True, 3, np.dtype(np.float32), None)
    with pytest.raises(ValueError, match="col_map"):
        _remap(m, np.array([0, 1]), True, 3, np.dtype(np.float32), None)


def test_rows_flagged_sorted_that_are_not_are_left_to_scipy() -> None:
    """Genes in the collection's order skip the sort; a row whose columns are not sorted
    (its matrix flagged sorted all the same) is caught, not written unsorted."""
    m = sp.csr_matrix((np.array([1.0, 2.0, 5.0], np.float32), np.array([0, 2, 1]),
                       np.array([0, 1, 3])), shape=(2, 3))
    m.has_sorted_indices = True  # a lie
    col_map = np.array([0, 2, 3])  # keeps the order
    assert remap_rows(m, col_map, 4, np.dtype(np.float32)) is None
    out = _remap(m, col_map, True, 4, np.dtype(np.float32), None)  # as pass 1 calls it
    assert out.indices.tolist() == [0, 2, 3]
    assert out.data.tolist() == [1.0, 5.0, 2.0]


@pytest.mark.parametrize("var_names", [None, ["g0", "g1", "g2", "gX"]])
def test_unsorted_input_rows_are_stored_sorted(tmp_path: Any, var_names: Any) -> None:
    """An input's rows with unsorted columns, its genes in the collection's order (no remap
    at all, or one that keeps the order): stored sorted, the values those of the input."""
    import anndata as ad
    import pandas as pd
    import zarr

    from annbatch_torch.write.writer import create_anndata_collection

    x = sp.csr_matrix((np.array([1, 2, 3, 4, 5], np.float32), np.array([2, 0, 1, 0, 2]),
                       np.array([0, 2, 5])), shape=(2, 3))
    assert not x.has_sorted_indices
    a = ad.AnnData(X=x, obs=pd.DataFrame(index=["c0", "c1"]),
                   var=pd.DataFrame(index=["g0", "g1", "g2"]))
    a.write_h5ad(tmp_path / "a.h5ad")  # read back as blocks (in memory, scipy sorts them)
    coll = create_anndata_collection([tmp_path / "a.h5ad"], tmp_path / "c",
                                     var_names=var_names, progress=False, shuffle=False)
    z = zarr.open_group(str(coll.shard_path(0)), mode="r")["X"]
    indptr, indices = z["indptr"][:], z["indices"][:].astype(np.int64)  # stored narrow
    stored = sp.csr_matrix((z["data"][:], indices, indptr),
                           shape=(2, 3 if var_names is None else 4))
    for r in range(2):
        row = indices[indptr[r]:indptr[r + 1]]
        assert (np.diff(row) > 0).all(), row
    np.testing.assert_array_equal(stored.toarray()[:, :3], x.toarray())
