"""The writer on Dask (``scheduler=``): shards equal to the serial writer's, for h5ad and zarr
inputs, sparse and dense X, both joins; a worker SIGKILLed mid-task; a failing task."""

from __future__ import annotations

import os
import signal
import threading
import time
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
from annbatch_torch import InputError

distributed = pytest.importorskip("distributed")

import dask_helpers  # noqa: E402

SHARD = 1024  # several shards from a few thousand cells


@pytest.fixture(scope="module")
def client() -> Any:
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  memory_limit=0, dashboard_address="127.0.0.1:0", host="127.0.0.1",
                                  silence_logs=40) as cluster, distributed.Client(cluster) as c:
        yield c


def _inputs(folder: Path, dense: bool, zarr: bool) -> list[Path]:
    """Two inputs with partly different genes, obs categories, a layer and an obsm."""
    rng = np.random.default_rng(0)
    paths = []
    for k, (n, genes) in enumerate([(2500, range(0, 60)), (1800, range(10, 70))]):
        x = sp.random(n, len(genes), density=0.2, format="csr", dtype=np.float32,
                      random_state=rng)
        a = ad.AnnData(x.toarray() if dense else x,
                       obs=pd.DataFrame({"cell_type": pd.Categorical(
                           rng.choice([f"t{i}" for i in range(3 + k)], n)),
                           "depth": rng.random(n)}, index=[f"i{k}_c{i}" for i in range(n)]),
                       var=pd.DataFrame(index=[f"g{g}" for g in genes]))
        a.layers["counts"] = x.copy()
        a.obsm["X_pca"] = rng.random((n, 5)).astype(np.float32)
        p = folder / (f"in{k}.zarr" if zarr else f"in{k}.h5ad")
        a.write_zarr(p) if zarr else a.write_h5ad(p)
        paths.append(p)
    return paths


def _same_shards(a: abt.Collection, b: abt.Collection) -> None:
    assert [s.path for s in a.manifest.shards] == [s.path for s in b.manifest.shards]
    assert [s.n_obs for s in a.manifest.shards] == [s.n_obs for s in b.manifest.shards]
    assert a.manifest.fields == b.manifest.fields
    for s in a.manifest.shards:
        x, y = ad.read_zarr(a.path / s.path), ad.read_zarr(b.path / s.path)
        assert list(x.obs_names) == list(y.obs_names)
        pd.testing.assert_frame_equal(x.obs, y.obs)
        for m, n in [(x.X, y.X), (x.layers["counts"], y.layers["counts"])]:
            assert m.shape == n.shape
            assert (sp.csr_matrix(m) != sp.csr_matrix(n)).nnz == 0
        np.testing.assert_array_equal(x.obsm["X_pca"], y.obsm["X_pca"])


@pytest.mark.parametrize(("dense", "zarr", "join"), [(False, False, "inner"),
                                                     (True, True, "outer"),
                                                     (False, True, "outer"),
                                                     (True, False, "inner")])
def test_parallel_equals_serial(client: Any, tmp_path: Path, dense: bool, zarr: bool,
                                join: str) -> None:
    paths = _inputs(tmp_path, dense, zarr)
    kw: dict[str, Any] = dict(seed=4, var_join=join, n_obs_per_shard=SHARD, progress=False,
                              layers=["counts"], obsm=["X_pca"])
    serial = abt.create_anndata_collection(paths, tmp_path / "serial", **kw)
    par = abt.create_anndata_collection(paths, tmp_path / "par", scheduler=client, **kw)
    assert len(serial.manifest.shards) == 5
    _same_shards(serial, par)
    assert not list(tmp_path.glob("par.tmp-*"))


