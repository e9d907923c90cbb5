"""Rank 0's side of ``weightwire_tcp``: listen, put the endpoint and secret in the init info.

The workers dial in and prove the secret (``rendezvous.TCPRendezvous``); ``join``
returns the root communicator once every worker rank is connected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from weightwire.backends import TCP
from weightwire.backends.tcp.rendezvous import TCPRendezvous
from weightwire.shared.communicator import Communicator
from weightwire.shared.info import TCPInitInfo
from weightwire.trainer.backends import Backend, Rendezvous

if TYPE_CHECKING:
    from weightwire.trainer.config import TrainerInitInfo


class TCPBackend(Backend):
    """``weightwire_tcp``: rank 0 listens; workers dial in and prove the secret."""

    name: ClassVar[str] = TCP
    on_device: ClassVar[bool] = False
    several_broadcasters: ClassVar[str | None] = "stars"  # each broadcaster listens; workers dial every star

    def open(self, info: TrainerInitInfo, *, world_size: int) -> Rendezvous:
        rdv = TCPRendezvous(world_size=world_size, bind_host=info.tcp_bind_host, advertise_host=info.tcp_advertise_host)
        try:
            payload = TCPInitInfo(
                **rdv.init_fields(), rank_offset=1, world_size=world_size, packed=info.packed,
                packed_buffer_size_bytes=info.packed_buffer_size_bytes,
                packed_num_buffers=info.packed_num_buffers, timeout_s=float(info.timeouts.transfer_s),
                stage_budget_bytes=info.stage_budget_bytes,
            ).to_dict()
        except BaseException:
            rdv.close()
            raise
        return _TCPRendezvous(payload, rdv)


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
