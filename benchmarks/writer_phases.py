"""Where the writer's time goes: serial, ``threads`` and ``processes``, phase by phase.

Runs ``create_anndata_collection`` on the benchmark inputs (``run.py`` writes them to
``benchmarks/data``) in the order given, each in a fresh interpreter, and prints per run:
wall time, CPU time of the driver and of its child processes, and per phase

* serial: pass 1 (``route_rows``), pass 2 (``write_shard_blocks``), the final ``fsync``;
* parallel: the local cluster's start and stop, and for pass 1 and pass 2 the span from the
  first task's start to the last one's end, the tasks' summed time, their user and system
  CPU and minor page faults (measured inside the workers).

    python benchmarks/writer_phases.py serial threads processes serial threads processes
    python benchmarks/writer_phases.py --shard-obs 50000 serial threads processes

``--shard-obs`` sets ``n_obs_per_shard`` for the parallel runs only (more pass-2 tasks than
the default's one shard at 100k cells; the serial run keeps the default, whose time does
not depend on it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LOG = Path(os.environ.get("ABT_PHASES_LOG", "/dev/null"))


def _log(kind: str, t0: float, r0: Any) -> None:
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    rec = {"kind": kind, "t0": t0, "t1": time.time(), "user": r1.ru_utime - r0.ru_utime,
           "sys": r1.ru_stime - r0.ru_stime, "minflt": r1.ru_minflt - r0.ru_minflt}
    with open(LOG, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _timed(kind: str, fn: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        t0, r0 = time.time(), resource.getrusage(resource.RUSAGE_SELF)
        try:
            return fn(*args, **kwargs)
        finally:
            _log(kind, t0, r0)
    return run


#: the writer's own task functions, kept where this module replaced them (the driver; the
#: ``threads`` workers share it); worker processes import the writer unpatched
_ORIGINAL: dict[str, Any] = {}


def _original(name: str) -> Any:
    from annbatch_torch.write import parallel
    return _ORIGINAL.get(name) or getattr(parallel, name)


def _route_task(*args: Any, **kwargs: Any) -> Any:  # module level: workers import it
    return _timed("pass1", _original("route_task"))(*args, **kwargs)


def _write_shard(*args: Any, **kwargs: Any) -> Any:
    return _timed("pass2", _original("write_shard"))(*args, **kwargs)


def one_run(mode: str, data: Path, out: Path, shard_obs: int | None) -> None:
    """One write in this process (the child of :func:`main`), phases appended to LOG."""
    import annbatch_torch as abt
    from annbatch_torch.write import parallel, writer

    marks: dict[str, float] = {}
    if mode == "serial":
        for name, kind in (("route_rows", "pass1"), ("write_shard_blocks", "pass2"),
                           ("sync_tree", "fsync")):
            setattr(writer, name, _timed(kind, getattr(writer, name)))
    else:
        sys.path.insert(0, str(HERE))
        import writer_phases as me  # by reference, so the workers find the wrappers

        opened = parallel.open_scheduler

        @contextlib.contextmanager
        def timed_open(scheduler: Any) -> Any:
            t = time.time()  # (the cluster started while the inputs were opened)
            with opened(scheduler) as got:
                marks["cluster_up"] = time.time() - t
                yield got
                t = time.time()
            marks["cluster_down"] = time.time() - t

        parallel.open_scheduler = timed_open
        me._ORIGINAL.update(route_task=parallel.route_task, write_shard=parallel.write_shard)
        parallel.route_task, parallel.write_shard = me._route_task, me._write_shard
    paths = sorted(str(p) for p in data.glob("*.h5ad"))
    kw: dict[str, Any] = {} if mode == "serial" else {"scheduler": mode, "n_workers": 2}
    if shard_obs and mode != "serial":
        kw["n_obs_per_shard"] = shard_obs
    r0, c0, t = os.times(), resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    abt.create_anndata_collection(paths, out, overwrite=True, progress=False,
                                  max_memory="1GB", **kw)
    wall = time.time() - t
    r1, c1 = os.times(), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"mode": mode, "wall": wall, "cpu_user": r1.user - r0.user,
                      "cpu_sys": r1.system - r0.system,
                      "children_user": c1.ru_utime - c0.ru_utime,
                      "children_sys": c1.ru_stime - c0.ru_stime, **marks}))


def _report(res: dict[str, Any], log: Path) -> str:
    line = (f"{res['mode']:9s} wall {res['wall']:5.1f} s  driver cpu {res['cpu_user']:.1f}u+"
            f"{res['cpu_sys']:.1f}s  children {res['children_user']:.1f}u+"
            f"{res['children_sys']:.1f}s")
    if "cluster_up" in res:
        line += f"  cluster up {res['cluster_up']:.2f} s, down {res['cluster_down']:.2f} s"
    recs = [json.loads(s) for s in log.read_text().splitlines()] if log.exists() else []
    for kind in ("pass1", "pass2", "fsync"):
        rs = [r for r in recs if r["kind"] == kind]
        if rs:
            span = max(r["t1"] for r in rs) - min(r["t0"] for r in rs)
            line += (f"\n    {kind}: {len(rs)} task(s), span {span:.2f} s, summed "
                     f"{sum(r['t1'] - r['t0'] for r in rs):.2f} s, cpu "
                     f"{sum(r['user'] for r in rs):.2f}u+{sum(r['sys'] for r in rs):.2f}s, "
                     f"{sum(r['minflt'] for r in rs):,} minor faults")
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("modes", nargs="+", choices=["serial", "threads", "processes"])
    p.add_argument("--data-dir", type=Path,
                   default=HERE / "data" / "grouped_100000x20000_seed0")
    p.add_argument("--shard-obs", type=int, default=None)
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the collections are written (default: the system's temp dir)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        one_run(args.child[0], Path(args.child[1]), Path(args.child[2]), args.shard_obs)
        return
    if not any(args.data_dir.glob("*.h5ad")):
        sys.exit(f"{args.data_dir} holds no .h5ad inputs: run benchmarks/run.py --only writer "
                 "first (it writes them)")
    with tempfile.TemporaryDirectory(dir=args.out_dir) as tmp:
        for mode in args.modes:
            log = Path(tmp) / f"{mode}.jsonl"
            log.unlink(missing_ok=True)
            cmd = [sys.executable, __file__, mode, "--child", mode, str(args.data_dir),
                   str(Path(tmp) / f"out_{mode}")]
            if args.shard_obs:
                cmd += ["--shard-obs", str(args.shard_obs)]
            res = subprocess.run(cmd, capture_output=True, text=True,
                                 env={**os.environ, "ABT_PHASES_LOG": str(log)})
            if res.returncode:
                sys.exit(f"{mode} failed:\n{res.stderr[-3000:]}")
            print(_report(json.loads(res.stdout.strip().splitlines()[-1]), log), flush=True)


if __name__ == "__main__":
    main()
