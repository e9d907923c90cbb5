"""``Session``: what a trainer engine holds between rounds, and rank 0's wire over its life.

The engine (``trainer.engine``), the round driver (``trainer.round``) and the several-
broadcaster plan (``trainer.multi_source``) all work on one ``Session``: its fields are
the state they share, so none reads another's private attributes. ``open_wire`` is
rank 0's trainer_init step: ask the server, open the backend's rendezvous, POST the
worker init info on a side thread while rank 0 joins, warm up, build the data path.
``reopen_wire`` opens it afresh after a refused round; ``close_wire`` is ``shutdown``'s end.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from weightwire.backends.base import (
    Backend,
    DevicePacker,
    Link,
    LocalShards,
    RoundSender,
    SenderParts,
    ShardLayout,
)
from weightwire.control.fallback import FallbackClient
from weightwire.control.fanout import spawn
from weightwire.shared.client import EngineClient
from weightwire.shared.errors import ConfigError, ControlTimeout, WeightSyncError
from weightwire.shared.limits import LIMITS, bounded_repr
from weightwire.shared.meta import ParamMeta
from weightwire.shared.served import ServedModel, from_checkpoint
from weightwire.shared.slices import Box
from weightwire.shared.source import WeightSource, checked_iter
from weightwire.shared.staging import round_bytes
from weightwire.shared.version import ServerFeatures
from weightwire.trainer.caps import ClientCaps
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.fp8_source import Fp8Source
from weightwire.trainer.freshness import CommitPlan
from weightwire.trainer.gating import RoundPause, guard_installed, round_pause, server_features
from weightwire.trainer.slice_plan import Holdings
from weightwire.trainer.sliced import Slicing
from weightwire.trainer.snapshot import FailedFirst, rewrapped
from weightwire.trainer.transfer import (
    SettleWatch,
    await_call,
    beside_init,
    join_beside_init,
    real_cause,
    settle_bound,
    shutdown_when_settled,
    tap,
    tensor_stream,
)
from weightwire.trainer.verify import RoundVerifier

logger = logging.getLogger(__name__)

_HALTED_POLL_S = 5.0
"""How long a shutdown poll halted between two calls may take to raise its own verdict: it
calls nothing more, so only a stalled thread would use this."""

Extend = Callable[[dict[str, Any]], dict[str, Any]]
"""Several broadcasters: rank 0's worker init info, extended with the group's fields."""


class Framework(Protocol):
    """What the framework engine (JAX or torch) lends a session."""

    def describe(self, tensor: Any) -> tuple[str, tuple[int, ...]]: ...
    def tensor_sha256(self, tensor: Any) -> str: ...
    def device_packer(self, device: int | None) -> DevicePacker: ...
    def sender_parts(self, packer: DevicePacker | None) -> SenderParts: ...
    def flat_index(self, n: int, like: Any) -> Any: ...
    def process_rank(self) -> int: ...
    def process_count(self) -> int: ...
    def slice_holdings(self, tensors: Mapping[str, Any]) -> Holdings: ...
    def read_box(self, tensor: Any, box: Box) -> Any: ...
    def host_bytes(self, tensor: Any) -> Any: ...
    def cut_box(self, tensor: Any, box: Box) -> Any: ...
    def sliced_source(self, source: WeightSource) -> WeightSource: ...
    def local_shards(self, tensors: Mapping[str, Any], device: int | None) -> LocalShards: ...


@dataclass(frozen=True)
class SentKey:
    """Whose slice the workers hold: the round's target (draft or not) and the
    broadcaster's ``src``."""

    draft: bool
    src: int


