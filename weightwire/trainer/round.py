"""The round driver: rank 0 runs one round of a ``BroadcastPlan``, whatever its wire.

A single sender is a plan with one turn (``sole_plan``) sent by ``SoleWire``; several
broadcasters are the same round over stars or one group (``trainer.multi_star`` /
``trainer.multi_group``). The driver owns what every round does, in order:

1. each turn's update info (reused when the workers already hold that slice's metadata);
2. the control plane, run by the wire at the point it chooses (``SoleWire``: once the
   first chunk is prepared): [verify snapshot] -> [pause] -> ``start_weight_update``
   (``start_draft_weight_update``);
3. the wire's transfer, the turns' ``update_weights`` beside it;
4. ``finish_weight_update(version)`` and the cache reset (``trainer.freshness``: at once in a
   round paused as a whole, else the finish first) -> [resume];
5. [verify: every slice's digests against the servers'].

A failure resumes a round paused as a whole only once it committed (only a check after
the commit failed); otherwise the pause's own failure rule applies (``gating``). The
wire hears how the round ended (``RoundEnd``): the multi-source plan tells the other
trainer ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from weightwire.backends.base import Sent, WirePlan
from weightwire.shared.framing import Chunk, plan
from weightwire.shared.meta import ParamMeta
from weightwire.shared.update_info import UpdateInfo
from weightwire.trainer.broadcast_plan import BroadcastPlan, Turn
from weightwire.trainer.early import EarlyStart, starts_with_pause
from weightwire.trainer.freshness import StaleCacheError
from weightwire.trainer.gating import RoundPause, after_failed_round, hold_guard, release_guard
from weightwire.trainer.metrics import PhaseClock, RoundMetrics
from weightwire.trainer.multi_verify import verify_union
from weightwire.trainer.session import SentKey, Session
from weightwire.trainer.transfer import (
    Transfer,
    best_effort_resume,
    chunked,
    tensor_stream,
)
from weightwire.trainer.verify import VerifyError

logger = logging.getLogger(__name__)


class Control(Protocol):
    """The round's control plane (verify snapshot, pause, start): the wire runs it once,
    before any byte."""

    def __call__(self) -> None: ...

    def ready(self) -> None:
        """The data path cleared what an earlier round left (a start sent early may go out
        from now on: ``trainer.early``); a wire that never calls it gets the start when it
        runs the control plane."""
        ...


class RoundControl:
    """``Control`` for ``lead_round``: ``run`` the control plane, ``ready`` tells an early
    start (if any) that it may go."""

    def __init__(self, run: Callable[[], None], early: EarlyStart | None) -> None:
        self._run, self._early = run, early

    def __call__(self) -> None:
        self._run()

    def ready(self) -> None:
        if self._early is not None:
            self._early.ready()


class Wire(Protocol):
    """How one round's turns go out from rank 0."""

    def transfer(
        self,
        payloads: list[dict[str, Any]],
        control: Control,
        own: dict[str, str] | None,
        clock: PhaseClock,
    ) -> Sent:
        """Run ``control``, then every turn with its ``update_weights`` payload; ``own``: record
        the digests of rank 0's own slice. Raises on the first failed turn."""
        ...

    def digests(self, own: dict[str, str]) -> dict[str, str]:
        """Every slice's digests (rank 0's are ``own``), for the verify step."""
        ...


class RoundEnd(Protocol):
    """Told how a round ended, on rank 0 (the other trainer ranks wait for it)."""

    def committed(self, version: str) -> None: ...
    def failed(self, exc: BaseException, *, committed: bool) -> None: ...


SoleRound = Callable[[list[ParamMeta], str, PhaseClock, bool, "RoundEnd | None"], RoundMetrics]
"""The engine's one-turn round (rank 0 the only broadcaster), told how it ended."""


def was_committed(exc: BaseException) -> bool:
    """The round landed and only a check after the commit failed (cache reset, verify)."""
    return isinstance(exc, (VerifyError, StaleCacheError)) and exc.committed


