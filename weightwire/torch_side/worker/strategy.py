"""How a worker applies a round: staged (all or nothing) or streaming (in place).

``StagedRound`` receives every byte of the round into fresh memory and applies it in
one call at finish, so a round that fails before finish changes nothing; it costs a
second copy of what the round carries. ``StreamingRound`` hands each chunk to
``load_weights`` as it lands (inside vLLM: its layerwise reload, a layer applied once
all of its tensors arrived), so the extra memory is the receive buffers, whatever the
model's size; a round that fails after its first write leaves the model part new.

A round starts staged while it fits the init info's ``stage_budget_bytes`` and turns
into a streaming one (``admit``) at the update that would take it over the budget:
the held tensors are applied first, then the rest streams. The trainer decides with the
same ``shared.staging.round_streams`` whether to refuse generation around the round.

What a round that ended without its commit leaves behind is recorded in
``weight_state.WeightState``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, ClassVar

from weightwire.backends.worker_base import LandingRecord
from weightwire.shared.meta import ParamMeta
from weightwire.shared.staging import round_streams
from weightwire.torch_side.worker.landing import LoaderMapRefused, record_loader_map
from weightwire.torch_side.worker.load import (
    CheckingModel,
    FrameworkHooks,
    InPlaceModel,
    Model,
    Pairs,
    TransactionalModel,
    call_hook,
    load_batches,
    load_staged,
)

if TYPE_CHECKING:  # a delta round's part is built by the patch step (``sinks``) only
    from weightwire.torch_side.worker.delta import RoundDelta

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundTarget:
    """What one round loads into, fixed at its start."""

    backend: str
    model: Model
    model_config: Any
    framework: FrameworkHooks | None
    load_batching: str = "chunk"


class ReceiveStrategy(ABC):
    """One round on one worker: ``receive`` per update, then ``commit`` or ``abort``."""

    name: ClassVar[str]

    def __init__(self, target: RoundTarget) -> None:
        self.target = target
        self.names: set[str] = set()
        self.wrote = False
        """True once a byte of this round may be in the model (in place)."""
        self.token: str | None = None
        """The round's token (``UpdateInfo.round_token``): the same in every update."""
        self.updates = 0
        """Updates received whole so far."""
        self.delta: RoundDelta | None = None
        """A delta round's patches and their sink; None on a dense round."""

    @property
    def label(self) -> str:
        """The strategy as the engine reports it (``round_strategy``): its name, or how far
        it went (a sliced round that went in place)."""
        return self.name

    def took(self, token: str | None) -> None:
        """One update of the round was received whole."""
        if self.updates == 0:
            self.token = token
        self.updates += 1

    def admit(self, nbytes: int, budget_bytes: int) -> ReceiveStrategy:
        """The strategy for the round once an update of ``nbytes`` joins it."""
        return self

    @property
    def untouched(self) -> bool:
        """No update joined the round yet (it may still become a write-through round)."""
        return not self.names and not self.wrote and not self.held_tensors()

    def held_tensors(self) -> Pairs:
        """The received tensors not yet in the model (a check before commit can
        still refuse them); a delta round's patches as their ``@values`` tensors."""
        return self.delta.held_values() if self.delta is not None else []

    @abstractmethod
    def begin(self) -> None: ...

    @abstractmethod
    def receive(self, chunks: Iterator[Pairs]) -> None:
        """Consume one update's chunks (``(name, tensor)`` views, in wire order)."""

    @abstractmethod
    def commit(self) -> None: ...

    @abstractmethod
    def abort(self, why: str) -> None:
        """Abandon the round; never raises."""

    def _abort_hooks(self) -> None:
        t = self.target
        try:
            call_hook(t.model, "abort_round")
        except Exception:
            log.exception("%s: model.abort_round failed", t.backend)
        if t.framework is not None:
            try:
                t.framework.abort(t.model, t.model_config)
            except Exception:
                log.exception("%s: framework abort failed", t.backend)


