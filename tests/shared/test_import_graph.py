"""The package's import graph, computed statically, keeps the layout's promises.

Read from the source with ``ast`` (nothing is imported, so a rule holds on hosts
that lack a framework too): every ``import`` of every module under ``weightwire/``,
marked module-level, function-level or type-only (under ``if TYPE_CHECKING:``).
Module-level imports run when a module is imported; function-level ones are how a
framework is kept out until it is needed, so the framework rules read module-level
imports only. The dependency rules (cycles, backends) count every kind: an import
that only a type checker or a function runs couples two modules all the same.

Rules (``docs/architecture.md``):

- no import cycle between weightwire modules, counting function-level and type-only
  imports (one that imports back a module importing it is a cycle the interpreter merely
  survives); a lazy package's export list is not an import of its own;
- no import from ``backends`` into ``trainer`` or the worker package (``torch_side.worker``);
- no import of a particular backend's package (``weightwire.backends.<name>``) from
  ``CONSUMERS``: ``trainer``, the worker package and the framework senders (``jax_side``,
  ``torch_side.sender``); the registry and the generic modules of ``backends`` are theirs;
- ``shared`` imports nothing of weightwire outside ``shared`` (at any level) and no
  jax/torch/cupy/flax (module level);
- ``jax_side`` never reaches torch or ``torch_side``, ``torch_side`` never reaches
  jax/flax or ``jax_side`` (transitively, through module-level imports, counting the
  parent packages a submodule import runs);
- ``trainer`` and ``control`` reach no framework and neither side (transitively);
- in ``backends``, only modules named ``worker`` may import torch at module level, and
  cupy is imported inside functions only;
- the library never imports its tools (``weightwire.tools``: the reference server, the
  reference Flax models, the demo, the bench harness, the CLI), at any level; only the
  package root's export list names one of them (``load_decoder``). ``tools.models`` never
  reaches torch, ``tools.server`` never reaches jax/flax.

A failure names the offending import path, module by module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "weightwire"

JAX = frozenset({"jax", "jaxlib", "flax"})
TORCH = frozenset({"torch"})
CUPY = frozenset({"cupy", "cupyx"})

# Cycles being removed in parallel; each entry must still be a cycle (a stale entry fails
# ``test_known_exceptions_still_exist``), so the list only shrinks, to empty.
# Each entry: the module set of the cycle's strongly connected component.
KNOWN_CYCLES: list[frozenset[str]] = []

CONSUMERS = (
    "weightwire.trainer",
    "weightwire.torch_side.worker",
    "weightwire.jax_side",
    "weightwire.torch_side.sender",
)
"""What uses a backend through the registry and the generic contract (``weightwire.backends``,
``weightwire.backends.base`` and the other modules directly in ``backends/``), never a
particular backend's package: the framework-neutral trainer, the worker package, and the two
framework senders (their packers fill what any on-device backend sends)."""

# Edges that break the backend rules today and are being removed in parallel; the same
# only-shrinks rule as KNOWN_CYCLES. Each entry: (importing module, imported module).
KNOWN_UPWARD: set[tuple[str, str]] = set()
"""``backends`` -> ``trainer`` / the worker package."""
KNOWN_PARTICULAR: set[tuple[str, str]] = set()
"""``CONSUMERS`` -> a particular backend's package."""


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


def _in(package: str) -> list[str]:
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


# -- the graph reader itself ------------------------------------------------------------------


def test_the_graph_sees_the_package() -> None:
    # A reader that found nothing would pass every rule below.
    assert len(GRAPH) > 100 and "weightwire.shared.info" in GRAPH
    assert "weightwire.shared.meta" in GRAPH["weightwire.shared.info"].internal
    assert "jax" in GRAPH["weightwire.jax_side.naming"].external
    # Function-level imports are recorded apart: the benchmark imports the TCP wire when it runs.
    bench = GRAPH["weightwire.tools.bench.comm"]
    assert (
        "weightwire.backends.tcp.comm" in bench.lazy_internal
        and "weightwire.backends.tcp.comm" not in bench.internal
    )


