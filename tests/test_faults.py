"""Faults lose nothing and never hang: a writer killed mid-write, a full disk, an exception
in a DataLoader worker, a worker killed mid-epoch, a worker that stops responding.

Real subprocesses and real signals throughout; every test has a hard timeout.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from conftest import drain
from torch.utils.data import DataLoader

import annbatch_torch as abt
from annbatch_torch import A, AnnBatchDataset, CollectionError, ReadError, open_collection
from annbatch_torch.store.manifest import MANIFEST_NAME

N_VARS = 50


def _adata(n: int, seed: int) -> ad.AnnData:
    rng = np.random.default_rng(seed)
    x = sp.random(n, N_VARS, density=0.2, format="csr", dtype=np.float32, random_state=rng)
    x.data = np.round(x.data * 10) + 1
    obs = pd.DataFrame(
        {"cell_type": pd.Categorical(rng.choice(["B", "T", "NK"], n))},
        index=[f"c{seed}_{i}" for i in range(n)],
    )
    return ad.AnnData(x, obs=obs, var=pd.DataFrame(index=[f"g{k}" for k in range(N_VARS)]))


@pytest.fixture(scope="module")
def h5ads(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    d = tmp_path_factory.mktemp("faults_in")
    paths = []
    for i, n in enumerate([1500, 1100]):
        p = d / f"in{i}.h5ad"
        _adata(n, i).write_h5ad(p)
        paths.append(p)
    return paths


N_OBS = 2600


@pytest.fixture(scope="module")
def collection(h5ads: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("faults_coll") / "store"
    abt.create_anndata_collection(h5ads, out, seed=0, n_obs_per_shard=500, progress=False)
    return out


def _all_rows(path: Path) -> np.ndarray:
    ds = AnnBatchDataset(path, selector={"x": A.X}, batch_size=256, return_index=True, seed=3)
    rows = np.concatenate([b["index"].numpy() for b in ds])
    return np.sort(rows)


# --------------------------------------------------------------------------------------
# writer killed with SIGKILL
# --------------------------------------------------------------------------------------

# Runs create_anndata_collection in a child process. Each shard written (zarr.open_group in
# write mode) or bucket frame appended touches a marker file and pauses a little, so the
# test can kill the child at a known phase with a real SIGKILL.
_WRITER_SCRIPT = textwrap.dedent(
    """
    import sys, time, pathlib
    import zarr
    import annbatch_torch as abt

    phase, out, marker, seed = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3]), sys.argv[4]
    inputs = sys.argv[5:]
    count = [0]

    def note():
        count[0] += 1
        marker.write_text(str(count[0]))
        time.sleep(0.15)

    if phase == "shards":
        real_open = zarr.open_group
        def open_group(*a, **k):
            if k.get("mode") == "w":
                note()
            return real_open(*a, **k)
        zarr.open_group = open_group
    else:
        from annbatch_torch.write import buckets as _buckets
        real_append = _buckets.BucketWriter.append
        def append(self, *a, **k):
            real_append(self, *a, **k)
            note()
        _buckets.BucketWriter.append = append
    abt.create_anndata_collection(inputs, out, seed=int(seed), n_obs_per_shard=300,
                                  overwrite=True, progress=False)
    print("FINISHED")
    """
)


def _kill_writer_at(tmp_path: Path, h5ads: list[Path], out: Path, phase: str,
                    after: int, seed: int = 1) -> None:
    script = tmp_path / "writer_child.py"
    script.write_text(_WRITER_SCRIPT)
    marker = tmp_path / f"marker_{phase}"
    marker.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, str(script), phase, str(out), str(marker), str(seed),
         *map(str, h5ads)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            seen = marker.read_text().strip() if marker.exists() else ""
            # (read once: the writer rewrites the marker, a second read may find it empty)
            if seen.isdigit() and int(seen) >= after:
                break
            time.sleep(0.01)
        assert proc.poll() is None, (
            f"the writer ended before the kill: {proc.communicate()[1].decode()[-2000:]}"
        )
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _leftovers(out: Path) -> list[Path]:
    return sorted(p for p in out.parent.iterdir() if p.name.startswith(out.name + "."))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("phase", "after"), [("buckets", 2), ("shards", 3)])
def test_writer_killed_mid_write_leaves_nothing_valid(
    tmp_path: Path, h5ads: list[Path], phase: str, after: int
) -> None:
    out = tmp_path / "store"
    _kill_writer_at(tmp_path, h5ads, out, phase, after)

    # nothing at the output path, and no partial folder that open_collection would accept
    assert not out.exists()
    with pytest.raises(CollectionError, match="no such collection folder"):
        open_collection(out)
    left = _leftovers(out)
    assert left, "expected the killed writer's temporary folder"
    for p in left:
        assert not (p / MANIFEST_NAME).exists()
        with pytest.raises(CollectionError, match=r"manifest\.json is missing"):
            open_collection(p)
        with pytest.raises(CollectionError, match=r"(manifest\.json is missing|neither)"):
            AnnBatchDataset(p)

    # running again succeeds and yields every cell exactly once
    coll = abt.create_anndata_collection(h5ads, out, seed=1, n_obs_per_shard=300,
                                         overwrite=True, progress=False)
    assert coll.n_obs == N_OBS
    np.testing.assert_array_equal(_all_rows(out), np.arange(N_OBS))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_overwrite_killed_mid_write_keeps_the_old_collection(
    tmp_path: Path, h5ads: list[Path]
) -> None:
    out = tmp_path / "store"
    abt.create_anndata_collection(h5ads, out, seed=7, n_obs_per_shard=500, progress=False)
    before = (out / MANIFEST_NAME).read_text()
    _kill_writer_at(tmp_path, h5ads, out, "shards", 3, seed=8)
    # the old store is untouched and still complete: it is removed only after the swap
    assert (out / MANIFEST_NAME).read_text() == before
    assert open_collection(out).manifest.seed == 7
    np.testing.assert_array_equal(_all_rows(out), np.arange(N_OBS))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rerun_removes_what_a_killed_write_left(tmp_path: Path, h5ads: list[Path]) -> None:
    """A killed write can leave a temporary folder as big as the dataset (buckets); the
    next write to the same output removes those of writers that are no longer running."""
    out = tmp_path / "store"
    _kill_writer_at(tmp_path, h5ads, out, "buckets", 2)
    assert _leftovers(out)
    abt.create_anndata_collection(h5ads, out, seed=1, overwrite=True, progress=False)
    assert _leftovers(out) == []


# --------------------------------------------------------------------------------------
# out of disk
# --------------------------------------------------------------------------------------


def _enospc(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["bucket", "shard", "manifest"])
def test_disk_full_leaves_no_output(
    tmp_path: Path, h5ads: list[Path], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    from annbatch_torch.write import buckets as _buckets
    from annbatch_torch.write import shardstore, writer

    if where == "bucket":
        monkeypatch.setattr(_buckets.BucketWriter, "append", _enospc)
    elif where == "shard":
        calls = [0]

        class FullDisk(shardstore.ShardStore):
            def close(self) -> Any:
                calls[0] += 1
                if calls[0] == 3:  # the third shard
                    _enospc()
                return super().close()

        monkeypatch.setattr(shardstore, "ShardStore", FullDisk)  # pass 2 looks it up there
    else:
        monkeypatch.setattr(writer, "write_manifest", _enospc)
    out = tmp_path / "store"
    with pytest.raises(OSError, match="No space left on device") as info:
        abt.create_anndata_collection(h5ads, out, seed=0, n_obs_per_shard=500, progress=False)
    assert info.value.errno == errno.ENOSPC
    assert not out.exists()
    assert _leftovers(out) == []  # the temporary folder is removed too
    with pytest.raises(CollectionError):
        open_collection(out)


def test_disk_full_during_overwrite_keeps_the_old_collection(
    tmp_path: Path, h5ads: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from annbatch_torch.write import writer

    out = tmp_path / "store"
    abt.create_anndata_collection(h5ads, out, seed=5, n_obs_per_shard=500, progress=False)
    before = (out / MANIFEST_NAME).read_text()
    monkeypatch.setattr(writer, "write_manifest", _enospc)
    with pytest.raises(OSError, match="No space left"):
        abt.create_anndata_collection(h5ads, out, seed=6, overwrite=True, progress=False)
    assert (out / MANIFEST_NAME).read_text() == before
    assert _leftovers(out) == []
    assert open_collection(out).manifest.seed == 5


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Any:
    """A 2 MiB tmpfs (needs root and mount permission; skipped otherwise)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_real_full_disk_leaves_no_output(tiny_tmpfs: Path, h5ads: list[Path],
                                         tmp_path: Path) -> None:
    big = tmp_path / "big.h5ad"
    rng = np.random.default_rng(0)
    x = sp.random(6000, 400, density=0.2, format="csr", dtype=np.float32, random_state=rng)
    ad.AnnData(x, obs=pd.DataFrame(index=[f"c{i}" for i in range(6000)]),
               var=pd.DataFrame(index=[f"g{i}" for i in range(400)])).write_h5ad(big)
    out = tiny_tmpfs / "store"
    with pytest.raises(OSError) as info:  # noqa: PT011 - the errno is checked below
        abt.create_anndata_collection([big], out, seed=0, progress=False, compressor="none")
    assert info.value.errno == errno.ENOSPC or "No space left" in str(info.value)
    assert not out.exists()
    assert list(tiny_tmpfs.iterdir()) == []  # nothing partial, the space is given back


