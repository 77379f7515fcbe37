"""DevicePool: batches cut out of a pool held on a device equal the CPU path's, exactly.

The pool logic is plain torch, so it runs here with the pool on the CPU (scipy or torch
densification); the ``gpu``-marked tests repeat the checks on CUDA with the cupy kernel and
skip where there is no CUDA device or no cupy.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from conftest import run_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from annbatch_torch.convert import to_tensor
from annbatch_torch.read import device_pool as gpu
from annbatch_torch.read import gpu_backends as _gpu_backends
from annbatch_torch.read.device_pool import DevicePool, check_device


def _cuda_and_cupy() -> bool:
    if not torch.cuda.is_available():  # never import cupy on CPU-only machines
        return False
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


HAS_GPU = _cuda_and_cupy()
CPU_BACKENDS = ("numpy", "torch")
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# --------------------------------------------------------------------------- helpers


def _csr(n: int, k: int, density: float, rng: np.random.Generator,
         index_dtype: Any = np.int32, empty_rows: float = 0.0) -> sp.csr_matrix:
    dense = rng.standard_normal((n, k)).astype(np.float32)
    dense[rng.random((n, k)) >= density] = 0
    dense[rng.random(n) < empty_rows] = 0
    m = sp.csr_matrix(dense)
    m.indices = m.indices.astype(index_dtype)
    m.indptr = m.indptr.astype(index_dtype)
    return m


def _rows(n_pool: int, order: np.ndarray | None, start: int, stop: int) -> np.ndarray:
    rows = np.arange(n_pool) if order is None else order
    return rows[start:stop]


def _check_csr_batch(m: sp.csr_matrix, rows: np.ndarray, dense: torch.Tensor,
                     sparse: torch.Tensor, device: torch.device) -> None:
    ref = m[rows] if len(rows) else sp.csr_matrix((0, m.shape[1]), dtype=np.float32)
    assert dense.device == device
    assert sparse.device == device
    assert dense.dtype == torch.float32
    assert dense.layout == torch.strided
    assert dense.shape == (len(rows), m.shape[1])
    np.testing.assert_array_equal(dense.cpu().numpy(), ref.toarray())
    assert sparse.layout == torch.sparse_csr
    assert sparse.shape == (len(rows), m.shape[1])
    assert sparse.crow_indices().dtype == sparse.col_indices().dtype == torch.int32
    assert sparse.values().dtype == torch.float32
    np.testing.assert_array_equal(sparse.crow_indices().cpu().numpy(), ref.indptr)
    np.testing.assert_array_equal(sparse.col_indices().cpu().numpy(), ref.indices)
    np.testing.assert_array_equal(sparse.values().cpu().numpy(), ref.data)


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(0, 40))
    k = draw(st.integers(0, 15))
    density = draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    m = _csr(n, k, density, rng, draw(st.sampled_from([np.int32, np.int64])),
             empty_rows=draw(st.sampled_from([0.0, 0.5])))
    kind = draw(st.sampled_from(["none", "perm", "subset"]))
    order = None
    if kind == "perm":
        order = rng.permutation(n)
    elif kind == "subset" and n:
        order = rng.integers(0, n, size=draw(st.integers(0, n)))  # repeats allowed
    length = n if order is None else len(order)
    start = draw(st.integers(0, length))
    stop = draw(st.integers(start, length))
    return {"m": m, "order": order, "start": start, "stop": stop, "rng": rng}


def _check_pool(case: dict[str, Any], device: str, backend: str | None) -> None:
    m, order, start, stop = case["m"], case["order"], case["start"], case["stop"]
    n = m.shape[0]
    rng = case["rng"]
    obs = {
        "obsm/pca": rng.standard_normal((n, 3)),  # float64 -> float32
        "obs/codes": rng.integers(-1, 5, size=n).astype(np.int8),  # -> int64
        "obs/flag": rng.random(n) < 0.5,  # bool stays
        "obs/f32": rng.standard_normal(n).astype(np.float32),
    }
    pool = {"X": m, **obs}
    dpool = DevicePool(pool, device, order=order, _backend=backend)
    dev = dpool.device
    rows = _rows(n, order, start, stop)
    dense = dpool.batch(start, stop, densify=True)
    sparse = dpool.batch(start, stop, densify=False)
    _check_csr_batch(m, rows, dense["X"], sparse["X"], dev)
    for out in (dense, sparse):
        assert set(out) == set(pool)
        for path, value in obs.items():
            expect = to_tensor(value[rows])
            got = out[path]
            assert got.device == dev, path
            assert got.dtype == expect.dtype, path
            assert got.shape == expect.shape, path
            assert torch.equal(got.cpu(), expect), path
    dpool.close()


# --------------------------------------------------------------------------- CPU


def test_cpu_paths_never_import_cupy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The loader, to_device to the CPU, the gpu module and CPU device pools (both CPU
    backends) run without ever importing cupy."""
    code = (
        "import sys, anndata as ad, numpy as np, scipy.sparse as sp\n"
        "import annbatch_torch as abt\n"
        "import annbatch_torch.read.device_pool as g\n"
        "a = ad.AnnData(sp.random(50, 7, density=0.5, format='csr', dtype=np.float32))\n"
        "ds = abt.AnnBatchDataset(a, batch_size=16, densify=True)\n"
        "assert sum(len(b['X']) for b in ds) == 50\n"
        "moved = abt.to_device(abt.batch_dict_converter({'x': a.X}), 'cpu')\n"
        "assert (moved['x'].numpy() == a.X.toarray()).all()\n"
        "ds = abt.AnnBatchDataset(a, batch_size=16, densify=True, device='cpu')\n"
        "assert sum(len(b['X']) for b in ds) == 50\n"
        "m = sp.random(20, 5, density=0.5, format='csr', dtype=np.float32)\n"
        "p = g.DevicePool({'X': m}, 'cpu')\n"
        "assert (p.batch(0, 20)['X'].numpy() == m.toarray()).all()\n"
        "p = g.DevicePool({'X': m}, 'cpu', _backend='torch')\n"
        "assert (p.batch(0, 20)['X'].numpy() == m.toarray()).all()\n"
        "assert 'cupy' not in sys.modules, 'cupy was imported'\n"
        "print('ok')\n"
    )
    assert run_python(code, tmp_path).strip().endswith("ok")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@SETTINGS