def test_a_cycle_and_a_leak_are_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    # The checks fail on a planted edge: shared -> trainer -> shared is a cycle and a leak.
    meta = GRAPH["weightwire.shared.meta"]
    monkeypatch.setattr(meta, "internal", meta.internal | {"weightwire.trainer.config"})
    monkeypatch.setitem(meta.lines, "weightwire.trainer.config", 1)
    assert any({"weightwire.shared.meta", "weightwire.trainer.config"} <= c for c, _ in cycles())
    leaks = forbidden_reach("weightwire.shared.meta", TORCH, ("weightwire.trainer",))
    assert leaks and leaks[0].startswith(
        "weightwire.shared.meta "
        "(line 1: import weightwire.trainer.config runs package weightwire.trainer)"
    ), leaks


def test_a_function_level_import_back_is_a_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    # limits is imported by info at module level; a lazy import of info inside limits
    # closes a cycle.
    limits = GRAPH["weightwire.shared.limits"]
    monkeypatch.setitem(limits.lazy_lines, "weightwire.shared.info", 7)
    found = [
        cycle
        for c, cycle in cycles()
        if {"weightwire.shared.info", "weightwire.shared.limits"} <= c
    ]
    assert found and "weightwire.shared.limits (line 7)" in " -> ".join(found[0]), found


# -- the rules ---------------------------------------------------------------------------------


def test_no_import_cycles() -> None:
    found = [" -> ".join(cycle) for component, cycle in cycles() if component not in KNOWN_CYCLES]
    assert found == [], "import cycles:\n" + "\n".join(found)