def test_local_processes_and_threads(tmp_path: Path) -> None:
    paths = _inputs(tmp_path, False, False)
    kw: dict[str, Any] = dict(seed=1, n_obs_per_shard=SHARD, progress=False)
    serial = abt.create_anndata_collection(paths, tmp_path / "serial", **kw)
    procs = abt.create_anndata_collection(paths, tmp_path / "procs", scheduler="processes",
                                          n_workers=2, **kw)
    _same_shards(serial, procs)
    mem = [ad.read_h5ad(p) for p in paths]  # in memory: threads share it, processes cannot
    threads = abt.create_anndata_collection(mem, tmp_path / "threads", scheduler="threads",
                                            n_workers=2, **kw)
    _same_shards(serial, threads)
    with pytest.raises(InputError, match=r"AnnData in memory.*write it first.*'threads'"):
        abt.create_anndata_collection(mem, tmp_path / "no", scheduler="processes",
                                      n_workers=1, **kw)
    with pytest.raises(InputError, match="scheduler='nope' is unknown"):
        abt.create_anndata_collection(paths, tmp_path / "no", scheduler="nope", **kw)


def test_a_worker_killed_mid_task_is_retried_and_the_result_is_equal(
        client: Any, tmp_path: Path) -> None:
    paths = _inputs(tmp_path, False, False)
    kw: dict[str, Any] = dict(seed=2, n_obs_per_shard=SHARD, progress=False)
    serial = abt.create_anndata_collection(paths, tmp_path / "serial", **kw)
    marks = tmp_path / "marks"
    marks.mkdir()
    killed: list[int] = []

    def killer() -> None:  # SIGKILL the first worker caught inside a task
        deadline = time.time() + 60
        while time.time() < deadline and not killed:
            for m in marks.glob("started-*"):
                pid = int(m.name.split("-")[1])
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                break
            time.sleep(0.05)

    t = threading.Thread(target=killer)
    t.start()
    par = abt.create_anndata_collection(
        paths, tmp_path / "par", scheduler=client,
        value_check=dask_helpers.SlowFirstBlock(str(marks), 3.0), **kw)
    t.join()
    assert killed, "no worker was killed: the test did not test anything"
    _same_shards(serial, par)
    assert not [p for p in os.listdir(par.path) if ".part-" in p]  # no half-written leftovers
    client.wait_for_workers(2, timeout=60)  # the nanny restarted it


def test_a_failing_task_fails_the_write_and_leaves_nothing(client: Any, tmp_path: Path) -> None:
    paths = _inputs(tmp_path, False, False)
    kw: dict[str, Any] = dict(seed=2, n_obs_per_shard=SHARD, progress=False)
    with pytest.raises(Exception, match=r"in1\.h5ad: X has values this test refuses"):
        abt.create_anndata_collection(paths, tmp_path / "par", scheduler=client,
                                      value_check=dask_helpers.RejectInput("in1.h5ad"), **kw)
    time.sleep(1.0)  # no task writes on after the call returned
    assert not (tmp_path / "par").exists()
    assert not list(tmp_path.glob("par.tmp-*"))
    # cleanly restartable: the same call again, without the refusal
    par = abt.create_anndata_collection(paths, tmp_path / "par", scheduler=client, **kw)
    _same_shards(abt.create_anndata_collection(paths, tmp_path / "serial", **kw), par)


