"""The backend registry: the one list of backend packages.

A backend is a wire (how rank 0 and the workers rendezvous and move bytes) plus the
classes that speak it on each side. Each backend package says what it is in its
``spec`` module (``weightwire.backends.<package>.spec``: ``SPECS``, a tuple of
``BackendSpec``); the registry lists the packages, one line each, and nothing else
names a backend. ``BackendSpec`` fields are ``"module:attr"`` paths:

- ``init_info``: the worker init info's strict (numpy-only) parser, in the backend's own package
  (``init_info_type`` / ``spec_of_init_info`` map between the two);
- ``trainer``: rank 0's ``Backend`` (rendezvous, payload);
- ``connect``: the worker's ``(info, *, rank, device) -> ReceiveLink`` (``None``:
  only vLLM's own receiver speaks this wire);
- ``worker_engine``: the standalone receiver outside vLLM (reference server, the
  loopback test receiver);
- ``vllm_engine``: the ``WeightTransferEngine`` subclass the vLLM plugin registers
  under the backend's name (``None``: vLLM ships it, the stock ``nccl``).

Every consumer reads this registry: the trainer (``get_backend``: rank 0's ``Backend``
object; ``DEFAULT_BACKEND``), the worker's ``connect`` and engines (``spec_of_engine``), the
plugin, the reference server's and the CLI's ``--backend`` choices, the demo and the loopback
receiver. That is the
failure it prevents: a backend added, renamed or given a new engine in one of those
places and forgotten in another (the CLI offering a name the server cannot run, the
plugin registering fewer backends than the trainer can open).

Importing this module imports the spec modules and nothing else (no torch, jax or
cupy, not even ``weightwire.shared``): ``load`` imports a part's module when it is
first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from weightwire.backends.spec import BackendSpec

if TYPE_CHECKING:
    from weightwire.backends.base import Backend

PACKAGES: tuple[str, ...] = (
    "weightwire.backends.tcp",
    "weightwire.backends.nccl",
    "weightwire.backends.ipc",
)
"""The backend packages, in the order commands list their backends (CPU-capable TCP first)."""


def _specs_of(package: str) -> tuple[BackendSpec, ...]:
    specs: tuple[BackendSpec, ...] = importlib.import_module(f"{package}.spec").SPECS
    return specs


def _table(packages: tuple[str, ...]) -> dict[str, BackendSpec]:
    table: dict[str, BackendSpec] = {}
    for package in packages:
        for spec in _specs_of(package):
            if spec.name in table:
                where = f"{package}.spec"
                raise RuntimeError(f"backend {spec.name!r} is declared twice (again in {where})")
            table[spec.name] = spec
    return table


SPECS: dict[str, BackendSpec] = _table(PACKAGES)
"""Name -> spec, in ``PACKAGES`` order."""

BACKEND_NAMES: tuple[str, ...] = tuple(SPECS)
"""Every built-in backend name."""
PLUGIN_BACKENDS: tuple[str, ...] = tuple(name for name, spec in SPECS.items() if spec.needs_plugin)
"""The backends the vLLM plugin adds, which are also the ones the reference server serves
(it stands in for a vLLM with the plugin)."""
ALIASES: dict[str, str] = {alias: spec.name for spec in SPECS.values() for alias in spec.aliases}
"""Short spelling -> name, accepted wherever a backend is (``tcp``)."""


def _the_default(specs: dict[str, BackendSpec]) -> str:
    named = [name for name, spec in specs.items() if spec.default]
    if len(named) != 1:
        raise RuntimeError(f"exactly one backend spec must say default=True, got {named}")
    return named[0]


DEFAULT_BACKEND: str = _the_default(SPECS)
"""``TrainerInitInfo.backend``'s default: the built-in backend whose spec says ``default``."""


def register(package: str) -> tuple[BackendSpec, ...]:
    """Add a backend package at run time: what its line in ``PACKAGES`` does at import (a
    test's toy backend, a user's own wire). Its specs join ``SPECS`` and ``ALIASES``, so the
    trainer, the worker's ``connect`` and the engines find it like a built-in;
    ``BACKEND_NAMES`` (the commands' choices) keeps listing the built-in ones."""
    specs = _specs_of(package)
    taken = [spec.name for spec in specs if spec.name in SPECS or spec.name in ALIASES]
    if taken:
        raise _config_error(
            f"{package}.spec declares backend(s) already registered: {', '.join(taken)}"
        )
    for spec in specs:
        SPECS[spec.name] = spec
        ALIASES.update({alias: spec.name for alias in spec.aliases})
    return specs


def canonical(name: str) -> str:
    """``name`` with an alias resolved (``tcp`` -> ``weightwire_tcp``); other names unchanged."""
    return ALIASES.get(name, name)


