"""The package's import graph, read statically: what ``test_import_graph.py`` checks rules on.

Read from the source with ``ast`` (nothing is imported, so the graph is the same on hosts
that lack a framework): every ``import`` of every module under ``weightwire/``, marked
module-level, function-level or type-only (under ``if TYPE_CHECKING:``). ``GRAPH`` is built
once per session; the tests plant edges in it with ``monkeypatch`` to prove a rule fires.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "weightwire"

JAX = frozenset({"jax", "jaxlib", "flax"})
TORCH = frozenset({"torch"})
CUPY = frozenset({"cupy", "cupyx"})


@dataclass
class Module:
    name: str
    is_package: bool
    internal: set[str] = field(default_factory=set)
    """weightwire modules imported at module level (explicit imports only)."""
    external: dict[str, int] = field(default_factory=dict)
    """top-level names of non-weightwire modules imported at module level -> line."""
    lines: dict[str, int] = field(default_factory=dict)
    """weightwire module -> the line of its module-level import."""
    lazy_internal: set[str] = field(default_factory=set)
    """weightwire modules imported inside functions (and not at module level)."""
    lazy_lines: dict[str, int] = field(default_factory=dict)
    typing_lines: dict[str, int] = field(default_factory=dict)
    """weightwire modules imported under ``if TYPE_CHECKING:`` only -> the line. Never run,
    so the framework rules skip them; a dependency all the same, so cycles count them."""

    export_lines: dict[str, int] = field(default_factory=dict)
    """A lazy package's export list (``weightwire._lazy``) -> the line."""

    def imports(self) -> dict[str, int]:
        """Every weightwire module this one imports, at any level, type-only too -> the line."""
        return {**self.typing_lines, **self.lazy_lines, **self.lines}

    def dependencies(self) -> dict[str, int]:
        """``imports`` plus a lazy package's exports: every module this one names."""
        return {**self.export_lines, **self.imports()}


def docstring_ids(tree: ast.AST) -> set[int]:
    """``id`` of every docstring node in ``tree`` (module, class, function): the text rules
    that read string constants leave the reader's documentation out."""
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


MODULE, FUNCTION, TYPING = "module", "function", "typing"
"""Where an import statement is: it runs when the module is imported, when a function
runs, or never (under ``if TYPE_CHECKING:``)."""


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with where it is (``MODULE``, ``FUNCTION`` or ``TYPING``)."""

    Found = Iterator[tuple[ast.Import | ast.ImportFrom, str]]

    def walk(nodes: Iterable[ast.AST], level: str) -> Found:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node, level
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.body, TYPING)
                yield from walk(node.orelse, level)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from walk(ast.iter_child_nodes(node), TYPING if level == TYPING else FUNCTION)
            else:
                yield from walk(ast.iter_child_nodes(node), level)

    return walk(tree.body, MODULE)


def _resolve(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def build_graph() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    trees: dict[str, ast.Module] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name, is_package = _module_name(path)
        modules[name] = Module(name, is_package)
        trees[name] = ast.parse(path.read_text(), filename=str(path))
    for name, tree in trees.items():
        module = modules[name]
        for node, level in _imports(tree):
            top = level == MODULE
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(module, node)
                # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one.
                targets = [
                    base,
                    *(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules),
                ]
            for target in targets:
                if target.split(".")[0] != "weightwire":
                    if top:
                        module.external.setdefault(target.split(".")[0], node.lineno)
                    continue
                # ``import weightwire.a.b`` binds a module that exists; a name in it is no module.
                while target not in modules:
                    target = target.rpartition(".")[0]
                if target == name:
                    continue
                if top:
                    module.internal.add(target)
                    module.lines.setdefault(target, node.lineno)
                elif level == FUNCTION:
                    module.lazy_internal.add(target)
                    module.lazy_lines.setdefault(target, node.lineno)
                else:
                    module.typing_lines.setdefault(target, node.lineno)
        module.lazy_internal -= module.internal
        if module.is_package and "weightwire._lazy" in module.internal:
            # A lazy package's ``if TYPE_CHECKING:`` block is its export list, resolved on
            # attribute access (``weightwire._lazy``): a dependency, but not one a cycle runs
            # through (``from weightwire import backends`` does not import the exports).
            module.export_lines, module.typing_lines = module.typing_lines, {}
    return modules


GRAPH = build_graph()


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _runtime_edges(name: str) -> Iterator[tuple[str, str]]:
    """What importing ``name`` runs, each with how: its module-level imports, and before
    each the parent packages Python imports first."""
    for target in sorted(GRAPH[name].internal):
        line = GRAPH[name].lines[target]
        for parent in _parents(target):
            if parent in GRAPH and parent != name:
                yield parent, f"line {line}: import {target} runs package {parent}"
        yield target, f"line {line}"


def reach(start: str) -> dict[str, list[str]]:
    """Every weightwire module importing ``start`` runs -> the import path to it, as text."""
    paths = {p: [f"{p} (package of {start})"] for p in _parents(start) if p in GRAPH}
    paths[start] = [start]
    todo = [*paths]
    while todo:
        current = todo.pop()
        for target, how in _runtime_edges(current):
            if target not in paths:
                paths[target] = [*paths[current][:-1], f"{paths[current][-1]} ({how})", target]
                todo.append(target)
    return paths


def forbidden_reach(start: str, frameworks: frozenset[str], packages: tuple[str, ...]) -> list[str]:
    """Each import path from ``start`` to a forbidden framework or weightwire package."""
    found = []
    for module, path in sorted(reach(start).items()):
        if any(module == p or module.startswith(p + ".") for p in packages):
            found.append(" -> ".join(path))
        for ext in sorted(set(GRAPH[module].external) & frameworks):
            hops = [*path[:-1], f"{path[-1]} (line {GRAPH[module].external[ext]})", ext]
            found.append(" -> ".join(hops))
    return found


def in_package(package: str) -> list[str]:
    return sorted(m for m in GRAPH if m == package or m.startswith(package + "."))


def cycles() -> list[tuple[frozenset[str], list[str]]]:
    """Each strongly connected component of the import graph (Tarjan), with one concrete
    cycle through it to print.

    Function-level imports count: one that imports back a module importing it at module
    level is a cycle the interpreter merely does not trip over (the ``# comm imports us``
    kind), and it couples the two modules all the same."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v].imports()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    out = []
    for component in components:
        start = min(component)
        # Shortest way back to ``start`` inside the component: the cycle to print.
        paths = {start: [start]}
        frontier = [start]
        cycle: list[str] = []
        while frontier and not cycle:
            nxt = []
            for v in frontier:
                for w in sorted(set(GRAPH[v].imports()) & component):
                    if w == start:
                        cycle = [*paths[v], start]
                        cycle = [
                            f"{a} (line {GRAPH[a].imports()[b]})"
                            for a, b in zip(cycle, cycle[1:], strict=False)
                        ]
                        cycle.append(start)
                        break
                    if w not in paths:
                        paths[w] = [*paths[v], w]
                        nxt.append(w)
                if cycle:
                    break
            frontier = nxt
        out.append((frozenset(component), cycle))
    return out
