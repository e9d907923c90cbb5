"""A worker's byte path: from the receive link to ``load_weights``.

``MetaCache.resolve`` turns an update info into the round's metadata, chunk plan (the
same ``framing.plan`` the trainer cut the round with) and each chunk's ``UnpackPlan``,
all kept for the next round with the same metadata; the backend's link
(``backends.worker_base.ReceiveLink.receive``) yields each chunk's ``(name, tensor)`` views;
``load_batches`` regroups them for ``load_weights``
("chunk": as received, "group": one decoder layer across chunk edges); ``load_staged``
applies a fully received (staged) round layer by layer. The session and failure rules
around these steps are ``core._ReceiverCore``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from weightwire.shared.delta import Patch
from weightwire.shared.framing import Chunk, plan
from weightwire.shared.groups import batch_by_layer
from weightwire.shared.meta import ParamMeta
from weightwire.shared.update_info import UpdateInfo
from weightwire.torch_side.worker.receive import UnpackPlan

LOAD_BATCHING = ("chunk", "group")

Pairs = list[tuple[str, torch.Tensor]]


@runtime_checkable
class Model(Protocol):
    """What a worker loads rounds into: vLLM's model, ``HFModelHost``, a test's host. Its
    other hooks are optional (``call_hook``, ``InPlaceModel``, ``TransactionalModel``,
    ``CheckingModel``, ``PatchingModel``)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object: ...


@runtime_checkable
class InPlaceModel(Protocol):
    """A model that can apply a round in place, opened with its own hook (``HFModelHost``);
    a streaming round into any other model opens with ``begin_round``."""

    def begin_in_place_round(self) -> None: ...


@runtime_checkable
class TransactionalModel(Protocol):
    """A model whose ``begin_round`` .. ``commit_round`` is all-or-nothing when
    ``transactional_rounds`` (``HFModelHost``): a load that fails midway wrote nothing."""

    transactional_rounds: bool


@runtime_checkable
class HasLoadedLayout(Protocol):
    """Framework hooks that can show a model's parameters as its loader creates them (vLLM's
    reload metadata), for recording what the loader reads on a model that post-processes."""

    def loaded_layout(self, model: Any) -> AbstractContextManager[Any]: ...


class FrameworkHooks(Protocol):
    """What the hosting framework does around a round (vLLM: layerwise reload)."""

    def begin(self, model: Model) -> None: ...
    def commit(self, model: Model, model_config: Any) -> None: ...
    def abort(self, model: Model, model_config: Any) -> None: ...
    def receive_context(self) -> AbstractContextManager[Any]: ...
    def prepare(self, model: Model, pairs: Pairs) -> Pairs: ...
    def round_dropped(self) -> None: ...


@runtime_checkable
class CheckingModel(Protocol):
    """A model that checks received tensors without taking them (``HFModelHost``): a bad
    name fails the update it came in, not the finish."""

    def check_weights(self, weights: Pairs) -> None: ...


@runtime_checkable
class PatchingModel(Protocol):
    """A model that applies a delta round's patches inside its own round, after its dense
    tensors (``HFModelHost``): every round it takes runs between its own hooks."""

    def check_patches(self, patches: Sequence[Patch]) -> None:
        """``ValueError`` naming a patched tensor the model does not have (before any byte)."""

    def patch_weights(self, patches: Any) -> None: ...


@dataclass(frozen=True)
class ReceiveStats:
    """What the last ``receive`` moved: for logs, benchmarks and the reference server."""

    tensors: int
    chunks: int
    nbytes: int
    seconds: float


@dataclass
class RoundPlan:
    """What a round's update info resolves to: built once per metadata, reused after.

    ``spec_checked``: the metadata passed the served model's ``ModelSpec`` (a failed
    check aborts the session, and a new session starts with an empty cache, so a plan
    that is reused was checked)."""

    metas: Sequence[ParamMeta]
    """A ``list``, or a delta round's ``MetaRows`` (made as read)."""
    chunks: list[Chunk]
    unpack: list[UnpackPlan]  # one per chunk
    spec_checked: bool = False


