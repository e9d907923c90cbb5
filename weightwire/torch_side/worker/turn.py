"""One update of a round on the worker (a turn): which strategy receives it, and where a
failed one stopped.

A round's first update may be written straight into the serving parameters by the trainer
(``WriteThroughRound``) when the link says it lands there; a round the trainer was let write
since its start (``early``) falls back to in place when this turn does not land. Otherwise the
round stays staged while it fits the stage budget and streams past it (``ReceiveStrategy.admit``).
``_ReceiverCore.receive`` applies these rules; they live here so the rules read on their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from weightwire.backends.worker_base import (
    LandingRecord,
    ReceiveLink,
    ReceiveProgress,
    ReceiveTurn,
)
from weightwire.shared.meta import ParamMeta
from weightwire.shared.staging import round_bytes
from weightwire.torch_side.worker.landing_rules import post_load_refusal
from weightwire.torch_side.worker.load import Model, PatchingModel
from weightwire.torch_side.worker.spec import ModelSpec
from weightwire.torch_side.worker.strategy import (
    ReceiveStrategy,
    RoundTarget,
    WriteThroughRound,
    record_landing,
)


def early_round(
    target: RoundTarget, settle: Callable[[], None], names: Iterable[str]
) -> WriteThroughRound:
    """A round the trainer may write in place from its start (``ReceiveLink.early_landing``):
    recorded as written from the outset, so a failure leaves the model marked incomplete."""
    round_ = WriteThroughRound(target, settle, early=True)
    round_.wrote = True
    round_.names.update(names)
    return round_


def turn_strategy(
    round_: ReceiveStrategy,
    link: ReceiveLink,
    turn: ReceiveTurn,
    model: Model,
    settle: Callable[[], None],
    budget_bytes: int,
    *,
    plain: bool,
    landing: Callable[[Model, Sequence[ParamMeta]], LandingRecord] = record_landing,
) -> ReceiveStrategy:
    """The strategy that receives ``turn`` (``round_`` itself or its successor).

    ``plain``: the turn's tensors go to the model as sent (no patches split off), so a round
    no update joined yet may become write-through when the link lands the turn in place; a
    model that runs every round between its own hooks (``PatchingModel``: ``HFModelHost``)
    takes none written through. ``landing``: the model's landing map for a turn's tensors,
    asked only when the link needs it (the core's: the join's map when it still holds)."""
    metas = turn.metas
    record = lambda: landing(model, metas)  # noqa: E731
    if isinstance(round_, WriteThroughRound) and round_.early:
        round_.early = False  # the update of a round the trainer may write since start
        round_.names.update(m.name for m in metas)
        if not link.lands(turn, record):  # other tensors, and not written through
            return round_.in_place()
        return round_
    plain = plain and not isinstance(model, PatchingModel)
    if plain and round_.untouched and link.lands(turn, record):
        through = WriteThroughRound(round_.target, settle)
        through.names.update(m.name for m in metas)
        return through
    return round_.admit(round_bytes(metas), budget_bytes)


def join_landing(model: Model, spec: ModelSpec | None) -> LandingRecord:
    """At a session's join: whether the trainer may write this model's rounds straight into
    its parameters (a backend that can asks, ``worker_base.Connect``'s ``landing``), or why
    not: a model that runs every round between its own hooks (``PatchingModel``, as
    ``turn_strategy`` rules), post-load processing that is not a no-op, or a loader that is not
    a set of plain copies for the served tensors (``spec``). Without a spec only the model is
    checked here; its loader is then checked per round, as the link lands each turn."""
    if isinstance(model, PatchingModel):
        return LandingRecord(
            None, f"{type(model).__name__} applies every round between its own hooks"
        )
    if spec is None:
        why = post_load_refusal(model) if isinstance(model, torch.nn.Module) else None
        return LandingRecord(None, why)
    metas = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in spec.tensors.items()]
    return record_landing(model, metas)


def failure_where(turn: ReceiveTurn, progress: ReceiveProgress) -> str:
    """Where a turn's receive stopped, for the error the worker raises."""
    where = (
        f"at chunk {progress.chunk + 1}/{len(turn.chunks)}"
        if progress.chunk >= 0
        else "before the first chunk"
    )
    if turn.src:
        where += f" from src {turn.src}"  # several broadcasters: name the one this turn lost
    return where
