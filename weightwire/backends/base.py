"""The per-backend contract, rank 0's half: what a backend gives the trainer.

The trainer (``weightwire.trainer``) consumes this module; a backend package implements it
and imports nothing above ``backends/``. The workers' half is ``backends.worker_base``.
"""

# A backend gives rank 0 a round's wire in three steps: ``Backend.open`` (a pending
# ``Rendezvous``: the worker init info to post, and rank 0's half of the join), then
# ``Backend.sender`` over the joined link (a ``RoundSender``: sends one round's chunks,
# as many rounds as the session lasts), then ``RoundSender.close`` and ``Link.close``.
# The trainer asks a backend's ``caps`` what it can do (several broadcasters, a stock
# receiver, packing on a device) and calls the matching hooks; a hook a backend lacks
# raises ``NotImplementedError`` naming it.

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple, Protocol

import numpy as np

from weightwire.shared.communicator import Communicator
from weightwire.shared.errors import ConfigError, TransferError
from weightwire.shared.framing import Chunk
from weightwire.shared.meta import MetaRows, ParamMeta
from weightwire.shared.patches import SparsePatch
from weightwire.shared.slices import Box
from weightwire.shared.source import Describe
from weightwire.shared.timeouts import Timeouts
from weightwire.shared.version import ServerFeatures

Prepared = tuple[Chunk, list[Any]]
"""One chunk of the round's plan with its tensors, in wire order."""
Begin = Callable[[], None] | None
"""Run once, after the first chunk is prepared and before its first byte goes out (the
trainer's control plane: pause, start, the update POST). If it raises, nothing was sent
(but see ``Outgoing.go_accepts``). A data path may run it beside its own preparation (a
thread), but writes nothing into a worker's serving parameters and announces nothing before
it returned: it returns once the start answered, so the round is accepted and paused on
every server."""
HostBytes = Callable[[Any], np.ndarray]
"""A tensor's C-order little-endian bytes as a flat ``uint8`` host array."""

Several = Literal["stars", "group"]


@dataclass(frozen=True)
class Outgoing:
    """One broadcaster's part of a round, as its data path (``RoundSender.send``) takes it."""

    prepared: Iterable[Prepared]
    stop: threading.Event
    """Set from outside (the update POST failed): the send stops with ``RoundAborted``."""
    begin: Begin = None
    metas: Sequence[ParamMeta] = ()
    """The round's tensors in wire order."""
    root: int = 0
    """This broadcaster's rank on the wire."""
    go_accepts: bool = False
    """The workers' own word that they are in the round is its acceptance: one server, whose
    start pauses generation before its workers' start (``routes.START_PAUSES``). A data path
    whose every worker said so from inside its start (``weightwire_ipc``'s early go) may write
    into the serving parameters before ``begin`` returned; it sets ``wrote_early`` first."""
    ready: Callable[[], None] | None = None
    """Called by a data path that runs ``begin`` from its start (``weightwire_ipc``) once it
    cleared what an earlier round left on its channels and made its first chunk (read from
    the source: one that fails there lets no start out), before that chunk's staging: a
    start sent ahead of ``begin`` (``trainer.early``) goes out then, not when ``begin`` runs
    on its helper thread."""
    wrote_early: threading.Event = field(default_factory=threading.Event)
    """Set by a data path that wrote before ``begin`` returned: a ``begin`` that then fails
    failed a round after its first byte (the workers hold part of it)."""
    one_request: bool = False
    """The round's start, update and finish are one request (``routes.UPDATE_STARTS``;
    only to a data path that ``hears_workers``): every worker's word of the round comes from
    inside it, after its server's checks and pause, so any of them accepts the round (a go
    from inside the update too). ``begin`` sends that request and returns once ``heard`` was
    called (or the request failed: its error raised, nothing written)."""
    heard: Callable[[], None] | None = None
    """Called by a data path that ``hears_workers`` once it read every worker's first word
    of the round, before its first write."""
    request: Callable[[], None] | None = None
    """A round of one request: sends it (once; ``begin`` does where the data path has not),
    returning once its bytes were written. A data path that runs ``begin`` from its start
    calls it from its own thread right after ``ready``: the request leaves without waiting for
    the helper that runs ``begin`` and without contending with the data path's first work."""


class Sent(NamedTuple):
    """What one rank put on the wire in a round."""

    nbytes: int
    sends: int
    """Broadcasts, or pieces through a backend's own slots."""


