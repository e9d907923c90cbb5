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
   pack overlaps the start round trip; no byte is broadcast before start returned. Other ranks only iterate the source, so they stay in any
   trainer-side gathers.
3. ``shutdown``: tell the servers, close the communicator.

The concurrency of steps 1 and 2 and its failure rules (which error is raised, what
aborts what) live in ``weightwire.trainer.transfer``. A round that failed after the
first broadcast leaves the communicator aborted: the engine refuses further rounds.

Framework engines implement only ``describe``, ``host_bytes``, ``device_packer`` (and
may override ``tensor_sha256`` / ``prefetch_host``).
"""

from __future__ import annotations

import hashlib
import logging
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Self, cast

import numpy as np

from weightwire.backends.base import DevicePacker, RoundSender, SenderParts, WirePlan
from weightwire.control.errors import WeightSyncError
from weightwire.control.fallback import FallbackClient, with_fallback_routes
from weightwire.control.fanout import spawn
from weightwire.shared.client import EngineClient, WeightSyncClient
from weightwire.shared.communicator import Communicator
from weightwire.shared.errors import ControlTimeout, RoundError
from weightwire.shared.framing import Chunk, plan
from weightwire.shared.info import UpdateInfo
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource, as_source, checked_iter
from weightwire.shared.staging import round_bytes
from weightwire.shared.version import ServerFeatures
from weightwire.trainer.backends import get_backend
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.freshness import CommitPlan, StaleCacheError, commit_plan
from weightwire.trainer.gating import (
    RoundPause,
    after_failed_round,
    check_client,
    require_draft_model,
    round_pause,
    server_features,
)
from weightwire.trainer.metrics import PhaseClock, RoundMetrics
from weightwire.trainer.transfer import (
    Transfer,
    await_call,
    best_effort_resume,
    chunked,
    join_beside_init,
    real_cause,
    shutdown_when_settled,
    tap,
    tensor_stream,
)
from weightwire.trainer.verify import RoundVerifier

logger = logging.getLogger(__name__)

__all__ = ["ControlTimeout", "EngineBroken", "TrainerEngine"]  # ControlTimeout: defined in shared.errors


class EngineBroken(RoundError, RuntimeError):
    """A previous round failed mid-transfer (communicator aborted): ``shutdown()``, then ``trainer_init()`` again."""


class TrainerEngine(ABC):
    """Shared trainer-side engine; see the module docstring for the protocol."""

    # -- framework hooks ------------------------------------------------------------

    @abstractmethod
    def describe(self, tensor: Any) -> tuple[str, tuple[int, ...]]:
        """``(wire dtype name, shape)`` of a yielded tensor."""

    @abstractmethod
    def host_bytes(self, tensor: Any) -> np.ndarray:
        """The tensor's C-order little-endian bytes as a flat ``uint8`` host array."""

    def prefetch_host(self, tensors: list[Any]) -> None:
        """Start device-to-host copies of a chunk before ``host_bytes`` is called."""
        return None

    def device_packer(self, device: int | None) -> DevicePacker:
        raise NotImplementedError(f"{type(self).__name__} cannot pack on a device")

    def sender_parts(self, packer: DevicePacker | None) -> SenderParts:
        """What this engine lends a backend's data path."""
        return SenderParts(self.host_bytes, self.prefetch_host, packer)

    def tensor_sha256(self, tensor: Any) -> str:
        return hashlib.sha256(self.host_bytes(tensor).data).hexdigest()  # .data: the array's memoryview

    # -- construction ------------------------------------------------------------------

    def __init__(self, init_info: TrainerInitInfo, *, client: WeightSyncClient, source: WeightSource) -> None:
        self.info = init_info
        # The optional calls are checked by name (_check_client) or guarded where called.
        self.client = cast(EngineClient, client)
        self.source = source
        self.features: ServerFeatures | None = None
        self._backend = get_backend(init_info.backend)
        self._comm: Communicator | None = None
        self._was_displaced = False  # a server dropped our link: another trainer owns the session
        self._pipeline: RoundSender | None = None
        self._sent_metas: dict[bool, list[ParamMeta]] = {}  # per target (draft or not): what its worker holds
        self._planned: tuple[list[ParamMeta], WirePlan, list[Chunk]] | None = None
        self._verifier = RoundVerifier() if init_info.verify else None
        self._draft_confirmed = False
        self._rounds = 0
        self._broken: BaseException | None = None
        self._closed = False
        self._pause_mode = None if init_info.pause_mode == "auto" else init_info.pause_mode
        self._commit_plan = CommitPlan(reset=init_info.reset_prefix_cache)  # resolved by _check_client
        self._multi: Any = None  # trainer.multi_source.MultiSource when built with a TrainerGroup

    def __repr__(self) -> str:
        role = "sender" if self.info.is_sender else f"rank {self.info.rank}"
        return f"{type(self).__name__}(backend={self.info.backend!r}, {role}, rounds={self._rounds})"

    @classmethod
    def trainer_init(cls, init_info: TrainerInitInfo, *, client: WeightSyncClient, source: Any = None,
                     group: Any = None) -> Self:
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
            raise TypeError(f"init_info must be a TrainerInitInfo, got {type(init_info).__name__}")
        try:
            source = as_source(source)
        except TypeError as exc:
            raise TypeError(f"{cls.__name__}: {exc}") from None
        if init_info.is_sender:
            client = with_fallback_routes(client, timeout=init_info.timeouts.http_s)
        engine = cls(init_info, client=client, source=source)
        if init_info.is_sender:
            engine._check_client()
        if group is not None:
            from weightwire.trainer.multi_source import MultiSource

            engine._multi = MultiSource(engine, group)
            engine._multi.connect()
        elif init_info.is_sender:
            engine._connect()
        return engine

    def _check_client(self) -> None:
        self._pause_mode = check_client(self.info, self.client, stock_receiver=self._backend.caps.stock_receiver)
        self._commit_plan = commit_plan(self.info, self.client, self._pause_mode)

    def _connect(self, extend: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 trainer_ranks: int = 1) -> None:  # trainer_ranks > 1: broadcasters sharing one NCCL group
        t = self.info.timeouts
        self.features = server_features(self.info, self.client)
        version = self.features.version
        self._backend.check_server(self.features)
        if self.info.verify:
            self.features.require("weight_checker_route", "verify=True compares /weight_checker before and after rounds")
        world = self.info.inference_world_size or self.client.get_world_size()
        # Made before any rendezvous so a trainer without a usable device fails here,
        # not after the workers joined.
        packer = self.device_packer(self.info.device) if self._backend.caps.on_device else None
        rdv = self._backend.open(self.info, world_size=trainer_ranks + world)
        if extend is not None:  # several broadcasters: the group's fields (multi_source)
            try:
                rdv.payload = extend(rdv.payload)
            except BaseException:
                rdv.cancel()
                raise
        logger.info("rendezvous: backend=%s world_size=%d server=%s", self.info.backend, trainer_ranks + world, version)
        comm, post = join_beside_init(rdv, lambda: self.client.init_weight_transfer_engine(rdv.payload),
                                      connect_s=t.connect_s, what=self.info.backend)
        try:
            comm.warmup(timeout=t.warmup_s)
            await_call(post, t.http_s, "init_weight_transfer_engine")
            self._pipeline = self._backend.sender(comm, self.info, self.sender_parts(packer))
        except BaseException as exc:
            comm.abort()
            raise real_cause(exc, post) from None
        self._comm = comm

    # -- a round -----------------------------------------------------------------------------

    def send_weights(self, weight_version: str | None = None, *, draft: bool = False) -> RoundMetrics:
        """Push the source's current weights; every trainer rank calls this.

        Returns once every worker loaded the round and (rank 0) the servers committed
        ``weight_version`` (default: ``"1"``, ``"2"``, ... per successful round).
        ``draft=True`` opens the round with ``start_draft_weight_update``: the source's
        tensors load into the speculative draft model instead of the target.
        """
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} was shut down")
        if self._broken is not None:
            raise EngineBroken(
                f"a previous round failed ({type(self._broken).__name__}: {self._broken}); "
                "call shutdown() and trainer_init() again"
            ) from self._broken
        if self._multi is not None:
            if draft and self.info.is_sender:
                assert self.features is not None
                self.features.require("draft_route", "a draft round starts with /start_draft_weight_update")
            return self._multi.send(weight_version, draft)
        clock = PhaseClock()
        with clock("metadata"):
            metas = self.source.metadata()
        if not self.info.is_sender:
            with clock("transfer"):
                for _ in self.source:
                    pass
            return RoundMetrics(None, 0, len(metas), 0, False, sender=False, seconds=clock.seconds)
        version = self._next_version(weight_version)
        if self._displaced():
            self._was_displaced = True
            self._broken = EngineBroken(
                "a server closed this trainer's data link: another trainer initialized and took the session "
                "over, or the server restarted; nothing was sent. Call trainer_init() again to take it back"
            )
            raise self._broken
        if draft:
            assert self.features is not None
            self.features.require("draft_route", "a draft round starts with /start_draft_weight_update")
            if not callable(getattr(self.client, "start_draft_weight_update", None)):
                raise TypeError(f"client {type(self.client).__name__} lacks start_draft_weight_update")
            if not self._draft_confirmed:
                require_draft_model(self.client)
                self._draft_confirmed = True  # the server's config cannot change without a restart
        metrics = self._sender_round(metas, version, clock, draft)
        logger.info("%s", metrics)  # formatted only when INFO is on
        return metrics

    def _next_version(self, weight_version: str | None) -> str:
        version = str(self._rounds + 1) if weight_version is None else weight_version
        if not isinstance(version, str) or not version:
            raise ValueError(f"weight_version must be a non-empty str, got {weight_version!r}")
        return version

    def _sender_round(self, metas: list[ParamMeta], version: str, clock: PhaseClock, draft: bool) -> RoundMetrics:
        assert self.features is not None and self._comm is not None
        with clock("metadata"):
            wire, chunks = self._plan(metas)  # a stock worker's refusal is raised here, before any call
            reuse = self.features.reuse_metadata and self._sent_metas.get(draft) == metas
            payload = (UpdateInfo() if reuse else UpdateInfo.from_metas(wire.metas)).to_dict()
        digests: dict[str, str] | None = {} if self.info.verify else None
        paused = False
        pause = self._round_pause(wire.metas)

        def control() -> None:
            # Runs inside the transfer, once the first chunk is packed (see _transfer).
            nonlocal paused
            if self._verifier is not None:
                self._verifier.before_round(self.client)
            if pause.mode is not None:
                paused = self._pause(pause.mode)
            (self.client.start_draft_weight_update if draft else self.client.start_weight_update)()

        try:
            self._sent_metas.pop(draft, None)  # until finish succeeds, the worker's copy is unknown
            clock.seconds["control"] = 0.0  # booked from inside the transfer (listed first)
            with clock("transfer"):
                nbytes, count = self._transfer(payload, metas, wire, chunks, digests, control, clock)
            with clock("finish"):
                def record() -> None:  # committed: the next automatic version moves on even if verify fails
                    self._sent_metas[draft] = metas
                    self._rounds += 1

                # finish, then (by default) every cache of the old weights dropped before anything runs
                try:
                    self._commit_plan.commit(self.client, version, record=record)
                except StaleCacheError:
                    if paused:  # committed: the model is whole, so a round paused as a whole resumes
                        paused = False
                        best_effort_resume(self.client)
                    raise
                if paused:
                    paused = False
                    self.client.resume()
        finally:
            if paused:
                after_failed_round(self.client, pause)
        report = None
        if self._verifier is not None and digests is not None:
            with clock("verify"):
                report = self._verifier.after_round(self.client, digests, version, draft=draft)
        return RoundMetrics(version, nbytes, len(metas), count, reuse, seconds=clock.seconds, verify=report)

    def _round_pause(self, metas: list[ParamMeta]) -> RoundPause:
        """This round's pause (``gating.round_pause``; a round applied in place: refusing, no resume on failure)."""
        return round_pause(self.info, self._pause_mode, stock_receiver=self._backend.caps.stock_receiver,
                           nbytes=round_bytes(metas), client=self.client)

    def _pause(self, mode: str | None = None) -> bool:
        """Pause generation for the round; ``False`` when ``auto`` found no pause route."""
        mode = mode if mode is not None else self._pause_mode
        try:
            assert mode is not None  # callers pause only with a mode
            self.client.pause(mode)
        except WeightSyncError as exc:
            if self.info.pause_mode != "auto" or exc.status != 404:
                raise
            logger.warning("server has no /pause route (%s): rounds run under live traffic", exc)
            self._pause_mode = None
            return False
        return True

    def _plan(self, metas: list[ParamMeta]) -> tuple[WirePlan, list[Chunk]]:
        """The round's wire order and chunks; the same metadata as last round reuses its
        plan (every round of a training run, in practice: the plan is on the critical path).
        A stock ``nccl`` worker gets the checked (maybe reordered) plan, or a refusal."""
        if self._planned is not None and self._planned[0] == metas:
            return self._planned[1], self._planned[2]
        size = self.info.packed_buffer_size_bytes
        assert self.features is not None
        wire = self._backend.plan_round(metas, features=self.features, packed=self.info.packed, buffer_size_bytes=size)
        chunks = plan(wire.metas, packed=self.info.packed, buffer_size_bytes=size)
        self._planned = (list(metas), wire, chunks)
        return wire, chunks

    def _transfer(self, payload: dict[str, Any], metas: list[ParamMeta], wire: WirePlan, chunks: list[Chunk],
                  digests: dict[str, str] | None, control: Callable[[], None], clock: PhaseClock) -> tuple[int, int]:
        """The round's checked stream through the pipeline (``trainer.transfer.Transfer``)."""
        assert self._pipeline is not None
        pairs = tensor_stream(self.source)
        if not self.source.checks_own_stream(metas):  # PytreeSource checks its own passes
            pairs = checked_iter(pairs, metas, self.describe)
        if digests is not None:
            pairs = tap(pairs, digests, self.tensor_sha256)
        step = Transfer(self._comm, self._pipeline, post_update=lambda: self.client.update_weights(payload),
                        control=control, clock=clock, http_s=self.info.timeouts.http_s)
        try:
            return step.run(chunked(wire.reorder(pairs), chunks), wire.metas)
        finally:
            if step.broken is not None:
                self._broken = step.broken

    def abort_requests(self, request_ids: list[str] | None = None) -> None:
        """Rank 0: abort in-flight generation on every server without pausing (all when ``None``)."""
        if self.info.is_sender:
            assert self.features is not None, "trainer_init() first"
            self.features.require("abort_route", "abort_requests posts /abort_requests")
            self.client.abort_requests(request_ids)

    # -- teardown ------------------------------------------------------------------------------

    def _displaced(self) -> bool:
        """Did a server drop this trainer's link (checked between rounds, no traffic)?"""
        if self._was_displaced:
            return True
        probe = getattr(self._comm, "peer_closed", None)
        return self._broken is None and callable(probe) and bool(probe())

    def shutdown(self) -> None:
        """Release the servers' engines and close the communicator (idempotent).

        The server call runs concurrently with the local close: neither side's
        teardown may wait on the other's. A displaced trainer (its link closed by the
        server) does not post: the server's engine belongs to another trainer now.
        """
        if self._closed:
            return
        self._closed = True
        if self._multi is not None:
            self._multi.shutdown()
        displaced = self._displaced()
        comm, pipeline, self._comm, self._pipeline = self._comm, self._pipeline, None, None
        if comm is None:
            return
        post: Future | None = None
        if not displaced and self.features is not None and self.features.shutdown_route and hasattr(self.client, "shutdown_weight_transfer_engine"):
            transfer_s = self.info.timeouts.transfer_s
            post = spawn(lambda: shutdown_when_settled(self.client, transfer_s), name="weightwire-shutdown")
        if self._broken is not None:
            comm.abort()
        else:
            comm.close()
        if pipeline is not None:
            pipeline.close()  # after the communicator: no kernel may still read its buffers
        try:
            if post is None:
                return
            # Called from a `finally` after a failed round, the caller's own error is what
            # matters: a shutdown failure is logged, never raised over it.
            failing = sys.exc_info()[1]
            try:
                post.result(timeout=self.info.timeouts.http_s)
            except BaseException as exc:
                if failing is None:
                    raise
                logger.warning("shutdown_weight_transfer_engine failed while %s propagated: %s",
                               type(failing).__name__, exc)
        finally:
            if isinstance(self.client, FallbackClient):
                self.client.close()  # only the connections the engine opened itself

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

