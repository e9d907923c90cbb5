"""Where a worker's bytes land: receive links (TCP, NCCL) and chunk unpacking.

A *link* receives the chunks of a round (``shared.framing.plan``) into uint8 torch
buffers on the worker's device, with up to ``depth`` (= ``packed_num_buffers``)
chunks in flight, so the network fills chunk ``i + 1`` while chunk ``i`` is being
loaded into the model.

Every chunk lands in a *fresh* allocation (the torch allocator recycles it once
nothing references it). That is deliberate: vLLM's layerwise reload keeps the
tensors handed to ``load_weights`` until their whole layer has arrived, and
``HFModelHost`` keeps them until commit, so a buffer reused in place would silently
overwrite weights still waiting to be applied. ``depth`` bounds how many chunks are
in flight, not how many allocations exist.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from weightwire.backends.nccl.buffers import tensor_device_bytes
from weightwire.shared.communicator import TransferError, TransferTimeout
from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.framing import Chunk
from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.dtypes import torch_dtype

# Extra seconds a pipelined wait allows beyond the communicator's own per-broadcast
# timeout, so the communicator's clearer TransferTimeout wins the race.
_WAIT_SLACK_S = 5.0


def unpack_chunk(buffer: torch.Tensor, metas: Sequence[ParamMeta], chunk: Chunk) -> list[tuple[str, torch.Tensor]]:
    """Split a received chunk into ``(name, tensor)`` views of each tensor's dtype/shape.

    The packed framing has no alignment, so a tensor whose offset is not a multiple
    of its itemsize cannot be viewed in place (torch refuses): it is copied out.
    """
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < chunk.nbytes:
        raise ValueError(f"chunk buffer must be 1-D uint8 of >= {chunk.nbytes} bytes")
    out: list[tuple[str, torch.Tensor]] = []
    for meta, offset in zip(metas[chunk.start : chunk.stop], chunk.offsets, strict=True):
        dtype = torch_dtype(meta.dtype)
        nbytes = meta.nbytes  # once: each property call re-derives it (per tensor, per round)
        if nbytes == 0:  # torch cannot reinterpret an empty slice's (zero) stride
            out.append((meta.name, torch.empty(meta.shape, dtype=dtype, device=buffer.device)))
            continue
        raw = buffer[offset : offset + nbytes]
        if offset % dtype.itemsize:
            raw = raw.clone()
        out.append((meta.name, raw.view(dtype).view(meta.shape)))
    return out


class ReceiveLink(ABC):
    """One worker's receiving end of the data plane, chunk by chunk.

    ``post(i, ...)`` starts receiving chunk ``i``; ``wait(i)`` returns its buffer once
    every byte landed (bounded by the link's timeout). Chunks must be posted and
    waited in order. After any error the caller must ``abort()``: a half-received
    stream cannot be resumed.
    """

    def __init__(self, communicator: Any, *, device: torch.device, timeout_s: float, depth: int) -> None:
        self.communicator = communicator
        self.device = device
        self.timeout_s = float(timeout_s)
        self.depth = int(depth)

    @abstractmethod
    def post(self, index: int, chunk: Chunk, metas: Sequence[ParamMeta], *, packed: bool) -> None: ...

    @abstractmethod
    def wait(self, index: int) -> torch.Tensor: ...

    def for_src(self, src: int) -> ReceiveLink:
        """The link that receives a turn broadcast by group rank ``src`` (see
        ``sources.MultiSourceLink``); a single-sender link takes only ``src`` 0."""
        if src != 0:
            raise ValueError(f"update info names src {src}, but this engine was initialized with one "
                             "broadcasting trainer rank (rank_offset 1): only src 0 can be received")
        return self

    def abort(self) -> None:
        self.communicator.abort()

    def peer_closed(self) -> bool:
        """True when the trainer is known to be gone (it closed the link). Only TCP can
        tell without traffic; an NCCL peer's death shows only as a timeout."""
        probe = getattr(self.communicator, "peer_closed", None)
        return bool(probe()) if callable(probe) else False

    def close(self) -> None:
        self.communicator.close()


class TCPLink(ReceiveLink):
    """TCP data plane: one background thread receives chunks in order.

    The socket read runs off the caller's thread so that it overlaps ``load_weights``
    (both release the GIL). On a CUDA worker bytes land in pinned host staging
    buffers (reused round-robin: each is free again once its chunk was copied to
    the device) and are copied to a fresh device buffer.
    """

    def __init__(self, communicator: Any, *, device: torch.device, timeout_s: float, depth: int) -> None:
        super().__init__(communicator, device=device, timeout_s=timeout_s, depth=depth)
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightwire-tcp-recv")
        self._pending: dict[int, tuple[cf.Future[None], torch.Tensor, int]] = {}
        self._staging: list[torch.Tensor | None] = [None] * self.depth

    def _host_buffer(self, index: int, nbytes: int) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.empty(nbytes, dtype=torch.uint8)
        slot = index % self.depth
        buf = self._staging[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._staging[slot] = buf
        return buf

    def post(self, index: int, chunk: Chunk, metas: Sequence[ParamMeta], *, packed: bool) -> None:
        host = self._host_buffer(index, chunk.nbytes)
        view = host.numpy()[: chunk.nbytes]
        try:
            future = self._pool.submit(self.communicator.broadcast, view, root=0, timeout=self.timeout_s)
        except RuntimeError:  # the pool is shut down: abort() ran, possibly from another thread
            raise TransferError(f"TCP receive link was aborted before chunk {index} was posted") from None
        self._pending[index] = (future, host, chunk.nbytes)

    def wait(self, index: int) -> torch.Tensor:
        future, host, nbytes = self._pending.pop(index)
        try:
            future.result(timeout=self.timeout_s + _WAIT_SLACK_S)
        except cf.TimeoutError:
            raise TransferTimeout(f"TCP receive of chunk {index} exceeded {self.timeout_s:.0f}s") from None
        if self.device.type == "cpu":
            return host[:nbytes]
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        out.copy_(host[:nbytes])  # synchronous: the staging slot is free after this
        return out

    def _stop(self) -> None:
        for future, _, _ in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def abort(self) -> None:
        try:
            super().abort()  # unblocks a recv in flight on the worker thread
        finally:
            self._stop()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._stop()


class NCCLLink(ReceiveLink):
    """NCCL data plane: chunk ``i`` is enqueued on stream ``i % depth``.

    ``wait`` blocks through the communicator's watchdog (``synchronize`` with a
    timeout), since an NCCL wait has no timeout of its own. Unpacked rounds use the
    tensor's own NCCL dtype, as a stock vLLM trainer sends them.
    """

    def __init__(self, communicator: Any, *, device: torch.device, timeout_s: float, depth: int) -> None:
        super().__init__(communicator, device=device, timeout_s=timeout_s, depth=depth)
        self._streams = [torch.cuda.Stream(device=device) for _ in range(self.depth)]
        self._pending: dict[int, tuple[torch.Tensor, torch.cuda.Stream]] = {}
        self.senders = 1  # trainer ranks below rank_offset: the roots this link may receive from
        self._root = 0

    def for_src(self, src: int) -> ReceiveLink:
        """One NCCL group, several roots: a view of this link that receives from ``src``."""
        if not 0 <= src < self.senders:
            raise ValueError(f"NCCL update src must be a broadcasting trainer rank in [0, {self.senders}), got {src}")
        view = copy.copy(self)  # shares the communicator, streams and pending chunks
        view._root = src
        return view

    def post(self, index: int, chunk: Chunk, metas: Sequence[ParamMeta], *, packed: bool) -> None:
        stream = self._streams[index % self.depth]
        buf = torch.empty(chunk.nbytes, dtype=torch.uint8, device=self.device)
        # The fresh block may have just been freed by work still queued on the
        # current stream; the receive must not overwrite it before that work ends.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Handed over as a raw pointer: the wait above already orders it, and going
        # through DLPack costs ~0.2 ms per chunk on the round's critical path.
        view = tensor_device_bytes(buf)
        if packed:
            self.communicator.broadcast(view, root=self._root, timeout=self.timeout_s, stream=stream.cuda_stream)
        else:
            meta = metas[chunk.start]
            self.communicator.broadcast_typed(
                view, nccl_dtype=wire_dtype(meta.dtype).nccl, count=meta.numel, root=self._root,
                timeout=self.timeout_s, stream=stream.cuda_stream,
            )
        buf.record_stream(stream)
        self._pending[index] = (buf, stream)

    def wait(self, index: int) -> torch.Tensor:
        buf, stream = self._pending.pop(index)
        self.communicator.synchronize(stream.cuda_stream, timeout=self.timeout_s)
        return buf

    def abort(self) -> None:
        self._pending.clear()
        super().abort()

    def close(self) -> None:
        self._pending.clear()
        super().close()