@dataclass(frozen=True)
class SlicePiece:
    """One piece of a sliced round: ``box`` of the update's tensor number ``tensor`` for
    worker ``worker`` (0-based, the order of ``Backend.hellos``); ``read`` gives its bytes as
    a C-contiguous host array of ``box.shape`` in the tensor's wire dtype."""

    worker: int
    tensor: int
    box: Box
    read: Callable[[], Any]


class RoundAborted(TransferError):
    """The round was stopped from outside (the update POST failed) between broadcasts."""


class StockRefusal(ConfigError):
    """A stock vLLM worker cannot receive ``tensor``; ``reason`` says why. Nothing was sent."""

    def __init__(self, tensor: str, reason: str, version: str, *, backend: str = "nccl") -> None:
        super().__init__(
            f"stock vLLM {version} (backend {backend!r}) cannot receive {tensor!r}: {reason}. "
            "Nothing was sent. Use the weightwire_nccl / weightwire_tcp backend (the plugin "
            "receives it), or change the tensor on the trainer side"
        )
        self.tensor = tensor
        self.reason = reason


def check_chunk_bytes(chunk: Chunk, got: int) -> None:
    """The bytes a chunk's tensors produced must be what the plan (and so the workers) expect."""
    if got != chunk.nbytes:
        raise ValueError(
            f"tensors {chunk.start}..{chunk.stop - 1} produced {got} bytes, "
            f"the plan says {chunk.nbytes}"
        )


def run_once(begin: Begin) -> Begin:
    """Call ``begin`` if it is still pending; returns the new pending value (always ``None``)."""
    if begin is not None:
        begin()
    return None


class SenderSettings(Protocol):
    """What every backend reads of the trainer's configuration (``TrainerInitInfo`` is one);
    a backend's own options (the TCP listener's host, the IPC data path) are a ``Protocol`` in
    its package (``options.py``), read through its checked accessor."""

    @property
    def packed(self) -> bool: ...
    @property
    def packed_buffer_size_bytes(self) -> int: ...
    @property
    def packed_num_buffers(self) -> int: ...
    @property
    def timeouts(self) -> Timeouts: ...
    @property
    def device(self) -> int | None: ...
    @property
    def stage_budget_bytes(self) -> int: ...


def missing_options(settings: SenderSettings, options: str, backend: str) -> ConfigError:
    """The refusal of settings that lack a backend's own options (a ``runtime_checkable``
    ``Protocol`` in its package, which ``TrainerInitInfo`` satisfies for every built-in one)."""
    return ConfigError(
        f"backend {backend!r} reads {options} from the trainer's settings, which "
        f"{type(settings).__name__} lacks; configure it with a TrainerInitInfo"
    )


def framing_fields(settings: SenderSettings, *, world_size: int) -> dict[str, Any]:
    """The worker init info's fields every backend's payload carries: the group (the trainer
    is rank 0, the workers follow it) and the round's framing."""
    return {
        "rank_offset": 1,
        "world_size": world_size,
        "packed": settings.packed,
        "packed_buffer_size_bytes": settings.packed_buffer_size_bytes,
        "packed_num_buffers": settings.packed_num_buffers,
    }


def receiver_fields(settings: SenderSettings) -> dict[str, Any]:
    """The fields weightwire's own receivers add (vLLM's stock ones have neither): their
    receive timeout and stage budget."""
    return {
        "timeout_s": float(settings.timeouts.transfer_s),
        "stage_budget_bytes": settings.stage_budget_bytes,
    }


class Link(Protocol):
    """Rank 0's joined connection to the workers, as the trainer handles it between rounds."""

    def warmup(self, *, timeout: float | None = None) -> None: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...


class WatchesPeer(Protocol):
    """A ``Link`` that tells, without traffic, whether a worker closed it (a server that
    dropped this trainer between rounds). Optional: a link without it is never displaced
    (the engine looks for ``peer_closed``)."""

    def peer_closed(self) -> bool: ...


class Rendezvous(ABC):
    """One pending rendezvous: the payload to post, and rank 0's half of the join.

    The payload holds secrets (unique id, TCP secret): never logged, never in a repr."""

    def __init__(self, payload: dict[str, Any]) -> None:
        self.payload = payload

    def __repr__(self) -> str:
        return f"{type(self).__name__}(<payload redacted>)"

    @abstractmethod
    def join(self, *, timeout: float) -> Any:
        """Rank 0 joins; returns its ``Link`` once every worker rank is connected (or raises)."""

    def cancel(self) -> None:
        """Best-effort: make a pending ``join`` fail soon (the init POST already failed)."""
        return None


