"""The per-backend contract: what a backend gives the trainer's rank 0 and the workers.

The trainer (``weightwire.trainer``) and the worker package consume this module; a
backend package implements it and imports nothing above ``backends/``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from weightwire.shared.framing import Chunk
from weightwire.shared.meta import ParamMeta

# ---- worker side ----
#
# A backend gives a worker one function, ``Connect``: from the init info the trainer
# posted, the worker's rank and its device, a connected, warmed-up ``ReceiveLink``. The
# worker then receives every update of a round through ``ReceiveLink.receive`` (one
# ``ReceiveTurn``: that update's chunks, in wire order) and ends the session with
# ``close``, or with ``abort`` after any error. Tensors and devices are torch's; this
# module names them ``Any`` so that importing it imports no framework.

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
            raise ValueError(f"update info names src {src}, but this engine was initialized with "
                             "one broadcasting trainer rank (rank_offset 1): only src 0 can be "
                             "received")
        if not 0 <= src < self.sources:
            raise ValueError(f"update info names src {src}, but the init info lists {self.sources} "
                             f"broadcasting trainer ranks: src must be in [0, {self.sources})")

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

    @abstractmethod
    def abort(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


Connect = Callable[..., ReceiveLink]
"""A backend's ``connect(info, *, rank, device) -> ReceiveLink`` (its registry entry)."""


class ChunkedLink(ReceiveLink):
    """A link that receives chunk by chunk, with up to ``depth`` chunks posted ahead of
    the one being unpacked, so the wire fills chunk ``i + 1`` while chunk ``i`` is loaded.

    ``post(i, turn)`` starts receiving chunk ``i``; ``wait(i)`` returns its buffer once
    every byte landed (bounded by the link's timeout). Chunks are posted and waited in
    order. Each chunk lands in a fresh allocation: the worker's model may keep a chunk's
    tensors until its whole layer (round) arrived.
    """

    def receive(self, turn: ReceiveTurn, progress: ReceiveProgress) -> Iterator[WorkerPairs]:
        posted, total = 0, len(turn.chunks)
        for i in range(total):
            progress.chunk = i
            while posted < total and posted < i + self.depth:
                self.post(posted, turn)
                posted += 1
            pairs = self.take(i, turn.unpackers[i])
            if pairs:
                yield pairs
            # Drop this chunk's views before the next post allocates: holding them
            # would keep depth + 1 chunk buffers alive at once.
            del pairs

    @abstractmethod
    def post(self, index: int, turn: ReceiveTurn) -> None: ...

    @abstractmethod
    def wait(self, index: int) -> Any:
        """Chunk ``index``'s buffer (1-D ``uint8``) once every byte landed."""

    def take(self, index: int, unpacker: Unpacker) -> WorkerPairs:
        """``wait(index)``, then the chunk's pairs; a link that knows a chunk's buffer
        before its bytes land may make the views while it waits."""
        return unpacker.unpack(self.wait(index))
