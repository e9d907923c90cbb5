"""``IPCOptions``: what ``weightwire_ipc`` reads of the trainer's settings beyond the generic
``SenderSettings`` (``TrainerInitInfo``'s ``ipc_*`` fields)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from weightwire.backends.base import SenderSettings, missing_options


@runtime_checkable
class IPCOptions(Protocol):
    @property
    def ipc_release_after_round(self) -> bool:
        """Free the slots after every round (memory back to training between rounds)."""
        ...

    @property
    def ipc_mode(self) -> str:
        """The data path asked for: ``pull``, ``push``, ``write_through`` or ``auto``."""
        ...

    @property
    def delta(self) -> str:
        """The session's delta rounds (``"off"`` / ``"auto"``): ``auto`` resolves to pull then."""
        ...


def ipc_options(settings: SenderSettings, backend: str) -> IPCOptions:
    """``settings`` read as this backend's options; ``ConfigError`` when they lack them."""
    if isinstance(settings, IPCOptions):
        return settings
    raise missing_options(settings, "IPCOptions", backend)