@dataclass(eq=False, repr=False)
class Session:
    """One engine's state between rounds (every trainer rank has one)."""

    info: TrainerInitInfo
    client: EngineClient
    caps: ClientCaps
    """Which optional calls ``client`` offers: probed once, after ``control.fallback`` filled in
    what it could (``trainer_init``), and again by ``reopen_wire``."""
    source: WeightSource
    backend: Backend
    framework: Framework
    commit_plan: CommitPlan
    pause_mode: str | None
    """The session's pause mode (``auto`` resolved; ``None`` once ``auto`` found no pause route)."""
    verifier: RoundVerifier | None = None
    features: ServerFeatures | None = None
    link: Link | None = None
    """This rank's joined connection (rank 0's, or a broadcaster's own star / group member)."""
    sender: RoundSender | None = None
    broken: BaseException | None = None
    """Set when a round failed mid-transfer: the engine refuses further rounds."""
    rounds: int = 0
    sent: dict[SentKey, Sequence[ParamMeta]] = field(default_factory=dict)
    """Rank 0: what each broadcaster's slice is on the workers, until a round changes it."""
    guard: bool | None = None
    """Whether the servers run the round guard: asked at the first round applied in place,
    then known (a server's middleware changes only with a restart, like its features)."""
    guard_left_held: bool = False
    """A failed commit left the round guard held over workers that hold different rounds
    (``round.guard_split_commit``): the next round holds and releases it as a round applied
    in place does, so its commit lifts it."""
    slicing: Slicing | None = None
    """Sliced rounds' state (``trainer.sliced``): the workers' hellos, their parsed wants and
    the plan; ``None`` unless the backend asked the workers for their wants."""
    served: ServedModel | None = None
    """The tensors the served model takes, as the servers told them at init (``None``: they
    told none, e.g. stock vLLM); every round is checked against it before its first byte."""
    failed_first: FailedFirst = field(default_factory=FailedFirst, init=False)
    """Whether the running call's round failed on its own before another thread's
    ``shutdown`` stopped it (the engine raises that error, not the stop)."""
    _sized: tuple[Sequence[ParamMeta], int] | None = field(default=None, init=False)
    """The last round's tensor list and its bytes: a plan's rounds pass the same list."""

    def __repr__(self) -> str:  # the link and the client hold secrets: names only
        return (
            f"Session(backend={self.info.backend!r}, rank={self.info.rank}, rounds={self.rounds})"
        )

    def next_version(self, weight_version: str | None) -> str:
        version = str(self.rounds + 1) if weight_version is None else weight_version
        if not isinstance(version, str) or not version:
            raise ConfigError(
                f"weight_version must be a non-empty str, got {bounded_repr(weight_version)}"
            )
        most = LIMITS.max_weight_version_chars
        if len(version) > most:
            # Refused here, before the round's first call: the server would refuse it only
            # at the commit (with UPDATE_FINISHES: the update POST, the bytes on the wire).
            raise ConfigError(
                f"weight_version is {len(version)} characters, over the {most} a server takes "
                f"({bounded_repr(version)}); pass a shorter weight_version"
            )
        return version

    def stream(
        self,
        source: WeightSource,
        pairs: Iterable[tuple[str, Any]],
        metas: Sequence[ParamMeta],
        digests: dict[str, str] | None,
    ) -> Iterator[tuple[str, Any]]:
        """``pairs`` (a pass over ``source``) checked against ``metas`` (unless ``source``
        checks its own passes) and, with ``digests``, each tensor's digest recorded for the
        round's verify step."""
        out = iter(pairs)
        if not source.checks_own_stream(metas):  # PytreeSource checks its own passes
            out = checked_iter(out, metas, self.framework.describe)
        return out if digests is None else tap(out, digests, self.framework.tensor_sha256)

    def check_fits(self, metas: list[ParamMeta], *, partial: bool = False) -> None:
        """The one check of a round against the served model, before any call or byte:
        ``ServedModelMismatch`` naming each tensor missing (unless ``info.partial`` or
        ``partial``: a round of patches), unknown, or of another dtype or shape. A no-op where
        the servers told nothing."""
        if self.served is not None:
            self.served.check_round(metas, partial=partial or self.info.partial)

    def round_pause(self, metas: Sequence[ParamMeta], *, keep: bool = True) -> RoundPause:
        """This round's pause (``gating.round_pause``; a round applied in place:
        refusing, no resume on failure). ``keep=False``: a list no later round passes (a
        delta round's): its byte count is not remembered, nor the list with it (#49)."""
        sized = self._sized
        if sized is None or sized[0] is not metas:  # summed once per plan, not per round
            sized = (metas, round_bytes(metas))
            if keep:
                self._sized = sized
        return round_pause(
            self.info,
            self.pause_mode,
            stock_receiver=self.backend.caps.stock_receiver,
            nbytes=sized[1],
            client=self.client,
            caps=self.caps,
            guard=self.guard_installed,
            in_place=self.sender is not None and self.sender.in_place,
        )

    def guard_installed(self) -> bool:
        if self.guard is None:
            self.guard = guard_installed(self.client, self.caps)
        return self.guard

    def pause(self, mode: str) -> bool:
        """Pause generation for the round; ``False`` when ``auto`` found no pause route."""
        try:
            self.client.pause(mode)
        except WeightSyncError as exc:
            if self.info.pause_mode != "auto" or exc.status != 404:
                raise
            logger.warning("server has no /pause route (%s): rounds run under live traffic", exc)
            self.pause_mode = None
            return False
        return True

    def close_link(self) -> None:
        """Close (or, after a failed round, abort) the link, then free the data path."""
        link, sender, self.link, self.sender = self.link, self.sender, None, None
        if link is not None:
            if self.broken is not None:
                link.abort()
            else:
                link.close()
        if sender is not None:
            sender.close()  # after the link: no kernel may still read its buffers
        if self.slicing is not None:
            self.slicing.sender.close()  # an on-device sender's chunk buffers, likewise
        self.slicing = None


