"""Worker engines outside vLLM, one per backend a weightwire worker receives.

``EngineFacade`` maps vLLM's ``WeightTransferEngine`` method set onto
``_ReceiverCore``; the standalone classes here (used by the reference server) and the
vLLM subclasses in ``vllm_engines`` both inherit it, so they behave identically.

Wire params (packed, buffer size, number of buffers, timeout) come from the init
info only: the trainer sends all of them, so the two sides cannot disagree. The data
link comes from ``connect.connect``, which finds the backend's connect function in the
registry (``weightwire.backends``) by the init info's ``backend``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

import torch

from weightwire import backends
from weightwire.backends.spec import BackendSpec
from weightwire.backends.worker_base import WorkerInitInfo
from weightwire.shared.update_info import UpdateInfo
from weightwire.torch_side.worker.connect import connect
from weightwire.torch_side.worker.core import _ReceiverCore
from weightwire.torch_side.worker.load import Model, ReceiveStats
from weightwire.torch_side.worker.weight_state import IncompleteRound, WeightState

if TYPE_CHECKING:  # adapter rounds import their module when one comes
    from weightwire.torch_side.worker.lora import AdapterHostFn
    from weightwire.torch_side.worker.spec import ModelSpec

_T = TypeVar("_T")


class _FromSpec(Generic[_T]):
    """An engine class's attribute read from the spec of the backend it receives."""

    def __init__(self, read: Callable[[BackendSpec], _T]) -> None:
        self._read = read

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, engine: object, owner: type) -> _T:
        for cls in owner.__mro__:
            spec = backends.spec_of_engine(cls)
            if spec is not None:
                return self._read(spec)
        raise AttributeError(
            f"{owner.__name__}.{self._name}: no backend's spec names this engine class; name "
            "it in a spec (worker_engine / vllm_engine) or set backend and init_info_cls"
        )


def _init_info_of(spec: BackendSpec) -> type[WorkerInitInfo]:
    info: type[WorkerInitInfo] = backends.init_info_type(spec.name)
    return info


