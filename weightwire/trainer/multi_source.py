"""``MultiSource``: rounds with several broadcasting trainer ranks (see ``broadcast_plan``).

The engine hands its rounds to this helper when it was built with a ``TrainerGroup``.
Every rank runs the same steps:

1. ``connect``: all ranks agree on the plan (metadata digest, each rank's local
   errors, rank 0's worker count) over the group. With several broadcasters the
   backend's ``caps.several`` decides the wire. ``"stars"`` (TCP): each non-zero
   broadcaster opens its own star (``Backend.open_star``) and publishes the endpoint;
   rank 0 posts one init info listing them all (``Backend.with_stars``),
   ``rank_offset`` = the group's trainer ranks, and every worker dials every star.
   ``"group"`` (NCCL): rank 0 opens one communicator of world size
   ``BroadcastPlan.world_size``, publishes the join fields (``Backend.peer_fields``)
   over the trainer group, and each broadcaster joins at its group rank
   (``Backend.join_peer``) while the workers join from ``rank_offset`` on.
2. ``send``: agree again (metadata may change between rounds), then every rank iterates its
   source once, in lockstep (turn order is metadata order, rule 3 of ``broadcast_plan``).
   Rank 0 runs the round driver (``trainer.round.lead_round``) over this plan's wire
   (``MultiSource.wire``, chosen at set-up: ``StarWire`` or ``GroupWire``, its ``transfer``):
   ``start``, one ``update_weights`` per turn with its ``src`` (sequentially, on a side
   thread), then ``finish``; the other ranks run the same wire's ``follow``. Stars: each
   broadcaster sends its own slice on its own star while its turn's request is receiving
   (``multi_star``). Group: the turn's broadcaster broadcasts with root ``src`` and every
   other group rank receives and drops the bytes (``multi_group``). Rank 0 publishes the
   verdict; the other ranks return or raise with it. ``verify=True``: each broadcaster
   digests its slice and rank 0 checks their union (``multi_verify``).

Failure rules: every cross-rank wait is bounded (``GroupTimeout`` names the rank); a
failed turn names its broadcaster (rank and ``src``) and that rank's own error when it
reported one; a failure leaves the engine broken on every rank exactly where it leaves
rank 0's broken, as for a single-sender round (a start refused by its servers, a refusal
before any call or a failed verification after a committed round do not), and always after
several broadcasters' failure or a sliced round's once rank 0 told the others "go" (their
wires took part; a sliced round refused before it, no byte out, keeps them as rank 0). The
ranks name the same ``weight_version`` (or leave it to rank 0). A rank that gives up on a
round's agreement is out of step: its engine is broken, rank 0's verdict tells a late rank
at once, and a rank 0 that comes after another gave up runs no round. A rank that gives up
on rank 0's verdict does not know the outcome (rank 0 may still commit): its engine stays
usable and the next round's agreement carries rank 0's last verdict (``settled``). A rank
that shuts down, or whose engine is broken, posts the next agreement as its leaving: the others'
next round fails at once naming it; a rank that refuses a round before its agreement
(``send_weights(wait=False)``) posts its refusal as it, so every rank refuses that round at
once and stays usable. A rank whose own pass over its source fails while rank 0 sends alone
tells rank 0 at once and raises its own error: rank 0 stops the round at its next tensor
(``OwnPasses``), so it and the other ranks raise ``RoundFailed`` naming that rank, each engine
kept or broken as rank 0's (the failed rank's: by the next round's agreement).
Each rank beats while its engine lives (``group.Beat``): a rank that waits for another's part
longer than a beat looks at its beat, so a rank that died between rounds (SIGKILL, OOM) fails
the others' next round within a few beats (``group.STOPPED_AFTER_S``), ``GroupTimeout`` naming
it and since when (was: at their ``http_s``); a rank merely slow keeps beating.
``weightwire_tcp`` and ``weightwire_nccl`` run several broadcasters (``check_receiver``);
a single-broadcaster plan is the engine's own one-turn round, its verdict published.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from weightwire.backends.base import Sent
from weightwire.shared.errors import ConfigError
from weightwire.shared.framing import plan
from weightwire.shared.meta import ParamMeta
from weightwire.shared.served import ServedModel, ServedModelMismatch
from weightwire.trainer.broadcast_plan import (
    BroadcastPlan,
    PlanError,
    Turn,
    check_agreement,
    check_holders,
    check_receiver,
    digest,
    first_difference,
    plan_broadcast,
)
from weightwire.trainer.fp8_source import Fp8Source
from weightwire.trainer.gating import server_features
from weightwire.trainer.group import Exchange, GroupTimeout, TrainerGroup
from weightwire.trainer.metrics import PhaseClock, RoundMetrics
from weightwire.trainer.multi_base import PlannedBroadcast, Ranks, RoundFailed, SeveralWire
from weightwire.trainer.multi_group import GroupWire
from weightwire.trainer.multi_sliced import SeveralSlicing, slices_across
from weightwire.trainer.multi_star import StarWire
from weightwire.trainer.round import Round, lead_round
from weightwire.trainer.session import Session, open_wire, refuse_no_tensors
from weightwire.trainer.snapshot import cancellable
from weightwire.trainer.sole_round import SoleRounds, sliced_round

logger = logging.getLogger(__name__)

__all__ = ["MultiSource", "RoundFailed"]

_SKEW_S = 1.0  # how far two trainer hosts' clocks may be apart (seconds)
_LATE_S = 0.001  # a follower's look for a verdict rank 0 posted when it gave up on the agreement
_LOOK_S = 0.05  # how often rank 0, sending alone, looks whether another rank's own pass failed


def check_versions(versions: list[str | None]) -> None:
    """Every rank that names the round's ``weight_version`` names rank 0's (``versions[0]``,
    the one the servers commit); ``None``: the rank left it to rank 0. Refused on every rank
    before any call: else a rank's ``send_weights("b")`` returned the metrics of a round the
    servers committed as rank 0's ``"a"``."""
    odd = [r for r, v in enumerate(versions) if r and v is not None and v != versions[0]]
    if odd:
        named = ", ".join(f"rank {r} {versions[r]!r}" for r in odd)
        raise ConfigError(
            f"trainer ranks disagree on the round's weight_version: rank 0 {versions[0]!r}, "
            f"{named}; pass the same weight_version on every rank (or on rank 0 only)"
        )


