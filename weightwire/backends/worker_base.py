"""The per-backend contract, the workers' half: what a backend gives a worker.

The worker package (``weightwire.torch_side.worker``) consumes this module; a backend
package implements it and imports nothing above ``backends/``. Rank 0's half is
``backends.base``.
"""

# A backend gives a worker one function, ``Connect``: from the init info the trainer
# posted, the worker's rank and its device, a connected, warmed-up ``ReceiveLink``. The
# worker then receives every update of a round through ``ReceiveLink.receive`` (one
# ``ReceiveTurn``: that update's chunks, in wire order) and ends the session with
# ``close``, or with ``abort`` after any error. Tensors and devices are torch's; this
# module names them ``Any`` so that importing it imports no framework.

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self

from weightwire.shared.errors import TransferError
from weightwire.shared.framing import Chunk
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box

WorkerPairs = list[tuple[str, Any]]
"""One chunk's ``(name, tensor)`` views, in wire order."""


class Unpacker(Protocol):
    """How one chunk's buffer becomes its tensors (the worker's ``UnpackPlan``)."""

    @property
    def in_place(self) -> bool:
        """Only views (no device work): ``unpack`` may run before the buffer's bytes landed."""
        ...

    def unpack(self, buffer: Any) -> WorkerPairs:
        """The chunk's tensors from ``buffer`` (1-D ``uint8`` on the worker's device)."""
        ...


@dataclass(frozen=True)
class ReceiveTurn:
    """One update of a round, as the worker resolved it before the first byte."""

    src: int
    """The group rank broadcasting this update (0 with one broadcaster)."""
    metas: Sequence[ParamMeta]
    chunks: Sequence[Chunk]
    """The round's plan (``shared.framing.plan``), the one the trainer cut it with."""
    unpackers: Sequence[Unpacker]
    """One per chunk."""
    packed: bool


@dataclass
class ReceiveProgress:
    """Where a turn's receive is, for the worker's error messages."""

    chunk: int = -1
    """Index of the chunk being received or loaded; -1 before the first."""
    nbytes: int = 0
    """Payload bytes of the turn that landed on this worker so far, counted by the link as
    each chunk lands (the worker's round adds them up: ``core.RoundStats.bytes_received``)."""


@dataclass(frozen=True)
class LandingRecord:
    """The worker model's landing map for a turn (``torch_side.worker.landing.LoaderMap``:
    its ``tensors`` and ``params``), or why there is none (``refused``)."""

    map: Any | None
    refused: str | None = None


class ReceiveLink(ABC):
    """One worker's receiving end of a backend's wire, for one session.

    ``receive`` yields a turn's chunks as they land. After any error the worker calls
    ``abort``: a half-received stream is never resumed. ``abort`` may be called from
    another thread and must wake a receive blocked in it.
    """

    def __init__(self, *, device: Any, timeout_s: float, depth: int, sources: int = 1) -> None:
        self.device = device
        self.timeout_s = float(timeout_s)
        self.depth = int(depth)
        """Chunks in flight at once (the init info's ``packed_num_buffers``)."""
        self.sources = int(sources)
        """Broadcasting trainer ranks a turn may name as its ``src``."""

    def check_source(self, src: int) -> None:
        """``ValueError`` unless this link receives turns from group rank ``src``."""
        if self.sources == 1 and src != 0:
            raise ValueError(
                f"update info names src {src}, but this engine was initialized with "
                "one broadcasting trainer rank (rank_offset 1): only src 0 can be "
                "received"
            )
        if not 0 <= src < self.sources:
            raise ValueError(
                f"update info names src {src}, but the init info lists {self.sources} "
                f"broadcasting trainer ranks: src must be in [0, {self.sources})"
            )

    def start_round(self) -> None:
        """A round started on the worker; a link may get ready for its first update here.
        Must not block on the trainer."""
        return None

    @abstractmethod
    def receive(self, turn: ReceiveTurn, progress: ReceiveProgress) -> Iterator[WorkerPairs]:
        """Each chunk's ``(name, tensor)`` pairs of ``turn`` as it lands (empty chunks are
        skipped); ``progress.chunk`` follows the chunk in hand. The source was checked."""

    def peer_closed(self) -> bool:
        """True when the trainer is known to be gone (it closed the wire) without traffic."""
        return False

    def bytes_unread(self) -> bool:
        """Between receives: the trainer's bytes wait on the link with no update reading
        them (checked without traffic; a link that cannot tell says False)."""
        return False

    def early_landing(self) -> frozenset[str] | None:
        """At a round's start: the tensors the trainer may write straight into the serving
        parameters from now on, before the update arrives (this session's landing table
        still holds), or None. When not None the worker records the round as written in
        place, then calls ``go_early``."""
        return None

    def go_early(self) -> None:
        """Let the trainer write (after ``early_landing``); see there."""
        raise NotImplementedError(f"{type(self).__name__} does not write through")

    def lands(self, turn: ReceiveTurn, record: Callable[[], LandingRecord]) -> bool:
        """Before ``turn``'s strategy is chosen: whether the trainer writes this turn
        straight into the serving parameters (write-through; ``receive`` then yields no
        tensor and returns once the bytes are in place). ``record`` gives the model's
        landing map for the turn's tensors, or why there is none. Default: never."""
        return False

    def receive_sliced(
        self, metas: Sequence[ParamMeta], progress: ReceiveProgress
    ) -> Iterator[tuple[int, Box, Any]]:
        """A sliced update's pieces as they land: ``(tensor index in metas, box, its bytes as
        a flat uint8 tensor)``; ``progress.chunk`` counts the frames. Default: refused."""
        raise TransferError(f"{type(self).__name__} receives no sliced rounds")

    @abstractmethod
    def abort(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class WorkerInitInfo(Protocol):
    """What a worker reads from any backend's init info (each backend's own class, parsed
    through the registry, adds its rendezvous): where this server's workers start in the
    group, the group's size, and the wire params the trainer sent."""

    @property
    def rank_offset(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def packed(self) -> bool: ...
    @property
    def packed_buffer_size_bytes(self) -> int: ...
    @classmethod
    def from_dict(cls, data: object) -> Self:
        """The strict parse of the init route's JSON body."""
        ...


Connect = Callable[..., ReceiveLink]
"""A backend's ``connect(info, *, rank, device) -> ReceiveLink`` (its registry entry). A backend
that writes into the serving parameters may also take ``landing``, a
``Callable[[], LandingRecord]``: the model's landing map for the tensors it serves, or why
there is none, asked at the join (the worker passes it to a connect that names it)."""


def takes_landing(connect: Callable[..., Any]) -> bool:
    """Whether ``connect`` names the ``landing`` keyword (``Connect``): only a backend that
    writes into the serving parameters asks for it, so the others never pay for a landing map."""
    try:
        return "landing" in inspect.signature(connect).parameters
    except (TypeError, ValueError):  # a callable without a readable signature: not asked
        return False
