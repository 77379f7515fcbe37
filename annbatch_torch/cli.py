"""Command line: ``annbatch-torch {shuffle,info,demo,bench}``.

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
import json
import logging
import os
import re
import runpy
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from .errors import AnnBatchError

__all__ = [
    "CliError", "CliParser", "Feed", "build_parser", "int_at_least", "main", "plain_text",
    "speak_cli", "version",
]

PROG = "annbatch-torch"
#: the distribution whose version ``--version`` prints
DISTRIBUTION = "annbatch-torch"
#: where ``annbatch-torch bench`` writes without ``--out``: a new folder per run in here
BENCH_DIR = "annbatch-torch-bench"

_REPO = Path(__file__).resolve().parents[1]

_EXAMPLES = """\
Examples:

    annbatch-torch shuffle a.h5ad b.zarr -o store/ --var-join outer --max-memory 4GB
    annbatch-torch append store/ c.h5ad
    annbatch-torch info store/
    annbatch-torch info a.h5ad
    annbatch-torch demo --n-obs 20000
    annbatch-torch bench --small

Also runnable as "python -m annbatch_torch". A user error prints one line and exits with
status 2; --debug (anywhere on the line) shows the traceback instead.
"""


# -- plain text --------------------------------------------------------------------------
_ROLE = re.compile(r":(?:py:)?[a-z]+:`(~?)([^`]+)`")


def plain_text(text: str) -> str:
    """``text`` (a docstring) without reST markup, for ``--help``.

    ``:class:`~a.B``` becomes ``B``, ``:func:`a.f``` becomes ``a.f``, double backticks are
    dropped and a literal-block ``::`` becomes ``:``.
    """
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2),
                     text)
    text = text.replace("``", "")
    return re.sub(r"(?<=\S)::$", ":", text, flags=re.MULTILINE)


class HelpFormatter(argparse.HelpFormatter):
    """Wraps the description and epilog paragraph by paragraph, keeps indented blocks
    (examples) as written, and never breaks a line inside a ``--flag`` or a command name."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in re.split(r"\n\s*\n", text.strip("\n")):
            lines = para.splitlines()
            if all(line[:1].isspace() for line in lines):
                out.append("\n".join(indent + line for line in lines))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent,
                                         subsequent_indent=indent, break_on_hyphens=False))
        return "\n\n".join(out) + "\n"

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


# -- arguments ---------------------------------------------------------------------------
def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= low``, else an argument error naming the flag."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def gene_list_file(text: str) -> list[str]:
    """An argparse ``type``: a text file of gene names, one per line (blank lines and lines
    starting with ``#`` are skipped), else an argument error naming the file."""
    path = Path(text).expanduser()
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # a BOM from Excel: not a gene
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise argparse.ArgumentTypeError(
            f"cannot read the gene list {text!r} ({why}); pass a text file with one gene "
            "name per line") from None
    genes = [g.strip() for g in lines if g.strip() and not g.lstrip().startswith("#")]
    if not genes:
        raise argparse.ArgumentTypeError(f"the gene list {text!r} names no gene; pass a text "
                                         "file with one gene name per line")
    return genes


gene_list_file.__name__ = "gene list file"

#: ``--raw`` values and the ``raw=`` they feed
RAW_CHOICES = {"auto": None, "true": True, "false": False}


def raw_choice(text: str) -> bool | None:
    """An argparse ``type``: ``auto`` / ``true`` / ``false`` (any case) as ``raw=``."""
    try:
        return RAW_CHOICES[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"must be auto (carry raw when every input has it), true (require it) or false "
            f"(leave it out), got {text!r}") from None


raw_choice.__name__ = "auto, true or false"