class OwnPasses:
    """Rank 0's look, while it sends a round alone, at the other ranks' own passes over their
    sources (each posts ``pass`` once its pass ended, or failed): asked before each tensor
    of rank 0's pass (``snapshot.cancellable``), at most every ``_LOOK_S``, each read bounded
    by ``_LATE_S``. A rank whose pass failed stops rank 0's pass with ``failure()``, a
    ``RoundFailed`` naming that rank and its error, so the round fails on every rank at once
    by the usual rules (rank 0's verdict)."""

    def __init__(self, exchange: Exchange, ranks: range) -> None:
        self._exchange = exchange
        self._waiting = list(ranks)
        self._next = 0.0
        self._failed: RoundFailed | None = None

    def is_set(self) -> bool:
        if self._failed is not None:
            return True
        now = time.monotonic()
        if not self._waiting or now < self._next:
            return False
        self._next = now + _LOOK_S
        for r in list(self._waiting):
            try:
                told = self._exchange.get("pass", r, _LATE_S)
            except GroupTimeout:
                continue  # still passing (or gone: rank 0's verdict wait is its own bound)
            self._waiting.remove(r)
            if told.get("error"):
                self._failed = RoundFailed(
                    f"trainer rank {r}'s own pass over its source failed while rank 0 sent "
                    f"the round alone ({told['error']}): rank 0 stopped the round at its next "
                    "tensor, on every rank"
                )
                return True
        return False

    def failure(self) -> BaseException:
        assert self._failed is not None
        return self._failed


@dataclass(frozen=True)
class Agreement:
    """What every trainer rank agreed on: the plan, and each rank's published values."""

    plan: BroadcastPlan
    values: list[dict[str, Any]]