def open_wire(
    s: Session,
    extend: Extend | None = None,
    trainer_ranks: int = 1,
    *,
    several_slice: bool = False,
) -> None:
    """Rank 0 joins the workers (``trainer_ranks > 1``: broadcasters sharing one group;
    ``several_slice``: every trainer process has a star, and sliced rounds go from all of
    them, ``trainer.multi_sliced``)."""
    t = s.info.timeouts
    s.features = server_features(s.info, s.client, s.caps)
    s.backend.check_server(s.features)
    if s.info.verify:
        s.features.require(
            "weight_checker_route", "verify=True compares /weight_checker before and after rounds"
        )
    world = s.info.inference_world_size or s.client.get_world_size()
    # read before any rendezvous: a directory that is no checkpoint fails here
    checkpoint = from_checkpoint(s.info.served_checkpoint) if s.info.served_checkpoint else None
    # Made before any rendezvous so a trainer without a usable device fails here,
    # not after the workers joined; a host without what the backend needs (CuPy, a GPU)
    # is told so by the backend first, not by the framework's packer.
    s.backend.check_host()
    packer = s.framework.device_packer(s.info.device) if s.backend.caps.on_device else None
    # A backend whose trainer ranks each send their own shard takes the source's layout in
    # its init info: one pass over the source, where its tensors are held (nothing gathered).
    layout = shard_layout(s) if s.backend.caps.local_shards else None
    if layout is not None:
        rdv = s.backend.open_sharded(s.info, workers=world, layout=layout)
    else:
        rdv = s.backend.open(s.info, world_size=trainer_ranks + world)
    # The workers keep what delta rounds need (docs/delta.md); vLLM's own workers refuse
    # an init info with a field they do not know.
    if s.info.delta != "off" and not s.backend.caps.stock_receiver:
        rdv.payload = {**rdv.payload, "delta_rounds": True}
    # The workers tell their wants at the join (one sender, or a star per trainer process
    # for sliced rounds from all of them; other broadcasters' turns stay broadcasts).
    asks_wants = (
        s.info.sliced == "auto" and s.backend.caps.sliced and (extend is None or several_slice)
    )
    if asks_wants:
        rdv.payload = {**rdv.payload, "sliced": True}
    if extend is not None:  # several broadcasters: the group's fields (multi_source)
        try:
            rdv.payload = extend(rdv.payload)
        except BaseException:
            rdv.cancel()
            raise
    logger.info(
        "rendezvous: backend=%s world_size=%d server=%s",
        s.info.backend,
        trainer_ranks + world,
        s.features.version,
    )
    link, post = join_beside_init(
        rdv,
        lambda: s.client.init_weight_transfer_engine(rdv.payload),
        connect_s=t.connect_s,
        what=s.info.backend,
    )
    try:

        def warm_and_hear() -> list[bytes]:
            link.warmup(timeout=t.warmup_s)
            # Read while the init POST is still in flight: a worker that tells its wants on
            # the data plane (NCCL) may not return from its init before rank 0 took them.
            return s.backend.hellos(link, timeout=t.warmup_s) if asks_wants else []

        hellos = beside_init(post, link, warm_and_hear)
        await_call(post, t.http_s, "init_weight_transfer_engine")
        s.served = served_model(s.client, s.caps, ask_workers=not s.backend.caps.stock_receiver)
        s.served = s.served or checkpoint
        if isinstance(s.source, Fp8Source):  # its spec against the served model's FP8 linears
            s.source.fit(s.served)
        parts = s.framework.sender_parts(packer)
        if layout is not None:
            parts = replace(parts, shards=layout.shards)
        s.sender = s.backend.sender(link, s.info, parts)
        if asks_wants:
            s.slicing = Slicing(
                hellos,
                s.backend.sliced_sender(link, s.info, parts),
                several=several_slice,
                partial=s.info.partial,
            )
    except BaseException as exc:
        link.abort()
        raise real_cause(exc, post) from None
    s.link = link