@dataclass(frozen=True)
class Feed:
    """One command-line argument and the Python parameter it feeds.

    Attributes
    ----------
    param
        The parameter of the command's Python function (``max_memory``).
    dest
        The argparse destination holding the value.
    flag
        How the command line spells it: ``--max-memory``, or the metavar of a positional
        argument (``INPUT``).
    kind
        ``"value"`` (``--flag VALUE``), ``"flag"`` (``--flag`` sets the parameter to True),
        ``"negated"`` (``--no-x`` sets ``x`` to False) or ``"positional"``.
    metavar
        The value's placeholder in messages (``MAX_MEMORY``).
    words
        How the command line spells some Python values (``{"False": "false"}``).
    """

    param: str
    dest: str
    flag: str
    kind: str
    metavar: str = ""
    words: tuple[tuple[str, str], ...] = ()

    def value(self, args: argparse.Namespace) -> Any:
        """The parameter's value from parsed arguments."""
        v = getattr(args, self.dest)
        return not v if self.kind == "negated" else v

    def spell(self, value: str) -> str:
        """How the command line says ``param=value`` (``value`` as Python source text)."""
        if self.kind == "flag":
            return self.flag if value == "True" else f"without {self.flag}"
        if self.kind == "negated":
            return self.flag if value == "False" else f"without {self.flag}"
        words = dict(self.words)
        if value in words:
            return f"{self.flag} {words[value]}"
        if value == "None":
            return f"without {self.flag}"
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" \
                and re.fullmatch(r"[\w.,:/+@%=-]+", value[1:-1]):
            value = value[1:-1]  # shell-safe: drop the quotes
        return value if self.kind == "positional" else f"{self.flag} {value}"

    def placeholder(self) -> str:
        """The argument with a placeholder value, as in a usage line."""
        if self.kind == "positional":
            return f"{self.flag} ..."
        return f"{self.flag} {self.metavar}" if self.kind == "value" else self.flag


class CliParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and whose flags name the parameters
    they feed.

    Parameters
    ----------
    api
        Name of the public Python function the (sub)command calls
        (``"create_anndata_collection"``); messages naming it are rewritten to the command.
    signature
        That function's signature: its defaults become the flags' defaults, its parameter
        order places the positional arguments of a call named in a message.
    *args, **kwargs
        As for :class:`argparse.ArgumentParser` (``formatter_class`` defaults to
        :class:`HelpFormatter`).
    """

    def __init__(self, *args: Any, api: str | None = None,
                 signature: inspect.Signature | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.api = api
        self.signature = signature
        #: Python parameter -> the argument feeding it
        self.feeds: dict[str, Feed] = {}
        #: subcommand name -> its parser
        self.commands: dict[str, CliParser] = {}

    def feed(self, *flags: str, param: str, **kwargs: Any) -> argparse.Action:
        """``add_argument(*flags, **kwargs)`` for an argument that feeds ``param``.

        A value option without an explicit ``default`` gets the library's default (from
        :attr:`signature`). An option whose action is ``store_true`` and whose name starts
        with ``--no-`` feeds False. ``words`` (a keyword of this method): how the command
        line spells Python values in messages (``{"False": "false"}``).
        """
        words = tuple(kwargs.pop("words", {}).items())
        positional = not flags[0].startswith("-")
        store_true = kwargs.get("action") == "store_true"
        if (not positional and not store_true and "default" not in kwargs
                and self.signature is not None and param in self.signature.parameters):
            kwargs["default"] = self.signature.parameters[param].default
        action = self.add_argument(*flags, **kwargs)
        if positional:
            kind, flag = "positional", str(action.metavar or action.dest.upper())
        else:
            flag = max(action.option_strings, key=len)  # the long spelling
            kind = ("negated" if flag.startswith("--no-") else "flag") if store_true \
                else "value"
        metavar = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
        self.feeds[param] = Feed(param, action.dest, flag, kind, metavar, words)
        return action

    def api_kwargs(self, args: argparse.Namespace) -> dict[str, Any]:
        """Keyword arguments of :attr:`api` from parsed arguments, one per feed."""
        return {f.param: f.value(args) for f in self.feeds.values()}

    def error(self, message: str) -> NoReturn:
        """Print ``annbatch-torch: error: <message>`` (one line) and exit with status 2."""
        self.exit(2, f"{PROG}: error: {_one_line(message)} (see '{self.prog} --help')\n")


class CliError(Exception):
    """A user error found by the command itself (exit status 2, no traceback)."""


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


# -- the package's messages in the command's words -------------------------------------
_START = r"(?<![\w./\\-])"  # a name starts here: not inside a word, a path or a flag
#: a Python value in a message: quoted, or bare up to a space, a separator or the full stop
#: ending a sentence ("Pass overwrite=True." is ``True``)
_VALUE = r"""(?:'[^']*'|"[^"]*"|[^\s,;()'"]+?(?=\.?(?:[\s,;()]|$)))"""


