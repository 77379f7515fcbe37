"""Command line: ``annbatch-torch {shuffle,append,info,diversity,demo,bench}``.

The command speaks its own flags: the package's errors (:class:`~.errors.AnnBatchError`)
name Python parameters (``overwrite=True``, ``max_memory='4GB'``), and the command rewrites
them to the flags that feed those parameters (``--overwrite``, ``--max-memory 4GB``). Each
flag declares the parameter it feeds where it is defined (:meth:`CliParser.feed`), and that
one table gives the call's keyword arguments, the flags' defaults (the library's own) and
the translation of messages (:func:`speak_cli`).

A user error (a package error, a missing file, no permission, a bad argument) prints one
line, ``annbatch-torch: error: <message>``, and exits with status 2; anything else is a bug,
reported in one line with status 1. ``--debug`` shows the traceback instead. A closed
output pipe (``annbatch-torch info STORE | head -1``) ends the command quietly with status 0.
"""

from __future__ import annotations

import argparse
import errno
import inspect
import logging
import os
import runpy
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import AnnBatchError
from .args import (
    PROG,
    RAW_CHOICES,
    CliError,
    CliParser,
    gene_list_file,
    int_at_least,
    one_line,
    raw_choice,
    speak_cli,
)
from .diversity import add_diversity
from .info import run_info

__all__ = ["build_parser", "main", "version"]

#: the distribution whose version ``--version`` prints
DISTRIBUTION = "annbatch-torch"
#: where ``annbatch-torch bench`` writes without ``--out``: a new folder per run in here
BENCH_DIR = "annbatch-torch-bench"

_REPO = Path(__file__).resolve().parents[2]

_EXAMPLES = """\
Examples:

    annbatch-torch shuffle a.h5ad b.zarr -o store/ --var-join outer --max-memory 4GB
    annbatch-torch append store/ c.h5ad
    annbatch-torch info store/
    annbatch-torch info a.h5ad
    annbatch-torch diversity store/ --obs cell_type --sampler balanced:cell_type
    annbatch-torch demo --n-obs 20000
    annbatch-torch bench --small

Also runnable as "python -m annbatch_torch". A user error prints one line and exits with
status 2; --debug (anywhere on the line) shows the traceback instead; -q (also anywhere)
logs warnings only.
"""


gene_list_file.__name__ = "gene list file"


raw_choice.__name__ = "auto, true or false"