class StagedRound(ReceiveStrategy):
    """Hold every received tensor; apply all of them in one call at commit."""

    name = "staged"

    def __init__(self, target: RoundTarget) -> None:
        super().__init__(target)
        self.held: Pairs = []
        self.held_bytes = 0

    def held_tensors(self) -> Pairs:
        return [*self.held, *super().held_tensors()]

    def admit(self, nbytes: int, budget_bytes: int) -> ReceiveStrategy:
        if not round_streams(self.held_bytes + nbytes, budget_bytes):
            return self
        streaming = StreamingRound(self.target)
        streaming.names = self.names
        streaming.token, streaming.updates, streaming.delta = self.token, self.updates, self.delta
        streaming.begin()
        streaming.pending, self.held = self.held, []
        if streaming.pending:
            log.info(
                "%s: the round outgrew the stage budget (%d bytes); the %d held tensors "
                "go in place first",
                self.target.backend,
                budget_bytes,
                len(streaming.pending),
            )
        return streaming

    def begin(self) -> None:
        pass

    def receive(self, chunks: Iterator[Pairs]) -> None:
        # A model that can check tensors without taking them (HFModelHost) does so as they
        # land: a bad name fails this update, not the finish.
        model = self.target.model
        check = model.check_weights if isinstance(model, CheckingModel) else None
        received: Pairs = []
        for pairs in chunks:
            if check is not None:
                check(pairs)
            received.extend(pairs)
        # Only once every byte of this update landed: a failed update adds nothing.
        self.held.extend(received)
        self.held_bytes += sum(t.numel() * t.element_size() for _, t in received)
        self.names.update(n for n, _ in received)

    def commit(self) -> None:
        held, self.held = self.held, []
        delta = self.delta
        if delta is not None:  # the fallback's rebuilt tensors
            held += delta.finish(self.names, {n for n, _ in held})
        if held or (delta is not None and delta.model_round):
            self._load(held)
        if delta is not None:
            self.wrote = self.wrote or delta.writes_live
            delta.after_commit()

    def _load(self, held: Pairs) -> None:
        t = self.target
        framework = t.framework if held else None
        if framework is not None:
            held = framework.prepare(t.model, held)
            framework.begin(t.model)
        # A load that fails midway leaves completed layers new, unless the model's own
        # begin_round .. commit_round is all-or-nothing (HFModelHost).
        self.wrote = not (isinstance(t.model, TransactionalModel) and t.model.transactional_rounds)
        try:
            delta = self.delta
            in_round = (lambda: delta.in_round(t.model)) if delta is not None else None
            load_staged(t.model, held, before_commit=in_round)
        except BaseException:
            self._abort_hooks()
            raise
        if framework is not None:
            framework.commit(t.model, t.model_config)

    def abort(self, why: str) -> None:
        if self.delta is not None:
            self.delta.drop()
        dropped, self.held = len(self.held), []
        log.info(
            "%s: round dropped (%s); %d received tensors discarded, weights unchanged",
            self.target.backend,
            why,
            dropped,
        )