def speak_cli(message: str, parser: CliParser) -> str:
    """``message`` with the Python parameters and functions the command's flags feed
    rewritten to those flags and subcommands.

    ``overwrite=True`` becomes ``--overwrite``, ``max_memory='415MB'`` becomes
    ``--max-memory 415MB``, a bare ``n_obs_per_shard`` becomes ``--shard-size``,
    ``create_anndata_collection(..., overwrite=True)`` becomes
    ``annbatch-torch shuffle ... --overwrite``. The table is the parsers' feeds
    (:meth:`CliParser.feed`); parameters no flag feeds are left as they are.
    """
    feeds: dict[str, Feed] = {}
    apis: dict[str, tuple[str, CliParser]] = {}
    for name, cmd in parser.commands.items():
        for param, f in cmd.feeds.items():
            feeds.setdefault(param, f)
        if cmd.api:
            apis.setdefault(cmd.api, (name, cmd))
    if not feeds and not apis:
        return message

    def alts(names: Any) -> str:
        return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))

    def kwarg(m: re.Match[str]) -> str:
        return feeds[m.group(1)].spell(m.group(2))

    def call(m: re.Match[str]) -> str:
        name, cmd = apis[m.group(1)]
        order = list(cmd.signature.parameters) if cmd.signature else []
        parts, i = [], 0
        for arg in (a.strip() for a in m.group(2).split(",")):
            if not arg:
                continue
            kv = re.fullmatch(rf"(\w+)=({_VALUE})", arg)
            if arg == "...":
                parts.append(arg)
            elif kv:
                f = feeds.get(kv.group(1))
                parts.append(f.spell(kv.group(2)) if f else arg)
            else:
                f = feeds.get(order[i]) if i < len(order) else None
                parts.append(f.placeholder() if f else arg)
                i += 1
        return " ".join([PROG, name, *parts])

    if apis:
        api = alts(apis)
        message = re.sub(rf"{_START}(?:annbatch_torch\.)?({api})\(([^()]*)\)", call, message)
        message = re.sub(rf"{_START}(?:annbatch_torch\.)?({api})\b(?!\()",
                         lambda m: f"{PROG} {apis[m.group(1)][0]}", message)
    if feeds:
        message = re.sub(rf"{_START}({alts(feeds)})=({_VALUE})", kwarg, message)
        named = [p for p in feeds if "_" in p]  # unmistakably identifiers
        if named:
            message = re.sub(rf"{_START}({alts(named)})(?![\w/\\=-])",
                             lambda m: feeds[m.group(1)].flag, message)
        valued = [p for p, f in feeds.items() if f.kind == "value" and "_" not in p]
        if valued:  # "compressor 'foo' unknown"
            message = re.sub(rf"{_START}({alts(valued)}) (?=['\"])",
                             lambda m: feeds[m.group(1)].flag + " ", message)
    return message


def _one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", str(text)).strip()


# -- shuffle -----------------------------------------------------------------------------
def _shuffle(args: argparse.Namespace, parser: CliParser) -> int:
    from .write.writer import create_anndata_collection

    coll = create_anndata_collection(**parser.api_kwargs(args))
    n = len(coll.shards)
    print(f"wrote {coll.path}: {coll.n_obs:,} cells x {coll.n_vars:,} genes in "
          f"{n} shard{'' if n == 1 else 's'}")
    return 0


def _append(args: argparse.Namespace, parser: CliParser) -> int:
    from .write.append import append_to_collection

    coll = append_to_collection(**parser.api_kwargs(args))
    added = int(coll.manifest.extra["appended"][-1]["n_obs"])
    print(f"appended {added:,} cells to {coll.path}: {coll.n_obs:,} cells in "
          f"{len(coll.shards)} shards")
    return 0


# -- info --------------------------------------------------------------------------------
def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _categories(cats: list[Any], limit: int, ordered: bool = False,
                counts: Any = None) -> str:
    """``counts``: a pandas Series of cells per category (``Collection.category_counts``)."""
    if counts is not None:
        missing = int(counts.iloc[len(cats):].sum()) if len(counts) > len(cats) else 0
        shown = ", ".join(f"{c} ({int(n):,})" for c, n in zip(cats[:limit], counts.iloc[:limit]))
        if missing:
            shown += f"; missing ({missing:,})"
    else:
        shown = ", ".join(map(str, cats[:limit]))
    head = f"{len(cats)} categories{' (ordered)' if ordered else ''}"
    if limit == 0:  # --max-categories 0: the count alone
        return head
    more = f", ... (+{len(cats) - limit})" if len(cats) > limit else ""
    return f"{head}: {shown}{more}"


def _first(names: Any, n: int = 5) -> str:
    names = list(names[:n + 1])
    return ", ".join(map(str, names[:n])) + (", ..." if len(names) > n else "")


