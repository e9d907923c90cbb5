"""``TrainerEngine``: the round driver both framework engines share.

Lifecycle (every trainer rank calls each step; only rank 0 touches the wire):

1. ``trainer_init``: read the server version (feature gates) and world size; open the
   backend's rendezvous; POST the worker init info on a side thread while rank 0
   joins; warm up; then check the POST. The wire params ride in that init info.
2. ``send_weights``: plan (a stock ``nccl`` worker's round is checked, maybe reordered
   or refused, by ``backends.nccl.stock``, before any call) -> pack the first chunk ->
   [verify snapshot] -> [pause] -> ``start_weight_update`` (``start_draft_weight_update``) ->
   ``update_weights`` on a side thread *concurrently with* the broadcasts (workers
   receive inside that request) -> ``finish_weight_update(version)`` -> [resume] ->
   [verify]. The first pack overlaps the start round trip; no byte is broadcast before
   start returned. Other ranks only iterate the source, so they stay in any
   trainer-side gathers.
3. ``shutdown``: tell the servers, close the communicator.

Failure rules, each preventing a hang or a misleading error: a failed update POST
aborts the communicator so a broadcast blocked on a worker that gave up returns at
once; the side thread is never joined on an error path; when the data plane failed
only because the server rejected the round, the server's error is raised (it names
the real cause), not the secondary transfer error. A round that failed after the
first broadcast leaves the communicator aborted: the engine refuses further rounds.

Framework engines implement only ``describe``, ``host_bytes``, ``device_packer`` (and
may override ``tensor_sha256`` / ``prefetch_host``).
"""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Self, cast

import numpy as np

from weightwire.backends.nccl.stock import WirePlan, plan_for_stock
from weightwire.control.errors import WeightSyncError
from weightwire.control.fallback import FallbackClient, with_fallback_routes
from weightwire.control.fanout import spawn
from weightwire.shared.client import ROUND_CALLS, EngineClient, WeightSyncClient
from weightwire.shared.communicator import Communicator, TransferError, TransferTimeout
from weightwire.shared.framing import Chunk, plan
from weightwire.shared.info import UpdateInfo
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource, as_source, checked_iter
from weightwire.shared.version import ServerFeatures
from weightwire.trainer.backends import get_backend
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.gating import require_draft_model, server_features
from weightwire.trainer.metrics import PhaseClock, RoundMetrics
from weightwire.trainer.pipelines import DevicePacker, DevicePipeline, HostPipeline, chunked
from weightwire.trainer.verify import RoundVerifier

logger = logging.getLogger("weightwire.trainer")

_GRACE_S = 2.0
"""How long a failed data plane waits for the server's verdict before raising its own
(a worker that failed answers its request within milliseconds)."""


class EngineBroken(RuntimeError):
    """A previous round failed mid-transfer; the communicator is aborted."""


class ControlTimeout(TimeoutError):
    """A control-plane call (init / update POST) did not answer within ``Timeouts.http_s``."""


