"""Lazy package exports, declared once: a package's ``if TYPE_CHECKING:`` block is its export list.

Why lazy: ``weightwire`` and ``weightwire.torch_side`` are imported by vLLM's plugin
loader in every vLLM process, and ``weightwire`` / ``weightwire.jax_side`` on hosts that
may lack torch; importing a package must cost nothing and pull in no framework until a
name is actually used.

Why the ``TYPE_CHECKING`` block is the list: type checkers and IDEs need static imports
to see the names, and a second, runtime list (name -> module) next to it drifts. So a
package writes only::

    if TYPE_CHECKING:
        from weightwire.jax_side.engine import JAXTrainerEngine as JAXTrainerEngine

    __getattr__, __dir__ = attach(__name__, globals())

and ``attach`` reads that block from the package's source (like ``lazy_loader.attach_stub``
reads a stub): each ``from M import N as N`` exports ``N`` from ``M``, imported on first
access; ``__all__`` is set to the exported names. The redundant ``as N`` marks an explicit
re-export for type checkers (no ``__all__`` literal needed, none to keep in step).
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def exports_of(source: str, *, package: str) -> dict[str, str]:
    """Name -> module of the ``from M import N as N`` lines under ``if TYPE_CHECKING:``.

    ``ValueError`` for anything else in that block (a bare import, a renaming alias, a
    name exported twice): the block is a declaration, and a line ``attach`` could not
    honour must not pass silently.
    """
    exports: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.If) and _is_type_checking(node.test)):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0):
                raise ValueError(
                    f"{package}: only 'from module import Name as Name' lines may be exported "
                    f"lazily (line {stmt.lineno})"
                )
            for alias in stmt.names:
                if alias.asname != alias.name:
                    raise ValueError(
                        f"{package}: write 'import {alias.name} as {alias.name}' "
                        f"(line {stmt.lineno})"
                    )
                if alias.name in exports:
                    raise ValueError(
                        f"{package}: {alias.name!r} is exported twice (line {stmt.lineno})"
                    )
                exports[alias.name] = stmt.module
    return exports


def attach(
    package: str, namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, exporting its ``TYPE_CHECKING`` imports.

    Sets ``__all__`` in ``namespace`` (the package's globals) to the exported names;
    a resolved name is cached in ``namespace``, so ``__getattr__`` runs once per name.
    """
    path = Path(namespace["__file__"])
    try:
        source = path.read_text()
    except OSError as exc:
        raise ImportError(f"{package}: cannot read {path} to find its exports ({exc})") from None
    exports = exports_of(source, package=package)
    namespace["__all__"] = sorted(exports)

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        # The exports and the module's own dunders (``__version__``): not the helpers the package
        # body used (``TYPE_CHECKING``, ``annotations``, ``attach``) nor the submodules it imported.
        return sorted(
            set(exports)
            | {name for name in namespace if name.startswith("__") and name.endswith("__")}
        )

    return __getattr__, __dir__