def _config_error(message: str) -> Exception:
    """A ``ConfigError`` (a ``ValueError``) saying ``message``; its module is imported on a
    refusal only, so importing the registry pulls in the specs and nothing else."""
    from weightwire.shared.errors import ConfigError

    return ConfigError(message)


def get(name: str) -> BackendSpec:
    """The spec of ``name`` (aliases accepted); ``ConfigError`` (a ``ValueError``) listing the
    known names otherwise."""
    spec = SPECS.get(canonical(name)) if isinstance(name, str) else None
    if spec is None:
        raise _config_error(f"unknown backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
    return spec


def load(path: str) -> Any:
    """Import ``"module:attr"`` and return the attribute (a class or function)."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise _config_error(f"backend part path must be 'module:attr', got {path!r}")
    return getattr(importlib.import_module(module), attr)


def init_info_type(name: str) -> type[Any]:
    """The init-info class the workers of backend ``name`` parse their init info with."""
    cls: type[Any] = load(get(name).init_info)
    return cls


def worker_engine(name: str) -> type[Any]:
    """The standalone receiver of backend ``name`` (reference server, loopback, Ray replica);
    ``ConfigError`` for a wire only vLLM's own worker receives (``worker_engine`` is ``None``)."""
    spec = get(name)
    if spec.worker_engine is None:
        raise _config_error(
            f"backend {spec.name!r} is received only by vLLM's own worker: nothing outside "
            f"vLLM (the reference server, the loopback receiver) receives it"
        )
    cls: type[Any] = load(spec.worker_engine)
    return cls


def spec_of_init_info(info_type: type) -> BackendSpec:
    """The backend whose init info is exactly ``info_type`` (a subclass is another backend's)."""
    path = f"{info_type.__module__}:{info_type.__qualname__}"
    for spec in SPECS.values():
        if spec.init_info == path:
            return spec
    known = ", ".join(BACKEND_NAMES)
    raise _config_error(f"{info_type.__name__} is no backend's init info; known: {known}")


def spec_of_engine(engine: type) -> BackendSpec | None:
    """The backend whose spec names ``engine`` as its worker or vLLM engine (a backend that
    speaks its own wire first: stock ``nccl`` is received by ``weightwire_nccl``'s engine
    outside vLLM); ``None`` when no spec names it (an abstract base, a test's engine)."""
    path = f"{engine.__module__}:{engine.__qualname__}"
    named = [s for s in SPECS.values() if path in (s.worker_engine, s.vllm_engine)]
    named.sort(key=lambda s: s.stock_receiver)
    return named[0] if named else None


# -- rank 0's Backend objects ---------------------------------------------------------------

_ADDED: dict[str, Backend] = {}
"""``Backend`` objects registered at run time; a name here shadows a built-in (``replace=True``)."""
_MADE: dict[str, Backend] = {}
"""Registered backends' ``Backend`` objects made so far (one each, made on first use: a TCP
trainer never imports the NCCL or IPC code)."""


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Add a ``Backend`` object under its name (tests register fakes; users may add their own
    transports without a package)."""
    if backend.name in backend_names() and not replace:
        raise _config_error(f"backend {backend.name!r} is already registered")
    _ADDED[backend.name] = backend


def unregister_backend(name: str) -> None:
    if name in SPECS:
        raise _config_error(f"built-in backend {name!r} cannot be removed")
    _ADDED.pop(name, None)


def get_backend(name: str) -> Backend:
    """Rank 0's ``Backend`` called ``name``; ``ConfigError`` (a ``ValueError``) listing the
    known names otherwise."""
    added = _ADDED.get(name)
    if added is not None:
        return added
    backend = _MADE.get(name)
    if backend is None:
        spec = SPECS.get(name)
        if spec is None:
            raise _config_error(f"unknown backend {name!r}; known: {', '.join(backend_names())}")
        backend = load(spec.trainer)()
        if backend.name != name:  # the spec and the class disagree: fail loudly, not on the wire
            raise RuntimeError(
                f"registry entry {name!r} loads {spec.trainer}, whose name is {backend.name!r}"
            )
        backend = _MADE.setdefault(name, backend)
    return backend


def backend_names() -> tuple[str, ...]:
    """Every backend the registry knows (built-in and ``register``-ed packages), then the
    ``Backend`` objects ``register_backend``-ed at run time."""
    return tuple(SPECS) + tuple(n for n in _ADDED if n not in SPECS)


__all__ = [
    "ALIASES",
    "BACKEND_NAMES",
    "DEFAULT_BACKEND",
    "PACKAGES",
    "PLUGIN_BACKENDS",
    "SPECS",
    "BackendSpec",
    "backend_names",
    "canonical",
    "get",
    "get_backend",
    "init_info_type",
    "load",
    "register",
    "register_backend",
    "spec_of_engine",
    "spec_of_init_info",
    "unregister_backend",
    "worker_engine",
]
