"""One trainer round, read top to bottom in ``lead_round``.

A round is a value (``Round``): what it sends (the turns' tensors, or the update info a
backend wrote for a delta round's patches, plus a delta round's extra update-info fields),
to whom and in which order (its ``BroadcastPlan``: a single sender is a plan with one turn,
``trainer.sole_round``; several broadcasters are the same round over stars or
one group, ``trainer.multi_star`` / ``trainer.multi_group``), its version, draft flag and
pause. The ``Session`` keeps only what lives between rounds (the wire, the served model,
what the workers hold, counters). ``lead_round`` runs any round on rank 0 in these steps:

1. ``prepare``: each turn's update info (reused when the workers already hold that slice's
   metadata); what the workers hold becomes unknown until the finish succeeds;
2. ``send_early``: the pause (and the start once the data path is ready) on a helper thread,
   ahead of the round's set-up, where nothing must precede them (``trainer.early``);
3. ``transfer``: the wire runs the control plane at the point it chooses (``SoleWire``: once
   the first chunk is prepared; ``open_round``: [verify snapshot] -> [round guard] ->
   [pause] -> ``start_weight_update`` / ``start_draft_weight_update``), then its broadcasts
   with the turns' ``update_weights`` beside them;
4. ``commit``: ``finish_weight_update(version)`` and the cache reset (``trainer.freshness``:
   beside the finish in a round paused as a whole), [resume], [release the guard];
5. ``verify``: every slice's digests against the servers';
6. on any failure, ``recover`` (its rules at the point they apply), then the error is raised.

The wire hears how the round ended (``RoundEnd``): the multi-source plan tells the other
trainer ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from weightwire._trace import trace
from weightwire.backends.base import RoundSender, Sent
from weightwire.shared.errors import WeightSyncError
from weightwire.shared.meta import MetaRows, ParamMeta
from weightwire.shared.routes import RESUME
from weightwire.shared.update_info import UpdateInfo
from weightwire.trainer.broadcast_plan import BroadcastPlan
from weightwire.trainer.early import (
    EarlyStart,
    go_accepts,
    one_request,
    one_server,
    starts_with_pause,
)
from weightwire.trainer.freshness import FinishInUpdate, StaleCacheError, finish_in_update
from weightwire.trainer.gating import (
    RoundPause,
    after_failed_round,
    hold_guard,
    reference_server,
    release_guard,
)
from weightwire.trainer.metrics import PhaseClock, RoundMetrics, http_calls, http_calls_since
from weightwire.trainer.multi_verify import verify_union
from weightwire.trainer.session import SentKey, Session
from weightwire.trainer.transfer import Transfer, best_effort_resume, start_opened_nothing
from weightwire.trainer.verify import VerifyError, VerifyReport
from weightwire.vllm_guard import MIDDLEWARE

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

    def release(self) -> None:
        """``ready``, said by a data path that does its first work right after: the start
        (sent early) is on its way before that work begins (``EarlyStart.release``)."""
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

    def release(self) -> None:
        if self._early is not None:
            self._early.release()


@dataclass(frozen=True)
class Transmission:
    """What a ``Wire`` sends of one round: each turn's ``update_weights`` payload, the
    control plane it runs before any byte, where the digests of rank 0's own slice go
    (``None``: not verified) and the round's clock."""

    payloads: list[dict[str, Any]]
    control: Control
    own: dict[str, str] | None
    clock: PhaseClock
    go_accepts: bool = False
    """The workers' word from inside their start is the round's acceptance
    (``backends.base.Outgoing.go_accepts``; ``trainer.early.go_accepts``)."""
    post_update: Callable[[dict[str, Any]], None] | None = None
    """The one turn's update POST, when it carries more than the update (the round's finish:
    ``freshness.FinishInUpdate``); None: ``update_weights``."""
    one_request: bool = False
    """``post_update`` carries the round's start too: the round is one request, sent by the
    data path's ``begin`` (``trainer.transfer.Transfer``: ``one_request``)."""

    @property
    def sole_payload(self) -> dict[str, Any]:
        """The one turn's payload of a round rank 0 sends alone."""
        (payload,) = self.payloads
        return payload


