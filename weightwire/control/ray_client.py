"""``RayWeightSyncClient``: the same calls, for vLLM engines running as Ray actors.

For users whose ``LLM`` / ``AsyncLLM`` instances live in Ray actors. ``ray`` is
imported only when a call is made, so weightwire never needs it installed. Calls
fan out to every handle and block until all of them answered (bounded by
``timeout``); the first failure is raised at once, as a ``WeightSyncError`` naming
the route and actor.

Ray carries the requests with its own serialization: that is Ray's transport, chosen
by the user, not a weightwire code path.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any

from weightwire.control.errors import WeightSyncError
from weightwire.shared.routes import PAUSE_MODES

logger = logging.getLogger(__name__)


def _has_method(handle: Any, name: str) -> bool:
    try:
        getattr(handle, name)
    except AttributeError:
        return False
    return True


def _ray() -> Any:
    try:
        return importlib.import_module("ray")
    except ImportError as exc:
        raise ImportError("RayWeightSyncClient needs ray: pip install 'weightwire[ray]'") from exc


def _request(kind: str, key: str, payload: Any) -> Any:
    """vLLM's request object when vLLM is importable here, else the dict form its
    offline ``LLM`` also accepts (``{"init_info": ...}``)."""
    try:
        base = importlib.import_module("vllm.distributed.weight_transfer.base")
    except ImportError:
        return {key: payload}
    return getattr(base, kind)(**{key: payload})


class RayWeightSyncClient:
    """Drive one or more vLLM engine actors as one unit.

    ``world_sizes``: each actor's inference world size (TP*PP*DP), needed for
    ``get_world_size`` because an actor exposes no such call; one int applies to all.
    ``server_version``: the actors' vLLM version, when it cannot be asked remotely.
    """

    def __init__(
        self,
        handles: Any | Sequence[Any],
        *,
        timeout: float = 300,
        world_sizes: int | Sequence[int] | None = None,
        server_version: str | None = None,
    ) -> None:
        self.handles = list(handles) if isinstance(handles, (list, tuple)) else [handles]
        if not self.handles:
            raise ValueError("RayWeightSyncClient needs at least one actor handle")
        if isinstance(world_sizes, int):
            world_sizes = [world_sizes] * len(self.handles)
        if world_sizes is not None and (len(world_sizes) != len(self.handles) or min(world_sizes) < 1):
            raise ValueError(f"world_sizes must give one positive size per handle, got {world_sizes!r}")
        self._world_sizes = None if world_sizes is None else list(world_sizes)
        self.timeout = float(timeout)
        self._server_version = server_version
        self._warned_encoder = False

    def __repr__(self) -> str:
        return f"RayWeightSyncClient({len(self.handles)} actors, timeout={self.timeout})"

    def _all(self, method: str, *args_per: Sequence[Any], **kwargs: Any) -> list[Any]:
        ray = _ray()
        refs = []
        calls = []
        for i, handle in enumerate(self.handles):  # every method found before any call goes out
            try:
                calls.append(getattr(handle, method))
            except AttributeError:  # the actor's class has no such method: as an HTTP server without the route
                raise WeightSyncError(method, 404, f"the actor has no method {method}", f"actor {i}") from None
        for i, call in enumerate(calls):
            refs.append(call.remote(*[a[i] for a in args_per], **kwargs))
        pending, results = list(refs), {}
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=self.timeout)
            if not done:
                raise WeightSyncError(method, None, f"no answer within {self.timeout} s", f"{len(pending)} actor(s)")
            ref = done[0]
            index = refs.index(ref)
            try:
                results[index] = ray.get(ref)
            except Exception as exc:  # Ray wraps the actor's exception; keep its text
                raise WeightSyncError(method, None, f"{type(exc).__name__}: {exc}", f"actor {index}") from exc
        return [results[i] for i in range(len(refs))]

    def init_weight_transfer_engine(self, init_info: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """One dict is shifted per actor by the preceding actors' world sizes (``rank_offset``)."""
        if isinstance(init_info, dict):
            infos = [init_info] * len(self.handles)
            if len(self.handles) > 1 and "rank_offset" in init_info:
                offset, infos = init_info["rank_offset"], []
                for size in self._sizes():
                    infos.append({**init_info, "rank_offset": offset})
                    offset += size
        else:
            infos = list(init_info)
        requests = [_request("WeightTransferInitRequest", "init_info", info) for info in infos]
        self._all("init_weight_transfer_engine", requests)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        request = _request("WeightTransferUpdateRequest", "update_info", update_info)
        self._all("update_weights", [request] * len(self.handles))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", [weight_version] * len(self.handles))

    def shutdown_weight_transfer_engine(self) -> None:
        self._all("shutdown_weight_transfer_engine")

    def _sizes(self) -> list[int]:
        if self._world_sizes is None:
            raise ValueError("RayWeightSyncClient(world_sizes=...) is required: actors expose no world size call")
        return self._world_sizes

    def get_world_size(self) -> int:
        return sum(self._sizes())

    def pause(self, mode: str = "keep") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._all("pause_generation", mode=mode)

    def resume(self) -> None:
        self._all("resume_generation")

    def reset_prefix_cache(self, reset_running_requests: bool = True, reset_connector: bool = True) -> list[bool]:
        """``reset_prefix_cache`` of every actor's ``LLM`` / ``AsyncLLM`` (same keywords); per
        actor, whether it reset. Running requests are preempted by default (they recompute)."""
        return [r is True for r in self._all("reset_prefix_cache", reset_running_requests=reset_running_requests,
                                             reset_connector=reset_connector)]

    def reset_encoder_cache(self) -> None:
        """``reset_encoder_cache`` of every actor that has one (``AsyncLLM``; vLLM's offline
        ``LLM`` exposes none, and an actor without it is skipped with a warning once)."""
        have = [h for h in self.handles if _has_method(h, "reset_encoder_cache")]
        if len(have) < len(self.handles) and not self._warned_encoder:
            self._warned_encoder = True
            logger.warning("%d actor(s) have no reset_encoder_cache: a multimodal model's encoder outputs cached "
                           "before a round may be reused after it", len(self.handles) - len(have))
        if have:
            RayWeightSyncClient(have, timeout=self.timeout)._all("reset_encoder_cache")

    def weight_info(self) -> list[dict[str, Any]]:
        return [{"weight_version": v} for v in self._all("get_weight_version")]

    def version(self) -> str:
        if self._server_version is None:
            raise ValueError("RayWeightSyncClient(server_version=...) is required to gate wire features")
        return self._server_version
