"""The backend registry: every weight-transfer backend, one entry each, by module path.

A backend is a wire (how rank 0 and the workers rendezvous and move bytes) plus the
classes that speak it on each side. Its entry names all of them as ``"module:attr"``
strings, so that a backend is one thing to find and one thing to add:

- ``init_info``: the shared (numpy-only) parser of the worker init info; its
  ``backend`` ClassVar is the entry's name (``tests/backends/test_registry.py``
  checks they agree; ``shared`` cannot import this module, so the names are written
  here and there, and nowhere else in code);
- ``trainer``: rank 0's ``weightwire.trainer.backends.Backend`` (rendezvous, payload);
- ``connect``: the worker's ``(info, *, rank, device) -> ReceiveLink`` (``None``:
  only vLLM's own receiver speaks this wire);
- ``worker_engine``: the standalone receiver outside vLLM (reference server, the
  loopback test receiver);
- ``vllm_engine``: the ``WeightTransferEngine`` subclass the vLLM plugin registers
  under the entry's name (``None``: vLLM ships it, the stock ``nccl``).

Every consumer reads this table: the trainer (``trainer.backends.get_backend``), the
worker engines (``torch_side.worker.connect``), the plugin, the reference server's
and the CLI's ``--backend`` choices, the demo and the loopback receiver. That is the
failure it prevents: a backend added, renamed or given a new engine in one of those
places and forgotten in another (the CLI offering a name the server cannot run, the
plugin registering fewer backends than the trainer can open).

Importing this module imports nothing else (no torch, jax or cupy, not even
``weightwire.shared``): ``load`` imports an entry's module when it is first used.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

TCP = "weightwire_tcp"
"""TCP data plane, no GPU needed; needs the weightwire plugin in vLLM."""
WEIGHTWIRE_NCCL = "weightwire_nccl"
"""vLLM's NCCL wire plus a worker-side receive timeout; needs the plugin."""
NCCL = "nccl"
"""vLLM's own dense NCCL backend (unique-id rendezvous); no plugin."""
IPC = "weightwire_ipc"
"""CUDA IPC: trainer and workers on one host (same GPU or peer GPUs); needs the plugin."""

_INFO = "weightwire.shared.info"
_ENGINES = "weightwire.torch_side.worker.engines"
_VLLM = "weightwire.torch_side.worker.vllm_engines"


@dataclass(frozen=True)
class BackendSpec:
    """One backend: its name, the module paths of its parts, and what it needs.

    Paths are ``"module:attr"`` (``load`` resolves them), never imported here.
    """

    name: str
    init_info: str
    """The shared init-info class the worker parses (its ``backend`` ClassVar == ``name``)."""
    trainer: str
    """Rank 0's ``Backend`` subclass."""
    connect: str | None
    """The worker's connect function; ``None``: only vLLM's own receiver speaks this wire."""
    worker_engine: str
    """The standalone receiver (reference server, loopback). Stock ``nccl``: the
    ``weightwire_nccl`` engine, whose init info is vLLM's plus a defaulted timeout."""
    vllm_engine: str | None
    """The engine class the plugin registers with vLLM; ``None``: vLLM has it built in."""
    needs_cuda: bool
    """Trainer and workers need CUDA devices (and cupy)."""
    stock_receiver: bool
    """The workers run vLLM's own receive code (rounds are planned for it first)."""
    same_host: bool = False
    """Trainer and workers must share a host (CUDA IPC)."""

    @property
    def needs_plugin(self) -> bool:
        """A stock vLLM lacks this backend: the weightwire plugin registers it."""
        return self.vllm_engine is not None


SPECS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec(
            name=TCP, init_info=f"{_INFO}:TCPInitInfo", trainer="weightwire.backends.tcp.trainer:TCPBackend",
            connect="weightwire.backends.tcp.worker:connect_tcp", worker_engine=f"{_ENGINES}:WeightwireTCPEngine",
            vllm_engine=f"{_VLLM}:VllmWeightwireTCPEngine", needs_cuda=False, stock_receiver=False,
        ),
        BackendSpec(
            name=WEIGHTWIRE_NCCL, init_info=f"{_INFO}:WeightwireNCCLInitInfo",
            trainer="weightwire.backends.nccl.trainer:WeightwireNCCLBackend",
            connect="weightwire.backends.nccl.worker:connect_nccl", worker_engine=f"{_ENGINES}:WeightwireNCCLEngine",
            vllm_engine=f"{_VLLM}:VllmWeightwireNCCLEngine", needs_cuda=True, stock_receiver=False,
        ),
        BackendSpec(
            name=NCCL, init_info=f"{_INFO}:NCCLInitInfo", trainer="weightwire.backends.nccl.trainer:NCCLBackend",
            connect=None, worker_engine=f"{_ENGINES}:WeightwireNCCLEngine",
            vllm_engine=None, needs_cuda=True, stock_receiver=True,
        ),
        BackendSpec(
            name=IPC, init_info="weightwire.shared.ipc_info:IPCInitInfo",
            trainer="weightwire.backends.ipc.trainer:IPCBackend", connect="weightwire.backends.ipc.worker:connect_ipc",
            worker_engine="weightwire.torch_side.worker.ipc_engine:WeightwireIPCEngine",
            vllm_engine=f"{_VLLM}:VllmWeightwireIPCEngine", needs_cuda=True, stock_receiver=False, same_host=True,
        ),
    )
}
"""Name -> spec, in the order commands list them (CPU-capable ``weightwire_tcp`` first)."""

BACKEND_NAMES: tuple[str, ...] = tuple(SPECS)
"""Every built-in backend name."""
PLUGIN_BACKENDS: tuple[str, ...] = tuple(name for name, spec in SPECS.items() if spec.needs_plugin)
"""The backends the vLLM plugin adds, which are also the ones the reference server serves
(it stands in for a vLLM with the plugin)."""
ALIASES: dict[str, str] = {"tcp": TCP}
"""Short spellings accepted wherever a backend is (``tcp`` is unambiguous; ``nccl`` is vLLM's own)."""


def canonical(name: str) -> str:
    """``name`` with an alias resolved (``tcp`` -> ``weightwire_tcp``); other names unchanged."""
    return ALIASES.get(name, name)


def get(name: str) -> BackendSpec:
    """The spec of ``name`` (aliases accepted); ``ValueError`` listing the known names otherwise."""
    spec = SPECS.get(canonical(name)) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
    return spec


def load(path: str) -> Any:
    """Import ``"module:attr"`` and return the attribute (a class or function)."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"backend part path must be 'module:attr', got {path!r}")
    return getattr(importlib.import_module(module), attr)


__all__ = [
    "ALIASES",
    "BACKEND_NAMES",
    "IPC",
    "NCCL",
    "PLUGIN_BACKENDS",
    "SPECS",
    "TCP",
    "WEIGHTWIRE_NCCL",
    "BackendSpec",
    "canonical",
    "get",
    "load",
]
