"""A CSR matrix's row offsets held compactly (``store/rowoffsets.py``): every read must
give what the same ``int64`` array gives (integers, negative ones, slices with any step,
integer and boolean arrays, ``np.searchsorted`` on both sides, ``np.asarray``, row
lengths), whichever layout the offsets took (``uint16`` in small blocks, ``uint32``,
``int64``), and the bytes held must be the layout's, not 8 a row."""

from __future__ import annotations

import contextlib
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numba
import numpy as np
import pytest
from conftest import run_python
from hypothesis import given, settings
from hypothesis import strategies as st

from annbatch_torch.store import rowoffsets
from annbatch_torch.store.rowoffsets import RowOffsets

#: how slices are expanded: numpy (a process's first slices, or numba's JIT disabled)
#: or the compiled loop
MODES = ["numpy", "no_jit", "compiled"]


@contextlib.contextmanager
def _mode(mode: str) -> Iterator[None]:
    saved = (rowoffsets._EXPAND_FROM_CALLS, rowoffsets._slices, numba.config.DISABLE_JIT,
             rowoffsets.load_now)
    try:
        if mode == "compiled":
            rowoffsets._EXPAND_FROM_CALLS = 0
        elif mode == "no_jit":
            numba.config.DISABLE_JIT = True
        else:
            rowoffsets._EXPAND_FROM_CALLS, rowoffsets._slices = 10**12, 0
            rowoffsets.load_now = lambda loop, done_without, limit: False
        yield
    finally:
        (rowoffsets._EXPAND_FROM_CALLS, rowoffsets._slices, numba.config.DISABLE_JIT,
         rowoffsets.load_now) = saved


def _indptr(lengths: list[int]) -> np.ndarray:
    ip = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=ip[1:])
    return ip


def _counts(seed: int, n: int, mean: int) -> list[int]:
    """``n`` heavy-tailed row lengths around ``mean`` (as a count matrix's rows are)."""
    return np.random.default_rng(seed).negative_binomial(1, 1 / (1 + mean), n).tolist()