@given(case=_cases())
def test_cpu_pool_batches_equal_source(backend: str, case: dict[str, Any]) -> None:
    _check_pool(case, "cpu", backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_all_batches_cover_the_pool_in_order(backend: str) -> None:
    rng = np.random.default_rng(3)
    m = _csr(103, 17, 0.2, rng, empty_rows=0.2)
    order = rng.permutation(103)
    dpool = DevicePool({"X": m}, "cpu", order=order, _backend=backend)
    assert len(dpool) == 103
    assert dpool.fields == ("X",)
    parts = [b["X"] for b in dpool.batches(10)]
    assert [len(p) for p in parts] == [10] * 10 + [3]
    np.testing.assert_array_equal(torch.cat(parts).numpy(), m[order].toarray())
    with pytest.raises(ValueError, match="batch_size"):
        next(dpool.batches(0))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_duplicates_are_summed_like_scipy(backend: str) -> None:
    data = np.array([1.5, 2.25, 3.0, -1.0, 4.0], dtype=np.float32)
    indices = np.array([2, 2, 0, 1, 1], dtype=np.int32)
    indptr = np.array([0, 2, 2, 5], dtype=np.int32)
    m = sp.csr_matrix((data, indices, indptr), shape=(3, 4))
    assert not m.has_canonical_format
    out = DevicePool({"X": m}, "cpu", _backend=backend).batch(0, 3)["X"]
    np.testing.assert_array_equal(out.numpy(), m.toarray())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_float32_and_non_csr_inputs(backend: str) -> None:
    rng = np.random.default_rng(1)
    m64 = _csr(12, 6, 0.4, rng).astype(np.float64)
    counts = sp.csr_matrix(rng.integers(0, 5, size=(12, 6)).astype(np.int32))
    csc = sp.csc_matrix(_csr(12, 6, 0.4, rng))
    pool = {"a": m64, "b": counts, "c": csc, "d": torch.arange(12)}
    out = DevicePool(pool, "cpu", _backend=backend).batch(3, 9)
    for key in "abc":
        expect = pool[key][3:9].toarray().astype(np.float32)
        assert out[key].dtype == torch.float32
        np.testing.assert_array_equal(out[key].numpy(), expect)
    assert torch.equal(out["d"], torch.arange(3, 9))


def test_other_dtypes_pass_through_on_the_host() -> None:
    names = np.array([f"cell{i}" for i in range(8)], dtype=object)
    dpool = DevicePool({"obs/name": names, "X": _csr(8, 3, 0.5, np.random.default_rng(0))},
                       "cpu", order=np.array([7, 0, 3]))
    out = dpool.batch(0, 2)
    assert isinstance(out["obs/name"], np.ndarray)
    assert list(out["obs/name"]) == ["cell7", "cell0"]
    assert dpool.nbytes == sum(t.numel() * t.element_size() for t in dpool._tensors())


def test_index_dtype_falls_back_to_int64(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _csr(10, 5, 0.8, np.random.default_rng(2))
    assert m.nnz >= 6
    monkeypatch.setattr(_gpu_backends, "_INT32_MAX", 6)  # as if the batch had 2**31 entries
    dpool = DevicePool({"X": m}, "cpu")
    sparse = dpool.batch(0, 10, densify=False)["X"]
    assert sparse.crow_indices().dtype == sparse.col_indices().dtype == torch.int64
    np.testing.assert_array_equal(sparse.to_dense().numpy(), m.toarray())
    small = dpool.batch(0, 1, densify=False)["X"]  # <= 5 entries: int32 again
    assert small.crow_indices().dtype == small.col_indices().dtype == torch.int32
    np.testing.assert_array_equal(small.to_dense().numpy(), m[:1].toarray())
    wide = DevicePool({"X": _csr(4, 9, 0.5, np.random.default_rng(3))}, "cpu")
    assert wide.batch(0, 1, densify=False)["X"].col_indices().dtype == torch.int64


def test_batches_own_their_memory_and_close_frees_the_pool() -> None:
    m = _csr(20, 5, 0.6, np.random.default_rng(4))
    pca = np.arange(40, dtype=np.float32).reshape(20, 2)
    pca.setflags(write=False)
    dpool = DevicePool({"X": m, "pca": pca}, "cpu")
    assert dpool.nbytes == (m.nnz * 4 + m.nnz * 4 + 21 * 8) + 40 * 4
    first = dpool.batch(0, 20)
    sparse = dpool.batch(0, 20, densify=False)["X"]
    for t in (first["X"], first["pca"], sparse.values(), sparse.col_indices()):
        t.zero_()
    again = dpool.batch(0, 20)
    np.testing.assert_array_equal(again["X"].numpy(), m.toarray())
    np.testing.assert_array_equal(again["pca"].numpy(), pca)
    pca.setflags(write=True)
    pca[:] = -1  # the pool holds its own copy of the host arrays too
    np.testing.assert_array_equal(dpool.batch(0, 20)["pca"].numpy(), again["pca"].numpy())
    with dpool:
        pass
    assert dpool.closed
    assert dpool.nbytes == 0
    assert "closed" in repr(dpool)
    np.testing.assert_array_equal(again["X"].numpy(), m.toarray())  # batches stay valid
    with pytest.raises(RuntimeError, match="closed"):
        dpool.batch(0, 1)
    dpool.close()  # idempotent


def test_empty_pool_and_empty_batches() -> None:
    m = sp.csr_matrix((0, 4), dtype=np.float32)
    dpool = DevicePool({"X": m, "y": np.zeros(0, dtype=np.int32)}, "cpu")
    out = dpool.batch(0, 0)
    assert out["X"].shape == (0, 4)
    assert out["y"].dtype == torch.int64
    assert list(dpool.batches(3)) == []
    assert len(DevicePool({}, "cpu")) == 0


def test_bad_inputs() -> None:
    m = _csr(5, 3, 0.5, np.random.default_rng(0))
    with pytest.raises(ValueError, match="has 4 rows"):
        DevicePool({"X": m, "y": np.zeros(4)}, "cpu")
    with pytest.raises(ValueError, match="scalar"):
        DevicePool({"X": m, "y": np.float32(1)}, "cpu")
    with pytest.raises(IndexError, match="outside"):
        DevicePool({"X": m}, "cpu", order=np.array([0, 5]))
    with pytest.raises(IndexError, match="outside"):
        DevicePool({"X": m}, "cpu", order=np.array([-1]))
    with pytest.raises(ValueError, match="1-D integer"):
        DevicePool({"X": m}, "cpu", order=np.array([0.5]))
    with pytest.raises(ValueError, match="_backend"):
        DevicePool({"X": m}, "cpu", _backend="jax")
    with pytest.raises(ValueError, match="CUDA device"):
        DevicePool({"X": m}, "cpu", _backend="cupy")
    dpool = DevicePool({"X": m}, "cpu", order=np.array([1, 2]))
    with pytest.raises(IndexError, match="outside"):
        dpool.batch(1, 3)
    with pytest.raises(IndexError, match="outside"):
        dpool.batch(2, 1)
    with pytest.raises(TypeError, match="ints"):
        dpool.batch(0.0, 1)  # type: ignore[arg-type]


def test_cupy_backend_launch_with_an_emulated_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cupy backend's launch code (argument order and types, empty batches, int64
    indices), run on the CPU against a Python emulation of the CUDA kernel."""
    import re
    from contextlib import nullcontext
    from types import SimpleNamespace

    sig = re.search(r"annbatch_csr_densify_\{name\}\((.*?)\)", _gpu_backends._KERNEL_SOURCE, re.S)
    assert sig is not None
    params = [p.split()[-1].strip("*") for p in sig.group(1).split(",")]
    assert params == ["data", "indices", "row_lo", "row_hi", "n_rows", "n_cols", "out"]
    launches: list[str] = []

    class FakeKernel:
        def __init__(self, source: str, name: str) -> None:
            assert name in source
            self.index = np.int32 if name.endswith("i32") else np.int64

        def __call__(self, grid: tuple[int], block: tuple[int], args: tuple) -> None:
            data, indices, row_lo, row_hi, n_rows, n_cols, out = args
            assert data.dtype == np.float32
            assert indices.dtype == self.index
            assert row_lo.dtype == row_hi.dtype == np.int64
            assert isinstance(n_rows, np.int64)
            assert isinstance(n_cols, np.int64)
            assert out.shape == (n_rows, n_cols)
            assert out.dtype == np.float32
            assert 1 <= grid[0] <= _gpu_backends._MAX_BLOCKS
            assert block == (_gpu_backends._THREADS,)
            for r in range(n_rows):
                for j in range(row_lo[r], row_hi[r]):
                    if 0 <= indices[j] < n_cols:
                        out[r, indices[j]] += data[j]
            launches.append(str(self.index))

    fake_cp = SimpleNamespace(
        RawKernel=FakeKernel, from_dlpack=lambda t: t.numpy(),
        cuda=SimpleNamespace(Device=lambda i: nullcontext(),
                             ExternalStream=lambda p: nullcontext()),
    )
    monkeypatch.setattr(_gpu_backends, "_KERNELS", {})
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda dev=None: SimpleNamespace(cuda_stream=0))
    backend = object.__new__(_gpu_backends._CupyBackend)
    backend.cp = fake_cp
    rng = np.random.default_rng(8)
    for case in range(40):
        n, k = int(rng.integers(0, 30)), int(rng.integers(0, 12))
        if case == 30:
            monkeypatch.setattr(_gpu_backends, "_INT32_MAX", 3)  # int64 column indices from here on
        m = _csr(n, k, float(rng.choice([0.0, 0.2, 0.7])), rng, empty_rows=0.3)
        order = rng.permutation(n) if case % 2 else None
        dpool = DevicePool({"X": m}, "cpu", order=order, _backend="numpy")
        dpool._backend = backend
        start = int(rng.integers(0, n + 1))
        stop = int(rng.integers(start, n + 1))
        out = dpool.batch(start, stop)["X"]
        expect = m[_rows(n, order, start, stop)].toarray() if stop > start else np.zeros((0, k))
        np.testing.assert_array_equal(out.numpy(), expect)
    assert "<class 'numpy.int32'>" in launches
    assert "<class 'numpy.int64'>" in launches


# --------------------------------------------------------------------------- check_device


def test_check_device_cpu_and_bad_devices() -> None:
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA devices"):
        check_device("meta")
    with pytest.raises(ValueError, match="not a torch device"):
        check_device("gpu0")


def test_check_device_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"CUDA is not available.*device=None"):
        check_device("cuda")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        DevicePool({}, "cuda:0", _backend="torch")


def _fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def test_check_device_without_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch)
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'annbatch-torch\[gpu\]'"):
        check_device("cuda:0")
    with pytest.raises(ImportError, match="needs cupy"):
        DevicePool({}, "cuda")


def test_check_device_index(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch)
    monkeypatch.setattr(gpu, "_import_cupy", lambda: None)
    assert check_device("cuda") == torch.device("cuda", 1)  # the current device
    assert check_device(0) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="2 CUDA device"):
        check_device("cuda:2")


def test_check_device_in_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch)
    monkeypatch.setattr(gpu, "get_worker_info", lambda: object())
    with pytest.raises(RuntimeError, match="num_workers=0"):
        check_device("cuda")
    assert check_device("cpu") == torch.device("cpu")


def test_pyproject_gpu_extra_lists_cupy() -> None:
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "annbatch-torch"  # as named in the install hint
    assert any(r.startswith("cupy") for r in meta["project"]["optional-dependencies"]["gpu"])


# --------------------------------------------------------------------------- CUDA


@pytest.mark.parametrize("backend", ["cupy", "torch"])
@SETTINGS
@given(case=_cases())
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and cupy")
def test_cuda_pool_batches_equal_source(backend: str, case: dict[str, Any]) -> None:
    _check_pool(case, "cuda", backend)


@pytest.mark.parametrize("pin_memory", [None, True, False])
@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and cupy")
def test_cuda_large_pool(pin_memory: bool | None, ordered: bool) -> None:
    rng = np.random.default_rng(5)
    m = _csr(3000, 2500, 0.1, rng, empty_rows=0.05)  # ~3 MiB of data: pinned by default
    for a in (m.data, m.indices, m.indptr):
        a.setflags(write=False)  # as buffers read from a file can be
    order = rng.permutation(3000) if ordered else None
    dpool = DevicePool({"X": m}, "cuda", order=order, pin_memory=pin_memory)
    assert dpool.device.type == "cuda"
    assert dpool.device.index is not None
    assert "backend=cupy" in repr(dpool)
    rows = _rows(3000, order, 0, 3000)
    for start in range(0, 3000, 1024):
        stop = min(start + 1024, 3000)
        _check_csr_batch(m, rows[start:stop], dpool.batch(start, stop)["X"],
                         dpool.batch(start, stop, densify=False)["X"], dpool.device)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and cupy")
def test_cuda_streams() -> None:
    rng = np.random.default_rng(6)
    m = _csr(2048, 1000, 0.2, rng)
    upload, use = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(upload):
        dpool = DevicePool({"X": m}, "cuda", pin_memory=True)
    with torch.cuda.stream(use):
        dense = dpool.batch(0, 2048)["X"]
        sums = dense.sum(dim=1)
    dpool.close()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(dense.cpu().numpy(), m.toarray())
    np.testing.assert_allclose(sums.cpu().numpy(), m.toarray().sum(axis=1), rtol=1e-5,
                               atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and cupy")
def test_cuda_int64_indices(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _csr(50, 40, 0.3, np.random.default_rng(7))
    # columns and batch entries "overflow" int32
    monkeypatch.setattr(_gpu_backends, "_INT32_MAX", 30)
    dpool = DevicePool({"X": m}, "cuda")
    assert dpool._fields["X"].indices.dtype == torch.int64  # type: ignore[union-attr]
    sparse = dpool.batch(0, 50, densify=False)["X"]
    assert sparse.crow_indices().dtype == torch.int64
    np.testing.assert_array_equal(dpool.batch(0, 50)["X"].cpu().numpy(), m.toarray())
    np.testing.assert_array_equal(sparse.to_dense().cpu().numpy(), m.toarray())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and cupy")
def test_cuda_kernel_skips_out_of_range_columns() -> None:
    data = np.array([1, 2, 3, 4], dtype=np.float32)
    indices = np.array([0, 9, -1, 1], dtype=np.int32)  # a damaged pool: 9 and -1 are bad
    m = sp.csr_matrix((data, indices, np.array([0, 2, 4])), shape=(2, 4))
    out = DevicePool({"X": m}, "cuda").batch(0, 2)["X"]
    np.testing.assert_array_equal(out.cpu().numpy(), [[1, 0, 0, 0], [0, 4, 0, 0]])


# ------------------------------------------------------------ benchmarks/gpu_check.py


def _gpu_check(tmp_path, *args: str) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the note printed without CUDA")
def test_gpu_check_exits_0_without_cuda(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = _gpu_check(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "no CUDA device" in out.stdout


def test_gpu_check_dry_run_on_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = _gpu_check(tmp_path, "--device", "cpu", "--n-obs", "1200", "--n-vars", "60",
                     "--batch-size", "128", "--workers", "0", "--pool-rows", "500",
                     "--check-rows", "100")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "to_device: 10 batches checked: OK" in out.stdout
    assert "DevicePool: 500 rows" in out.stdout
    assert "values equal: yes" in out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and cupy")
def test_to_device_with_batches_already_on_the_gpu() -> None:
    """to_device on a device pool's batches: CUDA -> CUDA moves as is (GPU tensors cannot
    be pinned), CUDA -> CPU copies synchronously (values are read right away)."""
    from annbatch_torch.convert import to_device

    rng = np.random.default_rng(4)
    m = _csr(64, 11, 0.3, rng)
    dpool = DevicePool({"X": m}, "cuda")
    batch = dpool.batch(0, 64, densify=False)
    again = to_device(batch, "cuda")
    np.testing.assert_array_equal(again["X"].cpu().numpy(), m.toarray())
    back = to_device(batch, "cpu")
    np.testing.assert_array_equal(back["X"].numpy(), m.toarray())
    dense = dpool.batch(0, 64)
    np.testing.assert_array_equal(to_device(dense, "cpu")["X"].numpy(), m.toarray())
