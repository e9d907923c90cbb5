"""``TCPOptions``: what ``weightwire_tcp`` reads of the trainer's settings beyond the generic
``SenderSettings`` (``TrainerInitInfo``'s ``tcp_*`` fields)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from weightwire.backends.base import SenderSettings, missing_options


@runtime_checkable
class TCPOptions(Protocol):
    @property
    def tcp_bind_host(self) -> str:
        """The address rank 0's rendezvous listens on."""
        ...

    @property
    def tcp_advertise_host(self) -> str | None:
        """The address the workers dial (``None``: the bind host)."""
        ...


def tcp_options(settings: SenderSettings, backend: str) -> TCPOptions:
    """``settings`` read as this backend's options; ``ConfigError`` when they lack them."""
    if isinstance(settings, TCPOptions):
        return settings
    raise missing_options(settings, "TCPOptions", backend)