def _deep_runs(seed: int, n: int, runs: int) -> list[int]:
    """``n`` rows of ~30 entries with ``runs`` runs of 2-12 rows of 10^4-10^5 entries (a
    run of deep cells: uint16 offsets with a few blocks held wide)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 60, n)
    for start in rng.integers(0, n, runs):  # a run may reach the last row
        lengths[start : start + int(rng.integers(2, 13))] = rng.integers(10_000, 100_000)
    return lengths.tolist()


# row lengths from empty rows to rows that force the wider layouts (2**16: uint16 blocks
# must shrink; 2**29: eight rows pass 2**32, so only int64 holds them), and thousands of
# count-like rows (uint16 offsets in blocks of 8 to 2**16 rows: slices cross blocks)
_lengths = st.one_of(
    st.lists(st.one_of(st.integers(0, 300), st.integers(0, 70_000),
                       st.sampled_from([0, 1, 2**16 - 1, 2**16, 2**29])),
             min_size=0, max_size=400),
    st.builds(_counts, st.integers(0, 2**16), st.integers(1, 6000),
              st.sampled_from([1, 30, 300, 3000])),
    st.builds(_deep_runs, st.integers(0, 2**16), st.integers(20, 20_000), st.integers(1, 4)))


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=150, deadline=None)
@given(lengths=_lengths, data=st.data())
def test_every_read_equals_the_int64_arrays(mode: str, lengths: list[int],
                                            data: st.DataObject) -> None:
    with _mode(mode):
        _check_every_read(_indptr(lengths), data)


def _check_every_read(ip: np.ndarray, data: st.DataObject) -> None:
    r = RowOffsets(ip)
    n = len(ip)
    assert len(r) == n
    assert r.shape == (n,)
    assert r.dtype == np.int64
    np.testing.assert_array_equal(np.asarray(r), ip)
    np.testing.assert_array_equal(r[...], ip)
    k = data.draw(st.integers(-n, n - 1))
    assert r[k] == ip[k]
    assert r[np.int32(k)] == ip[k]
    a = data.draw(st.integers(-n - 2, n + 2) | st.none())
    b = data.draw(st.integers(-n - 2, n + 2) | st.none())
    step = data.draw(st.sampled_from([None, 1, 2, 7, -1, -3]))
    got = r[a:b:step]
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, ip[a:b:step])
    a = data.draw(st.integers(0, n))  # a piece's rows: a short range anywhere
    b = a + data.draw(st.sampled_from([0, 1, 9, 100, 700, 3000]))
    np.testing.assert_array_equal(r[a:b], ip[a:b])
    rows = np.asarray(data.draw(st.lists(st.integers(-n, n - 1), max_size=50)), dtype=np.int64)
    np.testing.assert_array_equal(r[rows], ip[rows])
    np.testing.assert_array_equal(r[rows.astype(np.int32)], ip[rows])
    mask = np.random.default_rng(data.draw(st.integers(0, 2**16))).random(n) < 0.3
    np.testing.assert_array_equal(r[mask], ip[mask])
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start, min(n - 1, start + 1000)) | st.integers(start, n - 1))
    got = r.lengths(start, stop)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.diff(ip[start : stop + 1]))
    values = np.asarray(data.draw(st.lists(
        st.integers(-1, int(ip[-1]) + 1) | st.sampled_from(ip.tolist()), max_size=20)))
    for side in ("left", "right"):
        np.testing.assert_array_equal(np.searchsorted(r, values, side=side),
                                      np.searchsorted(ip, values, side=side))
        if values.size:
            assert np.searchsorted(r, values[0], side=side) == np.searchsorted(
                ip, values[0], side=side)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("row", "jump"), [(65_535, 70_000), (7, 65_536), (65_535, 2**32),
                                           (15, 2**32 + 1), (131_071, 65_536),
                                           (65_536, 70_000), (65_536, 2**33)])
def test_a_jump_on_a_blocks_last_row_is_held(mode: str, row: int, jump: int) -> None:
    """The only row whose offset passes what a layout holds is the last of its block (a
    block's largest offset is its last row's), or the first of the next (values between
    two blocks are searched past the first block's offsets)."""
    lengths = np.zeros(140_000, dtype=np.int64)
    lengths[row - 1] = jump  # indptr[row] jumps
    ip = _indptr(lengths.tolist())
    with _mode(mode):
        r = RowOffsets(ip)
        np.testing.assert_array_equal(np.asarray(r), ip)
        np.testing.assert_array_equal(r[row - 3 : row + 3], ip[row - 3 : row + 3])
        assert r[row] == jump
        np.testing.assert_array_equal(r.lengths(row - 2, row + 2),
                                      lengths[row - 2 : row + 2])
        values = np.array([0, 1, jump // 2, jump - 70_000, jump - 1, jump, jump + 1])
        for side in ("left", "right"):
            np.testing.assert_array_equal(r.searchsorted(values, side=side),
                                          np.searchsorted(ip, values, side=side))


@pytest.mark.parametrize("mode", MODES)
def test_a_run_of_deep_rows_widens_only_its_blocks(mode: str) -> None:
    """Eight rows of 20,000 entries among 131,072 of 300: their block's offsets are held
    wide (int64), every other row's stay uint16, about 2 bytes a row in all."""
    lengths = np.full(131_072, 300)
    lengths[5_000:5_008] = 20_000
    ip = _indptr(lengths.tolist())
    with _mode(mode):
        r = RowOffsets(ip)
        assert r.nbytes <= 2.2 * len(ip), r
        np.testing.assert_array_equal(np.asarray(r), ip)
        np.testing.assert_array_equal(r[4_990:5_020], ip[4_990:5_020])
        rows = np.arange(4_990, 5_020)
        np.testing.assert_array_equal(r[rows], ip[rows])
        assert [r[int(k)] for k in rows] == ip[rows].tolist()
        np.testing.assert_array_equal(r.lengths(4_995, 5_010), lengths[4_995:5_010])
        values = ip[4_990:5_020] + np.array([0, 1] * 15)
        for side in ("left", "right"):
            np.testing.assert_array_equal(r.searchsorted(values, side=side),
                                          np.searchsorted(ip, values, side=side))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n_rows", [131_000, 131_071])  # the last block partial / full
def test_a_deep_run_in_the_last_block_is_held(mode: str, n_rows: int) -> None:
    lengths = np.full(n_rows, 300)
    lengths[-6:] = 30_000
    ip = _indptr(lengths.tolist())
    with _mode(mode):
        r = RowOffsets(ip)
        assert r.nbytes <= 2.2 * len(ip), r
        np.testing.assert_array_equal(np.asarray(r), ip)
        np.testing.assert_array_equal(r[-200:], ip[-200:])
        assert [r[k] for k in range(-10, 0)] == ip[-10:].tolist()
        assert r[np.array(-1)] == ip[-1]
        assert r[np.array(n_rows - 3)] == ip[-4]
        values = np.concatenate([ip[-12:], ip[-12:] + 1, [ip[-1] + 1]])
        for side in ("left", "right"):
            np.testing.assert_array_equal(r.searchsorted(values, side=side),
                                          np.searchsorted(ip, values, side=side))


@pytest.mark.parametrize("lengths", [[1] * 60_000, [10_000] * 60_000, [2**30] * 5_000,
                                     [300] * 131_072])
def test_nothing_but_the_layout_is_held(lengths: list[int]) -> None:
    """The int64 offsets given are not kept alive (a one-element view of them as the
    bases of a single-block layout would keep all of them)."""
    tracemalloc.start()
    try:
        ip = _indptr(lengths)  # traced: held after the del only if the layout keeps it
        r = RowOffsets(ip)
        del ip
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held <= r.nbytes + 4096, (r, held, r.nbytes)


def test_out_of_range_reads_raise_as_numpy_does() -> None:
    r = RowOffsets(_indptr([3, 0, 5]))
    for bad in (4, -5):
        with pytest.raises(IndexError, match="out of bounds"):
            r[bad]
    with pytest.raises(IndexError):
        r[np.array([0, 4])]
    with pytest.raises(IndexError, match="out of bounds"):
        r[np.array([-5])]
    with pytest.raises(IndexError, match="boolean index"):
        r[np.array([True, False])]
    with pytest.raises(IndexError, match="integers"):
        r[np.array([0.5])]
    with pytest.raises(ValueError, match="side"):
        r.searchsorted(3, side="middle")
    with pytest.raises(IndexError, match="out of bounds"):
        r[np.array([2**64 - 1], dtype=np.uint64)]
    with pytest.raises(IndexError, match="bool"):
        r[True]
    with pytest.raises(ValueError, match="copy"):
        np.asarray(r, copy=False)
    assert r[[]].shape == (0,)
    assert r[np.array(2)] == 3
    values = [-0.5, 0.0, 2.5, 3.0, 3.5, 8.0, 8.5, np.inf, -np.inf, np.nan]
    for side in ("left", "right"):
        np.testing.assert_array_equal(r.searchsorted(values, side=side),
                                      np.searchsorted(_indptr([3, 0, 5]), values, side=side))


@pytest.mark.parametrize(("mean", "most"), [(4, 2.1), (250, 2.2), (20_000, 4.1)])
def test_bytes_held_a_row(mean: int, most: float) -> None:
    """Counts of a few to a few hundred entries a row hold about 2 bytes a row (uint16
    offsets in blocks of rows), wide rows about 4 (uint32), never the 8 of int64."""
    rng = np.random.default_rng(mean)
    lengths = rng.negative_binomial(2, 2 / (2 + mean), 200_000)
    ip = _indptr(lengths.tolist())
    r = RowOffsets(ip)
    assert r.nbytes <= most * len(ip), (r, r.nbytes / len(ip))
    np.testing.assert_array_equal(np.asarray(r), ip)


def test_offsets_past_four_billion_stay_exact() -> None:
    lengths = [2**31] * 9 + [1, 0, 7]
    ip = _indptr(lengths)
    r = RowOffsets(ip)
    np.testing.assert_array_equal(np.asarray(r), ip)
    assert r[-1] == ip[-1]
    assert int(r[10]) == 9 * 2**31 + 1
    np.testing.assert_array_equal(r.lengths(0, len(lengths)), np.asarray(lengths))


def test_the_compiled_slice_waits_for_numbas_start(tmp_path: Path) -> None:
    """A fresh process expands slices with numpy (no compiled loop loaded: an h5ad read in
    place pays no numba start for them) until a compiled loop has run (and the slice's
    own loop is in numba's disk cache) or it has made 4,096 of them; then by the compiled
    loop."""
    head = ("import numpy as np\n"
            "from annbatch_torch.store import rowoffsets\n"
            "from annbatch_torch.store.rowoffsets import RowOffsets\n"
            "r = RowOffsets(np.arange(0, 3001, 3))\n"
            "def check():\n"
            "    assert r[5:60].tolist() == list(range(15, 180, 3))\n"
            "    print(bool(rowoffsets._expand.overloads))\n")
    out = run_python(head + (
        "check()\n"
        "from annbatch_torch.read.scatter import scatter_rows  # another compiled loop\n"
        "scatter_rows(np.ones(4, np.float32), np.zeros(1, np.int64), np.full(1, 4, np.int64),"
        " np.zeros(4, np.float32), np.zeros(1, np.int64))\n"
        "check()\n"), tmp_path)
    assert out.split() == ["False", "True"]
    out = run_python(head + (  # where _expand is compiled in each process (no cache)
        "from annbatch_torch.store import native\n"
        "native.is_cached = lambda loop: False\n"
        "from annbatch_torch.read.scatter import scatter_rows\n"
        "scatter_rows(np.ones(4, np.float32), np.zeros(1, np.int64), np.full(1, 4, np.int64),"
        " np.zeros(4, np.float32), np.zeros(1, np.int64))\n"
        "check()\n"), tmp_path)
    assert out.split() == ["False"]
    out = run_python(head + (
        "for _ in range(rowoffsets._EXPAND_FROM_CALLS - 1):\n"
        "    r[5:60]\n"
        "check()\n"
        "check()\n"), tmp_path)
    assert out.split() == ["False", "True"]
