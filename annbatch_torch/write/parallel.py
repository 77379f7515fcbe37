"""The writer's two passes as tasks on Dask: ``create_anndata_collection(scheduler=...)``.

The serial writer (:mod:`.writer`) runs pass 1 input by input and pass 2 shard by shard in
one process. Both passes are parallel by nature, and here they run as tasks on a Dask
``distributed`` scheduler: a ``LocalCluster`` this module starts (``"processes"``,
``"threads"``) or the caller's ``Client`` (a cluster whose workers share the file system
holding the inputs and the output).

* **Pass 1** is cut into tasks of about equal rows (:func:`pass1_tasks`: about four per
  worker; a large input in pieces, small ones together). A task routes its rows (the very
  :func:`~.passes.route_block` of the serial writer, positions from the one permutation
  the caller drew) into bucket files of its own
  (``.buckets/t<task>/``), written in a part folder renamed into place when the task is done:
  a task run again after its worker died starts afresh, and pass 2 never sees half a task.
* **Pass 2** is one task per shard: it reads the shard's buckets from every pass-1 task's
  folder (:func:`~.buckets.load_bucket` over several files), puts rows in position order
  and writes the shard into a part folder renamed into place, then records it done
  (``.buckets/<shard>.done.json``) and deletes its buckets; run again, a done shard is
  returned as it is.

Rows land at the positions the permutation gives whichever task routes them and in
whichever order, so the shards equal the serial writer's array for array.

Memory: every task sizes its blocks from the working memory the caller computed from
``max_memory``, so ``max_memory`` bounds each worker process (about its own baseline plus
the buffers, as in the serial writer); ``n_workers`` processes take up to ``n_workers x
max_memory`` in all.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..errors import CollectionError, InputError, check_int
from ..store.inputs.view import InputSource, open_input
from ..store.manifest import ShardInfo
from .buckets import BucketSegment, BucketWriter, bucket_id, bucket_segments
from .narrow import ValueRange
from .passes import route_rows, write_shard_blocks
from .publish import start_writeback
from .remap import load_remap, usable_cpus
from .schema import Schema
from .shardstore import stored_arrays

__all__ = ["ClusterStart", "InputPiece", "Pass1Task", "pass1_tasks", "run_parallel",
           "open_scheduler", "start_cluster", "SCHEDULERS"]

logger = logging.getLogger(__name__)

#: names of the local schedulers ``create_anndata_collection(scheduler=...)`` starts
SCHEDULERS = ("processes", "threads")
#: a file in the bucket folder that tells the tasks still to run that the write failed
ABANDONED = ".abandoned"
#: seconds between looks at the cluster while no task ends
POLL_S = 2.0
#: seconds slept between checks for ended tasks (a done task waits at most this long)
IDLE_SLEEP_S = 0.02
#: seconds a cluster started here may have no workers before the write fails
NO_WORKERS_GRACE_S = 30.0
#: ... and a caller's cluster (an adaptive one scales up from none)
NO_WORKERS_GRACE_CLIENT_S = 600.0
#: seconds the tasks of a failed write get to see the abandon marker and stop
ABANDON_WAIT_S = 300
#: pass-1 tasks per worker: enough to balance inputs of unequal size, few enough that the
#: bucket files (tasks x buckets) stay few
TASKS_PER_WORKER = 4


class InputPiece(NamedTuple):
    """Rows ``[start, stop)`` of input ``source``; ``offset``: the global input row of its
    row 0 (the permutation is indexed by global input rows)."""

    source: int
    start: int
    stop: int
    offset: int


class Pass1Task(NamedTuple):
    """Pass-1 task ``task``: its pieces of inputs, routed into one set of bucket files."""

    task: int
    pieces: tuple[InputPiece, ...]

    @property
    def sources(self) -> list[int]:
        """The inputs it reads, in order."""
        return list(dict.fromkeys(p.source for p in self.pieces))


def pass1_tasks(n_obs: Sequence[int], n_workers: int) -> list[Pass1Task]:
    """Pass-1 tasks of inputs of ``n_obs`` rows, of about ``total / (TASKS_PER_WORKER *
    n_workers)`` rows each: a larger input cut into pieces, smaller ones taken together
    (consecutive inputs until the task is full: an atlas's hundred inputs make a few tasks,
    not a hundred, and so a few bucket files per bucket for pass 2 to read). An input with
    no rows takes no part."""
    total = sum(n_obs)
    size = max(1, -(-total // (TASKS_PER_WORKER * max(1, n_workers))))
    tasks: list[Pass1Task] = []
    pieces: list[InputPiece] = []
    rows = offset = 0
    for i, n in enumerate(n_obs):
        a = 0
        while a < n:
            b = min(n, a + size - rows)
            pieces.append(InputPiece(i, a, b, offset))
            rows += b - a
            a = b
            if rows >= size:
                tasks.append(Pass1Task(len(tasks), tuple(pieces)))
                pieces, rows = [], 0
        offset += n
    if pieces:
        tasks.append(Pass1Task(len(tasks), tuple(pieces)))
    return tasks


class ClusterStart:
    """A local Dask cluster (``"processes"`` or ``"threads"`` of ``n_workers``) started in a
    thread of its own, so that its start (worker processes importing the library) runs
    while the writer opens its inputs. The scheduler's name and ``n_workers`` are checked
    here, before any of that work. :meth:`cluster` waits for it; :meth:`close` stops it
    (again: nothing)."""

    def __init__(self, scheduler: str, n_workers: int | None) -> None:
        distributed = _distributed(scheduler)
        if scheduler not in SCHEDULERS:
            raise InputError(
                f"scheduler={scheduler!r} is unknown: use None (one process), 'processes' or "
                "'threads' (a local Dask cluster of n_workers), or a dask.distributed.Client.")
        if n_workers is None:
            n_workers = usable_cpus()
        self.name = scheduler
        self.n_workers = check_int("n_workers", n_workers, 1, error=InputError)
        self._cluster: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, args=(distributed,),
                                        name="annbatch-dask-start", daemon=True)
        self._thread.start()

    def _start(self, distributed: Any) -> None:
        import dask

        # dask's default MALLOC_TRIM_THRESHOLD_ in workers turns every large numpy buffer
        # into an mmap and munmap (fresh page faults each block); the writer trims memory
        # and workers spawned, never forked: this process's main thread is inside h5py
        # (opening the inputs) while the cluster starts
        try:
            with dask.config.set(
                    {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
                     "distributed.worker.multiprocessing-method": "spawn"}):
                self._cluster = _local_cluster(distributed, self.name == "processes",
                                               self.n_workers)
        except BaseException as e:  # raised where the cluster is asked for
            self._error = e

    def cluster(self) -> Any:
        """The started cluster (waits for its start; raises what the start raised)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._cluster

    def close_soon(self) -> None:
        """Begin stopping the cluster in a thread (its workers' exit then overlaps what the
        writer does next); :meth:`close` waits for it."""
        if self._thread.is_alive() or self._cluster is None:
            return  # still starting (an error on the way): close() stops it
        closing = threading.Thread(target=self.close, name="annbatch-dask-close",
                                   daemon=True)
        closing.start()
        self._thread = closing

    def close(self) -> None:
        """Stop the cluster (after its start or a :meth:`close_soon`, if one still runs).
        A failure to stop it is logged, never raised: this runs where a write is cleaning
        up, whose own error matters more."""
        if self._thread is not threading.current_thread():
            self._thread.join()
        cluster, self._cluster = self._cluster, None
        if cluster is None:
            return
        try:
            cluster.close()
        except Exception as e:
            logger.warning("The local Dask cluster of the write did not stop cleanly (%s: %s); "
                           "its worker processes may linger.", type(e).__name__, e)