# --------------------------------------------------------------------------------------
# errors inside DataLoader workers
# --------------------------------------------------------------------------------------


def _loader(source: Any, num_workers: int = 2, timeout: float = 30, **kwargs: Any) -> DataLoader:
    kwargs.setdefault("selector", {"x": A.X, "ct": A.obs["cell_type"]})
    ds = AnnBatchDataset(source, batch_size=64, chunk_size=32, preload_nchunks=4, seed=0,
                         **kwargs)
    return DataLoader(ds, batch_size=None, num_workers=num_workers,
                      timeout=timeout if num_workers else 0)


def _copy(collection: Path, tmp_path: Path) -> Path:
    out = tmp_path / "store"
    shutil.copytree(collection, out)
    return out


@pytest.mark.timeout(120)
def test_corrupted_chunk_reaches_the_training_loop_with_shard_and_rows(
    collection: Path, tmp_path: Path
) -> None:
    store = _copy(collection, tmp_path)
    shard = json.loads((store / MANIFEST_NAME).read_text())["shards"][2]["path"]
    chunks = sorted(p for p in (store / shard / "X" / "indices").rglob("*")
                    if p.is_file() and p.name != "zarr.json" and not p.name.startswith("."))
    chunks[0].write_bytes(np.random.default_rng(1).bytes(chunks[0].stat().st_size))
    with pytest.raises(ReadError, match=rf"(?s)in DataLoader worker process \d.*"
                       rf"{re.escape(shard)}: failed reading field 'X', shard rows "
                       rf"\[\d+, \d+\) \(shard 2\)"):
        drain(_loader(store))