class EngineFacade:
    """vLLM's worker-engine method set, delegated to ``self._core``.

    ``init_info_cls`` / ``update_info_cls`` are the strict parsers: unknown keys, wrong
    types and out-of-limit values fail the request with a ``ValueError`` naming the field
    before anything is allocated or joined.

    A backend's engine class names no backend: the registry does. ``backend`` and
    ``init_info_cls`` are read from the spec naming the class (``worker_engine`` /
    ``vllm_engine``) or its nearest base a spec names, when first asked (so an engine module
    may be imported before its package is registered); an engine no spec names sets both.
    """

    backend = _FromSpec(lambda spec: spec.name)
    init_info_cls = _FromSpec(_init_info_of)
    update_info_cls = UpdateInfo
    _core: _ReceiverCore

    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        return self.init_info_cls.from_dict(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateInfo:
        return UpdateInfo.from_dict(update_dict)

    def init_transfer_engine(self, init_info: Any) -> None:
        if isinstance(init_info, dict):
            init_info = self.parse_init_info(init_info)
        self._core.init(init_info)

    def start_weight_update(self) -> None:
        self._core.start()

    def weights_changed(self, why: str) -> None:
        """The model's weights changed outside a round (a sleep that discarded them, a
        reset): the delta base and the host copies die with them (``WeightState``), and a
        round open meanwhile fails (``_ReceiverCore.weights_changed``)."""
        self._core.weights_changed(why)

    def receive_weights(self, update_info: UpdateInfo) -> None:
        if not isinstance(update_info, UpdateInfo):
            raise TypeError(
                f"receive_weights takes an UpdateInfo, got {type(update_info).__name__}"
            )
        self._core.receive(update_info)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Parse, receive and load; returns once the new weights are on the device."""
        self._core.receive_dict(update_info)
        if self._core.device.type == "cuda" and self._core.strategy != "write_through":
            # load_weights may have queued copies; the next forward pass must see them. A
            # round written through waits at its commit instead (the trainer's writes then
            # overlap its finish call; generation is refused until the commit anyway).
            torch.cuda.current_stream(self._core.device).synchronize()

    def finish_weight_update(self) -> None:
        self._core.finish()

    def served_model(self) -> dict[str, Any] | None:
        """What the served model takes (``shared.served``), from the spec the worker checks
        rounds against; ``None`` without one (no local safetensors checkpoint)."""
        spec = self._core.caches.model_spec()
        served = spec.served() if spec is not None else None
        return served.to_dict() if served is not None else None

    def round_stats(self) -> dict[str, Any] | None:
        """What this worker received in its latest round (``core.RoundStats``) and its rank
        among the workers; ``None`` before its first round."""
        stats = self._core.last_round
        return None if stats is None else {"rank": self._core.worker_rank, **stats.to_dict()}

    def held_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The open round's tensors received but not yet applied (for checks before commit)."""
        return self._core.held_tensors()

    def shutdown(self) -> None:
        self._core.shutdown()

    def abort_transfer(self) -> None:
        """Out of band, from any thread: abort the data link so a receive blocked in
        ``update_weights`` raises now instead of at its timeout. The round then fails
        through its normal path (hooks aborted, weights kept)."""
        self._core.abort_link()

    def stale_round(self) -> str | None:
        """Why a new init may replace the session's round (none open, its link closed, or
        idle past the lease), or None; only meaningful while no weight call runs."""
        return self._core.stale_reason()

    @property
    def incomplete_round(self) -> IncompleteRound | None:
        """Set while the model holds part of a round applied in place (a round that failed
        after its first in-place write), until a complete round commits."""
        return self._core.incomplete_round

    @property
    def round_strategy(self) -> str | None:
        """The open round's strategy (``staged`` / ``streaming`` / ``sliced`` / ...), or None
        between rounds."""
        return self._core.strategy

    @property
    def last_stats(self) -> ReceiveStats | None:
        """Tensors, chunks, bytes and seconds of the last ``update_weights``."""
        return self._core.last_stats


class StandaloneEngine(EngineFacade):
    """An engine loading into any object with ``load_weights`` (e.g. ``HFModelHost``)."""

    def __init__(
        self,
        *,
        model: Model,
        device: torch.device | str | None = None,
        worker_rank: int = 0,
        load_batching: str = "chunk",
        weights: WeightState | None = None,
        adapters: AdapterHostFn | None = None,
        spec: Callable[[], ModelSpec | None] | None = None,
    ) -> None:
        """``spec``: the served checkpoint's tensors, when known (a worker then checks rounds
        against it, and tells the trainer its wants for sliced rounds)."""
        if not isinstance(model, Model):
            raise TypeError(
                "model must have a load_weights(list[(name, tensor)]) method, got "
                f"{type(model).__name__}"
            )
        self.model = model
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._core = _ReceiverCore(
            backend=self.backend,
            device=self.device,
            target=lambda: (self.model, None),
            connect=self._connect,
            info_type=self.init_info_cls,
            worker_rank=worker_rank,
            load_batching=load_batching,
            weights=weights,
            adapters=adapters,
            spec=spec,
        )

    @classmethod
    def standalone(cls, **options: Any) -> Self:
        """The reference server's constructor, ``__init__``'s keywords: ``worker_rank`` is this
        replica's index among the server's workers (its wire rank is ``rank_offset +
        worker_rank``); ``weights``: the model's ``WeightState``, kept across this model's
        engines; ``adapters``: where adapter rounds go (``torch_side.worker.lora``), if
        anywhere."""
        return cls(**options)

    _connect = staticmethod(connect)


# The built-in backends' engines: each one's name and init info come from the spec naming it.


class WeightwireTCPEngine(StandaloneEngine):
    """The TCP receiver: CPU or GPU worker, TCP data plane."""


class WeightwireNCCLEngine(StandaloneEngine):
    """The NCCL receiver: GPU worker, NCCL data plane via cupy, with timeouts (also what
    receives vLLM's own NCCL wire outside vLLM: its init info parses a superset)."""


class WeightwireIPCEngine(StandaloneEngine):
    """The CUDA IPC receiver: a GPU worker on the trainer's host (same GPU or a peer GPU).
    Pull mode (packed, the default) lends the trainer exported receive buffers it writes
    into, no copy here; push mode opens the trainer's slots once per session and copies
    each piece out."""


def watch_sleep(worker: Any, engine: EngineFacade) -> None:
    """Make ``worker.sleep(level)`` (vLLM's worker: ``collective_rpc("sleep")`` looks the
    method up on the instance) tell ``engine`` first at level 2, which discards the weights
    (``wake_up`` gives the memory back, not the values). Once per worker; the engine is held
    weakly (a dropped engine is no reason to keep a model alive)."""
    sleep: Callable[..., Any] | None = getattr(worker, "sleep", None)
    if not callable(sleep) or getattr(sleep, "weightwire_watched", False):
        return
    ref = weakref.ref(engine)

    def watched(level: int = 1, *args: Any, **kwargs: Any) -> Any:
        watching = ref()
        if level == 2 and watching is not None:  # before: a sleep that fails midway lost them too
            watching.weights_changed("sleep level 2 discards the weights")
        return sleep(level, *args, **kwargs)

    watched.weightwire_watched = True  # type: ignore[attr-defined]
    worker.sleep = watched
