"""``TrainerEngine``: the round driver both framework engines share.

Lifecycle (every trainer rank calls each step; only rank 0 touches the wire):

1. ``trainer_init``: read the server version (feature gates) and world size; open the
   backend's rendezvous; POST the worker init info on a side thread while rank 0
   joins; warm up; then check the POST. The wire params ride in that init info.
2. ``send_weights``: plan (a stock receiver's round is checked, maybe reordered or
   refused, by the backend's ``plan_round``, before any call) -> pack the first chunk ->
   [verify snapshot] -> [pause] -> ``start_weight_update`` (``start_draft_weight_update``) ->
   ``update_weights`` on a side thread *concurrently with* the broadcasts (workers
   receive inside that request) -> ``finish_weight_update(version)`` -> the servers'
   prefix / encoder caches reset (``trainer.freshness``) -> [resume] -> [verify]. The first
   pack overlaps the start round trip; no byte is broadcast before start returned. Other
   ranks only iterate the source, so they stay in any trainer-side gathers.
3. ``shutdown``: tell the servers, close the communicator.

Step 1 is ``trainer.session.open_wire``; step 2 is the round driver
(``trainer.round.lead_round``) over a one-turn plan. The concurrency of steps 1 and 2
and its failure rules (which error is raised, what aborts what) live in
``weightwire.trainer.transfer``. A round that failed after the
first broadcast leaves the communicator aborted: the engine refuses further rounds.

Framework engines implement only the hooks of ``trainer.framework.FrameworkHooks``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, Self, cast, overload

from weightwire._trace import trace
from weightwire.backends import get_backend
from weightwire.control.fallback import with_fallback_routes
from weightwire.shared.client import EngineClient, WeightSyncClient
from weightwire.shared.errors import ConfigError, RoundError, WrongType
from weightwire.shared.meta import ParamMeta
from weightwire.shared.patches import SparsePatch
from weightwire.shared.source import WeightSource, as_source
from weightwire.shared.version import ServerFeatures
from weightwire.trainer.caps import ClientCaps
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.delta import DeltaTracker
from weightwire.trainer.delta_round import DeltaRounds
from weightwire.trainer.fp8_source import Fp8Source
from weightwire.trainer.framework import FrameworkHooks, refuse_other_framework
from weightwire.trainer.freshness import CommitPlan, commit_plan
from weightwire.trainer.gating import check_client, require_draft_model
from weightwire.trainer.group import TrainerGroup
from weightwire.trainer.metrics import PhaseClock, RoundMetrics
from weightwire.trainer.multi_source import MultiSource
from weightwire.trainer.overlap import RoundHandle, RoundWaitTimeout
from weightwire.trainer.overlapped import OverlappedRounds
from weightwire.trainer.patch_round import patch_round, refuse_patches
from weightwire.trainer.session import (
    Session,
    close_wire,
    open_wire,
    refuse_no_tensors,
    reopen_wire,
)
from weightwire.trainer.sole_round import SoleRounds, sliced_instead_of_delta
from weightwire.trainer.verify import RoundVerifier

logger = logging.getLogger(__name__)

__all__ = ["EngineBroken", "TrainerEngine"]


def with_fp8(s: Session, metrics: RoundMetrics) -> RoundMetrics:
    """``metrics`` with the FP8 part of the round (``RoundMetrics.fp8``) of an FP8 source."""
    if isinstance(s.source, Fp8Source):
        return dataclasses.replace(metrics, fp8=s.source.report())
    return metrics


class EngineBroken(RoundError, RuntimeError):
    """A previous round failed mid-transfer (communicator aborted): ``shutdown()``, then
    ``trainer_init()`` again. Also what a call of an engine that was shut down raises."""


class TrainerEngine(FrameworkHooks):
    """Shared trainer-side engine; see the module docstring for the protocol."""

    # -- construction ------------------------------------------------------------------

    def __init__(
        self, init_info: TrainerInitInfo, *, client: WeightSyncClient, source: WeightSource
    ) -> None:
        self.info = init_info
        # The optional calls are read from session.caps (probed once, below), never probed again.
        self.client = cast(EngineClient, client)
        self.source = source
        self.session = Session(
            info=init_info,
            client=self.client,
            # after ``with_fallback_routes`` (trainer_init): the calls it filled in count
            caps=ClientCaps.of(self.client),
            source=source,
            backend=get_backend(init_info.backend),
            framework=self,
            commit_plan=CommitPlan(reset=init_info.reset_prefix_cache),  # resolved by _check_client
            pause_mode=None if init_info.pause_mode == "auto" else init_info.pause_mode,
            verifier=RoundVerifier() if init_info.verify else None,
        )
        if self.session.caps.bound_waits and init_info.rank == 0:
            # A wait pause the server drains longer than this engine waits for its call would
            # outlive the round this engine already reported failed (and broke on). Only rank 0
            # of a group calls the servers: another rank's client is never touched.
            cast(Any, self.client).bound_waits(init_info.timeouts.http_s)
        self._was_displaced = False  # a server dropped our link: another trainer owns the session
        self._sole_round = SoleRounds(self.session)  # rank 0 the only broadcaster
        self._draft_confirmed = False
        self._overlapped = OverlappedRounds(  # send_weights(wait=False)
            self.session,
            self._send_blocking,
            lambda metas: self.snapshot(self.source, metas),
            self._check_usable,
        )
        self._closed = False
        # Held by a send_weights / send_patches call: a second thread's call is refused, not
        # run beside it (two rounds of one session would share its link, versions and base).
        self._calling = threading.Lock()
        self._caller: int | None = None  # the thread holding _calling (shutdown never waits on it)
        self._multi: MultiSource | None = None  # built with a TrainerGroup
        self._delta: DeltaRounds | None = None
        if init_info.delta != "off" and init_info.is_sender:
            # A receiver of patches only takes a changed tensor whole as a patch of every
            # element: never cheaper than its changed elements, so only a tensor changed
            # everywhere goes whole.
            patches_only = self.session.backend.caps.delta
            tracker = DeltaTracker(
                self.delta_kernel(),
                density=1.0 if patches_only else init_info.delta_density,
                anchor_every=init_info.delta_anchor_every,
                smaller_only=not patches_only,
            )
            self._delta = DeltaRounds(
                self.session,
                tracker,
                self._sole_round,
                lambda: reopen_wire(self.session),
                self.tensor_sha256,
            )

    @property
    def features(self) -> ServerFeatures | None:
        """What the server's version supports (rank 0, after ``trainer_init``)."""
        return self.session.features

    def __repr__(self) -> str:
        role = "sender" if self.info.is_sender else f"rank {self.info.rank}"
        rounds = self.session.rounds
        return f"{type(self).__name__}(backend={self.info.backend!r}, {role}, rounds={rounds})"

    @classmethod
    def trainer_init(
        cls,
        init_info: TrainerInitInfo,
        *,
        client: WeightSyncClient,
        source: Any = None,
        group: TrainerGroup | None = None,
    ) -> Self:
        """Rendezvous with the inference side (rank 0) and return a ready engine.

        ``group`` (a ``trainer.group.TrainerGroup``, given on every rank): the trainer's
        processes agree on the broadcast plan, and the parameters' first owners each
        broadcast their share (``trainer.multi_source``).

        ``source`` is a ``WeightSource`` or any object shaped like one (vLLM's
        ``ModuleSource``: see ``shared.source.as_source``). ``client`` needs the four
        round calls; what else it lacks is asked of its ``base_url`` when it has one
        (vLLM's ``HTTPVLLMWeightSyncClient``: see ``control.fallback``).
        """
        if not isinstance(init_info, TrainerInitInfo):
            raise WrongType(f"init_info must be a TrainerInitInfo, got {type(init_info).__name__}")
        refuse_other_framework(cls.__name__, cls.framework, source, "source")
        try:
            source = as_source(source)
        except TypeError as exc:
            raise WrongType(f"{cls.__name__}: {exc}") from None
        if init_info.is_sender:
            client = with_fallback_routes(client, timeout=init_info.timeouts.http_s)
        engine = cls(init_info, client=client, source=source)
        if init_info.is_sender:
            engine._check_client()
        if group is not None:
            if engine.session.backend.caps.local_shards:
                raise ConfigError(
                    f"backend {init_info.backend!r} sends from the devices of one process, "
                    "each its own shard: a TrainerGroup's processes cannot share its session; "
                    "give the source's arrays to one process (its devices are the trainer ranks)"
                )
            if init_info.delta != "off":
                raise ConfigError(
                    "delta rounds need one sender: a TrainerGroup's several broadcasters "
                    "send dense rounds (delta='off')"
                )
            engine._multi = MultiSource(engine.session, group, engine._sole_round)
            try:
                engine._multi.connect()
            except BaseException:
                engine._multi.close("failed its trainer_init")  # no beat outlives the engine
                raise
        elif init_info.is_sender:
            open_wire(engine.session)
        return engine

    def _check_client(self) -> None:
        s = self.session
        s.pause_mode = check_client(
            self.info, self.client, s.caps, stock_receiver=s.backend.caps.stock_receiver
        )
        s.commit_plan = commit_plan(self.info, self.client, s.caps, s.pause_mode)

    # -- a round -----------------------------------------------------------------------------

    @overload
    def send_weights(
        self,
        weight_version: str | None = None,
        *,
        draft: bool = False,
        dense: bool = False,
        wait: Literal[True] = True,
    ) -> RoundMetrics: ...

    @overload
    def send_weights(
        self,
        weight_version: str | None = None,
        *,
        draft: bool = False,
        dense: bool = False,
        wait: Literal[False],
    ) -> RoundHandle: ...

    def send_weights(
        self,
        weight_version: str | None = None,
        *,
        draft: bool = False,
        dense: bool = False,
        wait: bool = True,
    ) -> RoundMetrics | RoundHandle:
        """Push the source's current weights; every trainer rank calls this.

        Returns once every worker loaded the round and (rank 0) the servers committed
        ``weight_version`` (default: ``"1"``, ``"2"``, ... per successful round).
        ``draft=True`` opens the round with ``start_draft_weight_update``: the source's
        tensors load into the speculative draft model instead of the target.

        ``wait=False`` (an overlapped round, ``trainer.overlapped``): waits for a free slot
        (``max_rounds_in_flight``), takes a snapshot of the weights (``snapshot``) and returns a
        ``RoundHandle`` while this same round runs on the engine's round thread. A failed
        round's error is raised by its handle's ``result()`` and, if nothing raised it yet, by
        the next ``send_weights``.
        ``dense=True`` (with ``delta="auto"``): send every tensor whole this round.
        """
        with self._one_call("send_weights"):
            if not wait:
                self._refuse_closed()
                return self._send_overlapped(weight_version, draft, dense)
            return self._send_blocking(self.session.source, weight_version, draft, dense)

    @contextmanager
    def _one_call(self, what: str) -> Iterator[None]:
        """The caller's round call, refused at once (nothing sent) while another thread's
        runs: its round would interleave with that one's on the same session."""
        if not self._calling.acquire(blocking=False):
            raise ConfigError(
                f"{what} was called while another send_weights / send_patches call of this "
                f"{type(self).__name__} is running (from another thread); nothing of this call "
                "was sent. An engine runs one round at a time: call it from one thread "
                "(send_weights(wait=False) runs a round beside the training step)"
            )
        self._caller = threading.get_ident()
        closed_before = self._closed
        failed_first = self.session.failed_first
        failed_first.begin()
        try:
            yield
        except Exception as exc:
            failed_first.failed(exc)  # one that failed outside the round driver
            if closed_before or not self._closed:
                raise
            if failed_first.came_first(exc):
                # The round had failed on its own before the shutdown closed anything: its
                # error is the story; the stop only ended what its failure left.
                exc.add_note(
                    f"shutdown() was called (from another thread) while this {what} was "
                    "failing, after its error; this engine is shut down: build a new one with "
                    "trainer_init() to send again"
                )
                raise
            # shutdown() from another thread closed the link under this round: say so, not
            # only the closed link's own words (which read as a network fault).
            raise EngineBroken(
                f"{what} was stopped: shutdown() was called (from another thread) while its "
                f"round ran, and closed this trainer's link ({type(exc).__name__}: {exc}); the "
                "servers end the round uncommitted and keep the weights they committed before. "
                "Build a new engine with trainer_init() to send again"
            ) from exc
        finally:
            self._caller = None
            self._calling.release()

    def _refuse_closed(self) -> None:
        if self._closed:
            raise EngineBroken(
                f"this {type(self).__name__} was shut down, so it sends nothing more (nothing "
                "was sent); build a new engine with trainer_init()"
            )

    def _send_blocking(
        self,
        source: WeightSource,
        weight_version: str | None,
        draft: bool,
        dense: bool,
        before_commit: Callable[[], None] | None = None,
    ) -> RoundMetrics:
        """One blocking round of ``source``: the live source, or an overlapped round's snapshot
        on the round thread, whose ``before_commit`` stops it right before its finish."""
        trace("engine>")
        s = self.session
        self._refuse_closed()
        self._overlapped.settle()  # the rounds in flight land first: rounds never reorder
        try:
            self._check_usable()
        except EngineBroken:
            if self._multi is not None and not self._closed:  # (a shutdown told them)
                self._multi.leave(f"has a broken engine ({type(s.broken).__name__}: {s.broken})")
            raise
        if self._multi is not None:
            if draft and self.info.is_sender:
                assert s.features is not None
                s.features.require(
                    "draft_route", "a draft round starts with /start_draft_weight_update"
                )
            return with_fp8(s, self._multi.send(weight_version, draft))
        clock = PhaseClock()
        with clock("metadata"):
            metas = source.metadata()
        if not self.info.is_sender:
            with clock("transfer"):
                for _ in source:
                    pass
            return RoundMetrics(None, 0, len(metas), 0, False, sender=False, seconds=clock.seconds)
        refuse_no_tensors(metas)
        version = s.next_version(weight_version)
        self._check_link()
        if draft:
            self._check_draft()
        else:  # the served model is the target's: a draft model's names are its own
            s.check_fits(metas)
        if self._delta is not None and not draft and not sliced_instead_of_delta(s, metas):
            metrics = self._delta.send(
                source, metas, version, clock, dense=dense, before_commit=before_commit
            )
        else:
            metrics = self._sole_round(
                metas, version, clock, draft, source=source, before_commit=before_commit
            )
        metrics = with_fp8(s, metrics)  # an overlapped round's snapshot read it too
        logger.info("%s", metrics)  # formatted only when INFO is on
        return metrics

    # -- overlapped rounds ---------------------------------------------------------------------

    def _send_overlapped(self, weight_version: str | None, draft: bool, dense: bool) -> RoundHandle:
        if self._multi is not None:
            if self.session.broken is None and not self._closed:
                # The other ranks' blocking calls are in this round's agreement: they are
                # told now and refuse too (was: they waited out http_s for this rank).
                self._multi.refuse(
                    "its send_weights(wait=False) was refused (a TrainerGroup's rounds stay "
                    "blocking: every rank takes part in each); nothing of this round was sent. "
                    "Call send_weights() with wait=True on every rank"
                )
            raise ConfigError(
                "send_weights(wait=False) needs a single broadcaster: with a TrainerGroup "
                "every rank takes part in each round, so its rounds stay blocking; nothing of "
                "this round was sent, and the other ranks' send_weights for it were refused too"
            )
        metas = None
        if draft and self.info.is_sender:
            self._check_draft()
        elif self.info.is_sender:  # raised here, not by the handle: nothing was queued
            metas = self.session.source.metadata()  # the snapshot's too: one call, not two
            refuse_no_tensors(metas)
            self.session.check_fits(metas)
        return self._overlapped.send(weight_version, draft, dense, metas)

    def send_patches(
        self, patches: Sequence[SparsePatch], weight_version: str | None = None
    ) -> RoundMetrics:
        """Rank 0: a delta round of ``patches`` (``shared.patches.SparsePatch``, one per changed
        tensor) through a backend that takes them (stock ``sparse_nccl``); other ranks return
        at once. The trainer must be sure of the workers' weights, or the round must be an
        anchor (``trainer.patch_round``); every refusal comes before any call."""
        with self._one_call("send_patches"):
            return self._send_patches(patches, weight_version)

    def _send_patches(
        self, patches: Sequence[SparsePatch], weight_version: str | None
    ) -> RoundMetrics:
        self._check_usable()
        refuse_patches(group=self._multi is not None, delta_auto=self._delta is not None)
        if not self.info.is_sender:
            return RoundMetrics(None, 0, 0, 0, False, sender=False)
        self._check_link()
        s = self.session
        # a patch round changes what changed: the served model's other tensors stay as they are
        s.check_fits([ParamMeta(p.name, p.dtype, p.shape) for p in patches], partial=True)
        metrics = patch_round(s, patches, s.next_version(weight_version), PhaseClock())
        logger.info("%s", metrics)
        return metrics

    def _check_usable(self) -> None:
        s = self.session
        self._refuse_closed()
        if s.broken is not None:
            raise EngineBroken(
                f"a previous round failed ({type(s.broken).__name__}: {s.broken}); "
                "call shutdown() and trainer_init() again"
            ) from s.broken

    def _check_link(self) -> None:
        """Rank 0, before a round's first call: refuse if a server dropped this trainer."""
        if self._displaced():
            self._was_displaced = True
            self.session.broken = EngineBroken(
                "a server closed this trainer's data link: another trainer initialized and took "
                "the session over, or the server restarted; nothing was sent. Call trainer_init() "
                "again to take it back"
            )
            raise self.session.broken

    def _check_draft(self) -> None:
        if not self.session.backend.caps.draft:
            raise ConfigError(
                f"backend {self.info.backend!r} sends no draft rounds: its stock receiver is "
                "planned against the target model at init and refuses "
                "start_draft_weight_update; nothing was sent"
            )
        assert self.features is not None
        self.features.require("draft_route", "a draft round starts with /start_draft_weight_update")
        if not self.session.caps.start_draft_weight_update:
            raise WrongType(f"client {type(self.client).__name__} lacks start_draft_weight_update")
        if not self._draft_confirmed:
            require_draft_model(self.client, self.session.caps)
            self._draft_confirmed = True  # the server's config cannot change without a restart

    def abort_requests(self, request_ids: list[str] | None = None) -> None:
        """Rank 0: abort in-flight generation on every server without pausing
        (all when ``None``)."""
        self._refuse_closed()  # the servers' sessions may be another trainer's by now
        if self.info.is_sender:
            assert self.features is not None, "trainer_init() first"
            self.features.require("abort_route", "abort_requests posts /abort_requests")
            self.client.abort_requests(request_ids)

    # -- teardown ------------------------------------------------------------------------------

    def _displaced(self) -> bool:
        """Did a server drop this trainer's link (checked between rounds, no traffic)?"""
        if self._was_displaced:
            return True
        if self._overlapped.aborted_link:  # closed by this trainer's own shutdown, not a server
            return False
        # Not ``isinstance(link, WatchesPeer)``: a runtime Protocol check walks the protocol's
        # members every round (~15 us), this one attribute lookup says the same.
        peer_closed = getattr(self.session.link, "peer_closed", None)
        return self.session.broken is None and callable(peer_closed) and bool(peer_closed())

    def shutdown(self, *, in_flight: str = "drain", timeout: float | None = None) -> None:
        """Release the servers' engines and close the communicator (idempotent).

        Overlapped rounds still in flight are first drained (``in_flight="drain"``: each runs
        to its end) or abandoned (``"abort"``: the queued ones are never sent, the running one
        stops and its link is aborted; the servers keep their last committed weights), within
        ``timeout`` (default ``Timeouts.round_s``). A failure of theirs that nothing raised yet
        is raised after the teardown. A drain that runs out of ``timeout`` abandons what is
        left as ``"abort"`` does (a round that has not sent its finish can no longer commit)
        and raises ``RoundWaitTimeout`` after the teardown, saying what the servers hold and
        whether their session for this trainer was shut down.

        A ``send_weights`` / ``send_patches`` another thread is running is stopped, not
        waited for (only overlapped rounds are drained): the link closes under it, the servers
        end its round uncommitted (a round whose finish was already sent commits whole), and
        that call raises ``EngineBroken`` naming the shutdown; shutdown returns once that call
        has ended (at most ``Timeouts.http_s`` later). A round that had already failed on its
        own (its error caught before the shutdown began) raises that error, the shutdown
        only a note on it.

        The server call runs concurrently with the local close: neither side's
        teardown may wait on the other's. A displaced trainer (its link closed by the
        server) does not post: the server's engine belongs to another trainer now.
        """
        if self._closed:
            return
        unseen = self._overlapped.stop(in_flight, timeout)
        self.session.failed_first.stopping()  # a running call's error from now on may be ours
        self._closed = True
        if self._multi is not None:
            if self._caller is None:  # between rounds: in step
                self._multi.leave()
            self._multi.close()
        told = False
        try:
            told = close_wire(self.session, displaced=self._displaced())
            self._await_caller()
        except BaseException as exc:
            if unseen is not None:  # raised over it: what became of the rounds still shows
                exc.add_note(f"before this: {type(unseen).__name__}: {unseen}")
            raise
        finally:
            if unseen is not None and sys.exc_info()[1] is None:
                if isinstance(unseen, RoundWaitTimeout):
                    unseen.add_note(_session_after(told))
                raise unseen

    def _await_caller(self) -> None:
        """A ``send_weights`` / ``send_patches`` of another thread, stopped by the closed link:
        wait (bounded) until it has failed, so nothing of this engine runs once shutdown
        returned. Not from that call's own thread (a hook of its source), which would wait
        on itself."""
        if self._caller is None or self._caller == threading.get_ident():
            return
        bound = self.info.timeouts.http_s
        if self._calling.acquire(timeout=bound):
            self._calling.release()
        else:
            logger.warning(
                "shutdown: the round another thread is running did not end within %s s of "
                "its link closing; returning without it",
                bound,
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # Leaving on an error: the rounds still in flight are abandoned, not waited for.
        self.shutdown(in_flight="drain" if exc_type is None else "abort")


def _session_after(told: bool) -> str:
    """After a shutdown whose wait ran out: the servers' session for this trainer."""
    if told:
        return (
            "the servers shut this trainer's weight-transfer session down: nothing more of it "
            "can commit there; trainer_init() opens a new one"
        )
    return (
        "the servers were not told to shut the session down (a displaced trainer, or no "
        "shutdown route): it stays theirs until a new init replaces it"
    )
