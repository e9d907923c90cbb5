"""``BackendSpec``: what one backend is, written once, in its own package.

Each backend package has a ``spec`` module (``weightwire.backends.<package>.spec``)
whose ``SPECS`` tuple holds the package's backends; the registry
(``weightwire.backends``) lists the packages. A spec is data only: its parts are
``"module:attr"`` paths, resolved by ``weightwire.backends.load`` when first used, so
reading the specs imports no framework (nor numpy).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendSpec:
    """One backend: its name, the module paths of its parts, and what it needs."""

    name: str
    """The backend's name, as vLLM's ``--weight-transfer-config`` and ``TrainerInitInfo.backend``
    spell it. Written nowhere else in code."""
    init_info: str
    """The (numpy-only) init-info class the worker parses its init info with, in the backend's
    package (``backends/<name>/info.py``)."""
    trainer: str
    """Rank 0's ``Backend`` subclass."""
    connect: str | None
    """The worker's connect function; ``None``: only vLLM's own receiver speaks this wire."""
    worker_engine: str | None
    """The standalone receiver (reference server, loopback). Stock ``nccl``: the
    ``weightwire_nccl`` engine, whose init info is vLLM's plus a defaulted timeout. ``None``:
    nothing outside vLLM receives this wire (``nccl_m2n``: vLLM's own worker only)."""
    vllm_engine: str | None
    """The engine class the plugin registers with vLLM; ``None``: vLLM has it built in."""
    needs_cuda: bool
    """Trainer and workers need CUDA devices (and cupy)."""
    stock_receiver: bool
    """The workers run vLLM's own receive code (rounds are planned for it first)."""
    dense_rounds: bool = True
    """Rounds may carry whole tensors (``False``: delta rounds of patches only)."""
    same_host: bool = False
    """Trainer and workers must share a host (CUDA IPC)."""
    default: bool = False
    """``TrainerInitInfo.backend``'s default (exactly one built-in backend says so)."""
    aliases: tuple[str, ...] = ()
    """Short spellings accepted wherever a backend name is (command line, ``TrainerInitInfo``)."""

    @property
    def needs_plugin(self) -> bool:
        """A stock vLLM lacks this backend: the weightwire plugin registers it."""
        return self.vllm_engine is not None