def test_tasks_run_again_change_nothing(tmp_path: Path) -> None:
    """What Dask does after a worker died: a pass-1 task run again (its first result lost,
    or its first run killed halfway, leaving a part folder) and a pass-2 shard written again
    give the same buckets and the same shard."""
    from annbatch_torch.store.inputs.plan import open_inputs
    from annbatch_torch.write import parallel
    from annbatch_torch.write.buckets import load_bucket
    from annbatch_torch.write.schema import resolve_schema

    paths = _inputs(tmp_path, False, False)
    sources = open_inputs(paths)
    schema = resolve_schema(sources, "inner", None, None, None)
    tasks = parallel.pass1_tasks([s.n_obs for s in sources], 2)
    assert len(tasks) >= 8  # about four per worker
    layout, work = (SHARD, 512), 64 << 20
    dest = np.random.default_rng(0).permutation(sum(s.n_obs for s in sources))
    folder = tmp_path / "tmp" / ".buckets"
    folder.mkdir(parents=True)
    t = tasks[3]
    args = (t, [paths[p.source] for p in t.pieces],
            [dest[p.offset + p.start: p.offset + p.stop] for p in t.pieces], schema, layout,
            work, str(folder), None)
    parallel.route_task(*args)
    first = {p.name: load_bucket(p, parallel.segments_of(schema))
             for p in sorted((folder / "t00003").iterdir())}
    (folder / "t00003.part-dead").mkdir()  # a run killed halfway
    (folder / "t00003.part-dead" / "bucket_00000.bin").write_bytes(b"half a frame")
    parallel.route_task(*args)  # run again: the first result stands
    again = {p.name: load_bucket(p, parallel.segments_of(schema))
             for p in sorted((folder / "t00003").iterdir())}
    assert first.keys() == again.keys()
    assert first
    for name in first:
        for key in first[name]:
            np.testing.assert_array_equal(first[name][key], again[name][key])
    assert sorted(p.name for p in folder.iterdir()) == ["t00003", "t00003.part-dead"]
    for task in tasks:
        if task.task != 3:
            parallel.route_task(task, [paths[p.source] for p in task.pieces],
                                [dest[p.offset + p.start: p.offset + p.stop]
                                 for p in task.pieces], schema, layout, work, str(folder), None)
    dirs = [str(folder / f"t{task.task:05d}") for task in tasks]
    opts = {"zarr_format": 3, "chunk_elems": 1 << 16, "shard_elems": None, "compressors": None}
    info, dtypes = parallel.write_shard(1, SHARD, str(folder.parent), dirs, schema, layout, opts)
    shard = ad.read_zarr(folder.parent / info.path)
    assert shard.n_obs == SHARD
    # written again after its buckets are gone: the record says it is done
    assert parallel.write_shard(1, SHARD, str(folder.parent), dirs, schema, layout,
                                opts) == (info, dtypes)
    for s in sources:
        s.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=40), st.integers(1, 8))