class _Boom:
    """A transform that fails on the third batch it sees (picklable for workers)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: Any) -> Any:
        self.calls += 1
        if self.calls == 3:
            raise ZeroDivisionError("boom in a user transform")
        return x


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_transform_error_names_field_shard_and_rows(collection: Path, num_workers: int) -> None:
    from annbatch_torch.errors import BatchError

    loader = _loader(collection, num_workers=num_workers,
                     selector={"x": A.X.with_transform(_Boom())})
    with pytest.raises(BatchError, match=r"(?s)transform of selector key 'x' \(field 'X'\) "
                       r"raised ZeroDivisionError: boom in a user transform.*"
                       r"shard_\d+\.zarr rows \[\d+, \d+\)"):
        drain(loader)


def _failing_converter(batch: dict[str, Any]) -> Any:
    raise KeyError("label")


@pytest.mark.timeout(120)
def test_converter_error_names_shard_and_rows(collection: Path) -> None:
    from annbatch_torch.errors import BatchError

    loader = _loader(collection, num_workers=2, batch_converter=_failing_converter)
    with pytest.raises(BatchError, match=r"(?s)batch_converter raised KeyError: 'label'.*"
                       r"shard_\d+\.zarr rows \[\d+, \d+\)"):
        drain(loader)


# --------------------------------------------------------------------------------------
# workers that die or stall
# --------------------------------------------------------------------------------------


#: run in a fresh interpreter: torch's SIGCHLD handler reports a dead worker again at any
#: later moment while the iterator is registered, which inside pytest's own process once
#: surfaced as an INTERNALERROR after the test; the child is the "main process" here
_KILL_SCENARIO = r"""
import faulthandler, json, os, re, signal, sys, time
# a hang (the scenario takes 5-10 s) fails the test in 60 s with every thread's stack
faulthandler.dump_traceback_later(60, exit=True)
from torch.utils.data import DataLoader
from torch.utils.data._utils import signal_handling
from annbatch_torch import A, AnnBatchDataset