class StreamingRound(ReceiveStrategy):
    """Apply each chunk in place as it lands, between the framework's begin and commit.

    The framework's round (vLLM: layerwise reload, which parks layers on the meta device
    until their tensors arrive) opens at the first update, inside that worker call, not at
    start: between start and the first update the model is whole and servable."""

    name = "streaming"

    def __init__(self, target: RoundTarget) -> None:
        super().__init__(target)
        self.pending: Pairs = []
        """Tensors a staged start held before the round outgrew the budget: loaded first."""
        self.opened = False

    def begin(self) -> None:
        pass

    def _open(self) -> None:
        t = self.target
        self.opened = True
        if t.framework is not None:
            t.framework.begin(t.model)
        try:
            # A model that can apply in place says so with its own hook (HFModelHost).
            call_hook(
                t.model,
                "begin_in_place_round" if isinstance(t.model, InPlaceModel) else "begin_round",
            )
        except BaseException:
            self._abort_hooks()
            raise

    def receive(self, chunks: Iterator[Pairs]) -> None:
        t = self.target
        if self.pending:
            chunks, self.pending = chain([self.pending], chunks), []
        check = t.model.check_weights if isinstance(t.model, CheckingModel) else None
        with t.framework.receive_context() if t.framework is not None else nullcontext():
            for pairs in load_batches(chunks, t.load_batching):
                if not self.opened:  # opened by the first tensor: an update may divert all
                    self._open()
                if check is not None:  # a batch the model refuses is refused before any write
                    check(pairs)
                self.names.update(n for n, _ in pairs)
                if t.framework is not None:
                    pairs = t.framework.prepare(t.model, pairs)
                self.wrote = True
                t.model.load_weights(pairs)
                del pairs  # let the chunk buffer go before the next one is posted

    def commit(self) -> None:
        t = self.target
        delta = self.delta
        # The fallback's rebuilt tensors
        extra = delta.finish(self.names, set(self.names)) if delta is not None else []
        if not self.opened and (extra or (delta is not None and delta.model_round)):
            self._open()
        if self.opened:
            try:
                if extra:
                    self.wrote = True
                    t.model.load_weights(
                        t.framework.prepare(t.model, extra) if t.framework is not None else extra
                    )
                if delta is not None:
                    delta.in_round(t.model)
                call_hook(t.model, "commit_round")
            except BaseException:
                self._abort_hooks()
                raise
            if t.framework is not None:
                t.framework.commit(t.model, t.model_config)
        if delta is not None:
            self.wrote = self.wrote or delta.writes_live
            delta.after_commit()

    def abort(self, why: str) -> None:
        if self.delta is not None:
            self.delta.drop()
        if self.opened:
            self._abort_hooks()


class WriteThroughRound(ReceiveStrategy):
    """The trainer writes the round straight into the serving parameters (``weightwire_ipc``
    write-through): nothing is received here, nothing is loaded. The model's own loader
    was recorded as plain copies (``landing.record_loader_map``), so no post-load step
    runs and no framework round (vLLM's layerwise reload) opens. In place from the
    trainer's first write, which comes only after ``receive`` started: a round that ends
    without its commit leaves the model incomplete."""

    name = "write_through"

    def __init__(
        self, target: RoundTarget, settle: Callable[[], None], *, early: bool = False
    ) -> None:
        super().__init__(target)
        self._settle = settle
        """Waits until the trainer's writes landed (the device stream that waited for them)."""
        self.early = early
        """Written through since the round's start, its update not yet here."""

    def in_place(self) -> StreamingRound:
        """The round goes on as a streaming one (its update's tensors are not written
        through after all); it was in place from its start, and stays so."""
        streaming = StreamingRound(self.target)
        streaming.names, streaming.wrote = self.names, True
        streaming.begin()
        return streaming

    def begin(self) -> None:
        pass

    def receive(self, chunks: Iterator[Pairs]) -> None:
        self.wrote = True  # before the link lets the trainer write
        for pairs in chunks:
            if pairs:
                raise RuntimeError(
                    f"{self.target.backend}: a write-through turn yielded {len(pairs)} tensors"
                )

    def commit(self) -> None:
        self._settle()  # the update returned before the bytes landed; the commit does not

    def abort(self, why: str) -> None:
        log.error(
            "%s: a round written through into the serving parameters ended without its commit (%s)",
            self.target.backend,
            why,
        )


def record_landing(model: Any, metas: Sequence[ParamMeta]) -> LandingRecord:
    """The model's landing map for ``metas`` (``landing.record_loader_map``), or why not:
    a write-through link then takes the round through its receive buffers."""
    try:
        return LandingRecord(record_loader_map(model, metas))
    except LoaderMapRefused as exc:  # not a plain copy: says which tensor or module
        return LandingRecord(None, str(exc))
    except Exception as exc:  # a loader that fails on tracers: the pull path still works
        log.debug("recording the landing map failed", exc_info=True)
        return LandingRecord(None, f"recording the landing map failed: {type(exc).__name__}: {exc}")


def first_strategy(target: RoundTarget, budget_bytes: int) -> ReceiveStrategy:
    """A round's strategy at start: staged unless nothing fits the budget (0: stream)."""
    strategy: ReceiveStrategy = StagedRound(target) if budget_bytes > 0 else StreamingRound(target)
    strategy.begin()
    return strategy
