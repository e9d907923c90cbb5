"""``IPCInitInfo``: the init info of ``weightwire_ipc`` (CUDA IPC on one host).

JSON only: the trainer's slot buffers (``cudaIpcMemHandle_t``) and its "slot is
ready" interprocess events (``cudaIpcEventHandle_t``) travel as standard base64 of
their 64 raw bytes, never pickled. The control channel (``host:port``, proven with
``secret_b64``) carries the per-piece "ready" / "free" messages, also as JSON.

The data path (write-through: the trainer writes into the worker's parameters; pull:
into its receive buffers; push: the slot ring) is not a field here: it is negotiated in
the control channel's hello (``IPC_MODES``), where each worker lists the modes it takes
and the trainer names the session's.

Parsed strictly like every other init info: a wrong count of handles, a handle of
the wrong length or a slot size over the limits fails the request naming the field,
before a worker opens anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from weightwire.shared.errors import ConfigError
from weightwire.shared.info import (
    DEFAULT_PACKED_NUM_BUFFERS,
    TCP_SECRET_BYTES,
    StrictInfo,
    check_listener,
    decode_secret,
)
from weightwire.shared.limits import DEFAULT_STAGE_BUDGET_BYTES, bounded_repr

IPC_HANDLE_BYTES = 64
"""``sizeof(cudaIpcMemHandle_t)`` == ``sizeof(cudaIpcEventHandle_t)`` (CUDA ABI)."""

DEFAULT_IPC_SLOT_BYTES = 1 << 30

IPC_MODES = ("write_through", "pull", "push")
"""``weightwire_ipc`` data paths, negotiated in the control channel's hello:
``write_through`` = the trainer writes each tensor into the worker's serving parameters
(one copy per byte, nothing loaded after), ``pull`` = the trainer writes into the
worker's receive buffers (one copy per byte, then loaded), ``push`` = the slot ring (two
copies)."""


@dataclass(frozen=True, kw_only=True, repr=False)
class IPCInitInfo(StrictInfo):
    """``weightwire_ipc``: slots in the trainer's GPU memory, opened by each worker.

    - ``mem_handles_b64`` / ``event_handles_b64``: one per slot
      (``packed_num_buffers`` of each); a slot holds ``packed_buffer_size_bytes``.
    - ``host`` / ``port`` / ``secret_b64``: the trainer's control channel (loopback).
    - ``device_uuid``: the trainer GPU's UUID (hex), so a worker can say whether it
      copies within one GPU or across NVLink/PCIe, and refuse a handle from another host.
    - ``release_after_round``: the trainer frees its slots after every round and
      exports fresh ones at the next (memory back to training between syncs, at the
      cost of re-opening handles each round); workers close their mappings then too.
    """

    _secret_fields: ClassVar[tuple[str, ...]] = (
        "secret_b64",
        "mem_handles_b64",
        "event_handles_b64",
    )

    host: str
    port: int
    secret_b64: str
    rank_offset: int
    world_size: int
    mem_handles_b64: list[str] = field(default_factory=list)
    event_handles_b64: list[str] = field(default_factory=list)
    device_uuid: str = ""
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_IPC_SLOT_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    timeout_s: float = 300.0
    release_after_round: bool = False
    stage_budget_bytes: int = DEFAULT_STAGE_BUDGET_BYTES
    delta_rounds: bool | None = None
    """The trainer may send delta rounds (``TrainerInitInfo.delta``); left out when unset."""

    def __post_init__(self) -> None:
        ctx = type(self).__name__
        check_listener(ctx, self)
        for key in ("mem_handles_b64", "event_handles_b64"):
            got = getattr(self, key)
            if len(got) != self.packed_num_buffers:
                raise ConfigError(
                    f"{ctx}.{key} must list one handle per slot ({self.packed_num_buffers}), "
                    f"got {len(got)}"
                )
        _ = self.mem_handles, self.event_handles
        uuid = self.device_uuid
        if len(uuid) > 64 or any(c not in "0123456789abcdef-" for c in uuid):
            raise ConfigError(
                f"{ctx}.device_uuid must be a lower-case hex GPU UUID, got {bounded_repr(uuid)}"
            )

    @property
    def secret(self) -> bytes:
        return decode_secret(f"{type(self).__name__}.secret_b64", self.secret_b64, TCP_SECRET_BYTES)

    @property
    def mem_handles(self) -> list[bytes]:
        return decode_handles(f"{type(self).__name__}.mem_handles_b64", self.mem_handles_b64)

    @property
    def event_handles(self) -> list[bytes]:
        return decode_handles(f"{type(self).__name__}.event_handles_b64", self.event_handles_b64)


def decode_handles(ctx: str, values: object) -> list[bytes]:
    """A list of base64 CUDA IPC handles, each exactly ``IPC_HANDLE_BYTES`` raw bytes."""
    if not isinstance(values, list):
        raise ConfigError(f"{ctx} must be a list of base64 strings, got {type(values).__name__}")
    return [decode_secret(f"{ctx}[{i}]", v, IPC_HANDLE_BYTES) for i, v in enumerate(values)]