class DevicePacker(ABC):
    """The framework's part of an on-device data path: its tensors' device bytes.

    Buffers are ``weightwire.backends.device.DeviceBytes`` on CUDA device ``ordinal``;
    what a backend does with them (gather into slots, copy into a peer's memory) is its own."""

    ordinal: int

    @abstractmethod
    def new_stream(self) -> Any:
        """A CuPy stream (``Stream`` or ``ExternalStream``) on the sender's device."""

    @abstractmethod
    def regions(self, tensors: Sequence[Any], stream: Any) -> list[Any]:
        """Each tensor's own device bytes, zero-copy where possible, every producer ordered
        before ``stream``; each keeps its memory alive until the caller drops it."""


class LocalShards(ABC):
    """Where a source's tensors live on this process's devices, each device a trainer rank
    (rank r on ``devices[r]``): what a backend whose trainer ranks each send their own shard
    (``SenderCaps.local_shards``) reads. Lent by the framework (``FrameworkHooks.local_shards``),
    fixed for the session: nothing is gathered."""

    @property
    @abstractmethod
    def devices(self) -> list[int]:
        """Each trainer rank's CUDA ordinal, in rank order."""

    @abstractmethod
    def boxes(self, name: str, tensor: Any) -> list[Box]:
        """The box of ``tensor`` each rank holds, in rank order (metadata only);
        ``ConfigError`` naming the tensor when it is not on every rank's device."""

    @abstractmethod
    def shards(self, name: str, tensor: Any) -> list[Any]:
        """Each rank's own part of ``tensor`` (a device array of its box, no copy where it is
        one already), its producers' writes done."""


@dataclass(frozen=True)
class ShardLayout:
    """A source as a backend with ``SenderCaps.local_shards`` is opened with: its tensors, in
    round order, and per tensor the box each trainer rank holds (``LocalShards.boxes``)."""

    metas: list[ParamMeta]
    boxes: list[list[Box]]
    shards: LocalShards


@dataclass(frozen=True)
class SenderParts:
    """What the trainer's framework lends a backend's data path."""

    host_bytes: HostBytes
    prefetch: Callable[[list[Any]], None] | None = None
    """Start device-to-host copies of a chunk before ``host_bytes`` is called."""
    packer: DevicePacker | None = None
    """Set when the backend packs on a device (``SenderCaps.on_device``)."""
    shards: LocalShards | None = None
    """Set when each trainer rank sends its own shard (``SenderCaps.local_shards``)."""


class RoundSender(ABC):
    """Rank 0's data path over a joined link: one round's chunks at a time."""

    in_place: ClassVar[bool] = False
    """Rounds may write straight into the serving parameters (from the first byte until
    the commit the workers' weights are not whole): the trainer refuses generation
    around every round, as around a round over the stage budget."""

    hears_workers: ClassVar[bool] = False
    """Writes nothing to a worker before that worker's own first word of the round (its go
    or its want, sent from inside its start or its update) and calls ``Outgoing.heard`` once
    every worker's was read: a round may then be one request (``Outgoing.one_request``)."""

    device_pieces: ClassVar[bool] = False
    """A sliced round's pieces are read as device arrays cut on the shard's device
    (``FrameworkHooks.cut_box``), not host bytes: the sender packs them on its device."""

    @abstractmethod
    def send(self, out: Outgoing) -> Sent:
        """Send every chunk of ``out``; returns once all left. Stops with ``RoundAborted`` once
        ``out.stop`` is set."""

    def settle(self) -> None:
        """A round that failed before its first byte: finish the local work it queued."""
        return None

    def close(self) -> None:
        """The session ended (after the link closed): free what the data path holds."""
        return None

    def check_round(self, metas: Sequence[ParamMeta]) -> None:
        """Refuse, when the round is planned (before any call), a round of ``metas`` this
        session cannot send (``nccl_m2n``: a tensor its init did not declare, or declared
        with another dtype or shape). Default: any round."""
        return None

    def discard(
        self,
        chunks: Sequence[Chunk],
        metas: Sequence[ParamMeta],
        *,
        root: int,
        stop: threading.Event,
    ) -> None:
        """``"group"`` wires: take part in another broadcaster's turn and drop its bytes."""
        raise NotImplementedError(
            f"{type(self).__name__} has no shared group for several broadcasters"
        )


