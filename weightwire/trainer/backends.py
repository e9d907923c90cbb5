"""Backends: how rank 0 rendezvouses with the workers, and what it tells them.

A backend turns a ``TrainerInitInfo`` into (a) the worker init info the engine posts
to ``/init_weight_transfer_engine`` and (b) a ``join`` that completes rank 0's side
of the rendezvous while that POST is in flight. It also says where packing happens
(``on_device``: NCCL packs in GPU memory; TCP packs host bytes) and which server
versions it needs. The worker init info holds secrets (unique id, TCP secret): it is
never logged and never part of a repr.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, cast

from weightwire.shared.communicator import Communicator, DeviceCommunicator
from weightwire.shared.info import NCCLInitInfo, TCPInitInfo, WeightwireNCCLInitInfo, encode_secret
from weightwire.shared.version import ServerFeatures
from weightwire.trainer.config import BACKENDS, TrainerInitInfo

if TYPE_CHECKING:
    from weightwire.backends.ipc.trainer import IPCRendezvous, IPCSenderComm
    from weightwire.backends.tcp.rendezvous import TCPRendezvous
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

    def check_server(self, features: ServerFeatures) -> None:
        """Raise ``ValueError`` if the server's version lacks what this backend needs."""
        features.require("packed_in_init", "the wire params travel in the init info")

    @abstractmethod
    def open(self, info: TrainerInitInfo, *, world_size: int) -> Rendezvous:
        """Prepare rank 0's endpoint for a group of ``world_size`` ranks (trainer included)."""

    def device_pipeline(self, comm: Communicator, packer: DevicePacker, *, num_buffers: int, timeout: float,
                        hold_bytes: int) -> DevicePipeline:
        """The on-device data path over ``comm`` (NCCL: slot buffers broadcast on rotating streams)."""
        from weightwire.trainer.pipelines import DevicePipeline  # noqa: PLC0415

        # An on_device backend's join returns a stream-ordered communicator (NCCLCommunicator).
        return DevicePipeline(cast(DeviceCommunicator, comm), packer, num_buffers=num_buffers, timeout=timeout,
                              hold_bytes=hold_bytes)


class NCCLBackend(Backend):
    """Stock vLLM ``nccl``: rank 0 mints an NCCL unique id and ships it base64-encoded."""

    name: ClassVar[str] = "nccl"
    on_device: ClassVar[bool] = True
    stock_receiver: ClassVar[bool] = True

    def check_server(self, features: ServerFeatures) -> None:
        features.require("unique_id_rendezvous", "a torch-free trainer joins NCCL through nccl_unique_id_b64")

    def _payload(self, info: TrainerInitInfo, unique_id: bytes, world_size: int) -> dict[str, Any]:
        # Built through the shared dataclass so the payload is validated exactly as the
        # worker will parse it, and carries exactly vLLM's fields.
        return NCCLInitInfo(
            nccl_unique_id_b64=encode_secret(unique_id), rank_offset=1, world_size=world_size,
            packed=info.packed, packed_buffer_size_bytes=info.packed_buffer_size_bytes,
            packed_num_buffers=info.packed_num_buffers,
        ).to_dict()

    def open(self, info: TrainerInitInfo, *, world_size: int) -> Rendezvous:
        from weightwire.backends.nccl import comm as nccl  # noqa: PLC0415  (cupy only where NCCL is used)

        if not nccl.nccl_available():
            raise RuntimeError(f"backend {self.name!r} needs cupy with NCCL and a CUDA device on the trainer host")
        unique_id = nccl.mint_unique_id()
        return _NCCLRendezvous(self._payload(info, unique_id, world_size), unique_id, world_size, info.device)


class WeightwireNCCLBackend(NCCLBackend):
    """``weightwire_nccl``: vLLM's NCCL fields plus the worker-side receive timeout."""

    name: ClassVar[str] = "weightwire_nccl"
    stock_receiver: ClassVar[bool] = False  # the plugin's receiver takes any offset, dtype and shape

    def _payload(self, info: TrainerInitInfo, unique_id: bytes, world_size: int) -> dict[str, Any]:
        return WeightwireNCCLInitInfo(
            nccl_unique_id_b64=encode_secret(unique_id), rank_offset=1, world_size=world_size,
            packed=info.packed, packed_buffer_size_bytes=info.packed_buffer_size_bytes,
            packed_num_buffers=info.packed_num_buffers, timeout_s=float(info.timeouts.transfer_s),
        ).to_dict()


