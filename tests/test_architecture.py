"""The import rules of the house (four wings under a torch face), checked on the source.

The rules are those of ../shared/DESIGN.md section 1 ("The house: four wings under a torch
face") and docs/architecture.md. Every module of ``annbatch_torch`` is read with ``ast``
(nothing is imported, so the test is fast and needs no optional dependency); each import,
relative or absolute, at module level, inside a function or under ``if TYPE_CHECKING:``, is
resolved to an absolute module name and checked:

* the wing rules (``RULES`` below): which groups and third-party packages a group may import
  (``test_import_rules``), every module in a known group, no private name or module of another
  group, no mixin classes, every import of an ``annbatch_torch`` module names one that exists
  (``test_internal_imports_name_existing_modules``);
* no cycle in the module graph (``test_no_import_cycles``);
* no ``from m import _private`` (nor an import of a private module) across modules at all
  (``test_no_private_imports_across_modules``);
* no public top-level ``def``/``class`` defined in two modules
  (``test_no_public_name_defined_twice``);
* the order inside ``store/``: inputs/ -> store root -> remote/ -> leaf root modules
  (``test_store_sub_wing_order``);
* the face in levels, ``FACE_ORDER`` below (``test_face_order``);
* each wing's and sub-wing's ``__init__`` docstring names its modules
  (``test_package_docstrings_name_their_modules``).

Rules 4-6 (store order, face order, docstrings) presuppose the target layout (store/inputs/,
store/remote/, cli/, batches.py) and fail, naming what is missing, until it is built; each has a
self-check on synthetic data so that it cannot pass vacuously.

A type-only import (under ``if TYPE_CHECKING:``) counts like any other: it names the module it
depends on, so an annotation that needs a forbidden module is the same breach of the layering
(the dependency exists; only its runtime cost is deferred).
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

# --------------------------------------------------------------------------------------------
# The rules: ../shared/DESIGN.md section 1 and docs/architecture.md. Change them there first.
#
# Groups: the four wings and integrations/ are subpackages; "errors" and "fields" are the two
# top-level modules shared by all (errors by every wing, fields by store/ and the face); "face"
# is every other top-level module, the package's __init__.py included, and the cli/ package.
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
FACE_PACKAGES = ("cli",)  # packages of the face: annbatch_torch/cli/*.py

# The face in levels (DESIGN section 1: "world, errors, fields < convert, torch_sampler, batches,
# resume < annbatch_dataset < loader < lightning < cli, integrations"). A face module may import
# modules of its own level or lower ones (a cycle inside a level is test_no_import_cycles'
# business); the wings sit below the whole face (the wing rules above keep them from importing
# it). "cli" and "integrations" stand for their whole packages.
# Placed beyond DESIGN's list:
#   datasets: level 0. It imports no annbatch_torch module (numpy, pandas, scipy, anndata only)
#             and is imported by the package's __init__ (lazily) and by cli/demo.py: a leaf.
#   __init__: the public API, just below cli and integrations: it re-exports levels 0-4 and
#             the wings, and integrations/ is built on it (`from annbatch_torch import X`, the
#             integrations rule) as is the cli (`annbatch_torch.__version__`). Put at the very
#             top, every integrations module would breach the order; so __init__ may import
#             anything but cli/ and integrations/.
#   __main__: the very top (`python -m annbatch_torch`): may import anything.
#   diversity: beside loader (the shuffle-quality report: it reads a dataset's plan and its
#             obs, and imports annbatch_dataset; nothing below the cli imports it).
FACE_ORDER: tuple[tuple[str, ...], ...] = (
    ("world", "errors", "fields", "datasets"),
    ("convert", "torch_sampler", "batches", "resume"),
    ("annbatch_dataset",),
    ("loader", "diversity"),
    ("lightning",),
    ("__init__",),
    ("cli", "integrations"),
    ("__main__",),
)
FACE_LEVEL = {unit: level for level, units in enumerate(FACE_ORDER) for unit in units}
# the top-level modules of the face (files annbatch_torch/<stem>.py), read off FACE_ORDER
FACE_MODULES = frozenset(FACE_LEVEL) - set(SHARED) - set(FACE_PACKAGES) - {"integrations"}

# the packages whose __init__.py docstring must name each of its modules (rule 6)
DOCUMENTED_PACKAGES = (
    "sampling",
    "store",
    "store/inputs",
    "store/remote",
    "read",
    "write",
    "integrations",
    "integrations/scvi",
    "cli",
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
STORE = f"{PACKAGE}.store"
STORE_INPUTS = f"{STORE}.inputs"
STORE_REMOTE = f"{STORE}.remote"


def label(group: str) -> str:
    """How a group is named in a message: ``store/``, ``the face``, ```errors```."""
    return f"{group}/" if group in WINGS else ("the face" if group == "face" else f"`{group}`")


def short(module: str) -> str:
    """A module name without the package prefix, for compact messages."""
    return module[len(PACKAGE) + 1 :] if module.startswith(PACKAGE + ".") else module


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
        """``file:line`` of the import statement."""
        return f"{self.file}:{self.line}"

    def taken(self) -> str:
        """What the statement takes: the name, the submodule, or the whole module."""
        if self.name is not None:
            return self.name
        if self.via != self.target:
            return f"module {self.target.rsplit('.', 1)[-1]}"
        return f"import {self.target}"


def module_name(path: Path) -> str:
    """The dotted module name of a file under ROOT (a package's ``__init__`` is the package)."""
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
    """Every .py file of the package, sorted."""
    return tuple(sorted(PKG_DIR.rglob("*.py")))


@cache
def parsed(path: Path) -> ast.Module:
    """The file's syntax tree."""
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


@cache
def edges_of(path: Path) -> tuple[Edge, ...]:
    """Every import in the file (module level, in functions, under TYPE_CHECKING, dynamic)."""
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


@cache
def internal_edges() -> tuple[Edge, ...]:
    """The module graph: every import from one annbatch_torch module of another one.

    `from pkg import sub` is an edge to the submodule, `import pkg` / `from pkg import name` an
    edge to pkg's __init__.py, `from a.b.c import z` an edge to a.b.c only (the parents' inits
    run too, but counting them would make every package that re-exports cyclic).
    """
    return tuple(
        e
        for path in python_files()
        for e in edges_of(path)
        if e.target != e.importer and is_internal_module(e.target)
    )


def group_of(module: str) -> str:
    """The group of an annbatch_torch module name."""
    parts = module.split(".")
    assert parts[0] == PACKAGE, module
    if len(parts) == 1:
        return "face"  # the package's __init__.py
    if parts[1] in WINGS or parts[1] in SHARED:
        return parts[1]
    if parts[1] in FACE_PACKAGES:
        return "face"  # annbatch_torch.cli.*
    return "face"


def is_private(part: str) -> bool:
    """One leading underscore, not a dunder."""
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def synthetic_edge(importer: str, target: str, name: str | None = None, line: int = 1) -> Edge:
    """An edge for the checkers' self-tests: names without the package prefix ("" is the
    package's __init__), `from target import name` (or `import target` where name is None)."""
    imp = f"{PACKAGE}.{importer}" if importer else PACKAGE
    tgt = f"{PACKAGE}.{target}" if target else PACKAGE
    file = f"{imp.replace('.', '/')}.py" if importer else f"{PACKAGE}/__init__.py"
    return Edge(file, line, imp, tgt, tgt, name)


def per_statement(edges: Iterable[Edge]) -> list[tuple[Edge, str]]:
    """The edges merged per import statement and target: (the first edge, the names taken)."""
    merged: dict[tuple[str, int, str, str], list[Edge]] = defaultdict(list)
    for e in edges:
        merged[(e.file, e.line, e.importer, e.target)].append(e)
    return [
        (group[0], ", ".join(sorted({e.taken() for e in group}))) for group in merged.values()
    ]


# --------------------------------------------------------------------------------------------
# the wing rules
# --------------------------------------------------------------------------------------------


def layering_breaches(group: str) -> list[str]:
    """Imports of `group`'s modules that its entry in RULES forbids."""
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
    """Each group imports only the groups and third-party packages its rule allows."""
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
        elif parts[0] not in WINGS and parts[0] not in FACE_PACKAGES:
            unknown.append(
                f"{PACKAGE}/{'/'.join(parts)}: folder {parts[0]}/ is no known wing "
                f"(nor a face package: {', '.join(f'{p}/' for p in FACE_PACKAGES)})"
            )
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
    assert group_of("annbatch_torch.cli.main") == "face"
    assert group_of("annbatch_torch.cli") == "face"
    with pytest.raises(ValueError, match="beyond"):
        resolve_base("annbatch_torch", True, None, 2)


def test_internal_imports_name_existing_modules() -> None:
    """An import of ``annbatch_torch.x`` names a module that exists (a move leaves none behind;
    a function-level import of a moved module fails only when that function runs)."""
    missing = [
        f"{e.where()}: imports {e.target} ({e.taken()}): no such module in {PACKAGE}/"
        for path in python_files()
        for e in edges_of(path)
        if e.target.split(".")[0] == PACKAGE and not is_internal_module(e.target)
    ]
    if missing:
        pytest.fail(
            f"{len(missing)} import(s) of annbatch_torch modules that do not exist:\n"
            + "\n".join(missing),
            pytrace=False,
        )


# --------------------------------------------------------------------------------------------
# rule 1: no cycle in the module graph
# --------------------------------------------------------------------------------------------


def strongly_connected(edges: Iterable[Edge]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module, each sorted
    (Tarjan's algorithm, iterative)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        graph[e.importer].add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def shortest_cycle(edges: Iterable[Edge], component: list[str]) -> list[str]:
    """A shortest cycle inside one component, as the modules in order (first repeated last)."""
    members = set(component)
    graph: dict[str, list[str]] = defaultdict(list)
    for e in edges:
        if e.importer in members and e.target in members:
            graph[e.importer].append(e.target)
    best: list[str] | None = None
    for start in component:
        parent: dict[str, str] = {}
        queue = deque([start])
        seen = {start}
        found = None
        while queue and found is None:
            node = queue.popleft()
            for child in sorted(set(graph[node])):
                if child == start:
                    found = node
                    break
                if child not in seen:
                    seen.add(child)
                    parent[child] = node
                    queue.append(child)
        if found is None:
            continue
        path = [found]
        while path[-1] != start:
            path.append(parent[path[-1]])
        cycle = [*reversed(path), start]
        if best is None or len(cycle) < len(best):
            best = cycle
    assert best is not None, component
    return best


def cycle_report(edges: Iterable[Edge]) -> list[str]:
    """One paragraph per cycle: its modules, a shortest cycle, and each import inside it."""
    edges = list(edges)
    reports = []
    for component in strongly_connected(edges):
        members = set(component)
        cycle = shortest_cycle(edges, component)
        inside = [e for e in edges if e.importer in members and e.target in members]
        lines = [
            f"cycle of {len(component)} modules: {', '.join(short(m) for m in component)}",
            f"  shortest: {' -> '.join(short(m) for m in cycle)}",
        ]
        for e, taken in sorted(per_statement(inside), key=lambda x: (x[0].file, x[0].line)):
            lines.append(f"  {e.where()} -> {e.target} ({taken})")
        reports.append("\n".join(lines))
    return reports


def test_cycle_checker_catches_cycles() -> None:
    """The checker itself, on a synthetic graph: a 3-cycle, a 2-cycle, a tail, a DAG part."""
    edges = [
        synthetic_edge("write.append", "write.prepare", "prepare_collection", 10),
        synthetic_edge("write.prepare", "write.staleness", "store_staleness", 20),
        synthetic_edge("write.staleness", "write.append", None, 30),
        synthetic_edge("write.prepare", "write.append", "append_to_collection", 21),
        synthetic_edge("cli", "demo", None, 5),
        synthetic_edge("demo", "cli", "main", 7),
        synthetic_edge("loader", "annbatch_dataset", "AnnBatchDataset", 3),
        synthetic_edge("annbatch_dataset", "errors", "AnnBatchError", 4),
    ]
    assert strongly_connected(edges) == [
        ["annbatch_torch.cli", "annbatch_torch.demo"],
        ["annbatch_torch.write.append", "annbatch_torch.write.prepare",
         "annbatch_torch.write.staleness"],
    ]
    component = strongly_connected(edges)[1]
    assert len(shortest_cycle(edges, component)) == 3  # append -> prepare -> append
    report = cycle_report(edges)
    assert len(report) == 2
    assert "annbatch_torch/demo.py:7 -> annbatch_torch.cli (main)" in report[0]
    assert "annbatch_torch/write/prepare.py:20 -> annbatch_torch.write.staleness" in report[1]
    assert strongly_connected(edges[-2:]) == []


def test_no_import_cycles() -> None:
    """The module graph of annbatch_torch has no cycle (module-level, function-level and
    TYPE_CHECKING imports all count): each module can be understood, and imported, before
    those that use it."""
    reports = cycle_report(internal_edges())
    if reports:
        pytest.fail(
            f"{len(reports)} import cycle(s) in {PACKAGE} (each strongly connected component; "
            "the edges are file:line -> module (names taken)):\n" + "\n".join(reports),
            pytrace=False,
        )


# --------------------------------------------------------------------------------------------
# rule 2: no private name or private module imported from another module
# --------------------------------------------------------------------------------------------


def private_import_breaches(edges: Iterable[Edge]) -> list[str]:
    """Imports of a `_private` name or module of another annbatch_torch module."""
    breaches = []
    for e in edges:
        if e.target.split(".")[0] != PACKAGE or e.target == e.importer:
            continue
        private_parts = [p for p in e.target.split(".")[1:] if is_private(p)]
        if private_parts:
            breaches.append(
                f"{e.where()}: {short(e.importer)} imports private module {e.target} "
                f"({e.taken()})"
            )
        elif e.name is not None and is_private(e.name):
            breaches.append(
                f"{e.where()}: {short(e.importer)} imports private name {e.name} "
                f"from {e.target}"
            )
    return breaches


def test_private_import_checker() -> None:
    """The checker itself: private names and modules of the package, not third-party ones."""
    edges = [
        synthetic_edge("read.device_pool", "read.gpu_backends", "_cupy_kernel", 12),
        synthetic_edge("write.append", "write._impl", None, 5),
        synthetic_edge("write.append", "write.writer", "create_anndata_collection", 6),
        synthetic_edge("write.append", "write.writer", "__all__", 7),
        Edge("annbatch_torch/store/zarrs.py", 3, "annbatch_torch.store.zarrs",
             "zarrs._internal", "zarrs._internal", "_thing"),
    ]
    assert private_import_breaches(edges) == [
        "annbatch_torch/read/device_pool.py:12: read.device_pool imports private name "
        "_cupy_kernel from annbatch_torch.read.gpu_backends",
        "annbatch_torch/write/append.py:5: write.append imports private module "
        "annbatch_torch.write._impl (import annbatch_torch.write._impl)",
    ]


def test_no_private_imports_across_modules() -> None:
    """A module uses another's public names only: no `from m import _private`, no `_module`
    (inside a wing too; private names of third-party packages are not in scope)."""
    breaches = private_import_breaches(e for path in python_files() for e in edges_of(path))
    if breaches:
        pytest.fail(
            f"{len(breaches)} private import(s) across modules (make the name public, or move "
            "the code that needs it next to it):\n" + "\n".join(breaches),
            pytrace=False,
        )


# --------------------------------------------------------------------------------------------
# rule 3: no public name defined twice
# --------------------------------------------------------------------------------------------


def top_level_definitions(tree: ast.Module) -> list[tuple[str, int, str]]:
    """(name, line, "def" / "class") of each top-level function and class, those under a
    top-level ``if`` / ``try`` included (still module scope); not methods, not assignments."""
    out = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out.append((node.name, node.lineno, "def"))
        elif isinstance(node, ast.ClassDef):
            out.append((node.name, node.lineno, "class"))
        elif isinstance(node, ast.If):
            pending.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try | ast.TryStar):
            pending.extend(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                pending.extend(handler.body)
    return sorted(out, key=lambda d: d[1])


def duplicate_definitions(
    definitions: dict[str, list[tuple[str, int, str]]],
) -> list[str]:
    """Public names defined in more than one file; `definitions` maps file -> its
    top-level definitions."""
    where: dict[str, list[str]] = defaultdict(list)
    for file, defs in sorted(definitions.items()):
        seen = set()
        for name, line, kind in defs:
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            where[name].append(f"{file}:{line} ({kind})")
    return [
        f"{name}: defined in {len(places)} modules: {', '.join(places)}"
        for name, places in sorted(where.items())
        if len(places) > 1
    ]


def test_duplicate_definition_checker() -> None:
    """The checker itself, on a synthetic package."""
    tree = ast.parse(
        "import x\nclass Segment: pass\ndef _hidden(): pass\nif x:\n    def main(): pass\n"
        "else:\n    def main(): pass\nclass C:\n    def method(self): pass\nrank_items = 1\n"
    )
    assert top_level_definitions(tree) == [
        ("Segment", 2, "class"), ("_hidden", 3, "def"), ("main", 5, "def"),
        ("main", 7, "def"), ("C", 8, "class"),
    ]
    assert duplicate_definitions(
        {
            "a.py": top_level_definitions(tree),
            "b.py": [("Segment", 4, "class"), ("_hidden", 1, "def"), ("method", 9, "def")],
        }
    ) == ["Segment: defined in 2 modules: a.py:2 (class), b.py:4 (class)"]


def test_no_public_name_defined_twice() -> None:
    """A public top-level class or function is defined in one module: two of one name are two
    concepts with one name, or one concept cut in two."""
    breaches = duplicate_definitions(
        {
            path.relative_to(ROOT).as_posix(): top_level_definitions(parsed(path))
            for path in python_files()
        }
    )
    if breaches:
        pytest.fail(
            f"{len(breaches)} public name(s) defined in more than one module of {PACKAGE}:\n"
            + "\n".join(breaches),
            pytrace=False,
        )


# --------------------------------------------------------------------------------------------
# rule 4: inside store/, inputs/ -> store root -> remote/ -> leaf root modules
# --------------------------------------------------------------------------------------------


def store_part(module: str) -> str | None:
    """"inputs", "remote" or "root" for a module of store/ (its __init__ is root); else None."""
    if module == STORE_INPUTS or module.startswith(STORE_INPUTS + "."):
        return "inputs"
    if module == STORE_REMOTE or module.startswith(STORE_REMOTE + "."):
        return "remote"
    if module == STORE or module.startswith(STORE + "."):
        return "root"
    return None


def path_to_remote(edges: Iterable[Edge], start: str) -> list[str] | None:
    """A shortest import chain from `start` to a module of store/remote/, or None."""
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        graph[e.importer].add(e.target)
    parent: dict[str, str] = {}
    seen = {start}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node != start and store_part(node) == "remote":
            chain = [node]
            while chain[-1] != start:
                chain.append(parent[chain[-1]])
            return chain[::-1]
        for child in sorted(graph[node]):
            if child not in seen:
                seen.add(child)
                parent[child] = node
                queue.append(child)
    return None


def store_order_breaches(edges: Iterable[Edge]) -> list[str]:
    """Imports inside store/ against the order inputs/ -> store root -> remote/ -> leaf root
    modules (root modules that do not import remote/, directly or transitively)."""
    edges = list(edges)
    breaches = []
    for e, taken in per_statement(edges):
        src, dst = store_part(e.importer), store_part(e.target)
        if src is None or dst is None:
            continue
        if dst == "inputs" and src != "inputs":
            breaches.append(
                f"{e.where()}: {short(e.importer)} (store/{'' if src == 'root' else 'remote/'}) "
                f"imports {short(e.target)} ({taken}): only store/inputs/ imports "
                "store/inputs/ (the order is inputs/ -> store root -> remote/ -> leaf root)"
            )
        elif src == "remote" and dst == "root":
            chain = path_to_remote(edges, e.target)
            if chain is not None:
                breaches.append(
                    f"{e.where()}: {short(e.importer)} (store/remote/) imports "
                    f"{short(e.target)} ({taken}), a store root module that imports "
                    f"store/remote/ ({' -> '.join(short(m) for m in chain)}): remote/ may "
                    "import only leaf root modules, those that import no store/remote/ module"
                )
    return breaches


def test_store_order_checker() -> None:
    """The checker itself, on a synthetic store/ (edges given as data)."""
    edges = [
        synthetic_edge("store.remote.mirror", "store.rawzarr", "read_chunk", 10),  # rawzarr
        synthetic_edge("store.rawzarr", "store.diskio", "preadv", 3),  # is no leaf: it
        synthetic_edge("store.diskio", "store.remote.chunkcache", "ChunkCache", 4),  # -> remote
        synthetic_edge("store.remote.location", "store.manifest", "MANIFEST_NAME", 5),  # leaf
        synthetic_edge("store.remote.mirror", "store.remote.location", "is_url", 6),
        synthetic_edge("store.collection", "store.remote.mirror", "MirrorStore", 7),
        synthetic_edge("store.collection", "store.inputs.view", "InputView", 8),  # root->inputs
        synthetic_edge("store.remote.mirror", "store.inputs", None, 9),  # remote -> inputs
        synthetic_edge("store.inputs.view", "store.remote.location", "is_url", 11),
        synthetic_edge("store.inputs.view", "store.collection", "Collection", 12),
        synthetic_edge("write.writer", "store.inputs.view", "InputView", 13),  # not store/
    ]
    breaches = store_order_breaches(edges)
    assert len(breaches) == 3, breaches
    assert breaches[0].startswith("annbatch_torch/store/remote/mirror.py:10: store.remote.mirror")
    assert "(store.rawzarr -> store.diskio -> store.remote.chunkcache)" in breaches[0]
    assert breaches[1].startswith("annbatch_torch/store/collection.py:8: store.collection (store/)")
    assert breaches[2].startswith(
        "annbatch_torch/store/remote/mirror.py:9: store.remote.mirror (store/remote/) "
        "imports store.inputs (import annbatch_torch.store.inputs)"
    )
    assert store_order_breaches(edges[3:6] + edges[8:]) == []


def test_store_sub_wing_order() -> None:
    """store/ has root modules and two sub-packages, inputs/ and remote/, in the order
    inputs/ -> store root -> remote/ -> leaf root modules: nothing of store/ outside inputs/
    imports inputs/, and remote/ imports only remote/ and the root modules that do not import
    remote/ themselves (manifest, rawzarr, the chunk readers)."""
    missing = []
    for sub in ("inputs", "remote"):
        if not (PKG_DIR / "store" / sub / "__init__.py").is_file():
            today = PKG_DIR / "store" / f"{sub}.py"
            was = f" (today store/{sub}.py is a module)" if today.is_file() else ""
            missing.append(f"{PACKAGE}/store/{sub}/ missing: the target layout has it{was}")
    breaches = missing + store_order_breaches(internal_edges())
    if breaches:
        pytest.fail(
            f"{len(breaches)} breach(es) of the store/ order (inputs/ -> store root -> remote/ "
            "-> leaf root modules):\n" + "\n".join(breaches),
            pytrace=False,
        )


# --------------------------------------------------------------------------------------------
# rule 5: the face in levels (FACE_ORDER)
# --------------------------------------------------------------------------------------------


def face_unit(module: str) -> str | None:
    """The unit of FACE_ORDER a module belongs to (its stem, "cli", "integrations",
    "__init__"), or None for a wing module (below the whole face)."""
    parts = module.split(".")
    assert parts[0] == PACKAGE, module
    if len(parts) == 1:
        return "__init__"
    if parts[1] in FACE_PACKAGES or parts[1] == "integrations":
        return parts[1]
    if parts[1] in WINGS:
        return None
    return parts[1]


def face_order_breaches(edges: Iterable[Edge], modules: Iterable[str]) -> list[str]:
    """Face modules outside FACE_ORDER, and imports of a higher level than the importer's."""
    breaches = []
    for module in sorted(modules):
        unit = face_unit(module)
        if unit is not None and unit not in FACE_LEVEL:
            breaches.append(f"{module}: {unit} has no level in the face order (FACE_ORDER)")
    for e, taken in per_statement(edges):
        src, dst = face_unit(e.importer), face_unit(e.target)
        if src is None or dst is None or src == dst:
            continue
        ls, ld = FACE_LEVEL.get(src), FACE_LEVEL.get(dst)
        if ls is None or ld is None or ld <= ls:
            continue
        breaches.append(
            f"{e.where()}: {short(e.importer)} (level {ls}: {', '.join(FACE_ORDER[ls])}) "
            f"imports {short(e.target)} ({taken}), of level {ld} "
            f"({', '.join(FACE_ORDER[ld])}): a face module imports its own level or lower ones"
        )
    return breaches


def test_face_order_checker() -> None:
    """The checker itself, on a synthetic face."""
    edges = [
        synthetic_edge("lightning", "loader", "AnnBatchDataLoader", 1),
        synthetic_edge("loader", "lightning", "AnnBatchDataModule", 2),  # up a level
        synthetic_edge("convert", "batches", "own_copy", 3),  # same level
        synthetic_edge("world", "resume", "Progress", 4),  # up a level
        synthetic_edge("cli.main", "cli.demo", None, 5),  # inside cli
        synthetic_edge("cli.demo", "lightning", "AnnBatchDataModule", 6),
        synthetic_edge("integrations.scvi.setup", "", "A", 7),  # the public API
        synthetic_edge("", "cli.main", "main", 8),  # __init__ below cli
        synthetic_edge("__main__", "cli", "main", 9),
        synthetic_edge("annbatch_dataset", "read.reader", "PoolReader", 10),  # a wing
        synthetic_edge("resume", "sampling", "ChunkPlan", 11),
    ]
    modules = [f"{PACKAGE}.{m}" for m in ("loader", "cli.main", "integrations.scvi", "stray")]
    breaches = face_order_breaches(edges, modules)
    assert breaches == [
        "annbatch_torch.stray: stray has no level in the face order (FACE_ORDER)",
        "annbatch_torch/loader.py:2: loader (level 3: loader, diversity) imports lightning "
        "(AnnBatchDataModule), of level 4 (lightning): a face module imports its own level "
        "or lower ones",
        "annbatch_torch/world.py:4: world (level 0: world, errors, fields, datasets) imports "
        "resume (Progress), of level 1 (convert, torch_sampler, batches, resume): a face "
        "module imports its own level or lower ones",
        "annbatch_torch/__init__.py:8: annbatch_torch (level 5: __init__) imports cli.main "
        "(main), of level 6 (cli, integrations): a face module imports its own level or lower "
        "ones",
    ]


def test_face_order() -> None:
    """The face in levels: world, errors, fields, datasets < convert, torch_sampler, batches,
    resume < annbatch_dataset < loader < lightning < __init__ < cli/, integrations/ <
    __main__ (see FACE_ORDER); a module imports its own level or lower ones."""
    missing = []
    for unit in FACE_LEVEL:
        if unit in FACE_PACKAGES or unit == "integrations":
            if not (PKG_DIR / unit / "__init__.py").is_file():
                today = PKG_DIR / f"{unit}.py"
                was = f" (today {unit}.py is a module)" if today.is_file() else ""
                missing.append(f"{PACKAGE}/{unit}/ missing: FACE_ORDER names the package{was}")
        elif not (PKG_DIR / f"{unit}.py").is_file():
            missing.append(f"{PACKAGE}/{unit}.py missing: FACE_ORDER names it")
    modules = [module_name(path) for path in python_files()]
    breaches = missing + face_order_breaches(internal_edges(), modules)
    if breaches:
        pytest.fail(
            f"{len(breaches)} breach(es) of the face order:\n" + "\n".join(breaches),
            pytrace=False,
        )


# --------------------------------------------------------------------------------------------
# rule 6: each wing's and sub-wing's __init__ docstring names its modules
# --------------------------------------------------------------------------------------------


def unnamed_modules(docstring: str | None, modules: Iterable[str]) -> list[str]:
    """The modules a package docstring does not name as a word (all of them if it has none)."""
    modules = sorted(modules)
    if not docstring:
        return modules
    return [
        m for m in modules if not re.search(rf"(?<![A-Za-z0-9_]){re.escape(m)}(?![A-Za-z0-9_])",
                                            docstring)
    ]


def package_modules(directory: Path) -> list[str]:
    """The modules of a package: its .py files but __init__, and its sub-packages."""
    files = [p.stem for p in directory.glob("*.py") if p.stem != "__init__"]
    subs = [p.parent.name for p in directory.glob("*/__init__.py")]
    return sorted(files + subs)


def test_docstring_checker() -> None:
    """The checker itself: a word, not a substring; a missing docstring names nothing."""
    doc = "``reader`` (a pool's rows), ``pool_stream.py`` and device pools; inputs/."
    mods = ["reader", "pool_stream", "device_pool", "inputs", "buffers"]
    assert unnamed_modules(doc, mods) == ["buffers", "device_pool"]
    assert unnamed_modules(None, ["a", "b"]) == ["a", "b"]


def test_package_docstrings_name_their_modules() -> None:
    """Each wing's and sub-wing's __init__.py docstring names each of its modules (the stem of
    each .py file, and each sub-package), so that reading it tells which room is which."""
    packages = sorted(
        {p.parent.relative_to(PKG_DIR).as_posix() for p in python_files()} - {"."}
        | set(DOCUMENTED_PACKAGES)
    )
    breaches = []
    for rel in packages:
        directory = PKG_DIR / rel
        init = directory / "__init__.py"
        if not init.is_file():
            what = "folder" if directory.is_dir() else "package"
            breaches.append(f"{PACKAGE}/{rel}/__init__.py missing (the {what} {rel}/ "
                            "has no docstring to name its modules)")
            continue
        doc = ast.get_docstring(parsed(init))
        file = init.relative_to(ROOT).as_posix()
        unnamed = unnamed_modules(doc, package_modules(directory))
        if doc is None:
            breaches.append(f"{file}:1: no docstring (it must name {', '.join(unnamed)})")
        elif unnamed:
            breaches.append(f"{file}:1: the docstring does not name {', '.join(unnamed)}")
    if breaches:
        pytest.fail(
            f"{len(breaches)} package docstring(s) that do not name their modules:\n"
            + "\n".join(breaches),
            pytrace=False,
        )


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