class Wire(Protocol):
    """How one round's turns go out from rank 0."""

    def transfer(self, t: Transmission) -> Sent:
        """Run ``t.control``, then every turn with its ``update_weights`` payload, recording
        the digests of rank 0's own slice in ``t.own``. Raises on the first failed turn."""
        ...

    def digests(self, own: dict[str, str]) -> dict[str, str]:
        """Every slice's digests (rank 0's are ``own``), for the verify step."""
        ...


class RoundEnd(Protocol):
    """Told how a round ended, on rank 0 (the other trainer ranks wait for it)."""

    def committed(self, version: str) -> None: ...
    def failed(self, exc: BaseException, *, committed: bool) -> None: ...


@dataclass(frozen=True)
class Round:
    """One round, as a value: built by a planning step, run by ``lead_round``."""

    version: str
    plan: BroadcastPlan
    """Who sends which slice, in which order (one turn per broadcaster)."""
    metas: Sequence[ParamMeta]
    """The round's tensors as the caller asked them (the pause's size, the metrics)."""
    wire: Wire
    draft: bool = False
    fields: Mapping[str, Any] = field(default_factory=dict)
    """Extra update-info fields of every turn: a delta round's ``round_token``,
    ``delta_base``, ``patches``."""
    payloads: list[dict[str, Any]] | None = None
    """Each turn's update info as the backend wrote it (a round of patches), instead of the
    one built from the turn's tensors."""
    pause: RoundPause | None = None
    """The round's pause, instead of the session's rule for a round of ``metas``."""
    before_commit: Callable[[], None] | None = None
    """An overlapped round's last chance to be stopped, asked right before its finish goes
    out (``RoundStop.before_commit``: ``shutdown`` stopped it, nothing commits)."""
    early_pause: bool = False
    """Send the pause now, and the start right after it once the data path is ready, beside
    the wire's own preparation (a wire that runs ``control`` soon: ``SoleWire``)."""
    sender: RoundSender | None = None
    """The data path the round's bytes go through, where one rank sends them all (the
    session's, or a sliced round's own): whether it hears its workers before writing decides
    whether the round can be one request (``early.one_request``)."""

    @property
    def delta(self) -> bool:
        """A delta round: its fields carry patches."""
        return carries_patches(self.fields)


@dataclass
class _Servers:
    """What this round did to the servers so far: the failure rules read it."""

    paused: bool = False
    held: bool = False
    """The round guard is held (requests that run the model are refused)."""
    started: bool = False
    """The start went out: from here the workers may hold part of the round."""
    committed: bool = False
    """Every server's finish committed the round (recorded): a later step's failure (the
    resume, a cache reset) leaves the model whole."""
    one_request: bool = False
    """The round's start (with its pause) rides on its update, which carries its finish:
    one request (``early.one_request``)."""
    finishing: bool = False
    """The finish went out: a worker may have committed the round while another failed."""


def was_committed(exc: BaseException) -> bool:
    """The round landed and only a check after the commit failed (cache reset, verify)."""
    return isinstance(exc, (VerifyError, StaleCacheError)) and exc.committed