def lead_round(
    s: Session,
    bplan: BroadcastPlan,
    metas: list[ParamMeta],
    version: str,
    clock: PhaseClock,
    draft: bool,
    wire: Wire,
    end: RoundEnd | None = None,
    payloads: list[dict[str, Any]] | None = None,
    pause: RoundPause | None = None,
    early_pause: bool = False,
) -> RoundMetrics:
    """Rank 0's round over ``wire``; returns once the servers committed ``version``.
    ``payloads``: each turn's update info as the backend wrote it (a delta round's), instead
    of the dense one built from the turn's tensors; ``pause``: the round's pause, instead of
    the session's rule for a round of ``metas``; ``early_pause``: send the pause now, and the
    start right after it once the data path is ready (``trainer.early``), beside the wire's
    own preparation (a wire that runs ``control`` soon: ``SoleWire``), instead of from
    ``control``, which then awaits them."""
    reused = False
    if payloads is None:
        with clock("metadata"):
            payloads, reused = _payloads(s, bplan, draft)
    for turn in bplan.turns:
        s.sent.pop(SentKey(draft, turn.src), None)  # unknown until finish succeeds
    own: dict[str, str] | None = {} if s.verifier is not None else None
    if pause is None:
        pause = s.round_pause(metas)
    paused = held = started = False
    start = s.client.start_draft_weight_update if draft else s.client.start_weight_update
    # The pause's and the start's round trips overlap the round's set-up; the start still goes
    # only after the pause returned. With the round guard, the guard is held first (requests
    # are refused with its reason); with verify, the checker's snapshot goes first (its calls
    # keep one order): neither starts early.
    early = None
    if early_pause and pause.mode is not None and not pause.guard and s.verifier is None:
        mode, http_s = pause.mode, s.info.timeouts.http_s
        if not draft and starts_with_pause(s.client):  # one call (the reference server's offer)
            both = s.client.pause_and_start  # type: ignore[attr-defined]
            early = EarlyStart(None, lambda: both(mode), http_s)
        else:
            early = EarlyStart(lambda: s.pause(mode), start, http_s)

    def run_control() -> None:
        nonlocal paused, held, started
        if early is not None:
            early.wait()  # on error: the failure path asks it what went out
            paused, started = early.paused, True
            return
        if s.verifier is not None:
            s.verifier.before_round(s.client)  # a failure here sent nothing
        held = hold_guard(s.client, pause, version)  # refusing, with the reason, before any write
        if pause.mode is not None:
            paused = s.pause(pause.mode)
        started = True  # from here the workers may hold part of the round
        start()

    control = RoundControl(run_control, early)

    def record() -> None:  # committed: the next automatic version moves on even if a check fails
        for turn in bplan.turns:
            s.sent[SentKey(draft, turn.src)] = turn.metas
        s.rounds += 1

    report = None
    try:
        clock.seconds["control"] = 0.0  # booked from inside the transfer (listed first)
        with clock("transfer"):
            sent = wire.transfer(payloads, control, own, clock)
        with clock("finish"):
            if s.before_commit is not None:  # an overlapped round that shutdown stopped
                s.before_commit()
            # + the caches reset; beside the finish when nothing generates until the resume
            resumed = s.commit_plan.commit(
                s.client, version, record=record, paused=paused, timeout=s.info.timeouts.http_s
            )
            if paused:
                paused = False
                if not resumed:  # else the finish resumed them (the reference server's offer)
                    s.client.resume()
            held = release_guard(s.client, pause)  # the guard checks the workers are whole first
        if s.verifier is not None and own is not None:
            with clock("verify"):
                report = verify_union(
                    s.verifier, s.client, bplan, wire.digests(own), version, draft=draft
                )
    except BaseException as exc:
        committed = was_committed(exc)
        if early is not None and not started:
            # Failed before the control plane returned: no start goes out from now on. One that
            # went out (whatever it answered) counts: the round failed after its start. Else
            # nothing reached the workers, so a pause that held is undone.
            paused, started, opened = early.abandon()
            if paused and not started:
                paused = False
                best_effort_resume(s.client)
            if opened and s.broken is None:
                # The servers hold a round this trainer will send nothing more into (the
                # reference server's lease aborts it; a stock worker may have begun a reload):
                # like a round that failed after its first byte, the engine needs a new init.
                # (A start that failed opened nothing: as in line, the engine stays usable.)
                s.broken = exc
        if end is not None:
            end.failed(exc, committed=committed)
        if committed:
            # Committed: the model is whole, so a round paused as a whole resumes.
            if paused:
                best_effort_resume(s.client)
            if held:
                _release_whole(s.client, pause)
        elif paused or held:
            after_failed_round(s.client, pause)
        raise
    if end is not None:
        end.committed(version)
    return RoundMetrics(
        version,
        sent.nbytes,
        len(metas),
        sent.sends,
        reused,
        seconds=clock.seconds,
        verify=report,
        dense_bytes=sent.nbytes,
    )


