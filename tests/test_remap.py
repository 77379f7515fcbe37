"""The writer's compiled remap of a block (write/remap.py) against scipy's three steps: the
same rows, columns, values and dtype, duplicates and dropped genes included."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from annbatch_torch.write.passes import _remap
from annbatch_torch.write.remap import remap_rows


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
    n_out = draw(st.integers(n_in, 300))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    density = draw(st.floats(0, 1))
    dense = (rng.random((n_rows, n_in)) < density) * rng.integers(1, 70_000, (n_rows, n_in))
    in_dtype = draw(st.sampled_from([np.float32, np.float64, np.int32, np.uint16]))
    m = sp.csr_matrix(dense.astype(in_dtype))
    if draw(st.booleans()):  # each row's entries in a random order, as some inputs store
        for r in range(n_rows):
            lo, hi = m.indptr[r], m.indptr[r + 1]
            p = lo + rng.permutation(hi - lo)
            m.indices[lo:hi], m.data[lo:hi] = m.indices[p], m.data[p]
        m.has_sorted_indices = False
    col_map = rng.permutation(n_out)[:n_in].astype(np.int64)
    col_map[rng.random(n_in) < draw(st.floats(0, 0.5))] = -1  # genes the collection drops
    dtype = np.dtype(draw(st.sampled_from([np.float32, np.float64, np.int32])))
    order = rng.permutation(n_rows) if draw(st.booleans()) else None
    return m, col_map, n_out, dtype, order


@settings(max_examples=200, deadline=None)
@given(_blocks())
def test_remap_rows_equals_scipy(block: tuple) -> None:
    m, col_map, n_out, dtype, order = block
    got = remap_rows(m, col_map, n_out, dtype, order)
    want = _reference(m, col_map, n_out, dtype, order)
    assert got is not None
    assert got.has_sorted_indices and got.shape == want.shape and got.dtype == dtype
    np.testing.assert_array_equal(got.indptr, want.indptr)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.data, want.data)


def test_a_column_twice_in_a_row_is_left_to_scipy_which_keeps_both() -> None:
    m = sp.csr_matrix((np.array([1.0, 2.0, 5.0], np.float32), np.array([3, 1, 3]),
                       np.array([0, 3])), shape=(1, 4))
    col_map = np.array([3, 2, 1, 0])
    assert remap_rows(m, col_map, 4, np.dtype(np.float32)) is None
    # the writer's path falls back to scipy: both entries kept, columns sorted
    out = _remap(m, col_map, False, 4, np.dtype(np.float32), None)
    assert out.indices.tolist() == [0, 0, 2] and sorted(out.data.tolist()[:2]) == [1.0, 5.0]
    # and the next call (same scratch state) is exact again
    ok = sp.csr_matrix(np.array([[0, 7, 0, 9]], np.float32))
    np.testing.assert_array_equal(remap_rows(ok, col_map, 4, np.dtype(np.float32)).toarray(),
                                  [[9, 0, 7, 0]])
