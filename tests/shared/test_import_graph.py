"""The package's import graph, computed statically, keeps the layout's promises.

The graph (``import_graph.py``) is read from the source with ``ast``, so a rule holds on hosts
that lack a framework too; it marks each import module-level, function-level or type-only.
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
import importlib
from collections.abc import Iterable

import pytest

from tests.shared.import_graph import (
    CUPY,
    GRAPH,
    JAX,
    PACKAGE,
    ROOT,
    TORCH,
    cycles,
    docstring_ids,
    forbidden_reach,
    in_package,
)

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
    inside = in_package("weightwire.backends")
    return sorted(m for m in inside if GRAPH[m].is_package and m.count(".") == 2)


def upward_edges() -> set[tuple[str, str]]:
    """Imports (any level, type-only too) from ``backends`` into ``trainer`` or the worker
    package."""
    return {
        (m, t)
        for m in in_package("weightwire.backends")
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


@pytest.mark.parametrize("name", in_package("weightwire.shared"))
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


@pytest.mark.parametrize("name", in_package("weightwire.jax_side"))
def test_jax_side_never_reaches_torch(name: str) -> None:
    assert forbidden_reach(name, TORCH, ("weightwire.torch_side",)) == []


@pytest.mark.parametrize("name", in_package("weightwire.torch_side"))
def test_torch_side_never_reaches_jax(name: str) -> None:
    assert forbidden_reach(name, JAX, ("weightwire.jax_side",)) == []


@pytest.mark.parametrize("name", in_package("weightwire.tools.models"))
def test_the_reference_models_never_reach_torch(name: str) -> None:
    assert forbidden_reach(name, TORCH, ("weightwire.torch_side", "weightwire.tools.server")) == []


@pytest.mark.parametrize("name", in_package("weightwire.tools.server"))
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


@pytest.mark.parametrize(
    "name", in_package("weightwire.trainer") + in_package("weightwire.control")
)
def test_trainer_and_control_reach_no_framework(name: str) -> None:
    assert (
        forbidden_reach(name, JAX | TORCH | CUPY, ("weightwire.jax_side", "weightwire.torch_side"))
        == []
    )


@pytest.mark.parametrize("name", in_package("weightwire.backends"))
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


# -- generic code names no backend ---------------------------------------------------------------

GENERIC = (
    "weightwire/trainer",
    "weightwire/torch_side/worker",
    "weightwire/torch_side/sender",
    "weightwire/jax_side",
    "weightwire/shared",
    "weightwire/control",
    "weightwire/vllm_guard",
    "weightwire/testing",
)
"""Code that reaches backends through the registry and the contract only: it spells no backend's
name and names no backend's init-info class; which backend does what comes from the specs'
flags, the ``SenderCaps`` and the registry's answers (``DEFAULT_BACKEND``, ``get_backend``).
Tools and tests may name one (an app's default, a test's case)."""

NAMED_ON_PURPOSE: set[tuple[str, str]] = {
    # vLLM's release feature (``VERSION_GATES``): the version that ships vLLM's sparse receiver,
    # whatever weightwire's registry holds.
    ("weightwire/shared/version.py", "sparse_nccl"),
    # likewise the release that ships vLLM's nccl_m2n receiver
    ("weightwire/shared/version.py", "nccl_m2n"),
}
"""(file, name) pairs that stay: each says why in its comment. Only shrinks."""


def _backend_words() -> tuple[set[str], set[str]]:
    """The backends' names and the identifiers that are a particular backend's: its init-info
    classes and its spec's variable, read from the registry itself."""
    from weightwire import backends
    from weightwire.backends.spec import BackendSpec

    names = set(backends.SPECS)
    idents = {backends.load(s.init_info).__name__ for s in backends.SPECS.values()}
    specs = {  # the packages' spec variables (``TCP``, ``WEIGHTWIRE_NCCL``, ...)
        name
        for package in backends.PACKAGES
        for name, value in vars(importlib.import_module(f"{package}.spec")).items()
        if isinstance(value, BackendSpec)
    }
    assert {"TCP", "NCCL"} <= specs
    return names, idents | specs


def backend_mentions(tree: ast.AST, names: set[str], idents: set[str]) -> set[str]:
    """What in ``tree`` names a particular backend: a string constant (docstrings aside: they
    are the reader's documentation) holding a backend's name (``nccl`` only as a whole string,
    the word has other meanings), an identifier, attribute or imported name that is a
    backend's init-info class (or defines one) or a registry constant."""
    docs = docstring_ids(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found |= {n for n in names if n == node.value or ("_" in n and n in node.value)}
        elif isinstance(node, ast.Name) and node.id in idents:
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in idents:
            found.add(node.attr)
        elif isinstance(node, ast.alias | ast.ClassDef) and node.name in idents:
            found.add(node.name)
    return found


def test_generic_code_names_no_backend() -> None:
    names, idents = _backend_words()
    found = {
        (str(path.relative_to(ROOT)), word)
        for package in GENERIC
        for path in sorted((ROOT / package).rglob("*.py"))
        for word in backend_mentions(ast.parse(path.read_text()), names, idents)
    }
    assert sorted(found - NAMED_ON_PURPOSE) == [], "generic code naming a backend"
    assert sorted(NAMED_ON_PURPOSE - found) == [], "remove from NAMED_ON_PURPOSE"


def test_the_backend_name_check_catches_every_spelling() -> None:
    names, idents = _backend_words()
    planted = '''
"""A docstring may name weightwire_tcp for the reader."""
from weightwire.backends.tcp.spec import TCP
from weightwire.backends.tcp.info import TCPInitInfo
import weightwire
x = f"dial {weightwire.IPCInitInfo} over weightwire_ipc"
y = {"nccl": 1, "a nccl group": 2}
class NCCLInitInfo: ...
'''
    assert backend_mentions(ast.parse(planted), names, idents) == {
        "TCP",
        "TCPInitInfo",
        "IPCInitInfo",
        "weightwire_ipc",
        "nccl",
        "NCCLInitInfo",
    }