class MultiSource:
    """Rounds of several broadcasting ranks (the module docstring); rank 0 tells the others
    how each ended (``round.RoundEnd``)."""

    def __init__(self, session: Session, group: TrainerGroup, sole_round: SoleRounds) -> None:
        self.ranks = Ranks(session, group)
        self.session = session
        self.rank = self.ranks.rank
        self.exchange = self.ranks.exchange
        self._sole_round = sole_round  # the engine's one-turn round (rank 0, one broadcaster)
        # chosen once: the backend's way to run several broadcasters
        self.wire: SeveralWire = (
            GroupWire(self.ranks)
            if session.backend.caps.several == "group"
            else StarWire(self.ranks)
        )
        # Sliced rounds from every process (``multi_sliced``): a star each, opened at init,
        # where the source names no broadcasters (no owners: rank 0 would send alone).
        self.slicing: SeveralSlicing | None = None
        self._told = False  # rank 0: this round's verdict is posted
        self._last: dict[str, Any] | None = None
        """Rank 0: its last verdict, told in the next round's agreement (``_settle``)."""
        self._unsettled = False
        """Not rank 0: it gave up on the last round's verdict, so that round's outcome is
        unknown here until the next round's agreement tells it (``_settle``)."""
        self.settled: dict[str, Any] | None = None
        """Not rank 0: the outcome of a round whose verdict this rank gave up on, as the next
        round's agreement told it: ``version`` (committed) or ``error``."""
        # alive from here to close(): another rank's wait on this one fails within a few
        # beats once this process dies, not at its http_s
        self.exchange.start_beat()

    def close(self, why: str = "shut down its engine") -> None:
        """This rank's engine ends (its shutdown, or a failed ``trainer_init``): its beat
        stops, ending with ``why`` (a rank still waiting on it fails at once, naming it)."""
        self.exchange.stop_beat(why)

    # -- agreement ----------------------------------------------------------------------

    def _plan(self, metas: list[ParamMeta]) -> BroadcastPlan:
        x = self.ranks
        if x.planned is None or x.planned.metas != metas:
            bplan = plan_broadcast(metas)
            # every process has a star (sliced): rank 0 alone may still broadcast on its own
            sole_on_stars = self.slicing is not None and not bplan.multi
            if (
                x.group_ranks is not None
                and bplan.group_ranks != x.group_ranks
                and not sole_on_stars
            ):
                raise PlanError(
                    f"the broadcasting ranks changed from {list(x.group_ranks)} (at init) to "
                    f"{list(bplan.group_ranks)}; call shutdown() and trainer_init() again"
                )
            info = self.session.info
            chunks = {
                t.src: plan(
                    list(t.metas),
                    packed=info.packed,
                    buffer_size_bytes=info.packed_buffer_size_bytes,
                )
                for t in bplan.turns
            }
            x.planned = PlannedBroadcast(list(metas), bplan, chunks)
        return x.planned.plan

    def _agree(
        self,
        name: str,
        metas: list[ParamMeta],
        extra: dict[str, Any],
        error: str | None,
        timeout: float,
        *,
        fits: bool = False,
        sliced: bool = False,
        tensors: bool = False,
    ) -> Agreement:
        """Every rank's local verdict and metadata digest; every rank raises the same error.
        ``fits``: rank 0 checks the round against the served model (every rank's ``metas``
        are the whole round's); its own ``ServedModelMismatch`` is raised there as itself.
        ``sliced``: a plan of one broadcaster goes sliced from every process (each reads
        its own shards): rank 0 need not hold every tensor whole. ``tensors``: a round, which
        lists at least one tensor: a rank whose source lists none makes every rank raise
        ``refuse_no_tensors``' ``ConfigError`` (told through the exchange, so none waits)."""
        bplan: BroadcastPlan | None = None
        unfit: ServedModelMismatch | None = None
        none_listed = tensors and not metas
        if error is None and none_listed:
            error = "its source lists no tensors"
        if error is None and fits and self.rank == 0:
            try:
                self.session.check_fits(metas)
            except ServedModelMismatch as exc:
                unfit, error = exc, str(exc)
        if error is None:
            try:
                bplan = self._plan(metas)
                if not (sliced and not bplan.multi):
                    check_holders(bplan, self.rank, self.session.source.held_names())
                b = self.session.backend
                check_receiver(bplan, b.name, stock=b.caps.stock_receiver, several=b.caps.several)
            except (PlanError, ValueError, TypeError) as exc:
                error = str(exc)
        values = self.exchange.allgather(
            name,
            {"digest": digest(metas), "error": error, "none": none_listed, **extra},
            timeout,
        )
        gone = [v["left"] for v in values if v.get("left")]
        if gone:
            failure = RoundFailed(
                f"{gone[0]}: the group's rounds need every rank; call shutdown() and "
                "trainer_init() again on every rank"
            )
            self.ranks.break_(failure)
            raise failure
        listed_none = [r for r, v in enumerate(values) if v.get("none")]
        if listed_none:
            refuse_no_tensors([], ranks=listed_none)
        if unfit is not None:
            raise unfit
        for r, v in enumerate(values):
            if v["error"] is not None:
                raise PlanError(f"trainer rank {r}: {v['error']}")
        digests = [v["digest"] for v in values]
        differences: dict[int, str] | None = None
        if any(d != digests[0] for d in digests):  # every rank sees it: they tell their lists
            try:
                told = self.exchange.allgather(
                    f"{name}_metas", [m.to_dict() for m in metas], timeout
                )
                differences = {r: first_difference(told[0], t) for r, t in enumerate(told) if r}
            except GroupTimeout:
                pass  # the digests alone, then
        check_agreement(digests, differences)
        assert bplan is not None
        return Agreement(bplan, values)

    # -- init ---------------------------------------------------------------------------

    def connect(self) -> None:
        self._connect()
        self._share_served()

    def _share_served(self) -> None:
        """Rank 0 heard the served model at its init (``open_wire``); an ``"auto"`` FP8
        source on another rank takes its spec from it (was: refused on every rank, rank
        0's included, its metadata asked before its init could tell it)."""
        s = self.session
        if self.rank == 0:
            self.exchange.post("served", None if s.served is None else s.served.to_dict())
            return
        if isinstance(s.source, Fp8Source) and s.source.awaits_served:
            told = self.exchange.get("served", 0, s.info.timeouts.http_s)
            s.source.fit(None if told is None else ServedModel.from_dict(told, "rank 0's served"))

    def _connect(self) -> None:
        s = self.session
        t = s.info.timeouts
        self.exchange.step()
        # An FP8 source's pairs are its inner tensors quantized (the same owners): the init
        # agrees on those, since an "auto" source learns its spec only from the init's reply
        # (every round agrees on the pairs themselves).
        src = s.source
        metas = src.inner.metadata() if isinstance(src, Fp8Source) else src.metadata()
        extra: dict[str, Any] = {}
        error = None
        if self.rank == 0:
            try:
                s.features = server_features(s.info, s.client, s.caps)
                extra["workers"] = s.info.inference_world_size or s.client.get_world_size()
            except Exception as exc:
                error = f"asking the server: {type(exc).__name__}: {exc}"
        agreed = self._agree(
            "init", metas, extra, error, t.connect_s + t.http_s, sliced=slices_across(self.ranks)
        )
        bplan = agreed.plan
        self.ranks.group_ranks = bplan.group_ranks
        workers = int(agreed.values[0]["workers"])
        if not bplan.multi and slices_across(self.ranks):  # else owners' turns, as before
            self.slicing = SeveralSlicing(self.ranks)
            size = self.exchange.group.size
            every = BroadcastPlan(tuple(range(size)), tuple(Turn(r, r, ()) for r in range(size)))
            self.ranks.group_ranks = every.group_ranks
            assert isinstance(self.wire, StarWire)  # slices_across: a star per sender
            self.wire.connect(every, workers, sliced=True)
            if self.session.slicing is not None:
                self.slicing.attach(self.session.slicing)
            return
        if not bplan.multi:
            if self.rank == 0:
                self.ranks.report("joined", lambda: open_wire(s))
            else:
                self.ranks.await_ok("joined", t.connect_s + t.http_s + t.warmup_s)
            return
        self.wire.connect(bplan, workers)

    # -- a round ------------------------------------------------------------------------

    def _sliced(self, metas: list[ParamMeta], draft: bool) -> bool:
        """This round goes sliced from every process (the same answer on every rank: the
        workers' wants, the round's kind and the settings)."""
        s = self.session
        return (
            self.slicing is not None
            and s.slicing is not None
            and s.slicing.slices(metas)
            and sliced_round(s, s.slicing, draft=draft, fields=None)
        )

    def send(self, version: str | None, draft: bool) -> RoundMetrics:
        s = self.session
        if version is not None:  # a bad one fails every rank here, before any cross-rank wait
            s.next_version(version)
        self.exchange.step()
        if self.slicing is not None:
            self.slicing.new_round()
        clock = PhaseClock()
        with clock("metadata"):
            metas = s.source.metadata()
            # rank 0 publishes the round's version, the others the one they asked for
            asked = s.next_version(version) if self.rank == 0 else version
            bound = s.info.timeouts.http_s
            sliced = False
            try:
                told: dict[str, Any] = {"version": asked, "at": time.time()}
                if self.rank == 0:
                    told["last"] = self._last  # for a rank that gave up on its verdict
                sliced = bool(metas) and self._sliced(metas, draft)
                agreed = self._agree(
                    "round",
                    metas,
                    told,
                    None,
                    bound,
                    fits=not draft,
                    sliced=sliced,
                    tensors=True,
                )
                if self.rank == 0:
                    self._refuse_late(agreed.values, bound)
            except GroupTimeout as exc:
                self._gave_up(exc)
                raise
            if self._unsettled:
                self._settle(agreed.values[0].get("last"))
            check_versions([v.get("version") for v in agreed.values])
            bplan = agreed.plan
            if self.rank != 0 and (bplan.multi or self.slicing is not None):
                self._refused_already()
        if self.rank == 0:
            self.ranks.round = bplan
            self._told = False
            try:
                if not bplan.multi:
                    named = s.next_version(version)
                    if sliced or self.exchange.group.size == 1:
                        return self._sole_round(metas, named, clock, draft, self)
                    # the other ranks pass over their own sources meanwhile: one that fails
                    # stops this round at rank 0's next tensor
                    passes = OwnPasses(self.exchange, range(1, self.exchange.group.size))
                    source = cancellable(s.source, passes, passes.failure)
                    return self._sole_round(metas, named, clock, draft, self, source=source)
                metrics = lead_round(
                    s, Round(s.next_version(version), bplan, metas, self.wire, draft), clock, self
                )
            except BaseException as exc:
                if not self._told:  # refused before the round driver ran (its plan, a check)
                    self.failed(exc, committed=False)
                raise
            logger.info("%s (%d broadcasters)", metrics.summary(), len(bplan.turns))
            return metrics
        if not bplan.multi:
            sent: Sent | None = None
            with clock("transfer"):
                try:
                    if self.slicing is not None:
                        sent = self.slicing.follow(metas, draft)
                except BaseException as exc:
                    assert self.slicing is not None
                    if not self.slicing.kept_before_any_byte(exc):
                        self.ranks.break_(exc)  # aborts this star: the workers fail it now
                    raise
                if sent is None:
                    try:
                        for _ in s.source:
                            pass
                    except BaseException as exc:
                        self._own_pass_failed(exc)
                        raise
                    self.exchange.post("pass", {"error": None})  # rank 0's OwnPasses
            verdict = self._await_verdict(None)
            return RoundMetrics(
                verdict["version"],
                0 if sent is None else sent.nbytes,
                len(metas),
                0 if sent is None else sent.sends,
                False,
                sender=sent is not None,
                seconds=clock.seconds,
            )
        return self._follow(bplan, clock)

    def leave(self, why: str = "shut down its engine") -> None:
        """This rank takes part in no more rounds (its engine shuts down between rounds, or
        is broken): it posts the next round's agreement as its leaving, so another rank's
        next round fails at once naming it (was: it waited out its agreement bound,
        ``http_s``, for a rank that would never post)."""
        self.exchange.step()
        left = f"trainer rank {self.rank} {why}"
        try:
            self.exchange.post("round", {"digest": None, "error": None, "left": left})
        except Exception as exc:  # a store already gone: the others' bound still holds
            logger.debug("could not tell the group this rank left: %s", exc)

    def refuse(self, why: str) -> None:
        """This rank refuses this round before its agreement (a call the group cannot run):
        it posts the refusal as its agreement, so every other rank's same round is refused at
        once naming it (``_agree``'s ``PlanError``), and every rank stays in step and usable
        for the next round (was: they waited out ``http_s`` for this rank's post)."""
        self.exchange.step()
        try:
            self.exchange.post("round", {"digest": None, "error": why})
        except Exception as exc:  # a store already gone: the others' bound still holds
            logger.debug("could not tell the group this rank refused the round: %s", exc)

    def _own_pass_failed(self, exc: BaseException) -> None:
        """This rank's own pass over its source failed while rank 0 sends the round alone: it
        tells rank 0 at once (``OwnPasses``: rank 0 stops the round at its next tensor, and
        every other rank raises rank 0's ``RoundFailed`` naming this rank), then raises its own
        error at once, the round's outcome as a note on it: rank 0's verdict where it was
        posted already, else told by the next round's agreement (``_settle``, which breaks
        this engine where rank 0 broke its own). Was: this rank waited for rank 0's verdict
        (``http_s`` x 3 + ``transfer_s``) while rank 0 sent on, unaware."""
        why = f"{type(exc).__name__}: {exc}"
        try:
            self.exchange.post("pass", {"error": why})
        except Exception as lost:  # the store is gone: rank 0's own bounds end its round
            exc.add_note(f"trainer rank 0 could not be told ({type(lost).__name__}: {lost})")
        try:
            verdict = self.exchange.get("verdict", 0, _LATE_S)
        except GroupTimeout:
            self._unsettled = True
            exc.add_note(
                f"trainer rank {self.rank} told rank 0, which stops the round at its next "
                "tensor (every other rank raises RoundFailed naming this rank; a round whose "
                "last tensor was out already may still commit): this rank's next "
                "send_weights learns the outcome from the round's agreement "
                "(MultiSource.settled), or read the servers' weight_version "
                "(client.weight_info())"
            )
            return
        if verdict["error"]:
            exc.add_note(f"trainer rank 0 reported the round failed too: {verdict['error']}")
            self._failure(verdict)  # this engine kept or broken as rank 0's
            return
        exc.add_note(
            f"trainer rank 0 sent the round alone and the servers committed it as version "
            f"{verdict['version']!r}: only this rank's own pass over its source failed"
        )

    def _gave_up(self, exc: GroupTimeout) -> None:
        """This rank stopped waiting for the round's agreement: the ranks are out of step
        (a late one still posts this round's keys), so the engine is broken here; rank 0
        also posts the round's verdict, so a rank that arrives late learns the round
        failed at once instead of waiting out its own bound for rank 0's next step; another
        rank posts that it gave up, for a rank 0 that arrives late (``_refuse_late``)."""
        self.ranks.break_(exc)
        error = f"{type(exc).__name__}: {exc}"
        if self.rank == 0:
            self.exchange.post("verdict", {"error": error, "version": None})
        else:
            self.exchange.post("gave_up", error)

    def _refuse_late(self, values: list[dict[str, Any]], bound: float) -> None:
        """Rank 0 joined the agreement so late that a rank may have given up on it (its post
        is older than its bound, within the hosts' clock skew): that rank's word, waited for
        at most until its bound surely ran out. One that gave up has raised, so the round
        must not run (was: rank 0 ran it alone and the servers committed a round that rank
        reported failed). A rank 0 in time reads nothing."""
        skew = min(_SKEW_S, bound / 4)
        for r, v in enumerate(values):
            at = v.get("at")
            if r == 0 or not isinstance(at, (int, float)) or time.time() < at + bound - skew:
                continue
            try:
                why = self.exchange.get("gave_up", r, max(0.001, at + bound + skew - time.time()))
            except GroupTimeout:
                continue  # it read rank 0's post in time and follows the round
            raise GroupTimeout(
                f"trainer rank {r} stopped waiting for this round's agreement before rank 0 "
                f"joined it ({why}); rank 0 came more than http_s ({bound:g} s) after it"
            )

    def _refused_already(self) -> None:
        """A rank that agreed late: rank 0 may have given up on the agreement already (its
        verdict is posted); its next wait on rank 0 (a turn's or a sliced round's "go",
        the holdings' exchange) would otherwise last its whole bound. A verdict without an
        error is no refusal: rank 0, sending alone, may have committed the round before this
        rank got here (its own pass and the verdict follow as usual)."""
        try:
            verdict = self.exchange.get("verdict", 0, _LATE_S)
        except GroupTimeout:
            return  # the usual case: rank 0 is running the round
        if verdict.get("error"):
            raise self._failure(verdict)

    def _follow(self, bplan: BroadcastPlan, clock: PhaseClock) -> RoundMetrics:
        """A non-zero rank's part of a round: its own turn (if any), every other turn's
        gathers, then rank 0's verdict."""
        s = self.session
        turn = bplan.turn_of(self.rank)
        sent = Sent(0, 0)
        digests: dict[str, str] | None = {} if s.info.verify and turn is not None else None
        try:
            with clock("transfer"):
                sent = self.wire.follow(bplan, self.ranks.pairs(turn, digests))
        except BaseException as exc:
            self.ranks.break_(exc)
            own = (
                exc.__cause__ if isinstance(exc, RoundFailed) and exc.__cause__ is not None else exc
            )
            self.exchange.post(
                "status", {"error": f"{type(own).__name__}: {own}"}
            )  # the cause, not its wrapper
            raise
        self.exchange.post("status", {"error": None, "digests": digests})
        verdict = self._await_verdict(bplan)
        return RoundMetrics(
            verdict["version"],
            sent.nbytes,
            len(turn.metas) if turn else 0,
            sent.sends,
            False,
            sender=turn is not None,
            seconds=clock.seconds,
        )

    def _await_verdict(self, bplan: BroadcastPlan | None) -> dict[str, Any]:
        t = self.session.info.timeouts
        turns = 1 if bplan is None else len(bplan.turns)
        bound = t.http_s * (turns + 2) + t.transfer_s
        try:
            verdict = self.exchange.get("verdict", 0, bound)
        except GroupTimeout:
            # This rank's part is done; rank 0's may still commit the round (a longer round
            # than this bound): its outcome is unknown, not failed. The engine stays usable
            # and the next round's agreement tells the outcome (was: broken here, reported
            # failed, and the round could commit afterwards).
            self._unsettled = True
            raise GroupTimeout(
                f"trainer rank 0 did not post this round's verdict within {bound:g} s "
                f"(http_s x {turns + 2} + transfer_s): the round's outcome is unknown, it "
                "may still commit. Read the servers' weight_version (GET /weight_info, "
                "client.weight_info()), or call send_weights again: the next round's "
                "agreement tells this rank what rank 0 committed (MultiSource.settled)"
            ) from None
        if verdict["error"]:
            raise self._failure(verdict)
        return verdict

    def _settle(self, last: dict[str, Any] | None) -> None:
        """The round whose verdict this rank gave up on ended as rank 0's ``last`` verdict,
        told in this round's agreement: kept in ``settled`` and logged; a failure rank 0 did
        not survive breaks this engine as it broke rank 0's."""
        self._unsettled = False
        if not isinstance(last, dict):
            return
        self.settled = {"version": last.get("version"), "error": last.get("error")}
        if last.get("error"):
            logger.warning(
                "trainer rank %d: the previous round, whose verdict it gave up on, failed on "
                "rank 0: %s",
                self.rank,
                last["error"],
            )
            if not last.get("committed") and not last.get("kept"):
                failure = RoundFailed(
                    f"trainer rank 0 reported the previous round failed after this rank gave "
                    f"up on its verdict, and broke its engine: {last['error']}"
                )
                self.ranks.break_(failure)
                raise failure
            return
        logger.warning(
            "trainer rank %d: the previous round, whose verdict it gave up on, was committed "
            "by rank 0 as version %r",
            self.rank,
            last.get("version"),
        )

    def _failure(self, verdict: dict[str, Any]) -> RoundFailed:
        """Rank 0's verdict of a failed round, as this rank's error."""
        failure = RoundFailed(f"trainer rank 0 reported the round failed: {verdict['error']}")
        # A committed round whose check failed leaves the wire usable; so does a round rank
        # 0's engine survived (a refused start, a refusal before any call): broken here, this
        # rank would leave rank 0 waiting out its agreement bound next round.
        if not verdict.get("committed") and not verdict.get("kept"):
            self.ranks.break_(failure)
        return failure

    # -- rank 0: how the round ended (``round.RoundEnd``) ---------------------------------------

    def committed(self, version: str) -> None:
        self._told = True
        self._last = {"error": None, "version": version}
        self.exchange.post("verdict", self._last)

    def failed(self, exc: BaseException, *, committed: bool) -> None:
        self._told = True
        verdict: dict[str, Any] = {"error": f"{type(exc).__name__}: {exc}", "version": None}
        if self.slicing is not None:
            # the other processes wrote (or aborted their stars) only once told "go": before
            # it they keep their engines as rank 0 keeps its own (kept_before_any_byte)
            opened = self.slicing.in_flight and self.slicing.opened
            self.slicing.release()  # the other senders may be waiting for their "go"
            if opened and not committed:
                self.ranks.break_(exc)
        bplan = self.ranks.round
        if bplan is not None and bplan.multi:
            verdict["committed"] = committed
            if not committed:
                self.ranks.break_(exc)
            for turn in bplan.turns:  # release broadcasters still waiting for their turn
                self.ranks.go(turn, False)
        # the others keep their engines exactly when rank 0 keeps its own
        verdict["kept"] = self.session.broken is None
        self._last = verdict
        self.exchange.post("verdict", verdict)