def start_cluster(scheduler: Any, n_workers: int | None) -> ClusterStart | None:
    """A :class:`ClusterStart` of the local scheduler ``scheduler`` names (refused here when
    it names none); ``None`` for ``None`` (the serial writer) and for a caller's ``Client``
    (started already)."""
    if scheduler is None or isinstance(scheduler, _distributed(scheduler).Client):
        return None
    return ClusterStart(scheduler, n_workers)


def _distributed(scheduler: Any) -> Any:
    try:
        import distributed
    except ImportError as e:
        raise InputError(
            f"scheduler={scheduler!r} needs Dask: pip install 'annbatch-torch[dask]' (dask and "
            "distributed); or leave scheduler=None for the single-process writer.") from e
    return distributed


@contextlib.contextmanager
def open_scheduler(scheduler: Any) -> Iterator[tuple[Any, int]]:
    """``(client, workers)`` of ``scheduler`` (:func:`start_cluster`'s): the cluster of a
    :class:`ClusterStart`, whose stop begins on the way out (its owner's
    :meth:`ClusterStart.close` waits for it), or the caller's ``distributed.Client`` as
    it is."""
    distributed = _distributed(scheduler)
    if not isinstance(scheduler, ClusterStart):
        workers = len(scheduler.scheduler_info().get("workers", {})) or 1
        yield scheduler, workers
        return
    try:
        with distributed.Client(scheduler.cluster()) as client:
            yield client, scheduler.n_workers
    finally:
        scheduler.close_soon()