def _release_whole(client: Any, pause: RoundPause) -> None:
    """After a commit whose later step failed (a cache reset): the model is whole, so the
    guard is lifted; a failure to lift it is logged, the round's own error is what raises."""
    try:
        release_guard(client, pause)
    except Exception as exc:
        logger.error(
            "the round committed but the round guard could not be lifted: %s "
            "(POST /weightwire/round_guard/release lifts it)",
            exc,
        )


def _payloads(s: Session, bplan: BroadcastPlan, draft: bool) -> tuple[list[dict[str, Any]], bool]:
    """Each turn's update info; the metadata alone is left out of a turn whose slice the
    workers already hold (``reuse_metadata``). ``True`` when every turn was."""
    assert s.features is not None
    payloads, reused = [], True
    extra = s.round_fields or {}
    for turn in bplan.turns:
        same = s.features.reuse_metadata and s.sent.get(SentKey(draft, turn.src)) == turn.metas
        same &= not extra.get("patches")  # a delta round's patches name their wire tensors
        reused &= same
        info = (
            UpdateInfo(src=turn.src)
            if same
            else replace(UpdateInfo.from_metas(list(turn.metas)), src=turn.src)
        )
        if extra:
            info = replace(info, **extra)
        payloads.append(info.to_dict())
    return payloads, reused


# -- one broadcaster ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SolePlan:
    """A single sender's round: its source metadata, its wire order and chunks, and the
    one-turn broadcast plan the driver runs."""

    metas: list[ParamMeta]
    wire: WirePlan
    chunks: list[Chunk]
    bplan: BroadcastPlan


def sole_plan(s: Session, metas: list[ParamMeta], last: SolePlan | None) -> SolePlan:
    """The round's plan; the same metadata as last round reuses it (every round of a
    training run, in practice: the plan is on the critical path). A stock receiver's
    round is checked, maybe reordered or refused (``StockRefusal``), before any call."""
    if last is not None and last.metas == metas:
        return last
    assert s.features is not None
    size = s.info.packed_buffer_size_bytes
    wire = s.backend.plan_round(
        metas, features=s.features, packed=s.info.packed, buffer_size_bytes=size
    )
    chunks = plan(wire.metas, packed=s.info.packed, buffer_size_bytes=size)
    bplan = BroadcastPlan((0,), (Turn(0, 0, tuple(wire.metas)),))
    return SolePlan(list(metas), wire, chunks, bplan)


class SoleWire:
    """Rank 0 alone: the update POST beside its broadcasts, control folded into the first
    chunk's preparation (``trainer.transfer.Transfer``)."""

    def __init__(
        self,
        s: Session,
        sole: SolePlan,
        remap: Callable[[dict[str, str]], dict[str, str]] | None = None,
    ) -> None:
        self._s, self._sole, self._remap = s, sole, remap

    def transfer(
        self,
        payloads: list[dict[str, Any]],
        control: Control,
        own: dict[str, str] | None,
        clock: PhaseClock,
    ) -> Sent:
        s, sole = self._s, self._sole
        (payload,) = payloads
        pairs: Iterator[tuple[str, Any]] = s.stream(tensor_stream(s.source), sole.metas, own)
        return send_update(
            s,
            payload,
            chunked(sole.wire.reorder(pairs), sole.chunks),
            sole.wire.metas,
            control,
            clock,
        )

    def digests(self, own: dict[str, str]) -> dict[str, str]:
        """``own``, keyed by what the workers hold (``remap``: a delta round's wire tensors ->
        the full tensors they patch)."""
        return own if self._remap is None else self._remap(own)


def send_update(
    s: Session,
    payload: dict[str, Any],
    chunks: Iterator[Any],
    metas: list[ParamMeta],
    control: Control,
    clock: PhaseClock,
) -> Sent:
    """Rank 0 alone: one update POST beside the broadcast of ``chunks``; a failure that
    leaves the link unusable marks the session broken."""
    assert s.sender is not None
    step = Transfer(
        s.link,
        s.sender,
        post_update=lambda: s.client.update_weights(payload),
        control=control,
        clock=clock,
        http_s=s.info.timeouts.http_s,
    )
    try:
        return step.run(announced(chunks, control.ready), metas)
    finally:
        if step.broken is not None:
            s.broken = step.broken


def announced(chunks: Iterator[Any], ready: Callable[[], None]) -> Iterator[Any]:
    """``chunks``, calling ``ready`` once the first was made: the data path pulls it only
    after clearing what an earlier round left on its channels (``trainer.early``), and a
    source that fails on its first tensors has not let a start out."""
    first = True
    for chunk in chunks:
        if first:
            ready()
            first = False
        yield chunk