def lead_round(
    s: Session, r: Round, clock: PhaseClock, end: RoundEnd | None = None
) -> RoundMetrics:
    """Rank 0's round ``r``; returns once the servers committed ``r.version``.

    What a failure leaves, step by step (``recover`` applies it, then the error is raised):
    before ``open_round`` returned, nothing reached the workers (a pause that held is undone;
    a start sent early that may have opened a round marks the engine broken), unless the
    data path wrote at the workers' go (``early.go_accepts``: then as after the first byte,
    the engine broken); after the
    start, the workers may hold part of the round: a round paused as a whole is resumed, one
    applied in place stays paused / guarded (``gating.after_failed_round``), and a transfer
    that lost its link leaves the engine broken (``trainer.transfer``); once the finish
    committed, only a check failed (``StaleCacheError`` / ``VerifyError``, ``committed``):
    the model is whole, so the servers are resumed and the guard lifted.

    A round in one request (``early.one_request``: its start, with the pause, rides on the
    update that carries the finish; its data path writes nothing before every worker's word
    from inside that request) fails by these rules:

    - refused before the go (asleep, not the owner, a round already open, a bad version or
      update info: the server's start refused it, ``start_weight_update``; or its pause
      failed, undone: a ``wait`` that did not drain): nothing was written, paused or
      started; the engine stays usable, as after a refused start;
    - failed by its server past the start's pause but before any worker's word (a worker's
      update refusing a delta round's base): the server failed the round and ended the
      session, so the engine needs a new init (``DeltaRounds`` takes it at once for its
      dense resend);
    - failing after the go (a worker's start failing after its go, the update, the commit:
      the error names ``start_weight_update`` / ``update_weights`` /
      ``finish_weight_update``): the round failed after its bytes could land; the link is
      aborted and the engine refuses rounds until a new init, and the server refuses
      generation on that model until a whole round commits (the round stays paused);
    - a finish that failed on some workers (separate calls): a model's ranks that committed
      hold the round beside ranks that did not, so the servers' round guard is held and
      released only if every worker says whole (``guard_split_commit``);
    - the trainer's own failure with the request out (its source mid-round, a kill): the
      link closes, so the workers fail their update and the server's round fails, nothing
      half-new served; the engine needs a new init;
    - every wait is bounded (the client's ``http_s`` for the request, the data path's own
      timeouts for the workers' word and the bytes)."""
    calls = http_calls(s.client)  # the round's share: RoundMetrics.http_calls
    # Fails: nothing was sent (the update infos are built here).
    payloads, reused = prepare(s, r, clock)
    pause = r.pause
    if pause is None:
        pause = s.round_pause(r.metas, keep=not r.delta)
    if s.guard_left_held and not pause.guard:
        pause = replace(pause, guard=True)  # its commit lifts the guard a failed one left
    servers = _Servers()
    # the finish in the update POST where the server offers it (one server, one update)
    finish = finish_in_update(
        s.client,
        s.caps,
        r.version,
        reset=s.commit_plan.reset,
        paused=lambda: servers.paused,
        single=len(r.plan.turns) == 1 and r.before_commit is None,
    )
    # Its failure surfaces from open_round, which awaits it. None too where the start rides
    # on the update (the round in one request: ``servers.one_request``).
    early = send_early(s, r, pause, finish, servers)
    control = RoundControl(lambda: open_round(s, r, pause, early, servers), early)
    own: dict[str, str] | None = {} if s.verifier is not None else None
    sending = Transmission(
        payloads,
        control,
        own,
        clock,
        go_accepts(s.client, early),
        None if finish is None else finish.post,
        servers.one_request,
    )
    try:
        # Fails before the start: nothing on the workers. After it: the servers are in a
        # round that gets no more bytes (the reference server's lease aborts it).
        sent = transfer(r, sending)
        # A failed finish: not committed. A failed cache reset after it: committed.
        commit(s, r, pause, servers, clock, finish)
        # Fails: committed (the digests are compared after the finish).
        report = verify(s, r, own, clock)
    except BaseException as exc:
        s.failed_first.failed(exc)  # before recover's calls, which a shutdown may meet
        recover(s, pause, early, servers, exc, end, version=r.version)
        raise
    if end is not None:
        end.committed(r.version)
    return RoundMetrics(
        r.version,
        sent.nbytes,
        len(r.metas),
        sent.sends,
        reused,
        seconds=clock.seconds,
        verify=report,
        dense_bytes=sent.nbytes,
        http_calls=http_calls_since(calls, s.client),
    )