@dataclass(frozen=True)
class WirePlan:
    """The round as it goes on the wire: ``metas`` in broadcast order.

    ``order[i]`` is the source index of wire tensor ``i`` (``None``: source order).
    A permutation only moves tensors inside their layer group.
    """

    metas: Sequence[ParamMeta]
    """A ``list``, or a delta round's ``MetaRows``."""
    order: tuple[int, ...] | None = None
    update_info: dict[str, Any] | None = None
    """The update info a stock receiver takes for this round, written by the backend
    (``nccl_m2n``: the names); ``None``: the one built from ``metas``."""

    def reorder(self, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Re-emit a source-order ``(name, tensor)`` stream in wire order.

        Buffers one span at a time: the span covers the source indices a run of wire
        positions draws from, which is one layer group since the order never crosses one.
        In source order the stream itself comes back (no per-tensor hop on the byte path).
        """
        if self.order is None:
            return iter(pairs)
        return _reordered(iter(pairs), self.order)


def _reordered(it: Iterator[tuple[str, Any]], order: tuple[int, ...]) -> Iterator[tuple[str, Any]]:
    """``WirePlan.reorder`` with a permutation: ``order[i]`` is wire tensor ``i``'s source index."""
    held: dict[int, tuple[str, Any]] = {}
    pulled = 0
    for src in order:
        while src not in held:
            item = next(it, None)
            if item is None:
                return  # short stream: checked_iter upstream raises with the name
            held[pulled] = item
            pulled += 1
        yield held.pop(src)
    yield from it  # extra tensors reach checked_iter's end check


@dataclass(frozen=True)
class PatchPlan:
    """A delta round as a backend sends it: the update info its workers are posted, and the
    wire tensors (``shared.patches.wire_metas``) in broadcast order with their chunks."""

    update_info: dict[str, Any]
    metas: list[ParamMeta]
    chunks: list[Chunk]
    pairs: Callable[[], Iterator[tuple[str, Any]]]
    """A fresh pass of ``(wire name, array)`` in ``metas`` order, made as it is pulled."""
    full: frozenset[str]
    """The tensors patched over every element (the round anchors them)."""


@dataclass(frozen=True)
class SenderCaps:
    """What the trainer may ask of a backend's sending side."""

    on_device: bool
    """Chunks are packed in device memory (``SenderParts.packer`` is required)."""
    stock_receiver: bool = False
    """The workers run vLLM's own receive code: every round goes through ``Backend.plan_round``
    first (refused, or reordered to what that code can take)."""
    several: Several | None = None
    """How several broadcasting trainer ranks share the wire: ``"stars"`` (each broadcaster
    opens its own endpoint, ``Backend.open_star``; the workers dial every one), ``"group"``
    (one communicator of every broadcaster and worker, ``Backend.peer_fields`` /
    ``Backend.join_peer``; each turn's root is its ``src``), ``None``: one broadcaster only."""
    unpacked: bool = True
    """Rounds may be sent unpacked (one send per tensor)."""
    delta: bool = False
    """Rounds may carry only the tensors that changed (not yet offered by any backend)."""
    lora: bool = False
    """Rounds may carry LoRA adapters (not yet offered by any backend)."""
    sliced: bool = False
    """Rounds may be sliced: each worker says at init what it wants (``Backend.hellos``) and
    gets only that, point to point (``Backend.sliced_sender``)."""
    local_shards: bool = False
    """Every trainer rank is a device of this process and sends its own shard of each tensor,
    nothing gathered; the init info carries the source's layout, so the backend is opened
    with it (``Backend.open_sharded``) and its sender reads ``SenderParts.shards``."""
    draft: bool = True
    """Rounds may target the speculative draft model (``nccl_m2n``'s receiver refuses them)."""


@dataclass(frozen=True)
class StarSource:
    """A non-zero broadcaster's endpoint as rank 0's init info lists it."""

    host: str
    port: int
    secret: bytes


class StarEndpoint(Protocol):
    """A non-zero broadcaster's own listening endpoint (``"stars"`` wires)."""

    host: str
    port: int

    def accept(self, *, timeout: float) -> Communicator: ...
    def close(self) -> None: ...


class Backend(ABC):
    """A backend's trainer side (rank 0, and the other broadcasters of several)."""

    name: ClassVar[str]
    caps: ClassVar[SenderCaps]

    def check_config(self, settings: SenderSettings, *, delta: str) -> None:  # noqa: B027
        """Raise ``ConfigError`` for a configuration this backend cannot run (at
        ``TrainerInitInfo``'s construction, before any rendezvous); ``delta``: its delta mode.
        Optional: most backends run every configuration."""

    def check_host(self) -> None:  # noqa: B027
        """Raise an ``UnavailableError`` naming what this host lacks for the backend's rank 0
        (CuPy, a CUDA device) and the fix, before any device work or rendezvous (``trainer_init``).
        Optional: a backend that runs on any host needs nothing."""

    def check_server(self, features: ServerFeatures) -> None:
        """Raise ``ValueError`` if the server's version lacks what this backend needs."""
        features.require("packed_in_init", "the wire params travel in the init info")

    @abstractmethod
    def open(self, settings: SenderSettings, *, world_size: int) -> Rendezvous:
        """Prepare rank 0's endpoint for a group of ``world_size`` ranks (trainer included)."""

    @abstractmethod
    def sender(self, link: Any, settings: SenderSettings, parts: SenderParts) -> RoundSender:
        """The data path over ``link`` (what this backend's rendezvous joined)."""

    def open_sharded(
        self, settings: SenderSettings, *, workers: int, layout: ShardLayout
    ) -> Rendezvous:
        """``caps.local_shards``: prepare rank 0's endpoint for ``workers`` inference workers
        and the trainer ranks of ``layout`` (the source's tensors and who holds what)."""
        raise NotImplementedError(f"backend {self.name!r} is not opened with the source's layout")

    def plan_round(
        self,
        metas: Sequence[ParamMeta],
        *,
        features: ServerFeatures,
        packed: bool,
        buffer_size_bytes: int,
    ) -> WirePlan:
        """The round's wire order; a stock receiver may reorder it or refuse it
        (``StockRefusal``)."""
        # rows stay rows (a delta round's listing: no ParamMeta per wire tensor, #49)
        return WirePlan(metas if isinstance(metas, MetaRows) else list(metas))

    def plan_patches(
        self, patches: Sequence[SparsePatch], *, features: ServerFeatures, describe: Describe
    ) -> PatchPlan:
        """A delta round of ``patches`` (``shared.patches.SparsePatch``; ``describe``: the
        framework's array description) as this backend sends it; ``ConfigError`` before any byte
        when its receiver cannot take them. Only backends with ``caps.delta`` implement it."""
        raise NotImplementedError(f"backend {self.name!r} sends no delta rounds (patches)")

    def hellos(self, link: Any, *, timeout: float | None = None) -> list[bytes]:
        """``caps.sliced``: each worker's hello (the JSON of its wants; empty: a worker that
        told none), in worker order, as the join received them (called right after rank 0's
        warm-up; a backend that still has to receive them waits at most ``timeout`` s)."""
        raise NotImplementedError(f"backend {self.name!r} sends no sliced rounds")

    def sliced_sender(
        self, link: Any, settings: SenderSettings, parts: SenderParts | None = None
    ) -> RoundSender:
        """``caps.sliced``: the data path of a sliced round over ``link``: its ``send`` takes,
        per tensor, the list of that tensor's ``SlicePiece`` s (``parts``: what the framework
        lends an on-device backend, its packer)."""
        raise NotImplementedError(f"backend {self.name!r} sends no sliced rounds")

    def open_star(
        self, settings: SenderSettings, *, world_size: int, secret: bytes
    ) -> StarEndpoint:
        """``"stars"``: a non-zero broadcaster's endpoint for ``world_size`` ranks (itself
        included), whose workers prove ``secret``."""
        raise NotImplementedError(f"backend {self.name!r} has no stars for several broadcasters")

    def with_stars(
        self,
        payload: dict[str, Any],
        stars: Sequence[StarSource],
        *,
        rank_offset: int,
        world_size: int,
    ) -> dict[str, Any]:
        """``"stars"``: rank 0's init info, also listing the other broadcasters' endpoints;
        validated as the workers will parse it."""
        raise NotImplementedError(f"backend {self.name!r} has no stars for several broadcasters")

    def peer_fields(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``"group"``: what another broadcaster needs from rank 0's worker init info to join
        the same communicator (a secret: it travels only over the trainer's group)."""
        raise NotImplementedError(
            f"backend {self.name!r} has no shared group for several broadcasters"
        )

    def join_peer(
        self, settings: SenderSettings, fields: dict[str, Any], *, rank: int, timeout: float
    ) -> Any:
        """``"group"``: a non-zero broadcaster joins rank 0's communicator as group rank
        ``rank`` (its ``src``); raises within ``timeout`` if the group never completes."""
        raise NotImplementedError(
            f"backend {self.name!r} has no shared group for several broadcasters"
        )