@dataclass(frozen=True)
class _Resolved:
    """The last round's update info for one (target model, broadcaster), and its plan."""

    model: object
    """Kept so that another model at a recycled ``id`` is not taken for this one."""
    update: UpdateInfo
    plan: RoundPlan
    packed: bool
    buffer_size_bytes: int


class MetaCache:
    """The round's metadata and plan, remembering the previous round's per target model
    (main vs draft) and broadcaster, for the 0.33 "empty lists = reuse" shorthand and so
    that a round repeating the previous metadata in full is not planned again."""

    def __init__(self, backend: str) -> None:
        self._backend = backend
        self._last: dict[tuple[int, int], _Resolved] = {}
        self._after_delta: set[tuple[int, int]] = set()
        """Keys whose previous round was a delta round: its plan is not kept (its metadata,
        patch sizes included, is never a later round's, and a plan swapped into this cache
        every round is the long-lived garbage that feeds the process's full collections,
        #49), and the shorthand cannot stand for it."""

    def clear(self) -> None:
        self._last.clear()
        self._after_delta.clear()

    def resolve(
        self, model: object, update: UpdateInfo, *, packed: bool, buffer_size_bytes: int
    ) -> RoundPlan:
        """The round's plan; ``ValueError`` for a reuse shorthand with nothing to reuse."""
        key = (id(model), update.src)  # reuse is per broadcaster: each turn has its own slice
        cached = self._last.get(key)
        if cached is not None and cached.model is not model:
            cached = None  # another model at a recycled id
        if update.reuses_previous:
            if key in self._after_delta:
                raise ValueError(
                    "update info reuses the previous round's metadata, which lists patch wire "
                    "tensors: a delta round's patches must be described in full"
                )
            if cached is None:
                raise ValueError(
                    f"{self._backend}: update info has empty names/dtype_names/shapes (reuse the "
                    "previous round's metadata) but this engine has received no round since init"
                )
            return cached.plan
        if update.patches:
            self._after_delta.add(key)
        else:
            self._after_delta.discard(key)
        if (
            cached is not None
            and cached.packed == packed
            and cached.buffer_size_bytes == buffer_size_bytes
            and _same(cached.update, update)
        ):
            return cached.plan  # the same metadata spelled out again: already checked and planned
        # A delta round's listing is new every round: rows over the update's own lists, not
        # a ParamMeta per wire tensor held through the round (#49).
        metas: Sequence[ParamMeta] = update.meta_rows() if update.patches else update.metas()
        chunks = plan(metas, packed=packed, buffer_size_bytes=buffer_size_bytes)
        resolved = RoundPlan(metas, chunks, [UnpackPlan(metas, c) for c in chunks])
        if not update.patches:  # a dense round's plan stays for the next dense round
            self._last[key] = _Resolved(model, update, resolved, packed, buffer_size_bytes)
        return resolved


def _same(a: UpdateInfo, b: UpdateInfo) -> bool:
    # Plain lists of str / lists of int: compared in C, far cheaper than building the metas.
    return a.names == b.names and a.dtype_names == b.dtype_names and a.shapes == b.shapes


def load_batches(chunk_batches: Iterator[Pairs], load_batching: str) -> Iterator[Pairs]:
    """Batches for ``load_weights``: whole chunks, or ("group") one decoder layer
    across chunk edges."""
    if load_batching == "chunk":
        return chunk_batches
    return batch_by_layer(pair for batch in chunk_batches for pair in batch)


def load_staged(
    model: Model,
    staged: Iterable[tuple[str, torch.Tensor]],
    *,
    before_commit: Callable[[], None] | None = None,
) -> None:
    """A fully received round into ``model``, one ``load_weights`` call per decoder layer,
    between the model's own ``begin_round`` / ``commit_round`` hooks (``before_commit``
    runs just before the latter: a delta round's patches join the model's round there)."""
    call_hook(model, "begin_round")
    for batch in batch_by_layer(staged):
        model.load_weights(batch)
    if before_commit is not None:
        before_commit()
    call_hook(model, "commit_round")


def call_hook(model: Model, name: str) -> None:
    """``model.<name>()`` when the model defines it (test models and staged adapters do)."""
    hook = getattr(model, name, None)
    if callable(hook):
        hook()