def _info(args: argparse.Namespace, parser: CliParser) -> int:
    from .store.manifest import MANIFEST_NAME
    from .store.remote import is_url

    if is_url(args.store):  # credentials and endpoint from the environment
        return _info_collection(args.store, args)
    path = Path(args.store).expanduser()
    if not (path.exists() or path.is_symlink()):
        raise CliError(f"{path}: no such file or folder.")
    if path.is_dir() and (path / MANIFEST_NAME).exists():
        return _info_collection(path, args)
    from .store.inputs import open_store

    try:
        group = open_store(path)
    except AnnBatchError as e:
        if path.is_dir() and not any(path.iterdir()):
            raise CliError(f"{path}: an empty folder, neither a collection nor an AnnData "
                           "store. Write a collection there with: annbatch-torch shuffle "
                           f"INPUT ... -o {path} --overwrite") from e
        if path.is_dir():  # a folder: say what a collection folder lacks
            return _info_collection(path, args)
        raise CliError(f"{path}: a file, not a collection folder (a collection is a folder "
                       f"with a {MANIFEST_NAME}), and not an AnnData .h5ad file either: {e}"
                       ) from e
    if hasattr(group, "close"):  # h5py; a zarr group holds nothing open
        group.close()
    return _info_anndata(path, args)


def _info_collection(path: Path | str, args: argparse.Namespace) -> int:
    from .store.collection import open_collection
    from .store.inputs import disk_usage

    coll = open_collection(path)
    m = coll.manifest
    if args.json:
        print(json.dumps(m.to_json(), indent=1))
        return 0
    sizes = coll.shard_sizes
    print(f"collection  {coll.describe()}")
    print(f"format      {m.format_version} ({m.created_by or 'unknown writer'})")
    print(f"cells       {coll.n_obs:,}")
    print(f"genes       {coll.n_vars:,} (var_join={m.var_join}; first: "
          f"{_first(coll.var_names)})")
    if coll.raw_var_names is not None:
        print(f"raw genes   {len(coll.raw_var_names):,} (first: {_first(coll.raw_var_names)})")
    var_columns = list(coll.var.columns)
    print("var         " + (", ".join(map(str, var_columns)) if var_columns else "(no columns)"))
    raw_var = coll.raw_var
    if raw_var is not None:
        print("raw var     " + (", ".join(map(str, raw_var.columns)) if len(raw_var.columns)
                                else "(no columns)"))
    print(f"shards      {len(sizes)} of {min(sizes):,}-{max(sizes):,} rows" if sizes else
          "shards      0")
    if coll.mirror is not None:
        print(f"stored      {_human(sum(s for s, _ in coll.mirror.objects.values()))}")
    else:
        print(f"on disk     {_human(disk_usage(coll.path)[0])}")
    print(f"shuffle     {m.shuffle} (seed {m.seed})")
    print("fields")
    for name, f in coll.fields.items():
        dims = ["n" if s is None else str(s) for s in f.shape]
        shape = f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"
        line = f"  {name:<24} {f.kind:<12} {f.dtype:<8} {shape:<10}"
        if f.kind == "categorical":
            counts = coll.category_counts(name[4:]) if name.startswith("obs/") else None
            line += "  " + _categories(list(f.categories or ()), args.max_categories,
                                       bool(f.ordered), counts)
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


def _info_anndata(path: Path, args: argparse.Namespace) -> int:
    """Summarise an .h5ad file or AnnData zarr store, opened read-only as the writer does."""
    from .store.inputs import disk_usage, open_input

    kind = "an AnnData zarr store" if path.is_dir() else "an AnnData .h5ad file"
    try:
        src = open_input(path, 0)
    except AnnBatchError as e:
        raise CliError(f"{path}: {kind}, not a collection folder; it cannot be "
                       f"summarised: {e}") from e
    assert src.path is not None
    try:
        layers = {k[len("layers/"):]: p for k, p in src.matrices.items()
                  if k.startswith("layers/")}
        obsm = {k[len("obsm/"):]: p for k, p in src.obsm.items()}
        if args.json:
            def probe(p: Any) -> dict[str, Any]:
                return {"kind": p.kind, "dtype": str(p.dtype), "shape": list(p.shape)}

            print(json.dumps({
                "path": str(src.path), "kind": src.kind, "collection": False,
                "n_obs": src.n_obs, "n_vars": len(src.var_names),
                "X": probe(src.matrices["X"]) if "X" in src.matrices else None,
                "layers": {k: probe(p) for k, p in layers.items()},
                "obsm": {k: probe(p) for k, p in obsm.items()},
                "obs": {c: {"kind": p.kind, "dtype": str(p.dtype),
                            **({"categories": [str(x) for x in p.categories]}
                               if p.categories is not None else {})}
                        for c, p in src.obs.items()},
            }, indent=1))
            return 0

        def matrix(p: Any) -> str:
            cols = f", {p.shape[1]:,} columns" if len(p.shape) == 2 else ""
            return f"{p.kind} {p.dtype}{cols}"

        print(f"{src.path}: {kind}, not a collection folder. Shuffle it into one "
              f"with: {PROG} shuffle {src.path} -o STORE")
        print(f"cells       {src.n_obs:,}")
        print(f"genes       {len(src.var_names):,} (first: {_first(src.var_names)})")
        print(f"on disk     {_human(disk_usage(src.path)[0])}")
        print("X           " + (matrix(src.matrices["X"]) if "X" in src.matrices
                                   else "(none: X is None)"))
        if "raw/X" in src.matrices:  # its columns are its raw genes
            print(f"raw         {matrix(src.matrices['raw/X'])}")
        print("layers      " + (", ".join(f"{k} ({matrix(p)})" for k, p in layers.items())
                                or "(none)"))
        print("obsm        " + (", ".join(f"{k} ({matrix(p)})" for k, p in obsm.items())
                                or "(none)"))
        print(f"obs         {len(src.obs)} column{'' if len(src.obs) == 1 else 's'}")
        for c, p in src.obs.items():
            line = f"  {c:<24} {p.kind:<12} {p.dtype!s:<8}"
            if p.categories is not None:
                line += "  " + _categories(list(p.categories), args.max_categories, p.ordered)
            elif p.why:
                line += f"  ({p.why})"
            print(line.rstrip())
    finally:
        src.close()
    return 0


