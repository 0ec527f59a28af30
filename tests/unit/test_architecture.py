"""The layering rules of DESIGN.md, checked on the source's imports (parsed, not run).

Every `portico` import counts, at module level or not: one inside a function or under
`TYPE_CHECKING` is still a dependency, only a deferred one. So: no two modules import
each other (directly or round a longer cycle), no two top-level parts of the package do
(core, runtime, store, ...; a top-level module such as `portico.errors` is a part of its
own), and the domain model, the ground floor, imports nothing of Portico but `errors`.
"""

from __future__ import annotations

import ast
import functools
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "portico"
GROUND_FLOOR = "portico.domain"
GROUND_FLOOR_MAY_IMPORT = ("portico.errors",)


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer} imports {self.imported} (line {self.line})"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def sources() -> dict[str, Path]:
    return {module_name(path): path for path in sorted((SRC / PACKAGE).rglob("*.py"))}


def known_module(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module `name` names, or the innermost one it lies in (a name a module defines)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imported_names(module: str, path: Path, node: ast.AST) -> list[str]:
    """The dotted names an import statement loads: for `from a import b`, `a.b` (a module
    when there is one, else a name that `a` defines)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the importer's package
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    return [f"{base}.{alias.name}" for alias in node.names]


@functools.cache
def imports() -> tuple[Import, ...]:
    """Every import of one portico module by another, however deep in the code it is."""
    modules = sources()
    found: set[Import] = set()
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            for name in imported_names(module, path, node):
                if name != PACKAGE and not name.startswith(f"{PACKAGE}."):
                    continue
                target = known_module(name, modules)
                if target is not None and target != module:
                    found.add(Import(module, target, getattr(node, "lineno", 0)))
    return tuple(sorted(found, key=lambda i: (i.importer, i.imported, i.line)))


def part(module: str) -> str:
    """The top-level part of the package a module belongs to: `portico.store.sqlite` is
    in `store`, `portico.errors` is `errors`, the package's own `__init__` is `portico`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def strongly_connected(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm),
    each shown as a shortest cycle from its first node back to it."""
    following: dict[str, set[str]] = defaultdict(set)
    for importer, imported in edges:
        following[importer].add(imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for after in sorted(following[node]):
            if after not in index:
                visit(after)
                low[node] = min(low[node], low[after])
            elif after in on_stack:
                low[node] = min(low[node], index[after])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(following):
        if node not in index:
            visit(node)
    return [cycle_through(component, following) for component in sorted(components)]


def cycle_through(component: list[str], edges: Mapping[str, set[str]]) -> list[str]:
    """A shortest cycle from the component's first node back to it, inside it."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for after in sorted(edges.get(node, set()) & members):
                if after == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if after not in came_from:
                    came_from[after] = node
                    following.append(after)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")


def graph(node: Callable[[str], str]) -> dict[tuple[str, str], list[Import]]:
    """The imports between the nodes modules belong to, by (importer, imported) node."""
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for i in imports():
        if node(i.importer) != node(i.imported):
            edges[node(i.importer), node(i.imported)].append(i)
    return edges


def cycles(edges: Mapping[tuple[str, str], list[Import]]) -> list[str]:
    """Each cycle of `edges` as a line of the failure message, with the imports making it."""
    found: list[str] = []
    for cycle in strongly_connected(edges):
        found.append("  " + " -> ".join(cycle))
        for step in itertools.pairwise(cycle):
            found.extend(f"      {i}" for i in edges[step])
    return found


def test_the_source_is_found_and_every_import_is_read() -> None:
    # A guard for the tests below: a graph with no edges has no cycle either.
    read = {(i.importer, i.imported) for i in imports()}
    assert ("portico.store.sqlite", "portico.store.sqlite_writes") in read
    assert ("portico.store.sqlite", "portico.config") in read  # under TYPE_CHECKING
    assert ("portico.cli", "portico.agent.server") in read  # inside a function


def test_no_two_modules_import_each_other() -> None:
    found = cycles(graph(lambda module: module))
    assert not found, "import cycles among modules:\n" + "\n".join(found)


def test_no_two_parts_of_the_package_import_each_other() -> None:
    found = cycles(graph(part))
    assert not found, "import cycles among the package's parts:\n" + "\n".join(found)


def test_the_domain_imports_nothing_of_portico_but_errors() -> None:
    upward = [
        i
        for i in imports()
        if within(i.importer, GROUND_FLOOR)
        and not within(i.imported, GROUND_FLOOR)
        and i.imported not in GROUND_FLOOR_MAY_IMPORT
    ]
    assert not upward, (
        f"{GROUND_FLOOR} is the ground floor: it may import only itself and "
        f"{', '.join(GROUND_FLOOR_MAY_IMPORT)}, but:\n" + "\n".join(f"  {i}" for i in upward)
    )


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")
