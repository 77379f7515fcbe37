"""Shared fixtures: small synthetic h5ad inputs and a collection written from them.

Both are session-scoped and shared by many test modules: treat them as read-only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import warnings

# one OpenMP thread per process, set before torch is imported (subprocesses inherit it): the
# suite runs two test processes on two CPUs, each starting DataLoader workers, ranks and
# scripts, and torch's intra-op threads spinning beside them cost time (test_scvi.py +
# test_lightning.py: 90 s with the default, 67-77 s with one thread; the whole parallel
# run 709 s -> 671 s)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

# hypothesis imported now, while this process has one thread: its pytest plugin imports it
# at the session's end otherwise (a run of files that do not use it), and pytest's rewrite of
# it then parses source beside the threads a Dask test left, which CPython 3.11.7's AST
# constructor can refuse ("AST constructor recursion depth mismatch", an INTERNALERROR after
# every test passed)
import hypothesis  # noqa: F401
import pytest

from annbatch_torch.datasets import write_synthetic_h5ads
from annbatch_torch.store.collection import Collection
from annbatch_torch.write.writer import create_anndata_collection

#: cells per file of ``synthetic_h5ads`` and their (shared) number of genes
SMALL_N_OBS = (1200, 900, 600)
SMALL_N_VARS = 200
#: rows per shard of ``small_collection`` (2,700 cells -> shards of 1024, 1024, 652)
SMALL_SHARD_OBS = 1024

#: ``write_h5ads(adatas, folder)``: the paths written
WriteH5ads = Callable[[Sequence[Any], Path], list[Path]]


def _write_h5ads(adatas: Sequence[Any], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, a in enumerate(adatas):
        path = folder / f"in{i}.h5ad"
        a.write_h5ad(path)
        paths.append(path)
    return paths


def drain(loader: Iterable[Any]) -> list[Any]:
    """Every batch of ``loader`` (a ``DataLoader``, or an iterator of one), its worker
    processes stopped on the way out, also when a batch raises.

    An error raised through a ``DataLoader`` holds its iterator in a reference cycle (the
    traceback's frames). The garbage collector then closes the iterator's queues before it
    finalises the iterator, so its workers never get their stop signal, and torch waits 5 s
    for each one before it kills it, in whichever later test the collection happens to run.
    """
    it = iter(loader)
    try:
        return list(it)
    finally:
        stop = getattr(it, "_shutdown_workers", None)  # none without worker processes
        if stop is not None:
            stop()


def dense_rows(collection: Collection) -> Any:
    """The collection's X, dense float32, in global row order (read in-process), to check
    batches against."""
    import numpy as np

    import annbatch_torch as abt

    out = np.zeros((collection.n_obs, collection.n_vars), dtype=np.float32)
    for b in abt.AnnBatchDataset(collection, batch_size=512, shuffle=False, densify=True,
                                 return_index=True):
        out[b["index"].numpy()] = b["X"].numpy()
    return out


def run_python(code: str, cwd: Path, timeout: float = 120) -> str:
    """Run ``code`` in a fresh Python (this interpreter), fail on a non-zero exit with the
    end of its stderr, and return its stdout: for what only a new process shows (which
    modules a path imports)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=cwd, timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def run_ranks(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None,
              cwd: Path | None = None, retry: bool = True,
              before_retry: Callable[[], None] | None = None
              ) -> subprocess.CompletedProcess[str]:
    """Run a multi-process command (``torchrun``, a Lightning DDP script that starts its
    other ranks) in its own process group with ``faulthandler`` on, and return its result.

    A rank that aborts prints every thread's Python stack before it dies. Past ``timeout``
    every process of the group gets SIGABRT, so that each prints its stacks (where a rank
    waited): ``subprocess.run``'s timeout kills only the first process, and a rank it
    started keeps the pipes open while it waits for the dead one, so nothing of what
    happened would reach the report.

    With ``retry``, a run that hung, or where a process aborted with "terminate called
    without an active exception", is run once more after ``before_retry`` (e.g. emptying
    the folder the first run wrote), and the first run's output and stacks become a
    warning in the report. Twice in seven full test runs on two loaded CPUs a two-rank
    gloo run crashed so: a rank aborted with that message (under ``torchrun``) or the
    Lightning example hung with nothing printed; neither came back in 60 runs of those
    scripts alone, under load and with numba's cache cold. Any other crash (a segfault,
    a Python error) is not retried, nor is a second one: a second hang fails the test with
    both runs' stacks, an abort is left to the caller's assertion.

    Signals go to the process group and to every process the command started, found while
    it runs: ``torchrun`` starts each rank in a session of its own.
    """
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    first = ""
    for attempt in range(2 if retry else 1):
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, cwd=cwd, start_new_session=True)
        hung = False
        started: list[Any] = []  # psutil.Process of each process the command started
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            hung = True
            out, err = _stop_tree(proc, started)
        finally:
            _signal_tree(proc.pid, signal.SIGKILL, started)  # a rank left behind
        what = f"ran past {timeout} s" if hung else "crashed"
        report = (f"{' '.join(map(str, cmd[1:]))} {what} "
                  f"(exit {proc.returncode}); its output, with each process's stacks:\n"
                  f"{out[-3000:]}\n{err[-12000:]}")
        if not (hung or "terminate called without an active exception" in err):
            break
        if attempt == 0 and retry:
            warnings.warn(f"run again after a crash: {report}", stacklevel=2)
            first = report
            if before_retry is not None:
                before_retry()
        elif hung:
            pytest.fail(report + (f"\n\nthe first run:\n{first}" if first else ""))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _signal_tree(root: int, sig: int, started: list[Any]) -> None:
    """``sig`` to process group ``root`` and to every process ``root`` started (listed now
    while ``root`` runs, added to ``started``; those listed before are signalled too)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        started.extend(p for p in psutil.Process(root).children(recursive=True)
                       if p not in started)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(root, sig)
    for p in started:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)  # (psutil refuses a pid reused since it was listed)


def _stop_tree(proc: subprocess.Popen[str], started: list[Any]) -> tuple[str, str]:
    """SIGABRT to every process of a hung command (faulthandler prints each one's stacks),
    then SIGKILL; its output. A process out of reach that keeps the pipes open is given
    up on after a minute."""
    out = err = ""
    for sig in (signal.SIGABRT, signal.SIGKILL):
        _signal_tree(proc.pid, sig, started)
        try:
            return proc.communicate(timeout=30)  # all the output (none lost on a retry)
        except subprocess.TimeoutExpired as e:
            out, err = _text(e.stdout), _text(e.stderr)
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    proc.wait(timeout=30)
    return out, err + "\n(a process out of reach kept the output pipes open)"


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


#: the slowest test files and their seconds in a full run (``--durations``, 2 CPUs, loaded):
#: started first, so that with ``-n 2 --dist loadfile --no-loadscope-reorder`` (make test)
#: no long file is left for the end while the other worker has nothing to do. Other files
#: follow, those with more tests first (what xdist's own reordering does).
SLOW_FILES = {
    "test_remote.py": 162, "test_examples.py": 135, "test_benchmarks.py": 76,
    "test_parallel_writer.py": 75, "test_scvi.py": 55, "test_elastic_runs.py": 45,
    "test_lightning.py": 40, "test_narrow_dtypes.py": 39, "test_pairing_loader.py": 38,
    "test_writer.py": 35, "test_scatter.py": 33, "test_lightning_elastic.py": 31,
    "test_sampling.py": 30, "test_doc_snippets.py": 29,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Whole files in ``SLOW_FILES`` order, then by number of tests (each file's own order
    kept: module fixtures are shared as before)."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(files, key=lambda f: (-SLOW_FILES.get(Path(f).name, 0), -len(files[f])))
    items[:] = [item for f in order for item in files[f]]


@pytest.fixture(scope="session")
def write_h5ads() -> WriteH5ads:
    """A function writing AnnData objects as ``folder/in0.h5ad``, ``in1.h5ad``, ... (the
    folder is made) and returning their paths, in order."""
    return _write_h5ads


@pytest.fixture(scope="session")
def synthetic_h5ads(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three small h5ad files: 1,200 + 900 + 600 cells x the same 200 genes.

    Each file holds: X, log1p-normalised counts (float32 CSR); ``layers["counts"]``, the raw
    counts (float32 CSR); ``obsm["X_pca"]`` (float32, 8 columns); obs columns ``cell_type``
    (categorical, 8 types with their own gene programs), ``batch`` (categorical, 2),
    ``n_counts`` (float32), ``n_genes`` (int32) and ``is_doublet`` (bool). obs_names are
    unique across files: ``part{i}_cell_{j}``; var_names ``gene_{k}``.
    """
    folder = tmp_path_factory.mktemp("synthetic_h5ads")
    return write_synthetic_h5ads(
        folder, len(SMALL_N_OBS), list(SMALL_N_OBS), SMALL_N_VARS,
        layers=("counts",), obsm_pca=8, x="log1p", seed=11,
    )


@pytest.fixture(scope="session")
def small_collection(
    synthetic_h5ads: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> Collection:
    """The collection written from ``synthetic_h5ads`` (seed 0, shuffled, inner join).

    2,700 cells x 200 genes in 3 shards of at most 1,024 rows; fields ``X``,
    ``layers/counts``, ``obsm/X_pca``, ``obs/cell_type``, ``obs/batch``, ``obs/n_counts``,
    ``obs/n_genes``, ``obs/is_doublet``.
    """
    out = tmp_path_factory.mktemp("small_collection") / "store"
    return create_anndata_collection(
        synthetic_h5ads, out, seed=0, n_obs_per_shard=SMALL_SHARD_OBS, progress=False
    )


#: a scanpy release whose wheel ships the legacy (anndata < 0.7) ``pbmc68k_reduced`` h5ad
SCANPY_WITH_PBMC68K = "1.10.4"


@pytest.fixture(scope="session")
def pbmc68k_reduced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """scanpy's ``pbmc68k_reduced.h5ad`` (700 cells x 765 genes, written by anndata < 0.7:
    obs / var / obsm are HDF5 compound datasets, categories in ``uns['<col>_categories']``),
    taken from the scanpy wheel with ``pip download --no-deps`` (pip's own cache makes it
    quick after the first time). Skips the test when the wheel cannot be downloaded."""
    import subprocess
    import sys
    import zipfile

    folder = tmp_path_factory.mktemp("pbmc68k")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           f"scanpy=={SCANPY_WITH_PBMC68K}", "-d", str(folder)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot download scanpy=={SCANPY_WITH_PBMC68K} ({e}); the legacy "
                    "pbmc68k_reduced.h5ad comes from its wheel")
    wheels = sorted(folder.glob("scanpy-*.whl"))
    if done.returncode != 0 or not wheels:
        pytest.skip(f"cannot download scanpy=={SCANPY_WITH_PBMC68K} (pip said: "
                    f"{(done.stderr or done.stdout).strip()[-300:]}); the legacy "
                    "pbmc68k_reduced.h5ad comes from its wheel")
    with zipfile.ZipFile(wheels[0]) as z:
        member = next((n for n in z.namelist() if n.endswith("pbmc68k_reduced.h5ad")), None)
        if member is None:
            pytest.skip(f"{wheels[0].name} ships no pbmc68k_reduced.h5ad")
        out = folder / "pbmc68k_reduced.h5ad"
        out.write_bytes(z.read(member))
    return out


#: cells, genes and classes of ``imbalanced_h5ad``; class k holds about n / (k + 1) ** 2.5
#: cells (the smallest about 0.4% of them)
IMBALANCED = (6000, 30, 8)


@pytest.fixture(scope="session")
def imbalanced_h5ad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One h5ad of Zipf-imbalanced classes: 6,000 cells x 30 genes, float32 CSR X whose
    rows are all different, obs ``cell_type`` (categorical ``t0`` .. ``t7``, shuffled over
    the rows, ``t7`` the smallest at <= 0.5%) and ``donor`` (categorical, 3)."""
    import anndata as ad
    import numpy as np
    import pandas as pd
    import scipy.sparse as sp

    n, g, k = IMBALANCED
    sizes = 1.0 / np.arange(1, k + 1) ** 2.5
    counts = np.maximum(1, np.round(sizes / sizes.sum() * n)).astype(int)
    counts[0] += n - counts.sum()
    rng = np.random.default_rng(21)
    codes = rng.permutation(np.repeat(np.arange(k), counts))
    x = sp.random(n, g, density=0.3, format="csr", dtype=np.float32, random_state=rng)
    x.data[:] = rng.integers(1, 1000, x.nnz)
    obs = pd.DataFrame({
        "cell_type": pd.Categorical.from_codes(codes, [f"t{i}" for i in range(k)]),
        "donor": pd.Categorical.from_codes(rng.integers(0, 3, n), ["d0", "d1", "d2"]),
    }, index=[f"cell{i}" for i in range(n)])
    path = tmp_path_factory.mktemp("imbalanced") / "imbalanced.h5ad"
    ad.AnnData(x, obs=obs, var=pd.DataFrame(index=[f"g{i}" for i in range(g)])).write_h5ad(path)
    return path


@pytest.fixture(scope="session")
def imbalanced_collection(imbalanced_h5ad: Path, tmp_path_factory: pytest.TempPathFactory
                          ) -> Collection:
    """``imbalanced_h5ad`` written as a collection (seed 0, shards of at most 2,048 rows)."""
    out = tmp_path_factory.mktemp("imbalanced_collection") / "store"
    return create_anndata_collection([imbalanced_h5ad], out, seed=0, n_obs_per_shard=2048,
                                     progress=False)


@pytest.fixture(scope="session")
def grouped_collection(imbalanced_h5ad: Path, tmp_path_factory: pytest.TempPathFactory
                       ) -> Collection:
    """``imbalanced_h5ad`` written as ``imbalanced_collection`` is (seed 0, shards of at most
    2,048 rows) with ``group_by="cell_type"``: the same cells in the same shards, each
    shard's rows sorted by cell type."""
    out = tmp_path_factory.mktemp("grouped_collection") / "store"
    return create_anndata_collection([imbalanced_h5ad], out, seed=0, n_obs_per_shard=2048,
                                     group_by="cell_type", progress=False)


SCREEN = (2400, 60, 6)


@pytest.fixture(scope="session")
def screen_h5ad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Perturb-seq-like screen (``datasets.synthetic_screen``): 2,400 cells x 60 genes,
    6 target genes and ~25% ``"non-targeting"`` controls, 2 cell lines x 3 GEM groups
    (obs ``target_gene``, ``cell_line``, ``gem_group``), float32 CSR counts."""
    from annbatch_torch.datasets import synthetic_screen

    n, g, k = SCREEN
    path = tmp_path_factory.mktemp("screen") / "screen.h5ad"
    synthetic_screen(n, g, n_perturbations=k, control_fraction=0.25, n_gem_groups=3,
                     density=0.3, seed=5).write_h5ad(path)
    return path


@pytest.fixture(scope="session")
def screen_collection(screen_h5ad: Path, tmp_path_factory: pytest.TempPathFactory
                      ) -> Collection:
    """``screen_h5ad`` written as a collection (seed 0, shards of at most 1,024 rows)."""
    out = tmp_path_factory.mktemp("screen_collection") / "store"
    return create_anndata_collection([screen_h5ad], out, seed=0, n_obs_per_shard=1024,
                                     progress=False)


class S3Server:
    """A moto S3 server on loopback (a separate process) and the storage_options that
    reach it; ``bucket(name)`` creates a bucket and returns ``s3://name``. ``env``: extra
    environment of the server (``INITIAL_NO_AUTH_ACTION_COUNT=0`` enforces credentials)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        import os
        import socket
        import subprocess
        import sys
        import time
        import urllib.request

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.proc.kill()
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.1)
        self.options = {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing",
                        "client_kwargs": {"region_name": "us-east-1"}}

    def fs(self) -> Any:
        """A fresh s3fs filesystem on the server (no listing cache)."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.options)

    def bucket(self, name: str) -> str:
        import fsspec.asyn

        fs = self.fs()
        fsspec.asyn.sync(fs.loop, fs._call_s3, "create_bucket", Bucket=name)
        return f"s3://{name}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def s3() -> Any:
    """A real S3-compatible server (moto) on 127.0.0.1, for the whole session."""
    server = S3Server()
    yield server
    server.stop()