def prepare(s: Session, r: Round, clock: PhaseClock) -> tuple[list[dict[str, Any]], bool]:
    """Each turn's update info, and whether every turn's metadata was left out (the workers
    hold it). What the workers hold is unknown from here until the finish succeeds."""
    reused = False
    payloads = r.payloads
    if payloads is None:
        with clock("metadata"):
            payloads, reused = _payloads(s, r)
    for turn in r.plan.turns:
        s.sent.pop(SentKey(r.draft, turn.src), None)
    return payloads, reused


def send_early(
    s: Session,
    r: Round,
    pause: RoundPause,
    finish: FinishInUpdate | None = None,
    servers: _Servers | None = None,
) -> EarlyStart | None:
    """The pause's and the start's round trips overlap the round's set-up; the start still
    goes only after the pause returned. With the round guard, the guard is held first
    (requests are refused with its reason); with verify, the checker's snapshot goes first
    (its calls keep one order): neither starts early. ``None``: ``open_round`` sends them,
    or the start (with its pause) rides on the update that carries the finish (``finish``:
    the round in one request, ``early.one_request``; ``servers.one_request`` set)."""
    if not r.early_pause or pause.mode is None or pause.guard or s.verifier is not None:
        return None
    mode, http_s = pause.mode, s.info.timeouts.http_s
    # one call (the reference server's offer)
    if not r.draft and starts_with_pause(s.client, s.caps):
        if (
            servers is not None
            and finish is not None
            and writes_a_byte(r)
            and one_request(s.client, s.caps, r.sender, finish)
        ):
            finish.start_in_update(mode)
            servers.one_request = True
            return None
        both = s.client.pause_and_start  # type: ignore[attr-defined]
        return EarlyStart(None, lambda: both(mode), http_s)
    together = pause_beside_start(s)
    return EarlyStart(lambda: s.pause(mode), _start_call(s, r), http_s, together=together)


def writes_a_byte(r: Round) -> bool:
    """The round puts at least one byte on the wire. A round of one request needs one: its
    data path hears the workers' word (``Outgoing.heard``) at its first chunk with bytes, and
    a round of empty tensors has none, so ``begin`` would wait for the request's answer while
    the workers wait for the trainer (``weightwire_ipc``'s release-after-round ``unmapped``,
    sent once ``begin`` returned): the round would hang until a timeout. Such a round keeps
    its start as a call of its own."""
    return any(m.nbytes for turn in r.plan.turns for m in turn.metas)


def pause_beside_start(s: Session) -> bool:
    """The round's pause and start go out at once (``trainer.early``: ``together``): both must
    be in effect before the first byte lands, and a plugin worker's start touches no weight.
    A stock worker's start opens vLLM's layerwise reload: there the pause comes first. No
    data path writes into the serving parameters before ``begin`` returned (both answered:
    ``RoundSender.send``)."""
    return not s.backend.caps.stock_receiver


def _start_call(s: Session, r: Round) -> Callable[[], object]:
    return s.client.start_draft_weight_update if r.draft else s.client.start_weight_update


def open_round(
    s: Session, r: Round, pause: RoundPause, early: EarlyStart | None, servers: _Servers
) -> None:
    """The control plane, run by the wire before its first byte: [verify snapshot] ->
    [round guard] -> [pause] -> start (or, sent early, await them; or, riding on the
    update, count them as sent: the data path sends that request right after)."""
    if servers.one_request:  # the request pauses first, and counts as a held pause once sent
        servers.paused = servers.started = True
        return
    if early is not None:
        early.wait()  # on error: ``recover`` asks it what went out
        servers.paused, servers.started = early.paused, True
        return
    if s.verifier is not None:
        s.verifier.before_round(s.client)  # a failure here sent nothing
    servers.held = hold_guard(s.client, pause, r.version)  # refusing, with the reason
    if pause.mode is None:
        servers.started = True  # from here the workers may hold part of the round
        _send_start(s, _start_call(s, r))
        return
    mode = pause.mode
    if not pause_beside_start(s):
        servers.paused = s.pause(mode)
        servers.started = True
        _send_start(s, _start_call(s, r))
        return
    # Both at once (``pause_beside_start``), each awaited: a failed one fails the round.
    both = EarlyStart(
        lambda: s.pause(mode), _start_call(s, r), s.info.timeouts.http_s, together=True
    )
    try:
        both.wait()
    except BaseException as exc:
        paused, started, opened = both.abandon()
        servers.paused, servers.started = paused, started
        if may_have_opened(s, started, opened) and s.broken is None:
            s.broken = exc  # a round open on the servers that gets no bytes
        raise
    servers.paused, servers.started = both.paused, True


