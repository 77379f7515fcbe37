"""batch_dict_converter / to_device produce the right tensors with the right values."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from annbatch_torch import batch_dict_converter, to_device
from annbatch_torch.convert import to_tensor
from annbatch_torch.read.buffers import DenseBuffers
from annbatch_torch.read.csr import densify_csr


def test_converter_types_and_values() -> None:
    rng = np.random.default_rng(0)
    m = sp.random(7, 11, density=0.3, format="csr", dtype=np.float32, random_state=rng)
    batch = {
        "x": m,
        "codes": np.array([0, 2, 1], dtype=np.int8),
        "f64": np.array([1.5, 2.5]),
        "flag": np.array([True, False]),
        "t": torch.ones(2),
    }
    out = batch_dict_converter(batch)
    assert out["x"].layout == torch.sparse_csr
    np.testing.assert_array_equal(out["x"].to_dense().numpy(), m.toarray())
    assert out["codes"].dtype == torch.int64
    np.testing.assert_array_equal(out["codes"].numpy(), [0, 2, 1])
    assert out["f64"].dtype == torch.float32
    assert out["flag"].dtype == torch.bool
    assert out["t"] is batch["t"]


def test_densify_and_to_device_match_scipy() -> None:
    m = sp.random(5, 9, density=0.4, format="csr", dtype=np.float32, random_state=1)
    np.testing.assert_array_equal(densify_csr(m), m.toarray())
    moved = to_device(batch_dict_converter({"x": m, "y": np.arange(5)}), "cpu")
    assert moved["x"].layout == torch.strided
    np.testing.assert_array_equal(moved["x"].numpy(), m.toarray())
    kept = to_device(batch_dict_converter({"x": m}), "cpu", densify=False)
    assert kept["x"].layout == torch.sparse_csr


@pytest.mark.parametrize("shape", [(0, 5), (1, 5), (2, 3), (7, 11), (300, 40)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shared", [False, True])
def test_densify_split_and_shared_equal_scipy(shape: tuple[int, int], threads: int,
                                               shared: bool) -> None:
    m = sp.random(*shape, density=0.3, format="csr", dtype=np.float32, random_state=3)
    m.sum_duplicates()
    out = densify_csr(m, threads=threads, shared=shared)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, m.toarray())
    if shared and out.size:  # (an empty batch may be copied: nothing to save)
        t = to_tensor(out)
        assert t.is_shared()
        assert t.data_ptr() == out.ctypes.data  # handed on without a copy


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_sparse_batches_are_float32_like_dense_ones(dtype: type) -> None:
    """``densify`` changes a batch's layout, never its dtype: ``nn.Linear`` takes both."""
    m = sp.csr_matrix(np.array([[0, 3, 0], [1, 0, 2]], dtype=dtype))
    out = batch_dict_converter({"x": m, "d": densify_csr(m)})
    assert out["x"].layout == torch.sparse_csr
    assert out["x"].dtype == torch.float32
    assert out["d"].dtype == torch.float32
    np.testing.assert_array_equal(out["x"].to_dense().numpy(), m.toarray().astype(np.float32))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 40), g=st.integers(1, 30), density=st.floats(0, 1),
       dtype=st.sampled_from([np.float32, np.float64, np.int32, np.uint16]),
       threads=st.sampled_from([1, 2]), dups=st.booleans(), seed=st.integers(0, 2**16))
def test_densify_into_a_used_buffer_equals_scipy(n: int, g: int, density: float,
                                                 dtype: type, threads: int, dups: bool,
                                                 seed: int) -> None:
    """Densifying into reused arrays holding an earlier batch (the compiled row loop
    zeroes each row before filling it): equal to scipy's dense matrix, duplicate entries
    summed, in every values dtype, on one thread or split over two."""
    rng = np.random.default_rng(seed)
    m = sp.random(n, g, density=density, format="csr", random_state=rng, dtype=np.float64)
    m.data = np.round(m.data * 100).astype(dtype)
    m = m.astype(dtype)
    if dups and m.nnz:  # a repeated column in the first stored row holding values
        r = int(np.flatnonzero(np.diff(m.indptr))[0])
        lo = m.indptr[r]
        m = sp.csr_matrix((np.insert(m.data, lo, m.data[lo]),
                           np.insert(m.indices, lo, m.indices[lo]),
                           np.concatenate([m.indptr[: r + 1], m.indptr[r + 1:] + 1])),
                          shape=m.shape)
    buffers = DenseBuffers(keep=1)
    junk = buffers.take((n, g), np.dtype(dtype))
    junk[...] = 7
    del junk
    out = densify_csr(m, dtype=dtype, threads=threads, buffers=buffers)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, m.toarray())


def test_torch_csr_warnings_are_ignored_only_where_the_package_builds_them(
        small_collection: Any) -> None:
    """CSR batches built in process and rebuilt from DataLoader workers raise none of
    torch's sparse CSR warnings, while the caller's own ``torch.sparse_csr_tensor`` still
    gives the one torch has not given yet in this process (the package's filters name its
    modules, not the whole process). In a fresh process: torch gives each once."""
    import subprocess
    import sys

    code = (
        "import warnings, torch, annbatch_torch as abt\n"
        "with warnings.catch_warnings(record=True) as rec:\n"
        f"    ds = abt.AnnBatchDataset({str(small_collection.path)!r}, batch_size=8,\n"
        "                             densify=False)\n"
        "    for b in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2):\n"
        "        assert b['X'].layout == torch.sparse_csr\n"
        "    ds.set_epoch(1)\n"
        "    for b in ds:\n"
        "        assert b['X'].layout == torch.sparse_csr\n"
        "    ours = [str(r.message) for r in rec if 'Sparse' in str(r.message)]\n"
        "    del rec[:]\n"
        "    torch.sparse_csr_tensor(torch.tensor([0, 1]), torch.tensor([0]),\n"
        "                            torch.tensor([1.0]), (1, 2))\n"
        "    theirs = [str(r.message) for r in rec]\n"
        "assert not ours, ours\n"
        "assert any('Sparse invariant checks' in m for m in theirs), theirs\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
