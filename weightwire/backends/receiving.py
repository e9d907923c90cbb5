"""The chunk-by-chunk receive loop the built-in backends' worker links share.

A generic part a backend may use, like ``pipelines`` on rank 0's side; the contract itself
is ``worker_base.ReceiveLink``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from typing import Any

from weightwire.backends.worker_base import (
    ReceiveLink,
    ReceiveProgress,
    ReceiveTurn,
    Unpacker,
    WorkerPairs,
)


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
            progress.nbytes += turn.chunks[i].nbytes
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
