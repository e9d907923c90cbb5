"""``_ReceiverCore``: every rule of the worker side, independent of who hosts it.

The vLLM adapters (``vllm_engines``) and the standalone engines (``engines``) are
thin shells over this class, so the reference server and a real vLLM worker run the
same code for session rules, metadata reuse, pipelining, loading and failure
handling.

Round outcomes: the update info is checked against the model's ``ModelSpec`` before
a byte is received. A round within the init info's ``stage_budget_bytes`` is staged
(``strategy.StagedRound``): received into fresh buffers, held, and applied in one call
at finish, so a round that fails before finish leaves the previous weights exactly. A
larger round streams (``strategy.StreamingRound``): each chunk goes into
``load_weights`` as it lands, so the worker's extra memory is its receive buffers plus
the budget; a failure after the first in-place write leaves the model part new, which
``WeightState`` records (``incomplete_round``) until a complete round commits. The
trainer refuses generation around such a round (``shared.staging.round_streams``). Which
strategy takes each update, write-through included, is ``turn.turn_strategy``'s rule.

One update is ``receive``: its steps read top to bottom there (and in
``docs/architecture.md``, "One worker round"). An update's round token and a delta round's
base are checked before any byte too (``DeltaBaseMismatch`` is refused like a bad spec); the
token of each committed round is kept in ``WeightState``. Delta rounds (``delta``, ``sinks``:
patches held and applied at finish) and adapter rounds (``lora``) are steps of their own,
taken only when an update carries them, and their modules are imported then: a dense round
runs none of their code.

Failure rule: any error while a round is receiving aborts the communicator (the
trainer then fails fast with ``PeerLost`` instead of waiting out its timeout, and a
half-read byte stream is never resumed), aborts the round and raises. The engine
must be re-initialized (``init_transfer_engine``) before the next round.

Sessions: see ``session``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from weightwire._trace import trace
from weightwire.backends.worker_base import (
    Connect,
    LandingRecord,
    ReceiveLink,
    ReceiveProgress,
    ReceiveTurn,
    takes_landing,
)
from weightwire.shared.delta import INDEX_SUFFIX, VALUES_SUFFIX, Patch
from weightwire.shared.errors import ConfigError, DeltaBaseMismatch, WeightwireError
from weightwire.shared.limits import DEFAULT_STAGE_BUDGET_BYTES
from weightwire.shared.lora import is_adapter_round
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Wants
from weightwire.shared.timeouts import Timeouts
from weightwire.shared.update_info import UpdateInfo
from weightwire.torch_side.worker.landing import LoaderMap, MapRecorder, record_loader_map
from weightwire.torch_side.worker.load import (
    LOAD_BATCHING,
    FrameworkHooks,
    HasLoadedLayout,
    MetaCache,
    Model,
    ReceiveStats,
    RoundPlan,
)
from weightwire.torch_side.worker.session import (
    InitInfo,
    abort_link,
    busy_error,
    check_info_type,
    close_link,
    not_ready_error,
    session_rank,
    stale_reason,
)
from weightwire.torch_side.worker.spec import ModelSpec
from weightwire.torch_side.worker.strategy import (
    ReceiveStrategy,
    RoundTarget,
    first_strategy,
    record_landing,
)
from weightwire.torch_side.worker.target_caches import TargetCaches
from weightwire.torch_side.worker.turn import (
    early_round,
    failure_where,
    join_landing,
    turn_strategy,
)
from weightwire.torch_side.worker.weight_state import IncompleteRound, WeightState

if TYPE_CHECKING:  # delta and adapter rounds import their modules when one comes
    from weightwire.torch_side.worker.delta import PatchSplitter, RoundDelta
    from weightwire.torch_side.worker.lora import AdapterHostFn
    from weightwire.torch_side.worker.sinks import SinkChooser
    from weightwire.torch_side.worker.sliced import PatchShare, SlicedRound

log = logging.getLogger(__name__)

PATCH_SUFFIXES = (INDEX_SUFFIX, VALUES_SUFFIX)


class WeightReceiveError(WeightwireError, RuntimeError):
    """A round failed while receiving or loading; the round and the communicator were aborted."""


@dataclass
class RoundStats:
    """What this worker received in its latest round, counted by the worker itself: the payload
    bytes its link took (``ReceiveProgress.nbytes``, a failed update's partial bytes too), so a
    round that sends a worker only its slice shows here as fewer bytes than the round's tensors."""

    session: str | None
    bytes_received: int = 0
    updates: int = 0
    """Updates received whole."""
    committed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _ReceiverCore:
    """Session state machine + receive pipeline for one worker.

    ``target()`` returns ``(model, model_config)`` at call time, because vLLM may
    retarget a session at the speculative draft model.
    """

    def __init__(
        self,
        *,
        backend: str,
        device: torch.device,
        target: Callable[[], tuple[Any, Any]],
        connect: Connect,
        info_type: type[InitInfo],
        worker_rank: int = 0,
        framework: FrameworkHooks | None = None,
        load_batching: str = "chunk",
        spec: Callable[[], ModelSpec | None] | None = None,
        lease_s: float | None = None,
        weights: WeightState | None = None,
        adapters: AdapterHostFn | None = None,
        map_recorder: MapRecorder | None = None,
    ) -> None:
        if load_batching not in LOAD_BATCHING:
            raise ValueError(f"load_batching must be one of {LOAD_BATCHING}, got {load_batching!r}")
        if type(worker_rank) is not int or worker_rank < 0:
            raise ValueError(f"worker_rank must be a non-negative int, got {worker_rank!r}")
        self.backend = backend
        self.device = device
        self._target = target
        self._connect = connect
        self._info_type = info_type
        self._worker_rank = worker_rank
        self._session_rank = worker_rank  # set by each init: rank_offset + worker_rank
        self._framework = framework
        self._load_batching = load_batching
        self.lease_s = float(lease_s) if lease_s is not None else Timeouts.from_env().http_s
        self.weights = weights if weights is not None else WeightState()
        self._adapters = adapters  # where adapter rounds go (torch_side.worker.lora)
        self._round: ReceiveStrategy | None = None
        self._touched = 0.0  # monotonic time of the session's last round call
        self.session: str | None = None
        self._link: ReceiveLink | None = None
        self._info: InitInfo | None = None
        self._broken: str | None = None
        self._active = False
        self._plans = MetaCache(backend)
        self.last_stats: ReceiveStats | None = None
        self.last_round: RoundStats | None = None
        """The latest round's byte count (from its start; kept after it ends)."""
        self.caches = TargetCaches(
            backend=backend,
            model=lambda: self._target()[0],
            spec=spec,
            record_map=map_recorder or record_loader_map,
            loaded_layout=framework.loaded_layout
            if isinstance(framework, HasLoadedLayout)
            else None,
        )
        self._map_lookup = self.caches.loader_map if map_recorder is not None else None
        self._delta_rounds = False  # the session's trainer declared delta rounds
        self._joined: tuple[Any, frozenset[Any], LandingRecord] | None = None
        """The landing map the join recorded (model, its tensors' keys, the record): the
        first round's, when it sends those tensors (``_round_landing``)."""
        self._told: Wants | None = None  # the wants this worker told its trainer at the join
        self._one_rank = False
        """This worker serves a slice of the model (told at a sliced join): one tensor-parallel
        rank of several, whose commits together make one model's round."""
        self._changed_in_round: str | None = None
        """Why the weights changed while a round was open (it failed then): its finish says so."""
        self.model_ranks = 1
        """The ranks that serve this model together, this one included (set by vLLM's
        engine: its tensor x pipeline parallel world); more than one: as ``_one_rank``."""
        self._sink_chooser: SinkChooser | None = None  # made by the first patch step

    # ---------------------------------------------------------------- session
    @property
    def active(self) -> bool:
        return self._active

    @property
    def incomplete_round(self) -> IncompleteRound | None:
        """Set while the model holds part of a round applied in place (see ``WeightState``)."""
        return self.weights.incomplete

    @property
    def stage_budget_bytes(self) -> int:
        return getattr(self._info, "stage_budget_bytes", DEFAULT_STAGE_BUDGET_BYTES)

    @property
    def strategy(self) -> str | None:
        """The open round's strategy (``staged`` / ``streaming`` / ``write_through`` /
        ``sliced`` / ``sliced_in_place``), or None between rounds."""
        return self._round.label if self._round is not None else None

    def held_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The open round's received tensors that are not in the model yet (none when streaming)."""
        return self._round.held_tensors() if self._round is not None else []

    @property
    def initialized(self) -> bool:
        return self._link is not None

    @property
    def worker_rank(self) -> int:
        """This worker's index across the servers' workers (the trainer's rank excluded)."""
        return self._worker_rank

    def init(self, info: InitInfo) -> None:
        check_info_type(self.backend, info, self._info_type)
        if self._active:
            stale = stale_reason(self._link, self._touched, self.lease_s)
            if stale is None:
                raise busy_error(self.backend, self.session, self._touched, self.lease_s)
            log.warning(
                "%s: aborting the stale round of session %s (%s)", self.backend, self.session, stale
            )
            self._drop_round(f"stale: {stale}")
        rank = session_rank(self.backend, info, self._worker_rank)
        self._session_rank = rank
        self._close_link()
        self._plans.clear()
        self._joined = None
        told: dict[str, Any] = {}
        self._told = None
        self._one_rank = False
        if getattr(info, "sliced", None):  # the trainer asks for this worker's wants
            from weightwire.torch_side.worker.sliced import hello, serves_a_slice

            told["hello"], self._told = hello(self.caches, self.backend)
            self._one_rank = serves_a_slice(self._told, self.caches)
        self._link = self._connect(
            info, rank=rank, device=self.device, **self._join_options(), **told
        )
        self._info = info
        self._broken = None
        previous, self.session = self.session, uuid.uuid4().hex[:12]
        # A session's delta rounds start from a round it committed itself: whatever the
        # model held before (another trainer's round, weights changed meanwhile) is no base.
        delta_rounds = bool(getattr(info, "delta_rounds", None))
        self.weights.weights_changed(f"session {self.session} starts", copies=not delta_rounds)
        self._delta_rounds = delta_rounds
        log.info(
            "%s: session %s joined as rank %d of %d (packed=%s)%s",
            self.backend,
            self.session,
            rank,
            info.world_size,
            info.packed,
            f"; displaced session {previous}" if previous else "",
        )
        if self.weights.incomplete is not None:
            log.warning(
                "%s: session %s starts on an incomplete model: %s",
                self.backend,
                self.session,
                self.weights.incomplete.describe(),
            )

    def _join_options(self) -> dict[str, Any]:
        """What a connect that asks for it learns at the join (``worker_base.Connect``): whether
        the trainer may write this model's rounds into its parameters (``turn.join_landing``)."""
        if not takes_landing(self._connect):
            return {}
        return {"landing": self._join_landing}

    def _join_landing(self) -> LandingRecord:
        model, spec = self._target()[0], self.caches.model_spec()
        got = join_landing(model, spec)
        if got.map is not None and spec is not None:  # the first round's tensors, most likely
            keys = frozenset((n, t.dtype, tuple(t.shape)) for n, t in spec.tensors.items())
            self._joined = (model, keys, got)
        return got

    def _round_landing(self, model: Model, metas: Sequence[ParamMeta]) -> LandingRecord:
        """A turn's landing map: the one the join recorded when the turn sends exactly the
        tensors it was recorded for and no parameter moved since (recording runs the model's
        loader on tracers: once per session is enough), else a fresh one. The join's is used
        once: the link keeps its own table from then on."""
        joined, self._joined = self._joined, None
        if joined is not None:
            was, keys, got = joined
            now = frozenset((m.name, m.dtype, tuple(m.shape)) for m in metas)
            if was is model and keys == now and got.map is not None and got.map.is_live(model):
                return got
        return record_landing(model, metas)

    def start(self) -> None:
        if self._active:
            raise RuntimeError(
                f"{self.backend}: start_weight_update called twice; call finish_weight_update first"
            )
        if self._link is None:
            raise not_ready_error(self.backend, self._broken)
        self._touched = time.monotonic()
        self._changed_in_round = None
        self._link.start_round()
        model, model_config = self._target()
        target = RoundTarget(
            self.backend, model, model_config, self._framework, self._load_batching
        )
        self._round = first_strategy(target, self.stage_budget_bytes)
        trace("strategy")
        self._active = True
        self.caches.round_began()
        self.last_round = RoundStats(self.session)
        trace("began")
        early = self._link.early_landing()
        trace("landing")
        if early is not None:  # in place from now on: the trainer writes once told so
            self._round = early_round(target, self._settle, early)
            trace("early round")
            try:
                self._link.go_early()
            except BaseException as exc:
                self._fail(exc, "at the round's start")
                raise WeightReceiveError(
                    f"{self.backend}: the round's start failed ({type(exc).__name__}: {exc}); "
                    "call init_weight_transfer_engine again"
                ) from exc

    def weights_changed(self, why: str) -> None:
        """The model's weights changed outside a round (a sleep that discarded them, a
        reset): the delta base and the host copies die with them (``WeightState``), and an
        open round fails now: what it holds (pieces, patches, the landing map's parameters)
        was for the weights that went, so its commit would land on the wrong ones."""
        if self._active:
            self._fail(WeightReceiveError(why), f"while the round was open: {why}")
            self._changed_in_round = why
        self.weights.weights_changed(why, copies=True)

    def finish(self) -> None:
        changed, self._changed_in_round = self._changed_in_round, None
        if not self._active and changed is not None:
            raise WeightReceiveError(
                f"{self.backend}: the round was aborted before its finish (the weights "
                f"changed while it was open: {changed}); nothing more of it applies: call "
                "init_weight_transfer_engine again and send a complete round"
            )
        if not self._active:
            raise RuntimeError(
                f"{self.backend}: finish_weight_update called without start_weight_update"
            )
        round_, self._round = self._round, None
        self._active = False
        assert round_ is not None
        try:
            round_.commit()
        except BaseException as exc:
            if round_.delta is not None:
                round_.delta.drop()
            self.weights.weights_changed(f"applying the round failed: {type(exc).__name__}")
            if not round_.wrote and (self._one_rank or self.model_ranks > 1):
                # This rank kept the previous weights, but the model's other ranks commit on
                # their own: those that did hold the new round, so the model is half new.
                why = (
                    f"applying the round failed on this rank of the model "
                    f"({type(exc).__name__}) while the model's other ranks may have committed it"
                )
                self.weights.broke(self.session, why, frozenset(round_.names))
                raise WeightReceiveError(
                    f"{self.backend}: applying the received round failed on this rank "
                    f"({type(exc).__name__}: {exc}); it kept the previous weights, but this worker "
                    "serves part of the model and its other ranks may have committed the new "
                    "round: the model refuses to count as whole until a complete round commits "
                    "(send a full round again)"
                ) from exc
            if not round_.wrote:
                raise
            self.weights.broke(
                self.session,
                f"applying the round failed: {type(exc).__name__}",
                frozenset(round_.names),
            )
            raise WeightReceiveError(
                f"{self.backend}: applying the received round failed ({type(exc).__name__}: "
                f"{exc}); layers not yet complete kept their previous weights, completed ones hold "
                "the new round: send a full round again"
            ) from exc
        self.weights.committed(frozenset(round_.names))
        if self.last_round is not None:
            self.last_round.committed = True
        if round_.updates:  # a round without an update changed nothing
            self.weights.adopt(round_.target.model, round_.token)

    def shutdown(self) -> None:
        """Idempotent teardown; an active round is aborted (shutdown never raises for it)."""
        if self._active:
            self._drop_round("shutdown")
        self._close_link()
        self._info = None
        self._plans.clear()
        self._joined = None
        self.session = None

    def abort_link(self) -> None:
        """Abort the communicator without touching round state (safe from another thread:
        a communicator's abort never blocks and wakes its blocked calls)."""
        abort_link(self.backend, self._link, "aborting the receive link")

    # ---------------------------------------------------------------- receive
    def receive_dict(self, update: dict[str, Any]) -> None:
        """Parse then receive; a malformed body also aborts, since the trainer
        is already sending."""
        self._require_ready()
        try:
            info = UpdateInfo.from_dict(update)
        except ValueError as exc:
            self._fail(exc, "parsing the update info")
            raise ValueError(f"{exc} (round and communicator aborted)") from exc
        self.receive(info)

    def receive(self, update: UpdateInfo) -> None:
        """One update of the open round, step by step (``docs/architecture.md``: "One worker
        round"). Every check runs before the first byte; a dense update takes neither the
        adapter nor the patch step, so it imports and runs no delta or adapter code. Any
        failure aborts the round and the link (the trainer then fails fast)."""
        self._require_ready()
        assert self._link is not None and self._info is not None and self._round is not None
        model, _ = self._target()
        self._touched = time.monotonic()
        splitter: PatchSplitter | None = None
        try:
            self._link.check_source(update.src)  # several broadcasters: this turn's sender
            patches: Sequence[Patch] = update.patch_list() if update.patches else []
            plan = self._resolve(model, update)
            # An adapter round checks the adapter's own metadata instead of the rest.
            share = self._share(update, patches) if update.sliced and patches else None
            if not self._adapter_step(plan):
                self._check_round(model, update, plan)
                if share is not None:  # each patch's elements this worker serves
                    delta: RoundDelta | None = self._sliced_patch_step(model, update, share)
                else:  # a dense sliced update: no patch step (its pieces land through the map)
                    delta = None if update.sliced else self._patch_step(model, plan, patches)
                self._check_spec(plan, patches, delta)
                if share is not None:
                    splitter = self._share_splitter(share)
                else:
                    splitter = self._admit_patches(model, update, plan, patches, delta)
        except DeltaBaseMismatch as exc:
            self._fail(exc, "checking the delta round's base")
            raise
        except ValueError as exc:
            self._fail(exc, "checking the update info")
            raise ValueError(f"{exc} (round and communicator aborted)") from exc
        turn = ReceiveTurn(update.src, plan.metas, plan.chunks, plan.unpack, self._info.packed)
        started = time.perf_counter()
        progress = ReceiveProgress()
        nbytes = sum(c.nbytes for c in plan.chunks)
        try:
            if update.sliced:
                metas = plan.metas if share is None else share.metas
                nbytes = self._sliced_step(model, metas, progress, share, splitter)
            else:
                self._round = self._choose_strategy(model, turn, plain=splitter is None)
                received = self._link.receive(turn, progress)
                self._round.receive(received if splitter is None else splitter.split(received))
            self._round.took(update.round_token)
            if splitter is not None:
                self._hold_patches(splitter)
        except BaseException as exc:
            self._count(progress, whole=False)
            where = failure_where(turn, progress)
            self._fail(exc, where)
            raise WeightReceiveError(
                f"{self.backend}: round failed {where} ({type(exc).__name__}: {exc}); the round "
                "was aborted and the communicator closed; call init_weight_transfer_engine again"
            ) from exc
        self._count(progress, whole=True)
        self._touched = time.monotonic()
        self.last_stats = ReceiveStats(
            len(plan.metas),
            progress.chunk + 1 if update.sliced else len(plan.chunks),
            nbytes,
            time.perf_counter() - started,
        )

    def _count(self, progress: ReceiveProgress, *, whole: bool) -> None:
        """The update's landed bytes into the round's count (``RoundStats``)."""
        if self.last_round is not None:
            self.last_round.bytes_received += progress.nbytes
            self.last_round.updates += int(whole)

    # ------------------------------------------------------ the round's steps
    def _resolve(self, model: Model, update: UpdateInfo) -> RoundPlan:
        """The update's metadata, chunk plan and unpack plans (kept for the next round)."""
        assert self._info is not None
        return self._plans.resolve(
            model,
            update,
            packed=self._info.packed,
            buffer_size_bytes=self._info.packed_buffer_size_bytes,
        )

    def _adapter_step(self, plan: RoundPlan) -> bool:
        """Whether the update is an adapter's (the round then becomes an adapter round,
        checked against the served adapter); taken only when the update names an adapter or
        the round already is one."""
        assert self._round is not None
        names = [m.name for m in plan.metas]
        if not is_adapter_round(names) and self._round.name != "adapter":
            return False
        from weightwire.torch_side.worker.lora import adapter_round

        adapter = adapter_round(self._round, plan.metas, self._adapters)
        if adapter is None:
            return False
        self._round = adapter
        return True

    def _check_round(self, model: Model, update: UpdateInfo, plan: RoundPlan) -> None:
        """The round's token (the same in every update) and a delta round's base: the token
        of the round this model last committed (``DeltaBaseMismatch``)."""
        assert self._round is not None
        if update.reuses_previous and any(m.name.endswith(PATCH_SUFFIXES) for m in plan.metas):
            raise ValueError(
                "update info reuses the previous round's metadata, which lists patch wire "
                "tensors: a delta round's patches must be described in full"
            )
        if self._round.updates and update.round_token != self._round.token:
            raise ValueError(
                f"round_token {update.round_token!r} differs from {self._round.token!r} sent "
                "earlier in the same round"
            )
        held = self.weights.token(model)
        if update.delta_base is not None and update.delta_base != held:
            raise DeltaBaseMismatch(update.delta_base, held)

    def _patch_step(
        self, model: Model, plan: RoundPlan, patches: Sequence[Patch]
    ) -> RoundDelta | None:
        """The round's delta part (its patches' sink), opened at the first update that carries
        patches, or at the first update of a session that declared delta rounds (its sink
        keeps what a later delta round patches: the host copy, the loader map); None: dense."""
        round_ = self._round
        assert round_ is not None
        first = round_.updates == 0
        if round_.delta is None and (patches or (self._delta_rounds and first)):
            round_.delta = self._sinks().open(model, plan.metas, patches, first=first)
        return round_.delta

    def _check_spec(
        self, plan: RoundPlan, patches: Sequence[Patch], delta: RoundDelta | None
    ) -> None:
        """The update against the served model's ``ModelSpec``: names, shapes, dtypes and
        whole layers (once per metadata, not per round)."""
        spec = self.caches.model_spec()
        if spec is None or plan.spec_checked:
            return
        metas: Sequence[ParamMeta] = plan.metas
        if patches:  # each patched tensor as the model sees it, whole
            from weightwire.torch_side.worker.delta import logical_metas

            metas = logical_metas(plan.metas, patches)
        # A delta round leaves unchanged tensors out: a sink that completes layers loads them.
        completes = delta is not None and delta.sink is not None and delta.sink.completes_layers
        spec.check(metas, complete_layers=not patches and not completes)
        plan.spec_checked = True

    def _admit_patches(
        self,
        model: Model,
        update: UpdateInfo,
        plan: RoundPlan,
        patches: Sequence[Patch],
        delta: RoundDelta | None,
    ) -> PatchSplitter | None:
        """Whether the round's sink can apply this update's patches on the held base; the
        splitter that holds them while the chunks arrive (None: a dense update)."""
        if delta is None:
            return None
        return self._sinks().admit(delta, model, update, plan, patches)

    def _choose_strategy(self, model: Model, turn: ReceiveTurn, *, plain: bool) -> ReceiveStrategy:
        """Staged, streaming or written through (``turn.turn_strategy``)."""
        assert self._round is not None and self._link is not None
        return turn_strategy(
            self._round,
            self._link,
            turn,
            model,
            self._settle,
            self.stage_budget_bytes,
            plain=plain,
            landing=self._round_landing,
        )

    def _share(self, update: UpdateInfo, patches: Sequence[Patch]) -> PatchShare:
        """A sliced delta update: this worker's share of its patches (``UpdateInfo.shares``,
        indexed by its place among the trainer's workers: its session rank - 1)."""
        from weightwire.torch_side.worker.sliced import PatchShare

        try:
            return PatchShare(update, patches, self._session_rank - 1)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    def _sliced_patch_step(self, model: Model, update: UpdateInfo, share: PatchShare) -> RoundDelta:
        """A sliced delta round's patches land through this worker's landing map (as its
        slices do), applied at the commit after its dense pieces; a worker that loads its
        slices through ``load_weights`` (no map) cannot apply them: refused before any byte
        (``DeltaBaseMismatch``: the trainer sends the round dense)."""
        from weightwire.torch_side.worker.delta import RoundDelta, refuse
        from weightwire.torch_side.worker.landing import tied_aliases
        from weightwire.torch_side.worker.sinks import MapSink
        from weightwire.torch_side.worker.sliced import spec_metas

        assert self._round is not None
        held = self.weights.token(model)
        spec = self.caches.model_spec()
        lmap = self.caches.loader_map(spec_metas(spec)) if spec is not None else None
        if lmap is None:
            raise refuse(
                update.delta_base or "",
                held,
                "this worker loads its slices through load_weights: it cannot apply a sliced "
                "round's patches",
            )
        if self._round.delta is None:
            aliases = tied_aliases(model) if isinstance(model, torch.nn.Module) else {}
            # its dense pieces are written through the map, never reloaded with their layer
            self._round.delta = RoundDelta(MapSink(lmap, aliases, whole_layers=False))
        sink = self._round.delta.sink
        # every tensor the update names must land through the map (no reload: no layer mates)
        dense = [m.name for m in share.metas if m.name not in share.sizes]
        why = sink.refusal(dense, share.patches) if sink is not None else "no patch sink"
        if why is not None:
            raise refuse(update.delta_base or "", held, why)
        share.lmap = lmap
        return self._round.delta

    def _share_splitter(self, share: PatchShare) -> PatchSplitter:
        """Holds a sliced delta update's patches (its shares) until the round's commit."""
        from weightwire.torch_side.worker.delta import PatchSplitter

        return PatchSplitter(share.patches, observe=None)

    def _sliced_step(
        self,
        model: Model,
        metas: Sequence[ParamMeta],
        progress: ReceiveProgress,
        share: PatchShare | None = None,
        splitter: PatchSplitter | None = None,
    ) -> int:
        """A sliced update's pieces (``sliced``): through the landing map, staged or in
        place as the budget says; without a map, assembled whole and loaded as a dense
        update. A sliced delta update's (``share``): its patch shares held by ``splitter``
        (checked to lie in this worker's wants) until the commit. Returns the payload bytes
        this worker received."""
        from weightwire.torch_side.worker.sliced import (
            Cover,
            SlicedRound,
            assembled,
            check_within,
            counted,
            typed,
        )

        assert self._round is not None and self._link is not None
        cover = Cover(metas, self._told)  # exactly what this worker told it wants, or refused
        pieces = cover.checked(typed(self._link.receive_sliced(metas, progress), metas))
        if share is not None:
            assert splitter is not None and share.lmap is not None
            nbytes = self._sliced_into(SlicedRound, share.lmap, share.split(pieces))
            for _ in splitter.split(iter([share.pairs()])):
                pass  # only patch wire tensors: nothing dense comes out
            check_within(splitter.patches, self._told)
            return nbytes + share.nbytes
        lmap = self.caches.loader_map(metas)
        if lmap is None:
            got = [0]  # the pieces' bytes (what crossed the wire), not the assembled tensors'
            pairs = assembled(counted(pieces, got), metas, self.device)
            held = sum(t.numel() * t.element_size() for _, t in pairs)
            self._round = self._round.admit(held, self.stage_budget_bytes)
            self._round.receive(iter([pairs]))
            return got[0]
        return self._sliced_into(SlicedRound, lmap, pieces)

    def _sliced_into(self, kind: type[SlicedRound], lmap: LoaderMap, pieces: Any) -> int:
        """``pieces`` into the round, a ``SlicedRound`` from its first update on (a delta
        round's patch part, opened before, goes with it)."""
        assert self._round is not None
        if not isinstance(self._round, kind):
            if not self._round.untouched:
                raise ValueError(
                    f"a sliced update after a {self._round.name} one in the same round"
                )
            was = self._round
            self._round = kind(was.target, lmap, self.stage_budget_bytes)
            self._round.delta, self._round.token = was.delta, was.token
            self._round.updates = was.updates
        return self._round.receive_pieces(pieces)

    def _hold_patches(self, splitter: PatchSplitter) -> None:
        """The update's patches, held until the round's commit."""
        assert self._round is not None and self._round.delta is not None
        self._round.delta.took(splitter)

    def _sinks(self) -> SinkChooser:
        """Where patches land (``sinks``), made at the first patch step: a worker that only
        ever takes dense rounds never imports the delta modules."""
        if self._sink_chooser is None:
            from weightwire.torch_side.worker.sinks import SinkChooser

            self._sink_chooser = SinkChooser(
                self.weights,
                self._map_lookup,
                whole_layers=self._framework is not None,
                spec=self.caches.model_spec,
            )
        self._sink_chooser.session(self._delta_rounds)
        return self._sink_chooser

    def _settle(self) -> None:
        """Wait for the device work queued on this worker's stream (a write-through round's
        wait for the trainer's writes)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # ---------------------------------------------------------------- failure
    def _require_ready(self) -> None:
        if self._link is None:
            raise not_ready_error(self.backend, self._broken)
        if not self._active:
            raise RuntimeError(f"{self.backend}: update_weights called without start_weight_update")

    def _fail(self, exc: BaseException, where: str) -> None:
        self._broken = f"{type(exc).__name__} {where}"
        link, self._link = self._link, None
        abort_link(self.backend, link, "communicator abort")
        self._drop_round(where)
        log.error("%s: round failed %s: %s: %s", self.backend, where, type(exc).__name__, exc)

    def stale_reason(self) -> str | None:
        """Why a new init may replace this session's round (see ``init``): no round open,
        or its trainer is gone; None while the round's trainer may still act. Only valid
        between weight calls."""
        if not self._active:
            return "no round is open on this worker"
        return stale_reason(self._link, self._touched, self.lease_s)

    def _end_round(self, why: str) -> None:
        """Abort the open round; one that wrote in place leaves the model incomplete."""
        round_, self._round = self._round, None
        self._active = False
        if round_ is None:
            return
        round_.abort(why)
        # Whatever the round did, no base is known now.
        self.weights.weights_changed(f"a {round_.name} round ended without its commit: {why}")
        if round_.wrote:
            self.weights.broke(
                self.session,
                f"{round_.name} round ended without its commit: {why}",
                frozenset(round_.names),
            )

    def _drop_round(self, why: str) -> None:
        """Abandon the open round (stale trainer, shutdown) and tell the framework."""
        self._end_round(why)
        if self._framework is not None:
            try:
                self._framework.round_dropped()
            except Exception:
                log.exception("%s: framework round_dropped failed", self.backend)

    def _close_link(self) -> None:
        link, self._link = self._link, None
        close_link(self.backend, link)