def _await(future: Future, timeout: float, what: str) -> Any:
    try:
        return future.result(timeout=timeout)
    except FutureTimeout:
        if future.done():  # the call itself raised a TimeoutError: that is its answer
            raise
        raise ControlTimeout(f"{what} did not return within {timeout} s") from None


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
        self._pipeline: HostPipeline | DevicePipeline | None = None
        self._sent_metas: dict[bool, list[ParamMeta]] = {}  # per target (draft or not): what its worker holds
        self._planned: tuple[list[ParamMeta], WirePlan, list[Chunk]] | None = None
        self._verifier = RoundVerifier() if init_info.verify else None
        self._draft_confirmed = False
        self._rounds = 0
        self._broken: BaseException | None = None
        self._closed = False
        self._pause_mode = None if init_info.pause_mode == "auto" else init_info.pause_mode
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
            from weightwire.trainer.multi_source import MultiSource  # noqa: PLC0415

            engine._multi = MultiSource(engine, group)
            engine._multi.connect()
        elif init_info.is_sender:
            engine._connect()
        return engine

    def _check_client(self) -> None:
        needed = list(ROUND_CALLS)
        if self.info.pause_mode == "auto":
            # Only a stock worker loads into the running model mid-round (layerwise reload puts
            # layers on the meta device: a request scheduled then crashes vLLM). The plugin
            # workers stage a round and apply it in one call at finish, so they need no pause,
            # and not pausing there means a trainer that dies mid-round cannot leave the
            # server paused with nobody to resume it.
            can_pause = all(callable(getattr(self.client, m, None)) for m in ("pause", "resume"))
            self._pause_mode = "keep" if can_pause and self._backend.stock_receiver else None
            if self._backend.stock_receiver and not can_pause:
                logger.warning("client %s cannot pause generation: rounds run under live traffic "
                               "(vLLM crashes when a request meets a layer mid-reload)", type(self.client).__name__)
        if self.info.verify:
            needed.append("weight_checker")
        if self._pause_mode is not None:
            needed += ["pause", "resume"]
        if self.info.server_version is None:
            needed.append("version")
        if self.info.inference_world_size is None:
            needed.append("get_world_size")
        missing = [m for m in needed if not callable(getattr(self.client, m, None))]
        if missing:
            raise TypeError(
                f"client {type(self.client).__name__} lacks {', '.join(missing)} (give server_version / "
                "inference_world_size in TrainerInitInfo, or drop verify / pause_mode)"
            )

    def _connect(self, extend: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        t = self.info.timeouts
        self.features = server_features(self.info, self.client)
        version = self.features.version
        self._backend.check_server(self.features)
        if self.info.verify:
            self.features.require("weight_checker_route", "verify=True compares /weight_checker before and after rounds")
        world = self.info.inference_world_size or self.client.get_world_size()
        # Made before any rendezvous so a trainer without a usable device fails here,
        # not after the workers joined.
        packer = self.device_packer(self.info.device) if self._backend.on_device else None
        rdv = self._backend.open(self.info, world_size=1 + world)
        if extend is not None:  # several broadcasters: the group's fields (multi_source)
            try:
                rdv.payload = extend(rdv.payload)
            except BaseException:
                rdv.cancel()
                raise
        post: Future[Any] = spawn(lambda: self.client.init_weight_transfer_engine(rdv.payload), name="weightwire-init")
        post.add_done_callback(lambda f: rdv.cancel() if f.exception() is not None else None)
        join = spawn(lambda: rdv.join(timeout=t.connect_s), name="weightwire-join")
        logger.info("rendezvous: backend=%s world_size=%d server=%s", self.info.backend, 1 + world, version)
        # Wait for the join, unless the POST fails first (the server refused the init
        # info: no worker will ever arrive). A POST that succeeds first is not an end.
        deadline = time.monotonic() + t.connect_s + _GRACE_S
        while not join.done() and not (post.done() and post.exception() is not None):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            wait([join] if post.done() else [post, join], timeout=remaining, return_when=FIRST_COMPLETED)
        if not join.done() and post.done() and post.exception() is not None:
            join.add_done_callback(_abort_late)  # rank 0 may still join later; release it then
            raise post.exception()  # type: ignore[misc]
        if not join.done():
            join.add_done_callback(_abort_late)
            rdv.cancel()
            raise TransferTimeout(f"rank 0 rendezvous ({self.info.backend}) did not complete within {t.connect_s} s")
        try:
            comm = join.result()
        except BaseException as exc:
            raise _real_cause(exc, post) from None
        try:
            comm.warmup(timeout=t.warmup_s)
            _await(post, t.http_s, "init_weight_transfer_engine")
            if self._backend.on_device:
                assert packer is not None
                hold = self.info.packed_buffer_size_bytes * self.info.packed_num_buffers
                self._pipeline = self._backend.device_pipeline(comm, packer, num_buffers=self.info.packed_num_buffers,
                                                               timeout=t.transfer_s, hold_bytes=hold)
            else:
                self._pipeline = HostPipeline(comm, self.host_bytes, num_buffers=self.info.packed_num_buffers,
                                              timeout=t.transfer_s, prefetch=self.prefetch_host)
        except BaseException as exc:
            comm.abort()
            raise _real_cause(exc, post) from None
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
        logger.info("%s", metrics.summary())
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

        def control() -> None:
            # Runs inside the transfer, once the first chunk is packed (see _transfer).
            nonlocal paused
            if self._verifier is not None:
                self._verifier.before_round(self.client)
            if self._pause_mode is not None:
                paused = self._pause()
            (self.client.start_draft_weight_update if draft else self.client.start_weight_update)()

        try:
            self._sent_metas.pop(draft, None)  # until finish succeeds, the worker's copy is unknown
            clock.seconds["control"] = 0.0  # booked from inside the transfer (listed first)
            with clock("transfer"):
                nbytes, count = self._transfer(payload, metas, wire, chunks, digests, control, clock)
            with clock("finish"):
                self.client.finish_weight_update(version)
                self._sent_metas[draft] = metas
                self._rounds += 1  # committed: the next automatic version moves on even if verify fails
                if paused:
                    paused = False
                    self.client.resume()
        finally:
            if paused:
                _best_effort_resume(self.client)
        report = None
        if self._verifier is not None and digests is not None:
            with clock("verify"):
                report = self._verifier.after_round(self.client, digests, version, draft=draft)
        return RoundMetrics(version, nbytes, len(metas), count, reuse, seconds=clock.seconds, verify=report)

    def _pause(self) -> bool:
        """Pause generation for the round; ``False`` when ``auto`` found no pause route."""
        try:
            assert self._pause_mode is not None  # callers pause only with a mode
            self.client.pause(self._pause_mode)
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
        if self._backend.stock_receiver:
            assert self.features is not None
            wire = plan_for_stock(metas, features=self.features, packed=self.info.packed, buffer_size_bytes=size)
        else:
            wire = WirePlan(list(metas))
        chunks = plan(wire.metas, packed=self.info.packed, buffer_size_bytes=size)
        self._planned = (list(metas), wire, chunks)
        return wire, chunks

    def _transfer(self, payload: dict[str, Any], metas: list[ParamMeta], wire: WirePlan, chunks: list[Chunk],
                  digests: dict[str, str] | None, control: Callable[[], None], clock: PhaseClock) -> tuple[int, int]:
        """The data plane with the control plane folded in.

        The pipeline prepares the first chunk, then calls ``begin``: pause + start (the
        ``control`` phase), then the update POST on a side thread; only then does the
        first byte go out. So the first chunk's packing overlaps the start round trip.
        A failure before ``begin`` finished sent nothing: the pipeline is settled and
        the engine stays usable. After it, the failure rules of the module docstring apply.
        """
        comm, pipeline, t = self._comm, self._pipeline, self.info.timeouts
        assert comm is not None  # _sender_round checked it
        stop = threading.Event()
        update: list[Future] = []

        def on_update_done(future: Future) -> None:
            if future.exception() is not None:
                # The workers gave up on this round: nothing will ever receive the
                # pending broadcast, so unblock it now instead of at its timeout.
                stop.set()
                comm.abort()

        def begin() -> None:
            started = time.perf_counter()
            try:
                control()
            finally:
                clock.shift("transfer", "control", time.perf_counter() - started)
            future = spawn(lambda: self.client.update_weights(payload), name="weightwire-update")
            future.add_done_callback(on_update_done)
            update.append(future)

        pairs = checked_iter(_stream(self.source), metas, self.describe)
        if digests is not None:
            pairs = _tap(pairs, digests, self.tensor_sha256)
        prepared = chunked(wire.reorder(pairs), chunks)
        try:
            if isinstance(pipeline, DevicePipeline):
                sent = (pipeline.send_packed(prepared, stop, begin) if self.info.packed
                        else pipeline.send_unpacked(prepared, wire.metas, stop, begin))
            else:
                assert pipeline is not None
                sent = pipeline.send(prepared, stop, begin)
            _await(update[0], t.http_s, "update_weights (after the last broadcast)")
            return sent
        except BaseException as exc:
            stop.set()
            if not update:  # nothing went on the wire: settle the local work, keep the engine
                if isinstance(pipeline, DevicePipeline):
                    try:
                        pipeline.drain()
                    except BaseException as drain_exc:
                        self._broken = drain_exc
                        comm.abort()
                raise
            self._broken = exc
            comm.abort()
            cause = _real_cause(exc, update[0])
            if cause is exc:
                raise
            self._broken = cause
            raise cause from None

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
            # The server fails an abandoned round within one broadcast timeout (its worker's
            # receive) or its round lease (the same bound): twice that, plus slack.
            wait_s = 2 * self.info.timeouts.transfer_s + _GRACE_S
            post = spawn(lambda: _shutdown_when_settled(self.client, wait_s), name="weightwire-shutdown")
        if self._broken is not None:
            comm.abort()
        else:
            comm.close()
        if isinstance(pipeline, DevicePipeline):
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


def _stream(source: WeightSource) -> Any:
    """The round's ``(name, tensor)`` stream. A source that overrides ``iter_groups``
    (``PytreeSource``: one jitted call per layer group) is driven per group, so a
    per-expert MoE costs one device dispatch per layer instead of one per tensor; any
    other source is iterated as is (the default grouping would only buffer a layer)."""
    if type(source).iter_groups is WeightSource.iter_groups:
        return iter(source)
    return (pair for group in source.iter_groups() for pair in group)


def _tap(pairs: Any, digests: dict[str, str], sha: Any) -> Any:
    for name, tensor in pairs:
        digests[name] = sha(tensor)
        yield name, tensor


def _real_cause(exc: BaseException, post: Future) -> BaseException:
    """The server's error when the data plane failed because the server gave up.

    A transfer error right after a rejected POST is a consequence; the POST's answer
    (route, status, server message) says why. Waits briefly for that answer.
    """
    if isinstance(exc, TransferError):
        try:
            post.exception(timeout=_GRACE_S)
        except FutureTimeout:
            return exc
    if post.done() and post.exception() is not None and isinstance(exc, TransferError):
        cause = post.exception()
        assert cause is not None
        cause.add_note(f"the data plane then failed: {type(exc).__name__}: {exc}")
        return cause
    return exc


_SETTLE_POLL_S = 0.05


def _shutdown_when_settled(client: EngineClient, wait_s: float) -> None:
    """``shutdown_weight_transfer_engine``, retried while the server answers 409 because it
    has not yet failed the round this trainer just abandoned (its workers notice the dead
    link within one broadcast timeout); bounded by ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.shutdown_weight_transfer_engine()
            return
        except Exception as exc:
            message = str(getattr(exc, "message", exc))
            settling = getattr(exc, "status", None) == 409 and (
                "a weight update is active" in message or "another weight operation" in message)
            if not settling or time.monotonic() + _SETTLE_POLL_S >= deadline:
                raise
        time.sleep(_SETTLE_POLL_S)


def _abort_late(join: Future) -> None:
    if join.exception() is None:
        join.result().abort()


def _best_effort_resume(client: EngineClient) -> None:
    # Called only on a failure path: the round's own error is what the caller must
    # see, so a resume failure is logged, not raised.
    try:
        client.resume()
    except Exception as exc:
        logger.warning("resume after a failed round also failed: %s", exc)
