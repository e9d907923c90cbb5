"""``MultiSource``: rounds with several broadcasting trainer ranks (see ``broadcast_plan``).

The engine hands its rounds to this helper when it was built with a ``TrainerGroup``.
Every rank runs the same steps:

1. ``connect``: all ranks agree on the plan (metadata digest, each rank's local
   errors, rank 0's worker count) over the group. With several broadcasters the
   backend's ``several_broadcasters`` decides the wire. ``"stars"`` (TCP): each
   non-zero broadcaster opens its own TCP star (``TCPRendezvous``) and publishes the
   endpoint; rank 0 posts one init info listing them all (``TCPInitInfo.sources``),
   ``rank_offset`` = the group's trainer ranks, and every worker dials every star.
   ``"group"`` (NCCL): rank 0 opens one communicator of world size
   ``BroadcastPlan.world_size``, publishes the join fields (``Backend.peer_fields``)
   over the trainer group, and each broadcaster joins at its group rank
   (``Backend.join_peer``) while the workers join from ``rank_offset`` on.
2. ``send``: agree again (metadata may change between rounds), then every rank
   iterates its source once, in lockstep (turn order is metadata order, rule 3 of
   ``broadcast_plan``). Rank 0 runs ``start``, one ``update_weights`` per turn with its
   ``src`` (sequentially, on a side thread), then ``finish``. Stars: each broadcaster
   sends its own slice on its own star while its turn's request is receiving. Group:
   the turn's broadcaster broadcasts with root ``src`` and every other group rank
   receives and drops the bytes (``multi_group``). Rank 0 publishes the verdict; the
   other ranks return or raise with it. ``verify=True``: each broadcaster digests its
   slice and rank 0 checks their union (``multi_verify``).

Failure rules: every cross-rank wait is bounded (``GroupTimeout`` names the rank); a
failed turn names its broadcaster (rank and ``src``) and that rank's own error when it
reported one; any failure leaves the engine broken on every rank, like a failed
single-sender round (a failed verification after a committed round does not).
``weightwire_tcp`` and ``weightwire_nccl`` run several broadcasters (``check_receiver``);
a single-broadcaster plan goes through the engine's ordinary path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from weightwire.shared.framing import plan
from weightwire.shared.info import UpdateInfo
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import checked_iter
from weightwire.trainer.broadcast_plan import (
    BroadcastPlan,
    PlanError,
    Turn,
    check_agreement,
    check_holders,
    check_receiver,
    digest,
    plan_broadcast,
)
from weightwire.trainer.gating import after_failed_round, server_features
from weightwire.trainer.group import GroupTimeout
from weightwire.trainer.metrics import PhaseClock, RoundMetrics
from weightwire.trainer.multi_base import RoundFailed
from weightwire.trainer.multi_group import GroupWire
from weightwire.trainer.multi_star import StarWire
from weightwire.trainer.multi_verify import gather_digests, verdict_of, verify_union
from weightwire.trainer.transfer import best_effort_resume, tap

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

__all__ = ["MultiSource", "RoundFailed"]


class MultiSource(StarWire, GroupWire):
    # -- agreement ----------------------------------------------------------------------

    def _plan(self, metas: list[ParamMeta]) -> BroadcastPlan:
        if self._planned is None or self._planned[0] != metas:
            bplan = plan_broadcast(metas)
            if self._group_ranks is not None and bplan.group_ranks != self._group_ranks:
                raise PlanError(f"the broadcasting ranks changed from {list(self._group_ranks)} (at init) to "
                                f"{list(bplan.group_ranks)}; call shutdown() and trainer_init() again")
            size = self.engine.info.packed_buffer_size_bytes
            self._chunks = {t.src: plan(list(t.metas), packed=self.engine.info.packed, buffer_size_bytes=size)
                            for t in bplan.turns}
            self._planned = (list(metas), bplan)
        return self._planned[1]

    def _agree(self, name: str, metas: list[ParamMeta], extra: dict[str, Any], error: str | None,
               timeout: float) -> tuple[BroadcastPlan, list[dict[str, Any]]]:
        """Every rank's local verdict and metadata digest; every rank raises the same error."""
        bplan: BroadcastPlan | None = None
        if error is None:
            try:
                bplan = self._plan(metas)
                check_holders(bplan, self.rank, self.engine.source.held_names())
                b = self.engine._backend
                check_receiver(bplan, b.name, stock=b.caps.stock_receiver, several=b.caps.several)
            except (PlanError, ValueError, TypeError) as exc:
                error = str(exc)
        values = self.x.allgather(name, {"digest": digest(metas), "error": error, **extra}, timeout)
        for r, v in enumerate(values):
            if v["error"] is not None:
                raise PlanError(f"trainer rank {r}: {v['error']}")
        check_agreement([v["digest"] for v in values])
        assert bplan is not None
        return bplan, values

    # -- init ---------------------------------------------------------------------------

    def connect(self) -> None:
        e, t = self.engine, self.engine.info.timeouts
        self.x.step()
        metas = e.source.metadata()
        extra: dict[str, Any] = {}
        error = None
        if self.rank == 0:
            try:
                e.features = server_features(e.info, e.client)
                extra["workers"] = e.info.inference_world_size or e.client.get_world_size()
            except Exception as exc:
                error = f"asking the server: {type(exc).__name__}: {exc}"
        bplan, values = self._agree("init", metas, extra, error, t.connect_s + t.http_s)
        self._group_ranks = bplan.group_ranks
        workers = int(values[0]["workers"])
        if not bplan.multi:
            if self.rank == 0:
                self._report("joined", e._connect)
            else:
                self._await_ok("joined", t.connect_s + t.http_s + t.warmup_s)
            return
        if self._shape == "group":
            self._connect_group(bplan)
            return
        self._connect_stars(bplan, workers)

    # -- a round ------------------------------------------------------------------------

    def send(self, version: str | None, draft: bool) -> RoundMetrics:
        e, t = self.engine, self.engine.info.timeouts
        self.x.step()
        clock = PhaseClock()
        with clock("metadata"):
            metas = e.source.metadata()
            bplan, _ = self._agree("round", metas, {}, None, t.http_s)
        if not bplan.multi:
            return self._single(metas, version, clock, draft)
        if self.rank == 0:
            return self._lead(bplan, metas, version, clock, draft)
        turn = bplan.turn_of(self.rank)
        nbytes = count = 0
        digests: dict[str, str] | None = {} if e.info.verify and turn is not None else None
        try:
            with clock("transfer"):
                pairs = self._pairs(turn, digests)
                if self._shape == "group" and bplan.in_group(self.rank):
                    turns = self._group_turns(bplan)
                    nbytes, count = turns.run(pairs)
                    if turns.failed:
                        raise self._turn_error(*turns.failed[0])
                else:
                    if turn is not None:
                        nbytes, count = self._send_turn(turn, pairs, threading.Event())
                    for _ in pairs:  # the later turns' gathers; raises on an extra tensor
                        pass
        except BaseException as exc:
            self._break(exc)
            own = exc.__cause__ if isinstance(exc, RoundFailed) and exc.__cause__ is not None else exc
            self.x.post("status", {"error": f"{type(own).__name__}: {own}"})  # the cause, not its wrapper
            raise
        self.x.post("status", {"error": None, "digests": digests})
        verdict = self._await_verdict(bplan, t)
        return RoundMetrics(verdict["version"], nbytes, len(turn.metas) if turn else 0, count, False,
                            sender=turn is not None, seconds=clock.seconds)

    def _pairs(self, turn: Turn | None, digests: dict[str, str] | None) -> Iterator[tuple[str, Any]]:
        """This rank's checked stream (its own slice), digested for verify when asked."""
        e = self.engine
        metas = list(turn.metas) if turn else []
        pairs = iter(e.source)
        if not e.source.checks_own_stream(metas):  # PytreeSource checks its own passes
            pairs = checked_iter(pairs, metas, e.describe)
        return pairs if digests is None else tap(pairs, digests, e.tensor_sha256)

    def _single(self, metas: list[ParamMeta], version: str | None, clock: PhaseClock, draft: bool) -> RoundMetrics:
        """One broadcaster (rank 0): the engine's own round; the others iterate and wait."""
        e, t = self.engine, self.engine.info.timeouts
        if self.rank == 0:
            try:
                metrics = e._sender_round(metas, e._next_version(version), clock, draft)
            except BaseException as exc:
                self.x.post("verdict", {"error": f"{type(exc).__name__}: {exc}", "version": None})
                raise
            self.x.post("verdict", {"error": None, "version": metrics.version})
            return metrics
        with clock("transfer"):
            for _ in e.source:
                pass
        verdict = self._await_verdict(None, t)
        return RoundMetrics(verdict["version"], 0, len(metas), 0, False, sender=False, seconds=clock.seconds)

    def _await_verdict(self, bplan: BroadcastPlan | None, t: Any) -> dict[str, Any]:
        turns = 1 if bplan is None else len(bplan.turns)
        try:
            verdict = self.x.get("verdict", 0, t.http_s * (turns + 2) + t.transfer_s)
        except GroupTimeout as exc:
            self._break(exc)
            raise
        if verdict["error"]:
            failure = RoundFailed(f"trainer rank 0 reported the round failed: {verdict['error']}")
            if not verdict.get("committed"):  # a committed round whose check failed leaves the wire usable
                self._break(failure)
            raise failure
        return verdict

    def _lead(self, bplan: BroadcastPlan, metas: list[ParamMeta], version: str | None, clock: PhaseClock,
              draft: bool) -> RoundMetrics:
        e, t = self.engine, self.engine.info.timeouts
        assert e.features is not None
        version = e._next_version(version)
        reuse = e.features.reuse_metadata
        payloads, reused = [], True
        for turn in bplan.turns:
            same = reuse and self._sent.get((draft, turn.src)) == turn.metas
            reused &= same
            info = UpdateInfo(src=turn.src) if same else UpdateInfo(
                names=[m.name for m in turn.metas], dtype_names=[m.dtype for m in turn.metas],
                shapes=[list(m.shape) for m in turn.metas], src=turn.src)
            payloads.append(info.to_dict())
        for turn in bplan.turns:
            self._sent.pop((draft, turn.src), None)  # unknown until finish succeeds
        failed: list[tuple[Turn, BaseException]] = []
        paused = False
        nbytes = count = 0
        mine = bplan.turn_of(0)
        own: dict[str, str] | None = {} if e._verifier is not None else None
        report = None
        pause = e._round_pause(metas)
        try:
            with clock("control"):
                if e._verifier is not None:
                    e._verifier.before_round(e.client)  # a failure here sent nothing
                if pause.mode is not None:
                    paused = e._pause(pause.mode)
                (e.client.start_draft_weight_update if draft else e.client.start_weight_update)()
            with clock("transfer"):
                pairs = self._pairs(mine, own)
                if self._shape == "group":
                    nbytes, count = self._group_lead(bplan, payloads, pairs, failed)
                else:
                    nbytes, count = self._star_lead(bplan, payloads, pairs, failed)
            if failed:
                raise self._turn_error(*failed[0])
            with clock("finish"):
                def record() -> None:
                    for turn in bplan.turns:
                        self._sent[(draft, turn.src)] = turn.metas
                    e._rounds += 1

                e._commit_plan.commit(e.client, version, record=record)  # + cache reset
                if paused:
                    paused = False
                    e.client.resume()
            if e._verifier is not None and own is not None:
                with clock("verify"):
                    sent = gather_digests(self.x, bplan, own, t.http_s)
                    report = verify_union(e._verifier, e.client, bplan, sent, version, draft=draft)
        except BaseException as exc:
            verdict = verdict_of(exc)
            if not verdict["committed"]:
                self._break(exc)
            for turn in bplan.turns:  # release broadcasters still waiting for their turn
                self._go(turn, False)
            self.x.post("verdict", verdict)
            if paused and verdict["committed"]:
                best_effort_resume(e.client)  # committed (only a cache reset failed): the model is whole
            elif paused:
                after_failed_round(e.client, pause)
            raise
        self.x.post("verdict", {"error": None, "version": version})
        metrics = RoundMetrics(version, nbytes, len(metas), count, reused, seconds=clock.seconds, verify=report)
        logger.info("%s (%d broadcasters)", metrics.summary(), len(bplan.turns))
        return metrics

    def shutdown(self) -> None:
        comm, self._comm = self._comm, None
        pipeline, self._pipeline = self._pipeline, None
        if comm is not None:
            if self.engine._broken is not None:
                comm.abort()
            else:
                comm.close()
        if pipeline is not None:
            pipeline.close()  # after the communicator: no kernel may still read its buffers