def shard_layout(s: Session) -> ShardLayout:
    """The source's tensors and which box of each every trainer rank (a device of this
    process) holds, from one pass over the source left where it is held (``sliced_source``):
    nothing is gathered, and each tensor is dropped once its boxes are read (the trainer
    ranks are told by the first tensor: ``FrameworkHooks.local_shards``)."""
    metas = s.source.metadata()
    source = rewrapped(s.source, s.framework.sliced_source)
    local: LocalShards | None = None
    boxes = []
    for name, tensor in s.stream(source, tensor_stream(source), metas, None):
        if local is None:
            local = s.framework.local_shards({name: tensor}, s.info.device)
        boxes.append(local.boxes(name, tensor))
    if local is None:  # a source of no tensors: one rank, on the configured device
        local = s.framework.local_shards({}, s.info.device)
    return ShardLayout(metas, boxes, local)


def served_model(client: Any, caps: ClientCaps, *, ask_workers: bool) -> ServedModel | None:
    """What the client's servers said at init about the tensors their model takes; where
    their init reply tells nothing and the backend's workers are weightwire's
    (``ask_workers``), what those workers tell (under vLLM's own routes); a client that
    cannot tell: ``None``."""
    served = client.served_model() if caps.served_model else None
    if served is None and ask_workers and caps.workers_served_model:
        served = client.workers_served_model()
    return served


def reopen_wire(s: Session) -> None:
    """After a round the workers refused before any byte: a fresh wire to the same servers
    (what ``shutdown()`` + ``trainer_init()`` do), when the refusal aborted it."""
    if s.broken is None and s.link is not None:
        return
    if s.features is not None and s.features.shutdown_route:
        shutdown_when_settled(s.client, s.info.timeouts.transfer_s)
    s.close_link()
    s.broken = None
    s.sent.clear()  # a fresh worker engine holds no metadata to reuse
    s.caps = ClientCaps.of(s.client)
    open_wire(s)


def close_wire(s: Session, *, displaced: bool) -> bool:
    """``shutdown``'s teardown: tell the servers (unless ``displaced``: their engine belongs to
    another trainer now) concurrently with closing the link, so neither side's teardown waits
    on the other's. ``True`` when the servers shut this trainer's session down."""
    if s.link is None:
        return False
    post: Future | None = None
    watch = SettleWatch()  # halted once this stops waiting: the poll then calls no more
    deadline = 0.0
    if (
        not displaced
        and s.features is not None
        and s.features.shutdown_route
        and s.caps.shutdown_weight_transfer_engine
    ):
        # One bound for the server to settle and for this wait: a server still in a round
        # answers 409 until it failed it (``settle_bound``), and no later.
        transfer_s = s.info.timeouts.transfer_s
        deadline = time.monotonic() + settle_bound(transfer_s)
        post = spawn(
            lambda: shutdown_when_settled(s.client, transfer_s, deadline=deadline, watch=watch),
            name="weightwire-shutdown",
        )
    s.close_link()
    try:
        if post is None:
            return False
        # Called from a `finally` after a failed round, the caller's own error is what
        # matters: a shutdown failure is logged, never raised over it.
        failing = sys.exc_info()[1]
        try:
            try:
                await_call(
                    post,
                    max(0.0, deadline - time.monotonic()),
                    "shutdown_weight_transfer_engine (retried while the server had a round active)",
                )
            except ControlTimeout:
                if not post.done() and watch.halt():
                    raise  # a call still out at the bound: abandoned
                # The poll answered meanwhile, or is between two calls: halted, it raises at
                # once naming the server's last answer (bounded against a stalled thread).
                await_call(post, _HALTED_POLL_S, "shutdown_weight_transfer_engine")
        except BaseException as exc:
            if failing is None:
                raise
            logger.warning(
                "shutdown_weight_transfer_engine failed while %s propagated: %s",
                type(failing).__name__,
                exc,
            )
            return False
        return True
    finally:
        watch.halt()
        if isinstance(s.client, FallbackClient):
            s.client.close()  # only the connections the engine opened itself


def refuse_no_tensors(metas: Sequence[ParamMeta], *, ranks: Sequence[int] = ()) -> None:
    """A round of no tensors at all is refused before any call (``ConfigError``): its update
    info would list none, which the workers read as "the previous round's tensors again"
    (vLLM's metadata reuse), so they would wait for bytes that never come (or, after an
    init, refuse the round). (``send_patches([])`` is refused by its own checks.) ``ranks``:
    a group's ranks whose source listed none (every rank raises it, ``multi_source``)."""
    if not metas:
        whose = f" (on trainer rank(s) {list(ranks)})" if ranks else ""
        raise ConfigError(
            f"send_weights was given a source with no tensors{whose}: a round of no tensors "
            "cannot be sent (its update info, listing none, reads as 'the previous round's "
            "tensors again' on the workers); nothing was sent. Send at least one tensor "
            "(partial=True lets a round leave the others out)"
        )
