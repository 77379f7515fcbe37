"""The flags of ``annbatch-torch`` that feed the library's parameters.

Each flag declares the parameter it feeds where it is defined (:meth:`CliParser.feed`), and that
one table gives the call's keyword arguments, the flags' defaults (the library's own) and the
translation of the library's messages, which name Python parameters (``overwrite=True``), into
the flags that feed them (``--overwrite``): :func:`speak_cli`. Also the parser's help
formatting (:class:`HelpFormatter`, :func:`plain_text`) and argument types
(:func:`int_at_least`, :func:`gene_list_file`, :func:`raw_choice`).
"""

from __future__ import annotations

import argparse
import inspect
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

__all__ = [
    "PROG", "RAW_CHOICES", "CliError", "CliParser", "Feed", "HelpFormatter", "gene_list_file",
    "int_at_least", "one_line", "plain_text", "raw_choice", "speak_cli",
]

#: the command's name in messages
PROG = "annbatch-torch"


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
    absent_is_none
        Whether leaving the argument out passes ``None`` (its default is ``None``).
    """

    param: str
    dest: str
    flag: str
    kind: str
    metavar: str = ""
    words: tuple[tuple[str, str], ...] = ()
    absent_is_none: bool = False

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
        self.feeds[param] = Feed(param, action.dest, flag, kind, metavar, words,
                                 absent_is_none=kind == "value" and action.default is None)
        return action

    def api_kwargs(self, args: argparse.Namespace) -> dict[str, Any]:
        """Keyword arguments of :attr:`api` from parsed arguments, one per feed."""
        return {f.param: f.value(args) for f in self.feeds.values()}

    def error(self, message: str) -> NoReturn:
        """Print ``annbatch-torch: error: <message>`` (one line) and exit with status 2."""
        self.exit(2, f"{PROG}: error: {one_line(message)} (see '{self.prog} --help')\n")


class CliError(Exception):
    """A user error found by the command itself (exit status 2, no traceback)."""


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
    ``annbatch-torch shuffle ... --overwrite``. A value parameter of any spelling is its
    flag where it opens a ``NAME must be ...`` sentence (the form of
    :func:`~annbatch_torch.errors.check_int`): ``seed must be an integer >= 0 (or None for
    a fresh random seed), got -1.`` becomes ``--seed must be an integer >= 0, got -1.``, as
    the command line cannot pass None; where leaving the flag out passes None, the note
    says so (``(or leave --n-workers out ...)``). The table is the parsers' feeds
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
            # "seed must be ...": a check's sentence about the parameter, where a sentence
            # or a clause starts (elsewhere a bare word may be no parameter: "obs column
            # seed must be categorical", "raw holds one matrix")
            message = re.sub(rf"(?:^|(?<=: )|(?<=\. )|(?<=; ))({alts(valued)})(?= must be )",
                             lambda m: feeds[m.group(1)].flag, message)
        flags = {f.flag: f for f in feeds.values() if f.kind == "value"}
        if flags:  # check_int's note: "(or None ...)" as the command line can say it
            message = re.sub(
                rf"(?<![\w-])({alts(flags)})( must be an integer [^(,]*?) \(([^()]*)\)"
                r"(?=, got )",
                lambda m: m.group(1) + m.group(2) + _cli_note(m.group(3), flags[m.group(1)]),
                message)
    return message


def _cli_note(note: str, feed: Feed) -> str:
    """A check_int note (the text in parentheses) in the command line's terms: "None" is
    leaving ``feed``'s flag out, or, where that passes another default, no option at all."""
    clauses = []
    for clause in note.split("; "):
        if feed.absent_is_none:
            clause = re.sub(r"\bor None\b", f"or leave {feed.flag} out", clause)
        elif clause.startswith("or None"):
            continue
        else:
            clause = re.sub(r" or None\b", "", clause)
        clauses.append(clause)
    return f" ({'; '.join(clauses)})" if clauses else ""


def one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", str(text)).strip()
