"""The ``Communicator`` protocol: what a data plane offers the engines.

The TCP, NCCL and IPC communicators implement it (structurally: none inherits), so
framing and engines are written once; ``DeviceCommunicator`` adds the stream-ordered
calls the on-device pipeline needs (NCCL). Every call that waits takes a timeout; a
communicator that times out or loses a peer raises a ``TransferError`` and is unusable
afterwards (``abort()``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Communicator(Protocol):
    """One rank's end of a broadcast group of ``world_size`` ranks.

    ``buffer`` is a contiguous byte buffer: a numpy array / memoryview for TCP, a
    device array (``__cuda_array_interface__`` or ``__dlpack__``) for NCCL. On the
    root it is sent; on every other rank it is overwritten with the root's bytes.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def warmup(self, *, timeout: float | None = None) -> None:
        """All ranks present before any broadcast (NCCL: a 1-element SUM all-reduce)."""

    def broadcast(
        self, buffer: Any, *, root: int = 0, timeout: float | None = None, stream: Any = None
    ) -> None:
        """Broadcast ``buffer`` from ``root``.

        Without ``stream`` it returns once the buffer may be reused (bounded by
        ``timeout``). With a device ``stream`` (NCCL) it only enqueues; the caller
        orders reuse after that stream, which is what lets chunks overlap.
        """

    def abort(self) -> None:
        """Tear down at once without waiting on peers; later calls raise."""

    def close(self) -> None:
        """Orderly shutdown after a successful session."""


@runtime_checkable
class DeviceCommunicator(Communicator, Protocol):
    """A communicator whose broadcasts are enqueued on device streams (NCCL).

    ``backends.pipelines.DevicePipeline`` broadcasts with a ``stream`` and waits only
    through ``synchronize``, so a hung peer surfaces as a timeout, never a stuck host.
    """

    def broadcast_typed(
        self,
        buffer: Any,
        *,
        nccl_dtype: int,
        count: int,
        root: int = 0,
        timeout: float | None = None,
        stream: Any = None,
    ) -> None:
        """Broadcast ``count`` elements of ``ncclDataType_t`` ``nccl_dtype`` (unpacked rounds:
        the way a stock vLLM worker receives each tensor)."""

    def synchronize(self, stream: Any, *, timeout: float) -> None:
        """Wait for the work enqueued on ``stream``, at most ``timeout`` s; on timeout or a
        peer's failure abort the communicator and raise a ``TransferError``."""