def may_have_opened(s: Session, started: bool, opened: bool) -> bool:
    """A round's start may have opened a round on some server: it answered success, or it went
    to several servers and failed. One server's refusal says nothing of another's start,
    which may have opened its round, or still may (the client raises the first error without
    waiting for the rest): that round gets no bytes, and its server refuses the next round's
    start until its lease ends it (was: the engine was kept, and each following round failed
    on "a weight update is already active", opening a round wherever it could)."""
    return opened or (started and not one_server(s.client))


def _send_start(s: Session, start: Callable[[], object]) -> None:
    """The round's start, in line: a failure that may have opened a round on some server
    (``may_have_opened``) marks the engine broken."""
    try:
        start()
    except BaseException as exc:
        if may_have_opened(s, True, False) and s.broken is None:
            s.broken = exc
        raise


def transfer(r: Round, t: Transmission) -> Sent:
    """The wire's turns (control first), ``update_weights`` beside its broadcasts."""
    t.clock.seconds["control"] = 0.0  # booked from inside the transfer (listed first)
    with t.clock("transfer"):
        return r.wire.transfer(t)


def commit(
    s: Session,
    r: Round,
    pause: RoundPause,
    servers: _Servers,
    clock: PhaseClock,
    finish: FinishInUpdate | None = None,
) -> None:
    """Finish + the caches reset (beside the finish when nothing generates until the
    resume), then [resume], then [release the guard: it checks the workers are whole].
    A round whose update POST carried its finish (``finish.posted``) committed with it: only
    its answers are read here."""

    def recorded() -> None:
        # committed: the next automatic version moves on even if a check fails
        _record(s, r)
        servers.committed = True

    with clock("finish"):
        if r.before_commit is not None:  # an overlapped round that shutdown stopped
            r.before_commit()
        try:
            servers.finishing = True
            if finish is not None and finish.posted:
                resumed = finish.committed(recorded)
            else:
                resumed = s.commit_plan.commit(
                    s.client,
                    r.version,
                    caps=s.caps,
                    record=recorded,
                    paused=servers.paused,
                    timeout=s.info.timeouts.http_s,
                )
            if servers.paused:
                servers.paused = False
                if not resumed:  # else the finish resumed them (the reference server's offer)
                    s.client.resume()
        except WeightSyncError as exc:
            if exc.route == RESUME.name and servers.committed:
                # A server answered the resume and refused it (an older server asleep, a
                # stock one): asking again gets the same answer, so it is not re-sent.
                servers.paused = False
                logger.error(
                    "round %r committed on every server (the model is whole), but its resume "
                    "was refused: %s. Generation stays paused there until POST /resume "
                    "succeeds",
                    r.version,
                    exc,
                )
            raise
        servers.held = release_guard(s.client, pause)
        if pause.guard:
            s.guard_left_held = False


def _record(s: Session, r: Round) -> None:
    for turn in r.plan.turns:
        key = SentKey(r.draft, turn.src)
        if r.delta:  # never reused (its patches are described in full), so
            s.sent.pop(key, None)  # not kept: a delta round's metadata is never a later one's
        else:
            s.sent[key] = turn.metas
    s.rounds += 1


