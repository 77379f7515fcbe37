"""The import rules of the house (four wings under a torch face), checked on the source.

The rules are those of ../shared/DESIGN.md section 1 ("The house: four wings under a torch
face") and docs/architecture.md. Every module of ``annbatch_torch`` is read with ``ast``
(nothing is imported, so the test is fast and needs no optional dependency); each import,
relative or absolute, at module level, inside a function or under ``if TYPE_CHECKING:``, is
resolved to an absolute module name and checked against ``RULES`` below.

A type-only import (under ``if TYPE_CHECKING:``) counts like any other: it names the module it
depends on, so an annotation that needs a forbidden module is the same breach of the layering
(the dependency exists; only its runtime cost is deferred).
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

# --------------------------------------------------------------------------------------------
# The rules: ../shared/DESIGN.md section 1 and docs/architecture.md. Change them there first.
#
# Groups: the four wings and integrations/ are subpackages; "errors" and "fields" are the two
# top-level modules shared by all (errors by every wing, fields by store/ and the face); "face"
# is every other top-level module, the package's __init__.py included.
#   internal: the groups a group may import besides itself (a group's own modules may always
#             import each other). "api" means the top-level package only: `import
#             annbatch_torch` or `from annbatch_torch import X`, never a path below it.
#   third_party_only: if set, the only non-stdlib packages allowed (else any but ..._never).
#   third_party_never: top-level packages never imported.
# No group lists "integrations": nothing in annbatch_torch imports integrations/.
# errors and fields obey the strictest rule of those that import them (sampling/ imports errors,
# store/ imports fields), since what they import, their importers import too.
# --------------------------------------------------------------------------------------------
TORCH = frozenset({"torch", "torchdata", "lightning", "pytorch_lightning"})
WINGS = ("sampling", "store", "read", "write", "integrations")
SHARED = ("errors", "fields")
FACE_MODULES = frozenset(
    {
        "__init__",
        "__main__",
        "annbatch_dataset",
        "loader",
        "lightning",
        "convert",
        "resume",
        "world",
        "torch_sampler",
        "cli",
        "demo",
        "datasets",
    }
)

RULES: dict[str, dict[str, frozenset[str] | None]] = {
    "sampling": {
        "internal": frozenset({"errors"}),
        "third_party_only": frozenset({"numpy"}),  # pure numpy: no torch, zarr, h5py, anndata
        "third_party_never": TORCH,
    },
    "store": {
        "internal": frozenset({"errors", "fields"}),
        "third_party_only": None,
        "third_party_never": TORCH,
    },
    "write": {
        "internal": frozenset({"store", "sampling", "errors"}),
        "third_party_only": None,
        "third_party_never": TORCH,
    },
    "read": {
        "internal": frozenset({"store", "sampling", "errors"}),
        "third_party_only": None,
        "third_party_never": frozenset(),  # torch allowed
    },
    "face": {
        "internal": frozenset({"sampling", "store", "read", "write", "errors", "fields"}),
        "third_party_only": None,
        "third_party_never": frozenset(),
    },
    "integrations": {
        "internal": frozenset({"api"}),
        "third_party_only": None,
        "third_party_never": frozenset(),
    },
    "errors": {
        "internal": frozenset(),
        "third_party_only": frozenset({"numpy"}),  # imported by sampling/
        "third_party_never": TORCH,
    },
    "fields": {
        "internal": frozenset({"errors"}),
        "third_party_only": None,
        "third_party_never": TORCH,  # imported by store/
    },
}

PACKAGE = "annbatch_torch"
ROOT = Path(__file__).resolve().parents[1]
PKG_DIR = ROOT / PACKAGE
STDLIB = frozenset(sys.stdlib_module_names)


def label(group: str) -> str:
    return f"{group}/" if group in WINGS else ("the face" if group == "face" else f"`{group}`")


# --------------------------------------------------------------------------------------------
# reading the imports
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Edge:
    file: str  # path relative to the repository root
    line: int
    importer: str  # absolute module name of the importing file
    target: str  # absolute module name imported (a submodule where `from m import sub` is one)
    via: str  # the module named by the statement: `from <via> import ...` / `import <via>`
    name: str | None  # the name imported by `from via import name` when it is no submodule

    def where(self) -> str:
        return f"{self.file}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_internal_module(name: str) -> bool:
    """Whether the dotted name is a module or package file under annbatch_torch/."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return False
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def resolve_base(importer: str, is_package: bool, module: str | None, level: int) -> str:
    """The absolute module of `from <.. * level><module> import ...` written in `importer`."""
    if level == 0:
        assert module is not None
        return module
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    if level - 1 >= len(package):
        raise ValueError(f"relative import beyond the top-level package in {importer}")
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def dynamic_import(node: ast.Call, importer: str) -> str | None:
    """`importlib.import_module("x")` / `__import__("x")` with a name known from the source."""
    func = node.func
    fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if fname not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr):  # f"{__name__}.datasets"
        out = []
        for part in arg.values:
            if isinstance(part, ast.Constant):
                out.append(str(part.value))
            elif isinstance(part.value, ast.Name) and part.value.id in ("__name__", "__package__"):
                out.append(importer)
            else:
                return None
        return "".join(out)
    return None