def _local_cluster(distributed: Any, procs: bool, n_workers: int) -> Any:
    """A LocalCluster on loopback only (threads: in this process); its worker processes
    run :func:`dask_setup` as they start, after the preloads the user configured."""
    import dask

    preload = [*(dask.config.get("distributed.worker.preload", None) or []), __name__]
    return distributed.LocalCluster(
        n_workers=n_workers if procs else 1, threads_per_worker=1 if procs else n_workers,
        processes=procs, memory_limit=0, dashboard_address="127.0.0.1:0",
        silence_logs=logging.ERROR,
        **({"host": "127.0.0.1", "preload": preload} if procs else {}))


def dask_setup(worker: Any) -> None:
    """Dask's preload hook, run by each worker process of a local ``"processes"`` cluster
    as it starts (:func:`_local_cluster`): it loads what the first task of each pass would
    load (anndata's element writer, which imports dask.array, for the shards; the compiled
    gene remap for pass 1), so that this runs beside the caller's opening of the inputs
    instead of inside the first tasks. A failure here is left to the task that meets it."""
    try:
        import anndata.io  # noqa: F401
    except Exception:
        logger.debug("importing anndata ahead in a worker failed", exc_info=True)
    load_remap()


# --------------------------------------------------------------------------- tasks


def _source(obj: Any, index: int) -> InputSource:
    return obj if isinstance(obj, InputSource) else open_input(obj, index, lean=True)


def route_task(task: Pass1Task, objs: Sequence[Any], dests: Sequence[np.ndarray | None],
               schema: Schema, layout: tuple[int, int], work: int, folder: str,
               value_check: Any) -> tuple[dict[str, str], dict[str, ValueRange]]:
    """Pass 1 for one task: its pieces' rows (``objs[k]`` the input of piece ``k``, a path
    or an open source; ``dests[k]`` its rows' positions) into ``folder/t<task>`` (renamed
    into place when done). Returns the fields it found bad values in (``Schema.dropped``)
    and what it saw of each CSR field's values (``Schema.ranges``)."""
    schema = copy.copy(schema)  # drops and value ranges are this task's, reported back
    schema.dropped, schema.unavailable = dict(schema.dropped), dict(schema.unavailable)
    schema.ranges = {}  # per (field, shard)
    final = Path(folder) / f"t{task.task:05d}"
    part = final.with_name(f"{final.name}.part-{secrets.token_hex(4)}")
    buckets = BucketWriter(part, segments_of(schema))
    abandoned = Path(folder) / ABANDONED
    done = True
    try:
        for p, obj, dest in zip(task.pieces, objs, dests):
            src = _source(obj, p.source)
            try:
                done = route_rows(src, schema, (p.start, p.stop), dest, p.offset, layout,
                                  work, buckets, value_check, stop_if=abandoned.exists)
            finally:
                if src is not obj:
                    src.close()
            if not done:
                break
    finally:
        buckets.close()
    if not done:  # the write failed elsewhere
        return {}, {}
    try:
        os.rename(part, final)
    except OSError:  # an earlier run of this task finished it: the same rows
        shutil.rmtree(part, ignore_errors=True)
    return dict(schema.dropped), schema.ranges