def verify(
    s: Session, r: Round, own: dict[str, str] | None, clock: PhaseClock
) -> VerifyReport | None:
    """[verify: every slice's digests against the servers'] (``VerifyError(committed=True)``)."""
    if s.verifier is None or own is None:
        return None
    with clock("verify"):
        return verify_union(
            s.verifier, s.client, r.plan, r.wire.digests(own), r.version, draft=r.draft
        )


def recover(
    s: Session,
    pause: RoundPause,
    early: EarlyStart | None,
    servers: _Servers,
    exc: BaseException,
    end: RoundEnd | None,
    version: str = "",
) -> None:
    """A failed round: undo what it did to the servers, as far as is safe; the caller raises."""
    committed = was_committed(exc) or servers.committed
    if servers.one_request and start_opened_nothing(exc):
        # The request's start was refused by its checks, before its pause, or failed at its
        # pause, which it undid: nothing paused by it, nothing started (the data path wrote
        # nothing: ``Transfer`` kept the engine).
        servers.paused = servers.started = False
    refused: BaseException | None = None  # a start that carried the pause, and failed
    if early is not None and not servers.started:
        # Failed before the control plane returned: no start goes out from now on. One that
        # went out (whatever it answered) counts: the round failed after its start. Else
        # nothing reached the workers, so a pause that held is undone.
        paused, started, opened = early.abandon()
        servers.paused, servers.started = paused, started
        if early.start_pauses and started and not opened:
            refused = early.start_error
        if paused and not started:
            servers.paused = False
            best_effort_resume(s.client)
        if may_have_opened(s, started, opened) and s.broken is None:
            # The servers hold a round this trainer will send nothing more into (the
            # reference server's lease aborts it; a stock worker may have begun a reload):
            # like a round that failed after its first byte, the engine needs a new init.
            # (A start that failed on its one server opened nothing: as in line, the engine
            # stays usable.)
            s.broken = exc
    if end is not None:
        end.failed(exc, committed=committed)
    if not committed and servers.finishing and not servers.held:
        # Held here (not the pause's guard): only a commit releases it; the pause's rule
        # below still resumes a round paused as a whole, behind the guard.
        guard_split_commit(s, pause, version)
    if committed:
        # Committed: the model is whole, so a round paused as a whole resumes.
        if servers.paused:
            best_effort_resume(s.client)
        if servers.held:
            _release_whole(s.client, pause)
    elif servers.paused or servers.held:
        # Not committed: the pause's own rule (``gating``): a round applied in place may
        # have left the workers part-written, so it stays paused / guarded.
        after_failed_round(s.client, pause, refused_start=refused)


def guard_split_commit(s: Session, pause: RoundPause, version: str) -> bool:
    """A finish that failed: a server's workers may be ranks of one model (tensor or
    pipeline parallel), each committing on its own, so those that committed hold the new
    round beside ranks that kept the old one (each of those says so: ``weightwire_round_state``
    answers not whole). Where the servers run the round guard it is held, then released only
    if every worker is whole (data-parallel replicas, a finish that failed on every rank);
    else it stays held (requests refused, saying why) until a round commits. Returns whether
    the guard is held now. Without the guard, a sliced session's (its workers are known to be
    ranks of one model) logs an error: the model is served as the ranks hold it."""
    if pause.guard or s.backend.caps.stock_receiver:
        # held for the whole round: its own rule (``after_failed_round``); a stock receiver
        # cannot tell the guard whether its weights are whole
        return False
    split = s.slicing is not None and s.slicing.split
    if s.guard is None and not split and reference_server(s.client):
        s.guard = False  # it refuses generation itself while a replica's model is incomplete
    if not (s.caps.round_guard and s.guard_installed()):
        if not split:
            return False
        logger.error(
            "round %r failed at its commit on workers that each hold a slice of the model: "
            "any that committed serve the new round beside ranks that did not, and "
            "the servers run no round guard to refuse requests meanwhile (start vLLM with "
            "--middleware %s); send a complete round",
            version,
            MIDDLEWARE,
        )
        return False
    try:
        s.client.hold_round(version)  # type: ignore[attr-defined]
    except Exception as exc:
        logger.error("could not hold the round guard after a failed commit: %s", exc)
        return False
    try:
        s.client.release_round(resume=False)  # type: ignore[attr-defined]
    except Exception as exc:
        s.guard_left_held = True
        logger.error(
            "round %r failed at its commit, and some of a model's ranks hold it while others "
            "kept the previous one: the servers refuse requests that "
            "run the model, saying why (%s), until a complete round commits",
            version,
            exc,
        )
        return True
    return False


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


