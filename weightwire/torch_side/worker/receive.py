"""Where a worker's bytes land: the ``ReceiveLink`` contract and chunk unpacking.

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

Each backend's link and connect function live in its package
(``weightwire.backends.<name>.worker``); ``connect`` picks one through the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from weightwire.shared.framing import Chunk
from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.dtypes import torch_dtype


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

    def round_started(self) -> None:
        """A round started (``start_weight_update``): a link may get the coming update's
        first chunks ready here (``weightwire_ipc`` pull mode names their buffers early).
        Must not block on the trainer."""
        return None  # most links need nothing before the update arrives

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