@cache
def python_files() -> tuple[Path, ...]:
    return tuple(sorted(PKG_DIR.rglob("*.py")))


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


@cache
def edges_of(path: Path) -> tuple[Edge, ...]:
    importer = module_name(path)
    is_package = path.name == "__init__.py"
    file = path.relative_to(ROOT).as_posix()
    out: list[Edge] = []
    # ast.walk reaches every statement: module level, functions, `if TYPE_CHECKING:` blocks
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Edge(file, node.lineno, importer, alias.name, alias.name, None))
        elif isinstance(node, ast.ImportFrom):
            base = resolve_base(importer, is_package, node.module, node.level)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if alias.name != "*" and is_internal_module(sub):  # `from . import reader`
                    out.append(Edge(file, node.lineno, importer, sub, base, None))
                else:
                    out.append(Edge(file, node.lineno, importer, base, base, alias.name))
        elif isinstance(node, ast.Call):
            target = dynamic_import(node, importer)
            if target is not None:
                out.append(Edge(file, node.lineno, importer, target, target, None))
    return tuple(sorted(out, key=lambda e: (e.line, e.target)))


def group_of(module: str) -> str:
    """The group of an annbatch_torch module name."""
    parts = module.split(".")
    assert parts[0] == PACKAGE, module
    if len(parts) == 1:
        return "face"  # the package's __init__.py
    if parts[1] in WINGS or parts[1] in SHARED:
        return parts[1]
    return "face"


def is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


# --------------------------------------------------------------------------------------------
# the checks
# --------------------------------------------------------------------------------------------


def layering_breaches(group: str) -> list[str]:
    rule = RULES[group]
    allowed = rule["internal"] or frozenset()
    only = rule["third_party_only"]
    never = rule["third_party_never"] or frozenset()
    breaches: list[str] = []
    for path in python_files():
        if group_of(module_name(path)) != group:
            continue
        for e in edges_of(path):
            top = e.target.split(".")[0]
            if top == PACKAGE:
                tgroup = group_of(e.target)
                if tgroup == group:
                    continue
                if "api" in allowed and e.via == PACKAGE:
                    continue  # `import annbatch_torch` / `from annbatch_torch import X`
                if tgroup in allowed:
                    continue
                if tgroup == "integrations":
                    why = "nothing in annbatch_torch imports integrations/"
                elif group == "integrations":
                    why = (
                        "integrations/ imports the public API only "
                        "(`import annbatch_torch` / `from annbatch_torch import X`)"
                    )
                elif tgroup == "face":
                    why = "no wing imports the face"
                else:
                    may = (
                        ", ".join(label(g) for g in sorted(allowed)) or "nothing in annbatch_torch"
                    )
                    why = f"{label(group)} may import only {may}; never {label(tgroup)}"
                breaches.append(f"{e.where()}: imports {e.target} ({label(tgroup)}): {why}")
            elif top in never:
                breaches.append(
                    f"{e.where()}: imports {e.target}: {label(group)} never imports torch "
                    f"({', '.join(sorted(never))})"
                )
            elif only is not None and top not in STDLIB and top not in only:
                breaches.append(
                    f"{e.where()}: imports {e.target}: {label(group)} may import only the "
                    f"standard library and {', '.join(sorted(only))} (third-party)"
                )
    return breaches


