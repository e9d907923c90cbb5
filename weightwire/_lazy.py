"""Lazy package exports: a package names what it exports and from which module, and
the module is imported on first attribute access.

Why: ``weightwire.torch_side`` is imported by vLLM's plugin loader in every vLLM
process, and ``weightwire.jax_side`` on hosts that may lack torch; importing either
package must cost nothing and pull in no framework until a name is actually used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> tuple[
    Callable[[str], Any], Callable[[], list[str]]
]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps name -> module path;
    a resolved name is cached in ``namespace`` (the package's globals)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