# -- demo and bench ----------------------------------------------------------------------
def _demo(rest: list[str]) -> int:
    from . import demo

    return int(demo.main(rest) or 0)


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


def _bench(rest: list[str]) -> int:
    script = _REPO / "benchmarks" / "run.py"
    if not script.is_file():
        raise CliError(f"{script} not found: the benchmarks ship with the source repository, "
                       "not the installed package. Clone the repository and run `make bench` "
                       "there.")
    extra: list[str] = []
    announce = not _given(rest, "--out") and not {"-h", "--help"} & set(rest)
    if announce:
        extra = ["--out", str(_bench_out(Path.cwd()))]
    argv = sys.argv
    sys.argv = [str(script), *extra, *rest]
    try:
        bench = runpy.run_path(str(script), run_name="annbatch_torch_bench")
        bench["_parser"]().parse_args([*extra, *rest])  # bad options: one line, nothing run
        if announce:
            print(f"{PROG} bench: results go to {extra[1]} (--out DIR to choose; --out "
                  "benchmarks/results updates the repository's committed results)", flush=True)
        return int(bench["main"]([*extra, *rest]) or 0)
    except SystemExit as e:
        return _exit_status(e)
    finally:
        sys.argv = argv


_PASSTHROUGH: dict[str, Callable[[list[str]], int]] = {"demo": _demo, "bench": _bench}


# -- the parser ----------------------------------------------------------------------------
def _scheduler_feeds(cmd: CliParser) -> None:
    cmd.feed("--scheduler", param="scheduler", choices=["processes", "threads"],
             help="run the two passes on a local Dask cluster of --n-workers processes (or "
                  "threads; the dask extra); default: this process")
    cmd.feed("--n-workers", param="n_workers", type=int, metavar="N",
             help="workers of --scheduler (default: the usable CPUs)")


def build_parser() -> CliParser:
    """The ``annbatch-torch`` argument parser.

    Its :attr:`CliParser.commands` hold the subcommands' parsers; ``shuffle``'s feeds are
    the keyword arguments of :func:`~annbatch_torch.create_anndata_collection`, with its
    defaults.
    """
    from .write.budget import DEFAULT_WORK_MEMORY
    from .write.writer import create_anndata_collection

    p = CliParser(
        prog=PROG, description="Shuffle AnnData into chunked collections for PyTorch data "
        "loading, and inspect them.", epilog=_EXAMPLES,
    )
    p.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
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
    _scheduler_feeds(s)
    s.set_defaults(func=_shuffle)

    from .write.append import append_to_collection

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
    i.set_defaults(func=_info)

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
    argv = [a for i, a in enumerate(argv) if i >= end or a != "--debug"]
    parser = build_parser()
    cmd = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    rest = None
    if cmd is not None and argv[cmd] in _PASSTHROUGH:
        argv, rest = argv[: cmd + 1], argv[cmd + 1 :]
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error (already reported)
        return _exit_status(e)
    try:
        if rest is not None:
            status = _PASSTHROUGH[args.command](rest)
        else:
            with _logging(args.quiet):
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
            print(f"{PROG}: error: {_one_line(msg)}", file=sys.stderr)
            return 2
        print(f"{PROG}: internal error: {type(e).__name__}: {_one_line(e)} (run with --debug "
              "for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
