"""Backends, trainer side: the ``Backend`` / ``Rendezvous`` contract and ``get_backend``.

A backend turns a ``TrainerInitInfo`` into (a) the worker init info the engine posts
to ``/init_weight_transfer_engine`` and (b) a ``join`` that completes rank 0's side
of the rendezvous while that POST is in flight. It also says where packing happens
(``on_device``: NCCL packs in GPU memory; TCP packs host bytes) and which server
versions it needs. The worker init info holds secrets (unique id, TCP secret): it is
never logged and never part of a repr.

The built-in backends live in their packages (``weightwire.backends.<name>.trainer``)
and are found through the one registry, ``weightwire.backends``: ``get_backend``
imports a backend's module the first time it is asked for, so a TCP trainer never
imports the NCCL or IPC code. ``register_backend`` adds one at run time (tests
register fakes; users may add their own transports).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, cast

from weightwire import backends as registry
from weightwire.shared.communicator import Communicator, DeviceCommunicator
from weightwire.shared.version import ServerFeatures

if TYPE_CHECKING:
    from weightwire.trainer.config import TrainerInitInfo

if TYPE_CHECKING:
    from weightwire.trainer.pipelines import DevicePacker, DevicePipeline


class Rendezvous(ABC):
    """One pending rendezvous: the payload to post, and rank 0's half of the join."""

    def __init__(self, payload: dict[str, Any]) -> None:
        self.payload = payload

    def __repr__(self) -> str:
        return f"{type(self).__name__}(<payload redacted>)"

    @abstractmethod
    def join(self, *, timeout: float) -> Communicator:
        """Rank 0 joins; returns once every worker rank is connected (or raises)."""

    def cancel(self) -> None:
        """Best-effort: make a pending ``join`` fail soon (the init POST already failed)."""
        return None


class Backend(ABC):
    name: ClassVar[str]
    on_device: ClassVar[bool]
    """True: chunks are packed in device memory and broadcast on CUDA streams."""
    stock_receiver: ClassVar[bool] = False
    """True: the workers run vLLM's own receive code, so rounds go through
    ``backends.nccl.stock.plan_for_stock`` (refusal / aligned reordering) first."""
    several_broadcasters: ClassVar[str | None] = None
    """How several broadcasting trainer ranks share this wire (``trainer.multi_source``):
    ``"stars"``: each broadcaster opens its own rendezvous and the workers dial every one
    (TCP); ``"group"``: one communicator of every broadcaster and worker, each turn
    broadcast with root = its ``src`` while the other group members receive and discard
    (NCCL: ``peer_fields`` / ``join_peer``); ``None``: refused by ``check_receiver``."""

    def check_server(self, features: ServerFeatures) -> None:
        """Raise ``ValueError`` if the server's version lacks what this backend needs."""
        features.require("packed_in_init", "the wire params travel in the init info")

    @abstractmethod
    def open(self, info: TrainerInitInfo, *, world_size: int) -> Rendezvous:
        """Prepare rank 0's endpoint for a group of ``world_size`` ranks (trainer included)."""

    def peer_fields(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``"group"`` backends: what another broadcaster needs from rank 0's worker init
        info to join the same communicator (a secret: it travels only over the trainer's group)."""
        raise NotImplementedError(f"backend {self.name!r} has no shared group for several broadcasters")

    def join_peer(self, info: TrainerInitInfo, fields: dict[str, Any], *, rank: int, timeout: float) -> Communicator:
        """``"group"`` backends: a non-zero broadcaster joins rank 0's communicator as group
        rank ``rank`` (its ``src``); raises within ``timeout`` if the group never completes."""
        raise NotImplementedError(f"backend {self.name!r} has no shared group for several broadcasters")

    def device_pipeline(self, comm: Communicator, packer: DevicePacker, *, num_buffers: int, timeout: float,
                        hold_bytes: int) -> DevicePipeline:
        """The on-device data path over ``comm`` (NCCL: slot buffers broadcast on rotating streams)."""
        from weightwire.trainer.pipelines import DevicePipeline

        # An on_device backend's join returns a stream-ordered communicator (NCCLCommunicator).
        return DevicePipeline(cast(DeviceCommunicator, comm), packer, num_buffers=num_buffers, timeout=timeout,
                              hold_bytes=hold_bytes)


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
        if backend.name != name:  # the registry and the class disagree: fail loudly, not on the wire
            raise RuntimeError(f"registry entry {name!r} loads {spec.trainer}, whose name is {backend.name!r}")
        backend = _BUILT_IN.setdefault(name, backend)
    return backend


def backend_names() -> tuple[str, ...]:
    """The built-in names (``weightwire.backends.BACKEND_NAMES``), then those registered at run time."""
    return registry.BACKEND_NAMES + tuple(n for n in _ADDED if n not in registry.SPECS)
