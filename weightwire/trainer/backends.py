"""The trainer's view of the backend registry: ``get_backend`` / ``register_backend``.

A backend's trainer side is a ``weightwire.backends.base.Backend``; the built-in ones
are found through the one registry, ``weightwire.backends``: ``get_backend`` imports a
backend's module the first time it is asked for, so a TCP trainer never imports the
NCCL or IPC code. ``register_backend`` adds one at run time (tests register fakes;
users may add their own transports).
"""

from __future__ import annotations

from weightwire import backends as registry
from weightwire.backends.base import Backend

_ADDED: dict[str, Backend] = {}
"""Backends registered at run time; a name here shadows a built-in (``replace=True``)."""
_BUILT_IN: dict[str, Backend] = {}
"""Built-in backends instantiated so far (one instance each, made on first use)."""


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Add a backend (tests register fakes; users may add their own transports)."""
    if backend.name in backend_names() and not replace:
        raise ValueError(f"backend {backend.name!r} is already registered")
    _ADDED[backend.name] = backend


def unregister_backend(name: str) -> None:
    if name in registry.SPECS:
        raise ValueError(f"built-in backend {name!r} cannot be removed")
    _ADDED.pop(name, None)


def get_backend(name: str) -> Backend:
    """The backend called ``name``; ``ValueError`` listing the known names otherwise."""
    added = _ADDED.get(name)
    if added is not None:
        return added
    backend = _BUILT_IN.get(name)
    if backend is None:
        spec = registry.SPECS.get(name)
        if spec is None:
            raise ValueError(f"unknown backend {name!r}; known: {', '.join(backend_names())}")
        backend = registry.load(spec.trainer)()
        if (
            backend.name != name
        ):  # the registry and the class disagree: fail loudly, not on the wire
            raise RuntimeError(
                f"registry entry {name!r} loads {spec.trainer}, whose name is {backend.name!r}"
            )
        backend = _BUILT_IN.setdefault(name, backend)
    return backend


def backend_names() -> tuple[str, ...]:
    """The built-in names (``weightwire.backends.BACKEND_NAMES``), then those
    registered at run time."""
    return registry.BACKEND_NAMES + tuple(n for n in _ADDED if n not in registry.SPECS)