def test_pass1_tasks_cover_every_row_once_in_tasks_of_about_equal_size(
        n_obs: list[int], workers: int) -> None:
    """Large inputs in pieces, small ones taken together: every row of every input in
    exactly one piece, in order; no task much larger than the others; and no more tasks
    than about four per worker (a hundred small inputs are not a hundred tasks)."""
    from annbatch_torch.write.parallel import TASKS_PER_WORKER, pass1_tasks

    tasks = pass1_tasks(n_obs, workers)
    total = sum(n_obs)
    size = -(-total // (TASKS_PER_WORKER * workers)) if total else 1
    assert [t.task for t in tasks] == list(range(len(tasks)))
    assert len(tasks) <= -(-total // size)
    offsets = np.concatenate([[0], np.cumsum(n_obs)])
    seen = [p for t in tasks for p in t.pieces]
    for t in tasks:
        assert t.pieces
        assert sum(p.stop - p.start for p in t.pieces) <= size
    got: dict[int, list[tuple[int, int]]] = {}
    for p in seen:
        assert p.offset == offsets[p.source]
        assert 0 <= p.start < p.stop <= n_obs[p.source]
        got.setdefault(p.source, []).append((p.start, p.stop))
    for i, n in enumerate(n_obs):
        spans = got.get(i, [])
        if not n:
            assert not spans  # an input without rows takes no part
            continue
        assert [a for a, _ in spans] == [0] + [b for _, b in spans[:-1]]  # contiguous
        assert spans[-1][1] == n


def test_a_routing_task_opens_inputs_without_reading_their_genes(tmp_path: Path) -> None:
    """The parallel writer's pass-1 tasks open inputs ``lean``: the gene names (tens of
    thousands of strings per input, read and checked by the caller already) are read only
    if asked for."""
    from annbatch_torch.store.inputs.view import open_input

    path = _inputs(tmp_path, False, False)[0]
    full, lean = open_input(path, 0), open_input(path, 0, lean=True)
    try:
        assert lean._var_names is None
        assert lean.n_obs == full.n_obs
        assert lean.matrices == full.matrices
        np.testing.assert_array_equal(lean.var_names, full.var_names)  # read when asked
    finally:
        full.close()
        lean.close()


def _dask_leftovers(before: set[int]) -> tuple[list[str], list[int]]:
    """Threads of the writer's cluster start and stop still alive, and child processes
    (not ``before``, not multiprocessing's resource tracker) still running after 30 s."""
    import psutil

    threads = [t.name for t in threading.enumerate() if t.name.startswith("annbatch-dask")]
    kids = [p for p in psutil.Process().children(recursive=True) if p.pid not in before
            and "resource_tracker" not in " ".join(p.cmdline())]
    _, alive = psutil.wait_procs(kids, timeout=30)
    return threads, [p.pid for p in alive]


def test_a_local_cluster_is_checked_first_and_stopped_however_the_write_ends(
        tmp_path: Path) -> None:
    """The cluster starts while the inputs are opened: its settings are refused before an
    input is looked at, and it is stopped when an input fails meanwhile and after a write."""
    import psutil

    paths = _inputs(tmp_path, False, False)
    gone = tmp_path / "gone.h5ad"
    with pytest.raises(InputError, match="scheduler='nope' is unknown"):
        abt.create_anndata_collection([gone], tmp_path / "no", scheduler="nope")
    with pytest.raises(InputError, match="n_workers"):
        abt.create_anndata_collection([gone], tmp_path / "no", scheduler="processes",
                                      n_workers=0)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(InputError, match=r"gone\.h5ad: no such file"):
        abt.create_anndata_collection([paths[0], gone], tmp_path / "no",
                                      scheduler="processes", n_workers=2, progress=False)
    assert _dask_leftovers(before) == ([], [])
    kw: dict[str, Any] = dict(seed=1, n_obs_per_shard=SHARD, progress=False)
    for scheduler in ("processes", "threads"):
        par = abt.create_anndata_collection(paths, tmp_path / scheduler, scheduler=scheduler,
                                            n_workers=2, **kw)
        assert par.n_obs == 4300
        assert _dask_leftovers(before) == ([], []), scheduler
    assert not (tmp_path / "no").exists()
    # an append starts its cluster the same way
    (tmp_path / "more").mkdir()
    more = _inputs(tmp_path / "more", False, False)[:1]
    with pytest.raises(InputError, match=r"gone\.h5ad: no such file"):
        abt.append_to_collection(tmp_path / "processes", [*more, gone], scheduler="processes",
                                 n_workers=2, progress=False)
    assert _dask_leftovers(before) == ([], [])
    grown = abt.append_to_collection(tmp_path / "processes", more, scheduler="processes",
                                     n_workers=2, progress=False)
    assert grown.n_obs == 4300 + 2500
    assert _dask_leftovers(before) == ([], [])


def _worker_modules() -> list[bool]:
    # (anndata is not asked about: this module, imported in the worker to run this
    # function, imports it)
    import sys

    from annbatch_torch.write import remap

    return ["colorsys" in sys.modules, bool(remap._remap.signatures)]


def test_a_local_clusters_workers_load_the_passes_imports_as_they_start() -> None:
    """Each worker process of a local 'processes' cluster loads the compiled remap (and
    imports anndata) as it starts (``parallel.dask_setup``, a Dask preload), after the
    preloads the user configured (here the stdlib's colorsys, which nothing imports)."""
    import dask

    from annbatch_torch.write.parallel import _local_cluster

    with dask.config.set({"distributed.worker.preload": ["colorsys"],
                          "distributed.worker.multiprocessing-method": "spawn"}):
        cluster = _local_cluster(distributed, True, 1)
    try:
        with distributed.Client(cluster) as c:
            [loaded] = c.run(_worker_modules).values()
    finally:
        cluster.close()
    assert loaded == [True, True]