def segments_of(schema: Schema) -> list[BucketSegment]:
    """The bucket frame layout of ``schema`` (every field, dropped ones as placeholders)."""
    return bucket_segments(schema.fields)


def write_shard(shard: int, n: int, tmp: str, task_dirs: Sequence[str], schema: Schema,
                layout: tuple[int, int], opts: dict[str, Any], first_shard: int = 0,
                stored: dict[str, tuple[np.dtype, np.dtype]] | None = None
                ) -> tuple[ShardInfo, dict[str, str]]:
    """Pass 2 for shard ``shard`` of ``n`` rows (its CSR fields stored as ``stored``
    says, ``Schema.stored_in``): its buckets from every pass-1 task into
    ``tmp/shard_<first_shard + shard>.zarr`` (a part folder renamed into place), recorded
    done, its buckets deleted. Returns its :class:`ShardInfo` and the stored dtypes."""
    shard_obs, block_obs = layout
    name = f"shard_{first_shard + shard:05d}.zarr"
    done = Path(tmp) / ".buckets" / f"{name}.done.json"
    if (Path(tmp) / ".buckets" / ABANDONED).exists():  # the write failed elsewhere
        return ShardInfo(name, 0), {}
    if done.exists():  # an earlier run finished it
        dtypes = json.loads(done.read_text())["dtypes"]
        return ShardInfo(name, n, stored=stored_arrays(dtypes, schema.kept)), dtypes
    paths = [[Path(d) / f"bucket_{bucket_id(shard, j, shard_obs, block_obs):05d}.bin"
              for d in task_dirs] for j in range(-(-n // block_obs))]
    final = Path(tmp) / name
    # under .buckets (removed with it): a part left by a killed run is never published
    part = Path(tmp) / ".buckets" / f"{name}.part-{secrets.token_hex(4)}"
    dtypes = write_shard_blocks(part, n, paths, schema, layout, opts, f"{tmp}: shard {shard}",
                                stored=stored or {})
    start_writeback(part)  # on the disk while other tasks run (the driver's fsync then waits less)
    if final.exists():  # a run that died between its rename and its record: the same shard
        shutil.rmtree(final)
    os.rename(part, final)
    note = done.with_suffix(".tmp")
    note.write_text(json.dumps({"dtypes": dtypes}))
    os.replace(note, done)
    for p in paths:
        for f in p:
            with contextlib.suppress(FileNotFoundError):
                os.remove(f)
    return ShardInfo(name, n, stored=stored_arrays(dtypes, schema.kept)), dtypes


# --------------------------------------------------------------------------- driver


def _describe(task: Pass1Task | int, sources: Sequence[InputSource]) -> str:
    if isinstance(task, int):
        return f"pass 2, shard {task}"
    parts = [f"rows [{p.start}, {p.stop}) of {sources[p.source].label}"
             for p in task.pieces[:3]]
    more = len(task.pieces) - len(parts)
    return "pass 1, " + ", ".join(parts) + (f" and {more} more input(s)" if more else "")


def _run(client: Any, calls: list[tuple[str, Any, tuple]], bar: Any, abandon: Path,
         no_workers_grace: float, started_here: bool = False) -> list[Any]:
    """Submit ``(description, fn, args)`` calls, wait for all (the bar moves as each one
    ends), return their results in order; at the first failure the rest are told to stop
    (the file ``abandon``), waited for, and the failure is raised.

    The wait is bounded whatever the cluster does: a cluster left without workers for
    ``no_workers_grace`` seconds (a LocalCluster's nannies give up restarting workers that
    die on every try of a task) fails the write, naming the tasks still pending, instead of
    waiting for workers that never come. ``started_here``: the cluster is one this write
    started (it had workers).
    """
    import distributed

    futures = [client.submit(fn, *args, pure=False, key=f"annbatch-{secrets.token_hex(6)}")
               for _, fn, args in calls]
    index = {f.key: i for i, f in enumerate(futures)}
    results: list[Any] = [None] * len(futures)
    watch = _WorkerWatch(client, no_workers_grace, started_here)
    try:
        ended = distributed.as_completed(futures)
        idle_since = time.monotonic()
        while not ended.is_empty():
            done = ended.next_batch(block=False)
            if not done:  # nothing ended: look at the cluster every POLL_S seconds
                if time.monotonic() - idle_since >= POLL_S:
                    watch.check([calls[index[f.key]][0] for f in futures if not f.done()])
                    idle_since = time.monotonic()
                time.sleep(IDLE_SLEEP_S)
                continue
            idle_since = time.monotonic()
            for fut in sorted(done, key=lambda f: index[f.key]):
                results[index[fut.key]] = _result(distributed, fut, calls[index[fut.key]][0],
                                                  watch)
                bar.update(1)
    except _NoWorkers as e:
        abandon.touch()  # a task that still starts somewhere stops at once
        client.cancel(futures)  # nothing runs them: no task can write into the folder
        raise CollectionError(str(e)) from None
    except Exception:
        # a cancelled task that started would run on: the others stop at the marker instead
        # (at their start or their next block), and all are waited for, so that none
        # writes into the temporary folder once the caller removes it
        abandon.touch()
        try:
            distributed.wait(futures, timeout=ABANDON_WAIT_S)
        except TimeoutError:
            logger.warning("%d task(s) of the failed parallel write still ran after %d s; "
                           "cancelled.", sum(not f.done() for f in futures), ABANDON_WAIT_S)
            client.cancel(futures)
        raise
    except BaseException:
        client.cancel(futures)
        raise
    return results


def _result(distributed: Any, fut: Any, what: str, watch: _WorkerWatch) -> Any:
    """``fut``'s result; its failure raised with the task named. A result lost with the
    worker holding it is computed again, so this waits, watched like the tasks."""
    try:
        while True:
            try:
                return fut.result(timeout=POLL_S)
            except TimeoutError:
                watch.check([what])
    except (InputError, CollectionError):
        raise
    except distributed.KilledWorker as e:
        raise CollectionError(
            f"the parallel write lost its workers running {what} (each worker that ran it "
            "died); nothing was published. Rerun it, with more memory per worker if they "
            f"were killed for memory ({e}).") from e
    except Exception as e:  # the task's own error (a value_check's, say), as raised
        e.add_note(f"(annbatch_torch: raised in the parallel write's {what})")
        raise


class _NoWorkers(CollectionError):
    """The cluster had no workers for longer than the grace period."""


class _WorkerWatch:
    """How long the cluster behind ``client`` has had no workers; :meth:`check` fails the
    write once that exceeds ``grace`` seconds. ``started_here``: the write started the
    cluster (its workers were there, whether or not a look saw them)."""

    def __init__(self, client: Any, grace: float, started_here: bool = False) -> None:
        self.client, self.grace = client, grace
        self.since: float | None = None
        self.seen = started_here  # whether any worker was there (at a look, or started)

    def check(self, pending: Sequence[str]) -> None:
        try:
            workers = len(self.client.scheduler_info().get("workers", {}))
        except Exception:  # the scheduler itself is gone
            workers = 0
        if workers:
            self.since, self.seen = None, True
            return
        now = time.monotonic()
        self.since = now if self.since is None else self.since
        if now - self.since >= self.grace:
            shown = ", ".join(pending[:3]) + (f" and {len(pending) - 3} more"
                                              if len(pending) > 3 else "")
            why = ("its workers died (a worker process that dies on every try of a task, "
                   "killed for memory or crashing on one input, makes a LocalCluster give up "
                   "restarting them)" if self.seen
                   else "no worker joined it (an adaptive cluster still waiting for its "
                   "machines?)")
            raise _NoWorkers(
                f"the parallel write's cluster has had no workers for {now - self.since:.0f} s "
                f"with {len(pending)} task(s) pending ({shown}): {why}; nothing was "
                "published. Fix: rerun with more memory per worker (max_memory=), on a "
                "cluster with workers up, or with scheduler=None to see a failing input's "
                "own error in this process.")


def run_parallel(sources: list[InputSource], schema: Schema, tmp: Path, n_total: int,
                 layout: tuple[int, int], dest: np.ndarray | None, work: int,
                 opts: dict[str, Any], progress: bool, value_check: Any, scheduler: Any,
                 first_shard: int = 0) -> tuple[list[ShardInfo], dict[str, str]]:
    """Both passes on ``scheduler`` (a :class:`ClusterStart` or a caller's ``Client``): the
    shards in ``tmp`` and the stored dtypes. Updates ``schema.dropped`` with what pass 1
    found."""
    from tqdm.auto import tqdm

    shard_obs = layout[0]
    local = isinstance(scheduler, ClusterStart)
    name = scheduler.name if local else scheduler
    local_threads = name == "threads"
    for s in sources:
        if s.path is None and not local_threads:
            raise InputError(
                f"{s.label} is an AnnData in memory: scheduler={name!r} runs pass 1 in "
                "other processes, which cannot see it. Fix: write it first "
                "(adata.write_h5ad(path)) and pass the path, or use scheduler='threads'.")
    folder = tmp / ".buckets"
    folder.mkdir(exist_ok=True)
    schema.use_storage(opts)  # an explicit data_dtype: checked in the tasks, block by block
    # a cluster started here restarts a dead worker within seconds; the caller's may be
    # adaptive (scaling up from none takes minutes)
    grace = NO_WORKERS_GRACE_S if local else NO_WORKERS_GRACE_CLIENT_S
    with open_scheduler(scheduler) as (client, workers):
        tasks = pass1_tasks([s.n_obs for s in sources], workers)
        n_shards = -(-n_total // shard_obs)
        logger.info("Writing on %d Dask workers (%s): %d pass-1 tasks, %d shards; each worker "
                    "within max_memory, %d x that in all.", workers,
                    name if local else "a Client", len(tasks),
                    n_shards, workers)
        objs = [s if s.path is None else s.path for s in sources]
        with tqdm(total=len(tasks) + n_shards, desc=f"shuffle on {workers} workers",
                  unit="tasks", disable=not progress, dynamic_ncols=True, leave=False) as bar:
            calls = [(_describe(t, sources), route_task, (
                t, [objs[p.source] for p in t.pieces],
                [None if dest is None else dest[p.offset + p.start: p.offset + p.stop]
                 for p in t.pieces], schema.for_inputs(t.sources), layout, work,
                str(folder), value_check)) for t in tasks]
            for dropped, ranges in _run(client, calls, bar, folder / ABANDONED, grace, local):
                for key, reason in dropped.items():
                    schema.drop(key, reason)
                for key, seen in ranges.items():
                    schema.ranges.setdefault(key, ValueRange()).merge(seen)
            task_dirs = [str(folder / f"t{t.task:05d}") for t in tasks]
            schema.settle_float32()
            # each task gets its own shard's dtypes, not every shard's value ranges
            stored = [schema.stored_in(s) for s in range(n_shards)]
            lean = schema.for_inputs(())  # no gene maps: pass 2 reads them from buckets
            lean.ranges = {}
            calls = [(_describe(s, sources), write_shard, (
                s, min(n_total, (s + 1) * shard_obs) - s * shard_obs, str(tmp), task_dirs,
                lean, layout, opts, first_shard, stored[s])) for s in range(n_shards)]
            done = _run(client, calls, bar, folder / ABANDONED, grace, local)
    shutil.rmtree(folder, ignore_errors=True)
    dtypes: dict[str, str] = {}
    for _, d in done:
        dtypes.update(d)
    return [info for info, _ in done], dtypes
