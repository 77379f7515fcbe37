"""Command line: ``annbatch-torch {shuffle,info,demo,bench}``.

Examples::

    annbatch-torch shuffle a.h5ad b.zarr -o store/ --var-join outer --max-memory 4GB
    annbatch-torch info store/
    annbatch-torch demo --n-obs 20000
    annbatch-torch bench --small

Also runnable as ``python -m annbatch_torch.cli``.
"""

from __future__ import annotations

import argparse
import json
import logging
import runpy
import sys
from pathlib import Path

from .errors import AnnBatchError

__all__ = ["main", "build_parser"]

_REPO = Path(__file__).resolve().parents[1]


def _shuffle(args: argparse.Namespace) -> int:
    from .write.writer import create_anndata_collection

    coll = create_anndata_collection(
        args.inputs, args.output, shuffle=not args.no_shuffle, seed=args.seed,
        var_join=args.var_join, obs_columns=args.obs, layers=args.layers, obsm=args.obsm,
        n_obs_per_shard=args.shard_size, max_memory=args.max_memory,
        overwrite=args.overwrite, progress=not args.no_progress,
        zarr_format=args.zarr_format, compressor=args.compressor,
        **({} if args.chunk_elems is None else {"zarr_chunk_elems": args.chunk_elems}),
    )
    print(f"wrote {coll.path}: {coll.n_obs:,} cells x {coll.n_vars:,} genes in "
          f"{len(coll.shards)} shards")
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _info(args: argparse.Namespace) -> int:
    from .store.collection import open_collection
    from .store.inputs import disk_usage

    coll = open_collection(args.store)
    m = coll.manifest
    if args.json:
        print(json.dumps(m.to_json(), indent=1))
        return 0
    sizes = coll.shard_sizes
    print(f"collection  {coll.path}")
    print(f"format      {m.format_version} ({m.created_by or 'unknown writer'})")
    print(f"cells       {coll.n_obs:,}")
    print(f"genes       {coll.n_vars:,} (var_join={m.var_join}; first: "
          f"{', '.join(map(str, coll.var_names[:5]))}{', ...' if coll.n_vars > 5 else ''})")
    print(f"shards      {len(sizes)} of {min(sizes):,}-{max(sizes):,} rows" if sizes else
          "shards      0")
    print(f"on disk     {_human(disk_usage(coll.path)[0])}")
    print(f"shuffle     {m.shuffle} (seed {m.seed})")
    print("fields")
    for name, f in coll.fields.items():
        dims = ["n" if s is None else str(s) for s in f.shape]
        shape = f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"
        line = f"  {name:<24} {f.kind:<12} {f.dtype:<8} {shape:<10}"
        if f.kind == "categorical":
            cats = list(f.categories or ())
            shown = ", ".join(map(str, cats[: args.max_categories]))
            more = f", ... (+{len(cats) - args.max_categories})" \
                if len(cats) > args.max_categories else ""
            line += f"  {len(cats)} categories{' (ordered)' if f.ordered else ''}: {shown}{more}"
        print(line.rstrip())
    for name, why in coll.unavailable.items():
        print(f"  {name:<24} (not available: {why})")
    print("inputs")
    for rec in m.inputs:
        where = rec.get("path") or rec.get("name") or "?"
        size = rec.get("size")
        size_txt = f", {_human(size)}" if isinstance(size, int | float) else ""
        n = rec.get("n_obs")
        cells = f"{n:,}" if isinstance(n, int) else "?"
        print(f"  {where} ({cells} cells{size_txt})")
    return 0


def _demo(rest: list[str]) -> int:
    from . import demo

    return int(demo.main(rest) or 0)


def _bench(rest: list[str]) -> int:
    script = _REPO / "benchmarks" / "run.py"
    if not script.is_file():
        print(f"error: {script} not found: the benchmarks ship with the source repository, "
              "not the installed package. Clone the repository and run `make bench` there.",
              file=sys.stderr)
        return 2
    argv = sys.argv
    sys.argv = [str(script), *rest]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    finally:
        sys.argv = argv
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``annbatch-torch`` argument parser."""
    p = argparse.ArgumentParser(
        prog="annbatch-torch", description="Shuffle AnnData into chunked collections for "
        "PyTorch data loading, and inspect them.", epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("shuffle", help="shuffle AnnData files (h5ad / zarr) into a collection")
    s.add_argument("inputs", nargs="+", help=".h5ad files or AnnData zarr stores")
    s.add_argument("-o", "--output", required=True, help="collection folder to write")
    s.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    s.add_argument("--no-shuffle", action="store_true", help="keep input row order")
    s.add_argument("--var-join", choices=["inner", "outer"], default="inner",
                   help="genes in every input (inner, default) or in any (outer)")
    for flag, what in (("--obs", "obs columns"), ("--layers", "layers"), ("--obsm", "obsm")):
        s.add_argument(flag, nargs="*", default=None, metavar="NAME",
                       help=f"{what} to carry (default: those in every input; the flag "
                            "alone: none)")
    s.add_argument("--max-memory", default=None,
                   help="peak RSS bound of the process, e.g. 4GB (default: 640 MB of buffers "
                   "on top of what the process uses)")
    s.add_argument("--shard-size", type=int, default=None,
                   help="rows per shard (default: derived from --max-memory)")
    s.add_argument("--overwrite", action="store_true", help="replace an existing collection")
    s.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    s.add_argument("--zarr-format", type=int, choices=[2, 3], default=3)
    s.add_argument("--chunk-elems", type=int, default=None,
                   help="elements per zarr chunk (default 65536, the writer's default)")
    s.add_argument("--compressor", default="raw",
                   help="raw (default: uncompressed + CRC-32C, fastest reads), lz4, zstd or none")
    s.set_defaults(func=_shuffle)

    i = sub.add_parser("info", help="describe a collection: schema, sizes, categories")
    i.add_argument("store", help="collection folder")
    i.add_argument("--json", action="store_true", help="print the manifest as JSON")
    i.add_argument("--max-categories", type=int, default=10,
                   help="categories shown per column (default 10)")
    i.set_defaults(func=_info)

    # demo and bench pass every following argument through (see main)
    sub.add_parser("demo", help="train a small classifier on synthetic data (args: see "
                   "`annbatch-torch demo --help`)", add_help=False)
    sub.add_parser("bench", help="run benchmarks/run.py from the source repository (args: "
                   "see `annbatch-torch bench --help`)", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 on a user error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if cmd is not None and argv[cmd] in ("demo", "bench"):
        return (_demo if argv[cmd] == "demo" else _bench)(argv[cmd + 1 :])
    args = build_parser().parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("annbatch_torch")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        return int(args.func(args) or 0)
    except AnnBatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