@pytest.mark.parametrize("group", list(RULES))
def test_import_rules(group: str) -> None:
    breaches = layering_breaches(group)
    if breaches:
        pytest.fail(
            f"{len(breaches)} import rule breach(es) in {label(group)}:\n" + "\n".join(breaches),
            pytrace=False,
        )


def test_every_module_belongs_to_a_known_group() -> None:
    """A new folder or top-level module must be added to the rules above (and to DESIGN)."""
    unknown = []
    for path in python_files():
        parts = path.relative_to(PKG_DIR).parts
        if len(parts) == 1:
            stem = path.stem
            if stem not in FACE_MODULES and stem not in SHARED:
                unknown.append(f"{PACKAGE}/{parts[0]}: top-level module not in FACE_MODULES")
        elif parts[0] not in WINGS:
            unknown.append(f"{PACKAGE}/{'/'.join(parts)}: folder {parts[0]}/ is no known wing")
    if unknown:
        pytest.fail(
            "modules outside the rules of tests/test_architecture.py:\n" + "\n".join(unknown),
            pytrace=False,
        )


def test_no_private_imports_across_groups() -> None:
    """A wing (or the face) uses another's public names only: no `_module`, no `_name`."""
    breaches = []
    for path in python_files():
        for e in edges_of(path):
            if e.target.split(".")[0] != PACKAGE:
                continue
            src, dst = group_of(e.importer), group_of(e.target)
            if src == dst:
                continue
            private_parts = [p for p in e.target.split(".")[1:] if is_private(p)]
            if private_parts:
                breaches.append(
                    f"{e.where()}: imports private module {e.target} of {label(dst)} "
                    f"from {label(src)}"
                )
            elif e.name is not None and is_private(e.name):
                breaches.append(
                    f"{e.where()}: imports private name {e.name} from {e.target} "
                    f"({label(dst)}) into {label(src)}"
                )
    if breaches:
        pytest.fail(
            f"{len(breaches)} private import(s) across groups:\n" + "\n".join(breaches),
            pytrace=False,
        )


def test_no_mixins() -> None:
    """Composition over mixins (DESIGN section 1): a split that needs its host is cut wrong."""
    mixins = [
        f"{path.relative_to(ROOT).as_posix()}:{node.lineno}: class {node.name}"
        for path in python_files()
        for node in ast.walk(parsed(path))
        if isinstance(node, ast.ClassDef) and node.name.endswith("Mixin")
    ]
    if mixins:
        pytest.fail(
            "mixin classes in annbatch_torch (prefer composition):\n" + "\n".join(mixins),
            pytrace=False,
        )


def test_relative_imports_resolve() -> None:
    """The resolver itself, on the forms the package uses."""
    assert resolve_base("annbatch_torch.read.reader", False, "store.x", 2) == (
        "annbatch_torch.store.x"
    )
    assert resolve_base("annbatch_torch.read.reader", False, None, 1) == "annbatch_torch.read"
    assert resolve_base("annbatch_torch.read", True, "reader", 1) == "annbatch_torch.read.reader"
    assert resolve_base("annbatch_torch.read.reader", False, None, 2) == "annbatch_torch"
    assert resolve_base("annbatch_torch", True, "errors", 1) == "annbatch_torch.errors"
    assert group_of("annbatch_torch") == "face"
    assert group_of("annbatch_torch.sampling.plan") == "sampling"
    assert group_of("annbatch_torch.errors") == "errors"
    assert group_of("annbatch_torch.convert") == "face"
    with pytest.raises(ValueError, match="beyond"):
        resolve_base("annbatch_torch", True, None, 2)


def test_serial_tests_are_run_by_make_test() -> None:
    """``make test`` runs the tests in parallel except the ``serial`` ones, which it runs
    after, from the files its ``SERIAL`` lists: a serial test elsewhere would never run."""
    root = Path(__file__).resolve().parent.parent
    make = (root / "Makefile").read_text()
    listed = set(re.search(r"^SERIAL := (.*)$", make, re.M).group(1).split())  # type: ignore[union-attr]
    mark = "pytest.mark." + "serial"  # not spelt whole here, or this file would match
    marked = {f"tests/{p.name}" for p in (root / "tests").glob("test_*.py")
              if mark in p.read_text()}
    assert marked == listed
