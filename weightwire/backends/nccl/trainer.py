"""Rank 0's side of ``nccl`` (stock vLLM) and ``weightwire_nccl``: mint the unique id, join.

Both ship a freshly minted NCCL unique id base64-encoded in the worker init info
(vLLM >= 0.30's ``nccl_unique_id_b64``: a torch-free trainer cannot host vLLM's
TCPStore rendezvous), then join the group as rank 0 while the init POST is in flight.
``weightwire_nccl`` adds the worker-side receive timeout that stock vLLM lacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from weightwire.backends.base import (
    Backend,
    PatchPlan,
    Rendezvous,
    RoundSender,
    SenderCaps,
    SenderParts,
    SenderSettings,
    WirePlan,
    framing_fields,
    receiver_fields,
)
from weightwire.backends.device import SlotBuffers
from weightwire.backends.nccl import comm as nccl
from weightwire.backends.nccl.info import NCCL_UNIQUE_ID_BYTES, NCCLInitInfo, WeightwireNCCLInitInfo
from weightwire.backends.nccl.library import mint_unique_id, nccl_available, nccl_unavailable
from weightwire.backends.nccl.slices import NCCLSlicedSender, recv_hellos
from weightwire.backends.nccl.sparse import sparse_nccl_round
from weightwire.backends.nccl.spec import NCCL, SPARSE_NCCL, WEIGHTWIRE_NCCL
from weightwire.backends.nccl.stock import plan_for_stock
from weightwire.backends.pipelines import DevicePipeline
from weightwire.shared.communicator import Communicator
from weightwire.shared.errors import ConfigError
from weightwire.shared.info import decode_secret, encode_secret
from weightwire.shared.meta import ParamMeta
from weightwire.shared.patches import SparsePatch
from weightwire.shared.source import Describe
from weightwire.shared.timeouts import Timeouts
from weightwire.shared.version import ServerFeatures


class NCCLBackend(Backend):
    """Stock vLLM ``nccl``: rank 0 mints an NCCL unique id and ships it base64-encoded."""

    name: ClassVar[str] = NCCL.name
    caps: ClassVar[SenderCaps] = SenderCaps(on_device=True, stock_receiver=True)

    def check_server(self, features: ServerFeatures) -> None:
        features.require(
            "unique_id_rendezvous", "a torch-free trainer joins NCCL through nccl_unique_id_b64"
        )

    # vLLM's own receiver: its wire order (or its refusal, ``StockRefusal``).
    plan_round = staticmethod(plan_for_stock)

    def sender(self, link: Any, settings: SenderSettings, parts: SenderParts) -> RoundSender:
        """Slot buffers broadcast on rotating streams (``link`` is an ``NCCLCommunicator``)."""
        assert parts.packer is not None, "an on-device backend is lent a packer"
        count = settings.packed_num_buffers
        return DevicePipeline(
            link,
            parts.packer,
            SlotBuffers(link.cupy, parts.packer.ordinal),
            packed=settings.packed,
            num_buffers=count,
            timeout=settings.timeouts.transfer_s,
            hold_bytes=settings.packed_buffer_size_bytes * count,
        )

    def _payload(self, info: SenderSettings, unique_id: bytes, world_size: int) -> dict[str, Any]:
        # Built through the shared dataclass so the payload is validated exactly as the
        # worker will parse it, and carries exactly vLLM's fields.
        return NCCLInitInfo(
            nccl_unique_id_b64=encode_secret(unique_id),
            **framing_fields(info, world_size=world_size),
        ).to_dict()

    def check_host(self) -> None:
        if not nccl_available():  # cupy is imported here, on first use, not with this module
            raise nccl_unavailable(
                self.name, "needs cupy with NCCL and a CUDA device on the trainer host"
            )

    def open(self, info: SenderSettings, *, world_size: int) -> Rendezvous:
        self.check_host()
        unique_id = mint_unique_id()
        return _NCCLRendezvous(
            self._payload(info, unique_id, world_size), unique_id, world_size, info.device
        )


class SparseNCCLBackend(NCCLBackend):
    """Stock vLLM ``sparse_nccl``: the ``nccl`` rendezvous, then delta rounds only, each patch
    an ``int32`` index broadcast and a values broadcast (``backends.nccl.sparse``)."""

    name: ClassVar[str] = SPARSE_NCCL.name
    caps: ClassVar[SenderCaps] = SenderCaps(on_device=True, stock_receiver=True, delta=True)

    def check_server(self, features: ServerFeatures) -> None:
        super().check_server(features)
        features.require("sparse_nccl", "the server's receiver is vLLM's sparse_nccl engine")

    def plan_round(self, metas: Sequence[ParamMeta], **_: Any) -> WirePlan:
        raise ConfigError(
            f"backend {self.name!r} receives patches only, not whole tensors: use "
            "TrainerInitInfo(delta='auto'), or send each round's patches with "
            "engine.send_patches (the first one an anchor: anchor_patches); nothing was sent"
        )

    def plan_patches(
        self, patches: Sequence[SparsePatch], *, features: ServerFeatures, describe: Describe
    ) -> PatchPlan:
        return sparse_nccl_round(patches, features=features, describe=describe)

    def sender(self, link: Any, settings: SenderSettings, parts: SenderParts) -> RoundSender:
        """Per-tensor broadcasts with their own NCCL types: the receiver never unpacks."""
        return super().sender(link, UnpackedSettings(settings), parts)

    def _payload(self, info: SenderSettings, unique_id: bytes, world_size: int) -> dict[str, Any]:
        return super()._payload(UnpackedSettings(info), unique_id, world_size)


class UnpackedSettings:
    """``settings`` with ``packed`` off (every other field read through)."""

    def __init__(self, settings: SenderSettings) -> None:
        self._settings = settings

    @property
    def packed(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._settings, name)


class WeightwireNCCLBackend(NCCLBackend):
    """``weightwire_nccl``: vLLM's NCCL fields plus the worker-side receive timeout; sliced
    rounds point to point on the same communicator (``backends.nccl.slices``)."""

    name: ClassVar[str] = WEIGHTWIRE_NCCL.name
    # The plugin's receiver takes any offset, dtype and shape; one communicator, each turn's root
    # is its src.
    caps: ClassVar[SenderCaps] = SenderCaps(on_device=True, several="group", sliced=True)

    def hellos(self, link: Any, *, timeout: float | None = None) -> list[bytes]:
        """Each worker's hello, sent on the communicator right after its warm-up."""
        wait = Timeouts.from_env().warmup_s if timeout is None else timeout
        return recv_hellos(link, timeout=wait)

    def sliced_sender(
        self, link: Any, settings: SenderSettings, parts: SenderParts | None = None
    ) -> RoundSender:
        assert parts is not None and parts.packer is not None, "an on-device backend is lent one"
        return NCCLSlicedSender(
            link,
            parts.packer,
            buffer_bytes=settings.packed_buffer_size_bytes,
            depth=settings.packed_num_buffers,
            timeout=settings.timeouts.transfer_s,
        )

    # Not a stock receiver: any wire order goes, as for every backend by default.
    plan_round = Backend.plan_round

    def _payload(self, info: SenderSettings, unique_id: bytes, world_size: int) -> dict[str, Any]:
        return WeightwireNCCLInitInfo(
            nccl_unique_id_b64=encode_secret(unique_id),
            **framing_fields(info, world_size=world_size),
            **receiver_fields(info),
        ).to_dict()

    def peer_fields(self, payload: dict[str, Any]) -> dict[str, Any]:
        return {
            "nccl_unique_id_b64": payload["nccl_unique_id_b64"],
            "world_size": payload["world_size"],
        }

    def join_peer(
        self, info: SenderSettings, fields: dict[str, Any], *, rank: int, timeout: float
    ) -> Communicator:
        if not nccl_available():
            raise nccl_unavailable(
                self.name, "needs cupy with NCCL and a CUDA device on every broadcasting rank"
            )
        unique_id = decode_secret(
            "nccl_unique_id_b64", fields["nccl_unique_id_b64"], NCCL_UNIQUE_ID_BYTES
        )
        return nccl.NCCLCommunicator.join(
            unique_id=unique_id,
            rank=rank,
            world_size=int(fields["world_size"]),
            device=info.device,
            timeout=timeout,
        )


class _NCCLRendezvous(Rendezvous):
    def __init__(
        self, payload: dict[str, Any], unique_id: bytes, world_size: int, device: int | None
    ) -> None:
        super().__init__(payload)
        self._unique_id = unique_id
        self._world_size = world_size
        self._device = device

    def join(self, *, timeout: float) -> Communicator:
        return nccl.NCCLCommunicator.join(
            unique_id=self._unique_id,
            rank=0,
            world_size=self._world_size,
            device=self._device,
            timeout=timeout,
        )