def version() -> str:
    """The installed package's version (``importlib.metadata``), else
    ``annbatch_torch.__version__``, else ``"unknown"``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version(DISTRIBUTION)
    except PackageNotFoundError:
        import annbatch_torch

        return str(getattr(annbatch_torch, "__version__", "unknown"))


# -- shuffle -----------------------------------------------------------------------------
def _shuffle(args: argparse.Namespace, parser: CliParser) -> int:
    from ..write.writer import create_anndata_collection

    coll = create_anndata_collection(**parser.api_kwargs(args))
    n = len(coll.shards)
    print(f"wrote {coll.path}: {coll.n_obs:,} cells x {coll.n_vars:,} genes in "
          f"{n} shard{'' if n == 1 else 's'}")
    return 0


def _append(args: argparse.Namespace, parser: CliParser) -> int:
    from ..write.append import append_to_collection

    coll = append_to_collection(**parser.api_kwargs(args))
    added = int(coll.manifest.extra["appended"][-1]["n_obs"])
    print(f"appended {added:,} cells to {coll.path}: {coll.n_obs:,} cells in "
          f"{len(coll.shards)} shards")
    return 0


# -- demo and bench ----------------------------------------------------------------------
def _demo(rest: list[str]) -> int:
    from . import demo

    return int(demo.command(rest) or 0)


def _given(rest: list[str], option: str) -> bool:
    """Whether ``option`` (a long option) is among ``rest``, as argparse would read it
    (``--out X``, ``--out=X``, or an unambiguous prefix such as ``--ou``)."""
    for a in rest:
        if a == "--":
            return False
        name = a.split("=", 1)[0]
        if name.startswith("--") and len(name) > 3 and option.startswith(name):
            return True
    return False


def _bench_out(base: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out, i = base / BENCH_DIR / stamp, 1
    while out.exists():
        i += 1
        out = base / BENCH_DIR / f"{stamp}-{i}"
    return out


def _source_checkout() -> bool:
    """Whether this package runs from its source repository (the folder above it holds
    the project's pyproject.toml), not from an install (site-packages, where a
    ``benchmarks/`` folder would be another distribution's)."""
    try:
        text = (_REPO / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return False
    return f'name = "{DISTRIBUTION}"' in text


def _bench(rest: list[str]) -> int:
    script = _REPO / "benchmarks" / "run.py"
    if not _source_checkout() or not script.is_file():
        raise CliError("annbatch-torch bench runs the benchmarks of the source repository, "
                       "which the installed package does not ship. Clone the repository and "
                       "run `make bench` (or this command) there.")
    extra: list[str] = []
    announce = not _given(rest, "--out") and not {"-h", "--help"} & set(rest)
    if announce:
        extra = ["--out", str(_bench_out(Path.cwd()))]
        if not _given(rest, "--data-dir"):  # the generated inputs, kept for the next run
            extra += ["--data-dir", str(Path.cwd() / BENCH_DIR / "data")]
    argv = sys.argv
    sys.argv = [str(script), *extra, *rest]
    try:
        bench = runpy.run_path(str(script), run_name="annbatch_torch_bench")
        bench["_parser"]().parse_args([*extra, *rest])  # bad options: one line, nothing run
        if announce:
            data = (f", generated inputs to {extra[3]} (--data-dir DIR)" if len(extra) > 2
                    else "")
            print(f"{PROG} bench: results go to {extra[1]} (--out DIR to choose; --out "
                  f"benchmarks/results updates the repository's committed results){data}",
                  flush=True)
        return int(bench["main"]([*extra, *rest]) or 0)
    except SystemExit as e:
        return _exit_status(e)
    finally:
        sys.argv = argv


_PASSTHROUGH: dict[str, Callable[[list[str]], int]] = {"demo": _demo, "bench": _bench}
#: the spellings of the quiet flag, taken from anywhere on the line (see main)
_QUIET = frozenset({"-q", "--quiet"})


# -- the parser ----------------------------------------------------------------------------
def _scheduler_feeds(cmd: CliParser) -> None:
    cmd.feed("--scheduler", param="scheduler", choices=["processes", "threads"],
             help="run the two passes on a local Dask cluster of --n-workers processes (or "
                  "threads; the dask extra); default: this process")
    cmd.feed("--n-workers", param="n_workers", type=int, metavar="N",
             help="workers of --scheduler (default: the usable CPUs)")


def _dtype_feeds(cmd: CliParser, default: str) -> None:
    cmd.feed("--data-dtype", param="data_dtype", metavar="DTYPE",
             help="how values of X, layers and raw/X are stored: auto (the narrowest dtype "
                  "that holds every value exactly, e.g. uint8 for small counts), field (each "
                  f"field's own dtype, as before) or a numpy dtype such as uint16 {default}")
    cmd.feed("--index-dtype", param="index_dtype", metavar="auto|int32",
             help="how their column indices are stored: auto (uint16 up to 65,536 genes, "
                  f"else int32) or int32 {default}")


def build_parser() -> CliParser:
    """The ``annbatch-torch`` argument parser.

    Its :attr:`CliParser.commands` hold the subcommands' parsers; ``shuffle``'s feeds are
    the keyword arguments of :func:`~annbatch_torch.create_anndata_collection`, with its
    defaults.
    """
    from ..write.budget import DEFAULT_WORK_MEMORY
    from ..write.writer import create_anndata_collection

    p = CliParser(
        prog=PROG, description="Shuffle AnnData into chunked collections for PyTorch data "
        "loading, and inspect them.", epilog=_EXAMPLES,
    )
    p.add_argument("-q", "--quiet", action="store_true",
                   help="log warnings only (may be given anywhere)")
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of an error (may be given anywhere)")
    p.add_argument("--version", action="version", version=f"{PROG} {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           parser_class=CliParser)

    s = sub.add_parser(
        "shuffle", help="shuffle AnnData files (h5ad / zarr) into a collection",
        description="Shuffle .h5ad files and AnnData zarr stores into one collection of "
        "zarr shards, out of core (every input read once). The options are those of "
        "annbatch_torch.create_anndata_collection, with its defaults.",
        api="create_anndata_collection", signature=inspect.signature(create_anndata_collection),
    )
    p.commands["shuffle"] = s
    s.feed("inputs", param="adata_paths", nargs="+", metavar="INPUT",
           help=".h5ad files or AnnData zarr stores")
    s.feed("-o", "--output", param="output_path", required=True, metavar="OUTPUT",
           help="collection folder to write")
    s.feed("--seed", param="seed", type=int,
           help="seed of the shuffle: the same inputs and seed give the same collection "
                "(default: %(default)s)")
    s.feed("--no-shuffle", param="shuffle", action="store_true",
           help="keep the input row order (default: rows of all inputs spread uniformly "
                "over all shards)")
    s.feed("--var-join", param="var_join", choices=["inner", "outer"],
           help="inner: genes present in every input; outer: every gene, absent ones are "
                "zeros (default: %(default)s)")
    s.feed("--var-names", param="var_names", type=gene_list_file, metavar="FILE",
           help="align every input to this reference gene list (a text file, one gene per "
                "line): missing genes are zeros, others dropped; --var-join is then unused")
    for flag, param, what in (("--obs", "obs_columns", "obs columns"),
                              ("--layers", "layers", "layers"),
                              ("--obsm", "obsm", "obsm entries")):
        s.feed(flag, param=param, nargs="*", metavar="NAME",
               help=f"{what} to carry (default: those in every input; the flag with no "
                    "NAME: none)")
    s.feed("--raw", param="raw", type=raw_choice, metavar="auto|true|false",
           words={repr(v): k for k, v in RAW_CHOICES.items()},
           help="AnnData's raw (raw.X and its genes): auto carries it when every input has "
                "it, true requires it, false leaves it out (default: auto)")
    s.feed("--max-memory", param="max_memory", metavar="SIZE",
           help="peak RSS bound of the whole process, e.g. 4GB or 512MiB (default: "
                f"{DEFAULT_WORK_MEMORY / 1e6:.0f} MB of buffers on top of what the process "
                "already uses)")
    s.feed("--shard-size", param="n_obs_per_shard", type=int, metavar="ROWS",
           help="rows per shard (default: 131072, fewer when --max-memory is tight; written "
                "in blocks that fit --max-memory)")
    s.feed("--overwrite", param="overwrite", action="store_true",
           help="replace an existing collection (the old one is removed only once the new "
                "one is complete)")
    s.feed("--no-progress", param="progress", action="store_true",
           help="hide the progress bars (default: shown on stderr)")
    s.feed("--zarr-format", param="zarr_format", type=int, choices=[2, 3],
           help="zarr format of the shards (default: %(default)s)")
    s.feed("--chunk-elems", param="zarr_chunk_elems", type=int, metavar="N",
           help="elements per zarr chunk of X and layers; obsm chunks hold N // width rows "
                "(default: %(default)s)")
    s.feed("--shard-elems", param="zarr_shard_elems", type=int, metavar="N",
           help="elements per zarr shard file of X, layers and obsm; 0: one file per chunk "
                "(default: %(default)s)")
    s.feed("--compressor", param="compressor", metavar="CODEC",
           help="raw (uncompressed + CRC-32C, fastest reads), lz4, zstd or none (no "
                "checksum) (default: %(default)s)")
    _dtype_feeds(s, "(default: %(default)s)")
    s.feed("--group-by", param="group_by", metavar="COLUMN",
           help="sort each shard's rows by this categorical obs column, so that a "
                "class-balanced sampler over it reads runs of rows (default: none)")
    _scheduler_feeds(s)
    s.set_defaults(func=_shuffle)

    from ..write.append import append_to_collection

    a = sub.add_parser(
        "append", help="add AnnData files to a collection as new shards (nothing rewritten)",
        description="Add the cells of .h5ad files / AnnData zarr stores to a collection as "
        "new shards, shuffled among themselves; existing shards are not touched and the "
        "manifest is replaced last. The options are those of "
        "annbatch_torch.append_to_collection, with its defaults.",
        api="append_to_collection", signature=inspect.signature(append_to_collection),
    )
    p.commands["append"] = a
    a.feed("store", param="collection", metavar="STORE", help="the collection folder")
    a.feed("inputs", param="adata_paths", nargs="+", metavar="INPUT",
           help=".h5ad files or AnnData zarr stores to add")
    a.feed("--seed", param="seed", type=int,
           help="seed of the shuffle of the new cells (default: %(default)s)")
    a.feed("--max-memory", param="max_memory", metavar="SIZE",
           help="peak RSS bound of the whole process, e.g. 4GB (default: as shuffle's)")
    a.feed("--no-progress", param="progress", action="store_true",
           help="hide the progress bars (default: shown on stderr)")
    _dtype_feeds(a, "(default: as the collection was written)")
    _scheduler_feeds(a)
    a.set_defaults(func=_append)

    i = sub.add_parser(
        "info", help="describe a collection (schema, sizes, categories) or an AnnData input",
        description="Describe a collection folder: cells, genes, shards, fields and their "
        "categories, inputs. An .h5ad file or AnnData zarr store is summarised instead "
        "(cells, genes, X, layers, obsm, obs columns).",
    )
    p.commands["info"] = i
    i.add_argument("store", metavar="PATH",
                   help="a collection folder (or an .h5ad file / AnnData zarr store)")
    i.add_argument("--json", action="store_true",
                   help="print the manifest (or the AnnData summary) as JSON")
    i.add_argument("--max-categories", type=int_at_least(0), default=10, metavar="N",
                   help="categories shown per column (default: %(default)s)")
    i.set_defaults(func=run_info)

    add_diversity(sub, p.commands)

    # demo and bench take every following argument (see main)
    sub.add_parser("demo", help="train a small classifier on synthetic data (options: "
                   f"{PROG} demo --help)", add_help=False)
    sub.add_parser("bench", help="run benchmarks/run.py of the source repository (options: "
                   f"{PROG} bench --help)", add_help=False)
    return p


# -- main --------------------------------------------------------------------------------
def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    return e.code if isinstance(e.code, int) else 1


_USER_OS_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                   NotADirectoryError)


def _is_user_error(e: BaseException) -> bool:
    if isinstance(e, (AnnBatchError, CliError, *_USER_OS_ERRORS)):
        return True
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _describe_os_error(e: OSError) -> str:
    if e.filename is None:
        return str(e)
    where = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 is not None else "")
    return f"{where}: {e.strerror or e}"


def _quiet_stdout() -> None:
    """Point stdout at /dev/null after the reader of its pipe left, so the interpreter's
    last flush does not fail again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (e.g. captured)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


@contextmanager
def _logging(quiet: bool) -> Iterator[None]:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("annbatch_torch")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.WARNING if quiet else logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    """Run the command line.

    Parameters
    ----------
    argv
        The arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status: 0, 2 for a user error (reported in one line on stderr), 1 for an
        internal error, the status of ``demo`` / ``bench``, 130 when interrupted.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    end = argv.index("--") if "--" in argv else len(argv)
    debug = "--debug" in argv[:end]
    # --debug and -q / --quiet may be given anywhere before "--" (after the command too)
    quiet = bool(_QUIET & set(argv[:end]))
    argv = [a for i, a in enumerate(argv) if i >= end or a not in {"--debug", *_QUIET}]
    parser = build_parser()
    cmd = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    rest = None
    if cmd is not None and argv[cmd] in _PASSTHROUGH:
        argv, rest = argv[: cmd + 1], argv[cmd + 1 :]
        if quiet and argv[cmd] == "bench":
            rest = ["--quiet", *rest]  # bench's own flag: no progress lines
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error (already reported)
        return _exit_status(e)
    try:
        if rest is not None:
            status = _PASSTHROUGH[args.command](rest)
        else:
            with _logging(quiet):
                status = int(args.func(args, parser.commands[args.command]) or 0)
        sys.stdout.flush()  # a closed pipe surfaces here, not at interpreter exit
        return status
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except SystemExit as e:  # demo's own argument errors
        return _exit_status(e)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        if _is_user_error(e):
            msg = _describe_os_error(e) if isinstance(e, OSError) else speak_cli(str(e), parser)
            print(f"{PROG}: error: {one_line(msg)}", file=sys.stderr)
            return 2
        print(f"{PROG}: internal error: {type(e).__name__}: {one_line(e)} (run with --debug "
              "for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