ds = AnnBatchDataset(sys.argv[1], selector={"x": A.X, "ct": A.obs["cell_type"]},
                     batch_size=64, chunk_size=32, preload_nchunks=4, seed=0)
it = iter(DataLoader(ds, batch_size=None, num_workers=2, timeout=20))
next(it)
victim = it._workers[0].pid
caught = []

def unregister():
    if it._worker_pids_set:
        signal_handling._remove_worker_pids(id(it))
        it._worker_pids_set = False

t0 = time.monotonic()
try:
    try:
        os.kill(victim, signal.SIGKILL)
        # usually torch's worker watchdog reports the death; a batch the dead worker had
        # already queued cannot be received either (its tensors' file descriptors were
        # served by that process): that read fails first with ConnectionResetError, or
        # EOFError when the worker died while serving it
        for _ in it:
            pass
    except (RuntimeError, ConnectionError, EOFError) as e:
        caught.append(e)
        unregister()
except (RuntimeError, ConnectionError, EOFError) as e:  # a second report while handling
    caught.append(e)
    unregister()
unregister()
elapsed = time.monotonic() - t0
it._shutdown_workers()
print(json.dumps({"victim": victim, "elapsed": elapsed,
                  "caught": [[type(e).__name__, str(e)] for e in caught]}))
"""


@pytest.mark.timeout(120)
def test_worker_killed_mid_epoch_raises_in_the_main_process(collection: Path) -> None:
    r = subprocess.run([sys.executable, "-c", _KILL_SCENARIO, str(collection)],
                       capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-6000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["caught"], "the loop ended without an error although a worker was killed"
    assert out["elapsed"] < 20 + 10  # within the DataLoader timeout (plus slack)
    runtime = [msg for kind, msg in out["caught"] if kind == "RuntimeError"]
    for msg in runtime:
        assert re.search(rf"DataLoader worker \(pid\(?s?\)? .*{out['victim']}.*\) (is killed by "
                         r"signal|exited unexpectedly)", msg), msg


def _stall(x: Any) -> Any:
    time.sleep(3600)
    return x


@pytest.mark.timeout(120)
def test_stalled_worker_hits_the_dataloader_timeout(collection: Path) -> None:
    loader = _loader(collection, num_workers=1, timeout=2,
                     selector={"x": A.X.with_transform(_stall)})
    it = iter(loader)
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"DataLoader timed out after 2 seconds"):
            next(it)
        assert time.monotonic() - t0 < 30
    finally:
        # joins, then terminates the stalled worker (unregistered first, so the DataLoader's
        # SIGCHLD handler does not report it); torch joins for MP_STATUS_CHECK_INTERVAL
        # (5 s, read at the call), which a worker asleep for an hour only makes wait
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
            it._shutdown_workers()  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_shard_deleted_while_workers_run(collection: Path, tmp_path: Path) -> None:
    """Files vanishing under a running loader: an error with the shard, never a hang."""
    store = _copy(collection, tmp_path)
    loader = _loader(store, num_workers=2, timeout=30, prefetch=False)
    it = iter(loader)
    next(it)
    for s in json.loads((store / MANIFEST_NAME).read_text())["shards"]:
        shutil.rmtree(store / s["path"])
    with pytest.raises((ReadError, CollectionError), match=r"shard_\d+\.zarr"):
        drain(it)


def test_worker_error_keeps_the_exception_type_for_handlers() -> None:
    """Our errors survive the DataLoader's re-raise (one-argument constructors)."""
    from torch._utils import ExceptionWrapper

    from annbatch_torch.errors import BatchError

    for cls in (ReadError, CollectionError, BatchError):
        try:
            raise cls("shard_00001.zarr rows [0, 64)")
        except cls:
            wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
        with pytest.raises(cls, match=r"shard_00001\.zarr rows \[0, 64\)"):
            wrapped.reraise()
    assert torch.utils.data.get_worker_info() is None