def _under(module: str, packages: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def backend_packages() -> list[str]:
    """The particular backends' packages: every package directly inside ``weightwire.backends``
    (a backend's own subpackages are part of it)."""
    inside = _in("weightwire.backends")
    return sorted(m for m in inside if GRAPH[m].is_package and m.count(".") == 2)


def upward_edges() -> set[tuple[str, str]]:
    """Imports (any level, type-only too) from ``backends`` into ``trainer`` or the worker
    package."""
    return {
        (m, t)
        for m in _in("weightwire.backends")
        for t in GRAPH[m].dependencies()
        if _under(t, ("weightwire.trainer", "weightwire.torch_side.worker"))
    }


def particular_edges() -> set[tuple[str, str]]:
    """Imports (any level, type-only and lazy exports too) of a particular backend by a consumer."""
    particular = backend_packages()
    return {
        (m, t)
        for m in GRAPH
        if _under(m, CONSUMERS)
        for t in GRAPH[m].dependencies()
        if _under(t, particular)
    }


def test_known_exceptions_still_exist() -> None:
    # An exception that no longer holds must be deleted, so that it cannot linger.
    stale = [sorted(known) for known in KNOWN_CYCLES if known not in {c for c, _ in cycles()}]
    assert stale == [], f"remove from KNOWN_CYCLES: {stale}"
    assert sorted(KNOWN_UPWARD - upward_edges()) == [], "remove from KNOWN_UPWARD"
    assert sorted(KNOWN_PARTICULAR - particular_edges()) == [], "remove from KNOWN_PARTICULAR"


def test_backends_never_import_the_trainer_or_the_worker() -> None:
    # The backend contract lives in ``backends``; ``trainer`` and the worker only consume it.
    found = [
        f"{m} (line {GRAPH[m].dependencies()[t]}) -> {t}"
        for m, t in sorted(upward_edges() - KNOWN_UPWARD)
    ]
    assert found == [], "backends import upward:\n" + "\n".join(found)


def test_consumers_never_import_a_particular_backend() -> None:
    # They reach a backend through the registry (``weightwire.backends``) and the generic contract.
    found = [
        f"{m} (line {GRAPH[m].dependencies()[t]}) -> {t}"
        for m, t in sorted(particular_edges() - KNOWN_PARTICULAR)
    ]
    assert found == [], "imports of a particular backend:\n" + "\n".join(found)


def test_the_backend_rules_catch_every_kind_of_import(monkeypatch: pytest.MonkeyPatch) -> None:
    # Planted: a type-only import upward, a function-level one of a particular backend.
    assert backend_packages() == [f"weightwire.backends.{n}" for n in ("ipc", "nccl", "tcp")]
    wire = GRAPH["weightwire.backends.tcp.wire"]
    monkeypatch.setitem(wire.typing_lines, "weightwire.trainer.engine", 3)
    transfer = GRAPH["weightwire.trainer.transfer"]
    monkeypatch.setitem(transfer.lazy_lines, "weightwire.backends.tcp.wire", 5)
    assert ("weightwire.backends.tcp.wire", "weightwire.trainer.engine") in upward_edges()
    assert ("weightwire.trainer.transfer", "weightwire.backends.tcp.wire") in particular_edges()
    # The registry is no particular backend.
    assert ("weightwire.trainer.transfer", "weightwire.backends") not in particular_edges()


def test_a_type_only_import_back_is_a_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    limits = GRAPH["weightwire.shared.limits"]
    monkeypatch.setitem(limits.typing_lines, "weightwire.shared.info", 9)
    pair = {"weightwire.shared.info", "weightwire.shared.limits"}
    found = [cycle for c, cycle in cycles() if pair <= c]
    assert found and "weightwire.shared.limits (line 9)" in " -> ".join(found[0]), found


@pytest.mark.parametrize("name", _in("weightwire.shared"))
def test_shared_is_a_sink(name: str) -> None:
    module = GRAPH[name]
    # weightwire._lazy (stdlib only, checked below) gives shared/__init__ its lazy exports.
    outside = sorted(
        t
        for t in module.internal | module.lazy_internal
        if not (
            t in ("weightwire.shared", "weightwire._lazy") or t.startswith("weightwire.shared.")
        )
    )
    assert outside == [], f"{name} imports weightwire modules outside shared: {outside}"
    assert forbidden_reach(name, JAX | TORCH | CUPY, ()) == []


def test_the_lazy_helper_imports_nothing_of_weightwire() -> None:
    # shared may import it only because it is a leaf: stdlib, no weightwire module, no framework.
    helper = GRAPH["weightwire._lazy"]
    assert helper.internal | helper.lazy_internal <= {"weightwire"}, (
        helper.internal | helper.lazy_internal
    )
    assert not set(helper.external) & (JAX | TORCH | CUPY | {"numpy"}), helper.external


@pytest.mark.parametrize("name", _in("weightwire.jax_side"))
def test_jax_side_never_reaches_torch(name: str) -> None:
    assert forbidden_reach(name, TORCH, ("weightwire.torch_side",)) == []


@pytest.mark.parametrize("name", _in("weightwire.torch_side"))
def test_torch_side_never_reaches_jax(name: str) -> None:
    assert forbidden_reach(name, JAX, ("weightwire.jax_side",)) == []


@pytest.mark.parametrize("name", _in("weightwire.tools.models"))
def test_the_reference_models_never_reach_torch(name: str) -> None:
    assert forbidden_reach(name, TORCH, ("weightwire.torch_side", "weightwire.tools.server")) == []


@pytest.mark.parametrize("name", _in("weightwire.tools.server"))
def test_the_reference_server_never_reaches_jax(name: str) -> None:
    assert forbidden_reach(name, JAX, ("weightwire.jax_side", "weightwire.tools.models")) == []


def test_the_library_never_imports_its_tools() -> None:
    entry = {
        "weightwire",
        "weightwire.__main__",
    }  # the export list; `python -m weightwire` is the CLI
    library = [m for m in GRAPH if m not in entry and not _under(m, ("weightwire.tools",))]
    found = [
        f"{m} -> {t}"
        for m in library
        for t in sorted(GRAPH[m].internal | GRAPH[m].lazy_internal | set(GRAPH[m].typing_lines))
        if _under(t, ("weightwire.tools",))
    ]
    assert len(library) > 50, library
    assert found == [], f"the library imports a tool: {found}"


@pytest.mark.parametrize("name", _in("weightwire.trainer") + _in("weightwire.control"))
def test_trainer_and_control_reach_no_framework(name: str) -> None:
    assert (
        forbidden_reach(name, JAX | TORCH | CUPY, ("weightwire.jax_side", "weightwire.torch_side"))
        == []
    )


@pytest.mark.parametrize("name", _in("weightwire.backends"))
def test_backends_import_torch_in_worker_modules_only_and_cupy_lazily(name: str) -> None:
    frameworks = CUPY if name.rpartition(".")[2] == "worker" else TORCH | CUPY
    assert forbidden_reach(name, frameworks, ()) == []


def test_every_logger_is_named_after_its_module() -> None:
    # A hand-written name drifts when a module moves (the rendezvous logged as ``tcp.comm``), and
    # then a ``caplog`` filter or a user's logging config silently misses its records.
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "getLogger"
                and not (
                    len(node.args) == 1
                    and isinstance(node.args[0], ast.Name)
                    and node.args[0].id == "__name__"
                )
            ):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bad == [], f"use logging.getLogger(__name__): {bad}"
