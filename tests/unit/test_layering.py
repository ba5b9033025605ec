"""The import structure the architecture promises, read from the source with ``ast``.

* ``listener -> bus <- router``: ``bus`` imports neither side; router and listener never
  import each other;
* product code (router, listener, bus, certs) never imports ``bench`` or ``harness``;
* only the composition root's caller (``router.serve``) imports ``router.app``: every
  other part gets its collaborators handed in, never the whole router;
* Tier 4 runs one way: the index (``router.kvindex``) knows nothing of where its events
  come from, ingestion (``router.ingest``) nothing of the index, and they meet in
  ``router.kv_runtime``; the event bus takes its opener seam from ingestion;
* no import cycle, between modules or between subpackages, counting every import:
  function-level ones and ``if TYPE_CHECKING:`` ones too (a type-only import is how a
  cycle hides), and a ``TYPE_CHECKING`` block never imports a project module.

A failure names the offending import (file and line).
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("router", "listener", "bus", "certs")
SUPPORT = ("bench", "harness", "tests")
COMPOSITION_ROOT = "router.app"
ROOT_CALLERS = frozenset({"router.serve"})


@dataclass(frozen=True)
class Import:
    source: str
    """The importing module."""
    target: str
    """The imported module, as far as it is a module of this repository (else as written)."""
    line: int
    type_only: bool
    """Inside ``if TYPE_CHECKING:``."""

    def __str__(self) -> str:
        path = _files()[self.source].relative_to(ROOT)
        return f"{path}:{self.line} imports {self.target}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


_FILES: dict[str, Path] = {}


def _files() -> dict[str, Path]:
    if not _FILES:
        for top in (*PRODUCT, *SUPPORT):
            for path in (ROOT / top).rglob("*.py"):
                if "_gen" not in path.parts:
                    _FILES[_module_name(path)] = path
    return _FILES


def _known(name: str) -> str | None:
    """The longest prefix of ``name`` that is a module of this repository."""
    mods = _files()
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, type_only: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        inner = type_only or (isinstance(child, ast.If) and _is_type_checking(child.test))
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield stmt, True
                yield from _walk(stmt, True)
            for stmt in child.orelse:
                yield stmt, type_only
                yield from _walk(stmt, type_only)
            continue
        yield child, inner
        yield from _walk(child, inner)


def _imports_of(module: str) -> list[Import]:
    path = _files()[module]
    is_pkg = path.name == "__init__.py"
    out: list[Import] = []
    for node, type_only in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name) or alias.name
                out.append(Import(module, target, node.lineno, type_only))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                package = ".".join([*base, *([node.module] if node.module else [])])
            else:
                package = node.module or ""
            for alias in node.names:
                full = f"{package}.{alias.name}"
                target = full if full in _files() else (_known(package) or package)
                if target != module:
                    out.append(Import(module, target, node.lineno, type_only))
    return out


@functools.cache
def _all_imports() -> list[Import]:
    return [imp for m in sorted(_files()) for imp in _imports_of(m)]


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def _product(imp: Import) -> bool:
    return _top(imp.source) in PRODUCT


def test_bus_imports_neither_side() -> None:
    bad = [
        str(i)
        for i in _all_imports()
        if _top(i.source) == "bus" and _top(i.target) != "bus"
        if _top(i.target) in (*PRODUCT, *SUPPORT)
    ]
    assert not bad, "bus is the contract layer; it imports neither router nor listener:\n" + (
        "\n".join(bad)
    )


def test_router_and_listener_never_import_each_other() -> None:
    bad = [
        str(i) for i in _all_imports() if {_top(i.source), _top(i.target)} == {"router", "listener"}
    ]
    assert not bad, "shared code belongs in bus/:\n" + "\n".join(bad)


def test_product_code_never_imports_benchmarks_or_test_support() -> None:
    bad = [str(i) for i in _all_imports() if _product(i) and _top(i.target) in SUPPORT]
    assert not bad, "\n".join(bad)


def test_only_the_composition_roots_caller_imports_it() -> None:
    bad = [
        str(i)
        for i in _all_imports()
        if _product(i) and i.target == COMPOSITION_ROOT and i.source not in ROOT_CALLERS
    ]
    assert not bad, "hand the parts their collaborators instead of the whole Router:\n" + "\n".join(
        bad
    )


def test_type_checking_blocks_import_no_project_module() -> None:
    bad = [
        str(i) for i in _all_imports() if _product(i) and i.type_only and _top(i.target) in PRODUCT
    ]
    assert not bad, "import it plainly (a type-only import hides a cycle):\n" + "\n".join(bad)


def _imported_by(package: str) -> set[str]:
    """The project modules that the modules of ``package`` import."""
    return {
        i.target
        for i in _all_imports()
        if (i.source == package or i.source.startswith(package + ".")) and _top(i.target) in PRODUCT
    }


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("router.kvindex", ("router.ingest", "router.eventbus", "router.kv_runtime")),
        (
            "router.ingest",
            ("router.kvindex", "router.eventbus", "router.kv_runtime", "router.redis"),
        ),
        ("router.redis", ("router.kvindex", "router.cache", "router.ingest")),
    ],
)
def test_tier4_imports_run_one_way(package: str, forbidden: tuple[str, ...]) -> None:
    imported = _imported_by(package)
    assert imported, f"{package} imports nothing from the project: the check is broken"
    bad = sorted(n for n in imported if n.startswith(forbidden))
    assert not bad, f"{package} imports {bad}"


def test_the_event_bus_takes_the_opener_seam_from_ingest() -> None:
    assert any(n.startswith("router.ingest") for n in _imported_by("router.eventbus"))


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
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
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _unit(module: str) -> str:
    """A module's subpackage (``router.kvindex``), or the module itself at the top."""
    parts = module.split(".")
    if len(parts) > 1 and (ROOT / parts[0] / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


@pytest.mark.parametrize("level", ["module", "subpackage"])
def test_no_import_cycles(level: str) -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], Import] = {}
    for imp in _all_imports():
        if not (_product(imp) and _top(imp.target) in PRODUCT):
            continue
        a, b = (
            (imp.source, imp.target)
            if level == "module"
            else (_unit(imp.source), _unit(imp.target))
        )
        if a != b:
            edges[a].add(b)
            edges.setdefault(b, set())
            where.setdefault((a, b), imp)
    cycles = _cycles(edges)
    detail = []
    for comp in cycles:
        members = set(comp)
        detail.append(" <-> ".join(comp))
        detail += [f"  {where[(a, b)]}" for a in comp for b in sorted(edges[a] & members)]
    assert not cycles, "import cycles:\n" + "\n".join(detail)


def test_the_checker_sees_what_it_checks() -> None:
    """Guards the test itself: it must see relative, function-level and type-only imports."""
    imports = {(i.source, i.target): i for i in _all_imports()}
    assert ("router.app", "router.forwarder") in imports  # relative, top level
    assert ("router.serve", COMPOSITION_ROOT) in imports
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    tree = ast.parse("if TYPE_CHECKING:\n    import x\ndef f():\n    import y\n")
    seen = {(n.names[0].name, t) for n, t in _walk(tree) if isinstance(n, ast.Import)}
    assert seen == {("x", True), ("y", False)}
