"""``MultiSource``: rounds with several broadcasting trainer ranks (see ``broadcast_plan``).

The engine hands its rounds to this helper when it was built with a ``TrainerGroup``.
Every rank runs the same steps:

1. ``connect``: all ranks agree on the plan (metadata digest, each rank's local
   errors, rank 0's worker count) over the group. With several broadcasters each
   non-zero broadcaster opens its own TCP star (``TCPRendezvous``) and publishes the
   endpoint; rank 0 posts one init info listing them all (``TCPInitInfo.sources``),
   ``rank_offset`` = the group's trainer ranks, and every worker dials every star.
2. ``send``: agree again (metadata may change between rounds), then every rank
   iterates its source once, in lockstep (turn order is metadata order, rule 3 of
   ``broadcast_plan``). Rank 0 runs ``start``, one ``update_weights`` per turn with its
   ``src`` (sequentially, on a side thread), then ``finish``; each broadcaster sends
   its own slice on its own star while its turn's request is receiving. Rank 0
   publishes the verdict; the other ranks return or raise with it.

Failure rules: every cross-rank wait is bounded (``GroupTimeout`` names the rank); a
failed turn names its broadcaster (rank and ``src``) and that rank's own error when it
reported one; any failure leaves the engine broken on every rank, like a failed
single-sender round. Only host pipelines (``weightwire_tcp``) run several
broadcasters; a single-broadcaster plan goes through the engine's ordinary path.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, cast

from weightwire.control.fanout import spawn
from weightwire.shared.communicator import Communicator
from weightwire.shared.errors import RoundError
from weightwire.shared.framing import Chunk, plan
from weightwire.shared.info import TCPInitInfo, UpdateInfo
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
from weightwire.trainer.gating import server_features
from weightwire.trainer.group import Exchange, GroupTimeout, TrainerGroup
from weightwire.trainer.metrics import PhaseClock, RoundMetrics
from weightwire.trainer.pipelines import HostPipeline, chunked
from weightwire.trainer.transfer import await_call

if TYPE_CHECKING:
    from weightwire.trainer.engine import TrainerEngine

logger = logging.getLogger(__name__)

_GRACE_S = 2.0  # how long rank 0 waits for a failed broadcaster's own account of the failure


class RoundFailed(RoundError, RuntimeError):
    """Another trainer rank reported that this round failed; the message names it."""


class MultiSource:
    def __init__(self, engine: TrainerEngine, group: TrainerGroup) -> None:
        if not isinstance(group, TrainerGroup):
            raise TypeError(f"group must be a weightwire TrainerGroup, got {type(group).__name__}")
        if group.rank != engine.info.rank:
            raise ValueError(f"TrainerInitInfo.rank {engine.info.rank} is not the group's rank {group.rank}")
        self.engine = engine
        self.rank = group.rank
        self.x = Exchange(group)
        self._group_ranks: tuple[int, ...] | None = None
        self._planned: tuple[list[ParamMeta], BroadcastPlan] | None = None
        self._chunks: dict[int, list[Chunk]] = {}
        self._comm: Communicator | None = None  # a non-zero broadcaster's own star
        self._pipeline: HostPipeline | None = None
        self._sent: dict[tuple[bool, int], tuple[ParamMeta, ...]] = {}  # rank 0: what each src's slice is on the workers

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
                check_receiver(bplan, b.name, stock=b.stock_receiver, on_device=b.on_device,
                               verify=self.engine.info.verify)
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
        if self.rank == 0:
            def extend(payload: dict[str, Any]) -> dict[str, Any]:
                sources = [self.x.get("endpoint", r, t.connect_s) for r in bplan.group_ranks[1:]]
                out = {**payload, "rank_offset": len(bplan.group_ranks),
                       "world_size": bplan.world_size(workers), "sources": sources}
                TCPInitInfo.from_dict(out)  # validated here, before the workers see it
                return out

            self._report("joined", lambda: e._connect(extend=extend))
            self._await_all("ready", [r for r in bplan.group_ranks if r != 0], t.connect_s + t.warmup_s)
            return
        if bplan.turn_of(self.rank) is None:
            self._await_ok("joined", t.connect_s + t.http_s + t.warmup_s)
            return
        from weightwire.backends.tcp.rendezvous import TCPRendezvous

        rdv = TCPRendezvous(world_size=1 + workers, bind_host=e.info.tcp_bind_host,
                            advertise_host=e.info.tcp_advertise_host)
        try:
            self.x.post("endpoint", rdv.init_fields())  # rides the trainer's own coordination store
            comm = rdv.accept(timeout=t.connect_s)
        except BaseException as exc:
            rdv.close()
            self.x.post("ready", {"error": f"{type(exc).__name__}: {exc}"})
            raise
        try:
            comm.warmup(timeout=t.warmup_s)
        except BaseException as exc:
            comm.abort()
            self.x.post("ready", {"error": f"{type(exc).__name__}: {exc}"})
            raise
        self._comm = comm
        self._pipeline = HostPipeline(comm, e.host_bytes, num_buffers=e.info.packed_num_buffers,
                                      timeout=t.transfer_s, prefetch=e.prefetch_host)
        self.x.post("ready", {"error": None})
        self._await_ok("joined", t.http_s)

    def _report(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            out = fn()
        except BaseException as exc:
            self.x.post(name, {"error": f"{type(exc).__name__}: {exc}"})
            raise
        self.x.post(name, {"error": None})
        return out

    def _await_ok(self, name: str, timeout: float, rank: int = 0) -> dict[str, Any]:
        got = self.x.get(name, rank, timeout)
        if got.get("error"):
            raise RoundFailed(f"trainer rank {rank} failed ({name}): {got['error']}")
        return got

    def _await_all(self, name: str, ranks: list[int], timeout: float) -> None:
        for r in ranks:
            self._await_ok(name, timeout, rank=r)

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
        try:
            with clock("transfer"):
                pairs = checked_iter(iter(e.source), list(turn.metas) if turn else [], e.describe)
                if turn is not None:
                    nbytes, count = self._send_turn(turn, pairs, threading.Event())
                for _ in pairs:  # the later turns' gathers; raises on an extra tensor
                    pass
        except BaseException as exc:
            self._break(exc)
            self.x.post("status", {"error": f"{type(exc).__name__}: {exc}"})
            raise
        self.x.post("status", {"error": None})
        verdict = self._await_verdict(bplan, t)
        return RoundMetrics(verdict["version"], nbytes, len(turn.metas) if turn else 0, count, False,
                            sender=turn is not None, seconds=clock.seconds)

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
            self._break(failure)
            raise failure
        return verdict

    def _send_turn(self, turn: Turn, pairs: Iterator[tuple[str, Any]], stop: threading.Event,
                   pipeline: HostPipeline | None = None) -> tuple[int, int]:
        pipeline = pipeline or self._pipeline
        assert pipeline is not None
        # islice: the pipeline must not pull past this turn (the next item may be a
        # later turn's gather, which can wait on a broadcaster blocked until its turn).
        mine = itertools.islice(pairs, len(turn.metas))
        begin = None if turn.rank == 0 else (lambda: self._await_go(turn))
        return pipeline.send(chunked(mine, self._chunks[turn.src]), stop, begin)

    def _await_go(self, turn: Turn) -> None:
        """A broadcaster's first byte waits for its turn's request (its first chunk is
        packed meanwhile): bytes queued behind earlier turns would run down the
        per-broadcast timeout for as long as those turns take."""
        t = self.engine.info.timeouts
        go = self.x.get(f"go{turn.src}", 0, t.http_s * (turn.src + 1) + t.transfer_s)
        if not go:
            raise RoundFailed(f"trainer rank 0 ended the round before the turn of rank {turn.rank} (src {turn.src})")

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
        stop = threading.Event()
        self._went: set[int] = set()
        self._go_lock = threading.Lock()
        failed: list[tuple[Turn, BaseException]] = []
        paused = False
        nbytes = count = 0
        try:
            with clock("control"):
                if e._pause_mode is not None:
                    paused = e._pause()
                (e.client.start_draft_weight_update if draft else e.client.start_weight_update)()
            with clock("transfer"):
                turns = spawn(lambda: self._run_turns(bplan, payloads, stop, failed), name="weightwire-turns")
                mine = bplan.turn_of(0)
                pairs = checked_iter(iter(e.source), list(mine.metas) if mine else [], e.describe)
                try:
                    if mine is not None:
                        # Several broadcasters run only on host pipelines (check_receiver refused the rest).
                        nbytes, count = self._send_turn(mine, pairs, stop, cast(HostPipeline, e._pipeline))
                    for _ in pairs:
                        pass
                except BaseException as exc:
                    if not failed:
                        failed.append((mine or bplan.turns[0], exc))
                    stop.set()
                    if e._comm is not None:
                        e._comm.abort()
                _wait(turns, t.http_s * (len(bplan.turns) + 1))
            if failed:
                raise self._turn_error(*failed[0])
            with clock("finish"):
                e.client.finish_weight_update(version)
                for turn in bplan.turns:
                    self._sent[(draft, turn.src)] = turn.metas
                e._rounds += 1
                if paused:
                    paused = False
                    e.client.resume()
        except BaseException as exc:
            self._break(exc)
            for turn in bplan.turns:  # release broadcasters still waiting for their turn
                self._go(turn, False)
            self.x.post("verdict", {"error": f"{type(exc).__name__}: {exc}", "version": None})
            if paused:
                try:
                    e.client.resume()
                except Exception as resume_exc:
                    logger.warning("resume after a failed round also failed: %s", resume_exc)
            raise
        self.x.post("verdict", {"error": None, "version": version})
        metrics = RoundMetrics(version, nbytes, len(metas), count, reused, seconds=clock.seconds)
        logger.info("%s (%d broadcasters)", metrics.summary(), len(bplan.turns))
        return metrics

    def _go(self, turn: Turn, go: bool) -> None:
        # Each key once per round (the JAX store refuses to overwrite); rank 0's own turn needs none.
        with self._go_lock:
            if turn.rank == 0 or turn.src in self._went:
                return
            self._went.add(turn.src)
        self.x.post(f"go{turn.src}", go)

    def _run_turns(self, bplan: BroadcastPlan, payloads: list[dict[str, Any]], stop: threading.Event,
                   failed: list[tuple[Turn, BaseException]]) -> None:
        """The turns' ``update_weights``, one after another (a worker receives one turn at a time)."""
        e, t = self.engine, self.engine.info.timeouts
        for turn, payload in zip(bplan.turns, payloads, strict=True):
            if stop.is_set():
                return
            self._go(turn, True)
            try:
                _wait(spawn(functools.partial(e.client.update_weights, payload), name="weightwire-update"), t.http_s)
            except BaseException as exc:
                failed.append((turn, exc))
                stop.set()
                if e._comm is not None:
                    e._comm.abort()  # rank 0's own send may be blocked on a worker that gave up
                return

    def _turn_error(self, turn: Turn, exc: BaseException) -> BaseException:
        note = ""
        if turn.rank != 0:
            try:
                status = self.x.get("status", turn.rank, _GRACE_S)
                if status.get("error"):
                    note = f"; rank {turn.rank} reported: {status['error']}"
            except GroupTimeout:
                note = f"; rank {turn.rank} did not report within {_GRACE_S:g} s (it may have died)"
        err = RoundFailed(f"turn of trainer rank {turn.rank} (src {turn.src}, {len(turn.metas)} tensors from "
                          f"{turn.metas[0].name!r}) failed: {type(exc).__name__}: {exc}{note}")
        err.__cause__ = exc
        return err

    def _break(self, exc: BaseException) -> None:
        self.engine._broken = exc
        if self._comm is not None:
            self._comm.abort()

    def shutdown(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            if self.engine._broken is not None:
                comm.abort()
            else:
                comm.close()


def _wait(future: Future, timeout: float) -> Any:
    return await_call(future, timeout, "update_weights")