class _NCCLRendezvous(Rendezvous):
    def __init__(self, payload: dict[str, Any], unique_id: bytes, world_size: int, device: int | None) -> None:
        super().__init__(payload)
        self._unique_id = unique_id
        self._world_size = world_size
        self._device = device

    def join(self, *, timeout: float) -> Communicator:
        from weightwire.backends.nccl.comm import NCCLCommunicator  # noqa: PLC0415

        return NCCLCommunicator.join(
            unique_id=self._unique_id, rank=0, world_size=self._world_size, device=self._device, timeout=timeout
        )


class TCPBackend(Backend):
    """``weightwire_tcp``: rank 0 listens; workers dial in and prove the secret."""

    name: ClassVar[str] = "weightwire_tcp"
    on_device: ClassVar[bool] = False

    def open(self, info: TrainerInitInfo, *, world_size: int) -> Rendezvous:
        from weightwire.backends.tcp.comm import TCPRendezvous  # noqa: PLC0415

        rdv = TCPRendezvous(world_size=world_size, bind_host=info.tcp_bind_host, advertise_host=info.tcp_advertise_host)
        try:
            payload = TCPInitInfo(
                **rdv.init_fields(), rank_offset=1, world_size=world_size, packed=info.packed,
                packed_buffer_size_bytes=info.packed_buffer_size_bytes,
                packed_num_buffers=info.packed_num_buffers, timeout_s=float(info.timeouts.transfer_s),
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


class IPCBackend(Backend):
    """``weightwire_ipc``: trainer and workers on one host (same GPU or peer GPUs), CUDA IPC.

    Rank 0 allocates the slot ring, exports its memory and ready-event handles in the
    init info (JSON, base64) and listens on loopback for the workers' control channels."""

    name: ClassVar[str] = "weightwire_ipc"
    on_device: ClassVar[bool] = True

    def open(self, info: TrainerInitInfo, *, world_size: int) -> Rendezvous:
        from weightwire.backends.ipc.slots import ipc_available  # noqa: PLC0415  (cupy only where IPC is used)
        from weightwire.backends.ipc.trainer import IPCRendezvous  # noqa: PLC0415

        if not ipc_available():
            raise RuntimeError(f"backend {self.name!r} needs cupy and a CUDA device on the trainer host")
        rdv = IPCRendezvous(
            world_size=world_size, device=info.device, slot_bytes=info.packed_buffer_size_bytes,
            num_slots=info.packed_num_buffers, packed=info.packed, timeout_s=float(info.timeouts.transfer_s),
            release_after_round=info.ipc_release_after_round,
        )
        return _IPCRendezvous(rdv.payload, rdv)

    def device_pipeline(self, comm: Communicator, packer: DevicePacker, *, num_buffers: int, timeout: float,
                        hold_bytes: int) -> DevicePipeline:
        from weightwire.backends.ipc.pipeline import IPCPipeline  # noqa: PLC0415

        # comm is what _IPCRendezvous.join returned.
        return IPCPipeline(cast("IPCSenderComm", comm), packer, num_buffers=num_buffers, timeout=timeout,
                           hold_bytes=hold_bytes)


class _IPCRendezvous(Rendezvous):
    def __init__(self, payload: dict[str, Any], rdv: IPCRendezvous) -> None:
        super().__init__(payload)
        self._rdv = rdv

    def join(self, *, timeout: float) -> Communicator:
        return self._rdv.join(timeout=timeout)

    def cancel(self) -> None:
        self._rdv.cancel()


_REGISTRY: dict[str, Backend] = {
    b.name: b for b in (NCCLBackend(), WeightwireNCCLBackend(), TCPBackend(), IPCBackend())
}
assert tuple(_REGISTRY) == BACKENDS


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Add a backend (tests register fakes; users may add their own transports)."""
    if backend.name in _REGISTRY and not replace:
        raise ValueError(f"backend {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend


def unregister_backend(name: str) -> None:
    if name in BACKENDS:
        raise ValueError(f"built-in backend {name!r} cannot be removed")
    _REGISTRY.pop(name, None)


def get_backend(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(_REGISTRY)}") from None


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)
