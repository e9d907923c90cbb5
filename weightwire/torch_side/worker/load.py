"""A worker's byte path: from the receive link to ``load_weights``.

``MetaCache.resolve`` turns an update info into the round's metadata and chunk plan
(the same ``framing.plan`` the trainer cut the round with); ``receive_chunks`` keeps
up to ``link.depth`` chunks posted ahead of the one being unpacked and yields each
chunk's ``(name, tensor)`` views; ``load_batches`` regroups them for ``load_weights``
("chunk": as received, "group": one decoder layer across chunk edges); ``load_staged``
applies a fully received (staged) round layer by layer. The session and failure rules
around these steps are ``core._ReceiverCore``'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from weightwire.shared.framing import Chunk, plan
from weightwire.shared.groups import batch_by_layer
from weightwire.shared.info import UpdateInfo
from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.worker.receive import ReceiveLink, unpack_chunk

LOAD_BATCHING = ("chunk", "group")

Pairs = list[tuple[str, torch.Tensor]]


class FrameworkHooks(Protocol):
    """What the hosting framework does around a round (vLLM: layerwise reload)."""

    def begin(self, model: Any) -> None: ...
    def commit(self, model: Any, model_config: Any) -> None: ...
    def abort(self, model: Any, model_config: Any) -> None: ...
    def receive_context(self) -> AbstractContextManager[Any]: ...
    def prepare(self, model: Any, pairs: Pairs) -> Pairs: ...
    def round_dropped(self) -> None: ...


@dataclass(frozen=True)
class ReceiveStats:
    """What the last ``receive`` moved: for logs, benchmarks and the reference server."""

    tensors: int
    chunks: int
    nbytes: int
    seconds: float


class MetaCache:
    """The round's metadata and plan, remembering the previous round's per target model
    (main vs draft) and broadcaster, for the 0.33 "empty lists = reuse" shorthand."""

    def __init__(self, backend: str) -> None:
        self._backend = backend
        self._last: dict[tuple[int, int], tuple[Any, list[ParamMeta], list[Chunk]]] = {}

    def clear(self) -> None:
        self._last.clear()

    def resolve(self, model: Any, update: UpdateInfo, *, packed: bool,
                buffer_size_bytes: int) -> tuple[list[ParamMeta], list[Chunk]]:
        """``(metas, chunks)``; ``ValueError`` for a reuse shorthand with nothing to reuse."""
        key = (id(model), update.src)  # reuse is per broadcaster: each turn has its own slice
        if update.reuses_previous:
            cached = self._last.get(key)
            if cached is None or cached[0] is not model:
                raise ValueError(
                    f"{self._backend}: update info has empty names/dtype_names/shapes (reuse the previous "
                    "round's metadata) but this engine has received no round since init"
                )
            return cached[1], cached[2]
        metas = update.metas()
        chunks = plan(metas, packed=packed, buffer_size_bytes=buffer_size_bytes)
        self._last[key] = (model, metas, chunks)
        return metas, chunks


def receive_chunks(link: ReceiveLink, metas: list[ParamMeta], chunks: list[Chunk], *, packed: bool,
                   progress: list[int]) -> Iterator[Pairs]:
    """Each chunk's ``(name, tensor)`` views in order, with up to ``link.depth`` chunks
    posted ahead of the one in hand; ``progress[0]`` tracks that chunk, for error messages."""
    posted = 0
    for i, chunk in enumerate(chunks):
        progress[0] = i
        while posted < len(chunks) and posted < i + link.depth:
            link.post(posted, chunks[posted], metas, packed=packed)
            posted += 1
        pairs = unpack_chunk(link.wait(i), metas, chunk)
        if pairs:
            yield pairs
        # Drop this chunk's views before the next post allocates: holding them
        # would keep num_buffers + 1 chunk buffers alive at once.
        del pairs


def load_batches(chunk_batches: Iterator[Pairs], load_batching: str) -> Iterator[Pairs]:
    """Batches for ``load_weights``: whole chunks, or ("group") one decoder layer across chunk edges."""
    if load_batching == "chunk":
        return chunk_batches
    return batch_by_layer(pair for batch in chunk_batches for pair in batch)


def load_staged(model: Any, staged: Iterable[tuple[str, torch.Tensor]]) -> None:
    """A fully received round into ``model``, one ``load_weights`` call per decoder layer,
    between the model's own ``begin_round`` / ``commit_round`` hooks."""
    call_hook(model, "begin_round")
    for batch in batch_by_layer(staged):
        model.load_weights(batch)
    call_hook(model, "commit_round")


def call_hook(model: Any, name: str) -> None:
    """``model.<name>()`` when the model defines it (test models and staged adapters do)."""
    hook = getattr(model, name, None)
    if callable(hook):
        hook()