def _payloads(s: Session, r: Round) -> tuple[list[dict[str, Any]], bool]:
    """Each turn's update info; the metadata alone is left out of a turn whose slice the
    workers already hold (``reuse_metadata``). ``True`` when every turn was."""
    assert s.features is not None
    payloads, reused = [], True
    extra = dict(r.fields)
    for turn in r.plan.turns:
        # a delta round's patches name their wire tensors: never the shorthand (nor compared)
        same = not carries_patches(extra) and s.features.reuse_metadata
        same = same and s.sent.get(SentKey(r.draft, turn.src)) == turn.metas
        reused &= same
        # One construction, one validation (a delta round lists hundreds of wire tensors);
        # the round's fields override, as they did replacing a built info's
        listing = {} if same else _listing(turn.metas)
        payloads.append(UpdateInfo(**{"src": turn.src, **listing, **extra}).to_dict())
    return payloads, reused


def _listing(metas: Sequence[ParamMeta]) -> dict[str, Any]:
    """A turn's tensors as the update info lists them (``UpdateInfo.from_metas``' fields).
    The shapes are the metas' own tuples (JSON writes them as lists): no object per tensor,
    where a list each was a delta round's hundreds of objects the young collections during
    the round promoted towards a full one (#49)."""
    if isinstance(metas, MetaRows):  # a delta round's rows: read, no meta made
        return {
            "names": list(metas.names),
            "dtype_names": list(metas.dtypes),
            "shapes": list(metas.shapes),
        }
    return {
        "names": [m.name for m in metas],
        "dtype_names": [m.dtype for m in metas],
        "shapes": [m.shape for m in metas],
    }


def carries_patches(fields: Mapping[str, Any] | None) -> bool:
    """Whether a round's update-info ``fields`` make it a delta round (it carries patches)."""
    return bool((fields or {}).get("patches"))


class _Began:
    """``control``, then ``began`` (the other sending processes may start)."""

    def __init__(self, control: Control, began: Callable[[], None]) -> None:
        self._control, self._began = control, began

    def __call__(self) -> None:
        self._control()
        self._began()

    def ready(self) -> None:
        self._control.ready()

    def release(self) -> None:
        self._control.release()


def send_update(
    s: Session,
    t: Transmission,
    chunks: Iterator[Any],
    metas: Sequence[ParamMeta],
    *,
    sender: RoundSender | None = None,
) -> Sent:
    """Rank 0 alone: its one update POST beside the broadcast of ``chunks`` (``sender``: another
    data path than the session's, a sliced round's); a failure that leaves the link unusable
    marks the session broken."""
    trace("transfer>")
    sender = s.sender if sender is None else sender
    assert sender is not None
    payload, control = t.sole_payload, t.control
    post = s.client.update_weights if t.post_update is None else t.post_update
    step = Transfer(
        s.link,
        sender,
        post_update=lambda: post(payload),
        control=control,
        clock=t.clock,
        http_s=s.info.timeouts.http_s,
        go_accepts=t.go_accepts,
        ready=control.release,
        finishes=t.post_update is not None,
        one_request=t.one_request,
        failed=s.failed_first.failed,
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
