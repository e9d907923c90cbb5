"""Rank 0's side of ``weightwire_tcp``: listen, put the endpoint and secret in the init info.

The workers dial in and prove the secret (``rendezvous.TCPRendezvous``); ``join``
returns the root communicator once every worker rank is connected. Several
broadcasters are stars: each non-zero broadcaster listens too (``open_star``) and rank
0's init info lists every star (``with_stars``); the workers dial them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from weightwire.backends.base import (
    Backend,
    Rendezvous,
    RoundSender,
    SenderCaps,
    SenderParts,
    SenderSettings,
    StarEndpoint,
    StarSource,
    framing_fields,
    receiver_fields,
)
from weightwire.backends.pipelines import host_sender
from weightwire.backends.tcp.comm import TCPCommunicator
from weightwire.backends.tcp.info import TCPInitInfo
from weightwire.backends.tcp.options import tcp_options
from weightwire.backends.tcp.rendezvous import TCPRendezvous
from weightwire.backends.tcp.slices import TCPSlicedSender
from weightwire.backends.tcp.spec import TCP
from weightwire.shared.communicator import Communicator
from weightwire.shared.info import encode_secret


class TCPBackend(Backend):
    """``weightwire_tcp``: rank 0 listens; workers dial in and prove the secret."""

    name: ClassVar[str] = TCP.name
    caps: ClassVar[SenderCaps] = SenderCaps(on_device=False, several="stars", sliced=True)

    def open(self, settings: SenderSettings, *, world_size: int) -> Rendezvous:
        options = tcp_options(settings, self.name)
        rdv = TCPRendezvous(
            world_size=world_size,
            bind_host=options.tcp_bind_host,
            advertise_host=options.tcp_advertise_host,
        )
        try:
            payload = TCPInitInfo(
                **rdv.init_fields(),
                **framing_fields(settings, world_size=world_size),
                **receiver_fields(settings),
            ).to_dict()
        except BaseException:
            rdv.close()
            raise
        return _TCPRendezvous(payload, rdv)

    def sender(self, link: Any, settings: SenderSettings, parts: SenderParts) -> RoundSender:
        return host_sender(link, settings, parts)

    def hellos(self, link: Any, *, timeout: float | None = None) -> list[bytes]:
        comm: TCPCommunicator = link
        return [comm.hellos.get(rank, b"") for rank in range(1, comm.world_size)]

    def sliced_sender(
        self, link: Any, settings: SenderSettings, parts: SenderParts | None = None
    ) -> RoundSender:
        return TCPSlicedSender(
            link,
            buffer_bytes=settings.packed_buffer_size_bytes,
            timeout=settings.timeouts.transfer_s,
        )

    def open_star(
        self, settings: SenderSettings, *, world_size: int, secret: bytes
    ) -> StarEndpoint:
        options = tcp_options(settings, self.name)
        return TCPRendezvous(
            world_size=world_size,
            bind_host=options.tcp_bind_host,
            advertise_host=options.tcp_advertise_host,
            secret=secret,
        )

    def with_stars(
        self,
        payload: dict[str, Any],
        stars: Sequence[StarSource],
        *,
        rank_offset: int,
        world_size: int,
    ) -> dict[str, Any]:
        sources = [
            {"host": s.host, "port": s.port, "secret_b64": encode_secret(s.secret)} for s in stars
        ]
        out = {**payload, "rank_offset": rank_offset, "world_size": world_size, "sources": sources}
        TCPInitInfo.from_dict(out)  # validated here, before the workers see it
        return out


class _TCPRendezvous(Rendezvous):
    def __init__(self, payload: dict[str, Any], rdv: TCPRendezvous) -> None:
        super().__init__(payload)
        self._rdv = rdv

    def join(self, *, timeout: float) -> Communicator:
        try:
            return self._rdv.accept(timeout=timeout)
        finally:
            self._rdv.close()  # no later connection is ever expected on this port

    def cancel(self) -> None:
        self._rdv.close()
