"""``RayWeightSyncClient``: the same calls, for vLLM engines running as Ray actors.

For users whose ``LLM`` / ``AsyncLLM`` instances live in Ray actors. ``ray`` is
imported only when a call is made, so weightwire never needs it installed. Calls
fan out to every handle and block until all of them answered, ``timeout`` seconds
at most for the whole call. A failure is raised as one ``WeightSyncError`` naming
the route and the actor (its index and Ray handle): the actor's own exception text
(never Ray's remote traceback), or Ray's reason for an actor that is gone
(``ActorDiedError: The actor died unexpectedly ...``). When several actors fail
together, an actor's death is reported first: it is the cause, the others' errors
(their data link closed) are its consequence.

Ray cannot withdraw a call a synchronous actor has queued or is running
(``ray.cancel`` reports it cancelled and it still runs), so after a timeout the call
may yet complete there; the trainer engine treats the round as failed and a new
``trainer_init`` replaces the actors' session.

Ray carries the requests with its own serialization: that is Ray's transport, chosen
by the user, not a weightwire code path.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from weightwire._extras import install_command
from weightwire.shared.errors import ConfigError, WeightSyncError
from weightwire.shared.routes import PAUSE_MODES

logger = logging.getLogger(__name__)

_GRACE_S = 1.5
"""After one actor failed, how long the others get to report a death (the likelier cause;
Ray learns of one from its node, which is slow on a loaded host). Shorter than the
engine's 2 s wait for a control call's verdict after a data-plane failure, so the
client's answer is the one a failed round reports."""
_MAX_MESSAGE = 2000


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
        raise ImportError(f"RayWeightSyncClient needs ray: {install_command('ray')}") from exc


def _request(kind: str, key: str, payload: Any) -> Any:
    """vLLM's request object when vLLM is importable here, else the dict form its
    offline ``LLM`` also accepts (``{"init_info": ...}``)."""
    try:
        base = importlib.import_module("vllm.distributed.weight_transfer.base")
    except ImportError:
        return {key: payload}
    return getattr(base, kind)(**{key: payload})


def _died(ray: Any, exc: BaseException) -> bool:
    """Is ``exc`` Ray saying the actor is gone (killed, crashed, its node lost)?"""
    return isinstance(exc, ray.exceptions.RayActorError)


def _describe(ray: Any, exc: BaseException) -> str:
    """The failure in one bounded message: the actor's own exception for an error raised
    there (Ray's text adds the remote traceback), Ray's reason for a dead actor."""
    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        text = f"{type(exc.cause).__name__}: {exc.cause}"
    elif _died(ray, exc):
        # Ray's text: a headline, indented "key: value" lines (ids, pid, ip), then the reason.
        lines = [
            ln.strip()
            for ln in str(exc).splitlines()
            if ln.strip() and not ln.startswith((" ", "\t"))
        ]
        text = f"{type(exc).__name__}: " + " ".join(lines)
    else:
        text = f"{type(exc).__name__}: {str(exc).strip()}"
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + "..."


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
            raise ConfigError("RayWeightSyncClient needs at least one actor handle")
        if isinstance(world_sizes, int):
            world_sizes = [world_sizes] * len(self.handles)
        if world_sizes is not None and (
            len(world_sizes) != len(self.handles) or min(world_sizes) < 1
        ):
            raise ConfigError(
                f"world_sizes must give one positive size per handle, got {world_sizes!r}"
            )
        self._world_sizes = None if world_sizes is None else list(world_sizes)
        self.timeout = float(timeout)
        self._server_version = server_version
        self._warned_encoder = False

    def __repr__(self) -> str:
        return f"RayWeightSyncClient({len(self.handles)} actors, timeout={self.timeout})"

    def _name(self, index: int) -> str:
        return f"actor {index} ({self.handles[index]!r})"

    def _all(
        self, method: str, *args_per: Sequence[Any], dead_ok: bool = False, **kwargs: Any
    ) -> list[Any]:
        """``method`` on every actor, its results in handle order. ``dead_ok``: an actor
        that is gone answers ``None`` (logged) instead of failing the call."""
        ray = _ray()
        deadline = time.monotonic() + self.timeout
        refs = []
        calls = []
        for i, handle in enumerate(self.handles):  # every method found before any call goes out
            try:
                calls.append(getattr(handle, method))
            except (
                AttributeError
            ):  # the actor's class has no such method: as an HTTP server without the route
                raise WeightSyncError(
                    method, 404, f"the actor has no method {method}", f"actor {i}"
                ) from None
        for i, call in enumerate(calls):
            refs.append(call.remote(*[a[i] for a in args_per], **kwargs))
        pending, results = list(refs), {}
        while pending:
            done, pending = ray.wait(
                pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not done:
                late = ", ".join(self._name(refs.index(r)) for r in pending)
                self._settle_later(ray, method, refs, pending)
                raise WeightSyncError(
                    method,
                    None,
                    f"no answer within {self.timeout:g} s (the call may still run "
                    "there: Ray cannot withdraw it)",
                    late,
                )
            index = refs.index(done[0])
            try:
                results[index] = ray.get(done[0], timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                if dead_ok and _died(ray, exc):
                    logger.warning(
                        "%s on %s: the actor is gone; nothing to do there",
                        method,
                        self._name(index),
                    )
                    results[index] = None
                    continue
                raise self._failure(ray, method, refs, pending, {index: exc}) from exc
        return [results[i] for i in range(len(refs))]

    def _failure(
        self,
        ray: Any,
        method: str,
        refs: list[Any],
        pending: list[Any],
        failed: dict[int, Exception],
    ) -> WeightSyncError:
        """One error for a failed fan-out: an actor's death when one died within the grace
        (the others' failures follow from it), else the first failure; the rest as notes."""
        if pending and not any(_died(ray, e) for e in failed.values()):
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=_GRACE_S)
            for ref in done:
                try:
                    ray.get(ref, timeout=0)
                except Exception as exc:
                    failed[refs.index(ref)] = exc
        self._settle_later(ray, method, refs, pending)
        index = next((i for i, e in failed.items() if _died(ray, e)), next(iter(failed)))
        error = WeightSyncError(method, None, _describe(ray, failed[index]), self._name(index))
        for other, also in failed.items():
            if other != index:
                error.add_note(f"{self._name(other)} also failed: {_describe(ray, also)}")
        return error

    def _settle_later(self, ray: Any, method: str, refs: list[Any], pending: list[Any]) -> None:
        """Calls left running when this call gave up: their outcome is logged in one line
        when it arrives (unread, Ray would print each failure's remote traceback)."""
        for ref in pending:

            def settled(future: Any, index: int = refs.index(ref)) -> None:
                exc = future.exception()
                if exc is not None:
                    logger.info(
                        "%s on %s, after the call gave up: %s",
                        method,
                        self._name(index),
                        _describe(ray, exc),
                    )

            ref.future().add_done_callback(settled)

    def init_weight_transfer_engine(
        self, init_info: dict[str, Any] | Sequence[dict[str, Any]]
    ) -> None:
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
        """A dead actor holds no session: it is skipped (logged), so the survivors are released."""
        self._all("shutdown_weight_transfer_engine", dead_ok=True)

    def _sizes(self) -> list[int]:
        if self._world_sizes is None:
            raise ConfigError(
                "RayWeightSyncClient(world_sizes=...) is required: actors expose no world size call"
            )
        return self._world_sizes

    def get_world_size(self) -> int:
        return sum(self._sizes())

    def pause(self, mode: str = "keep") -> None:
        if mode not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._all("pause_generation", mode=mode)

    def resume(self) -> None:
        self._all("resume_generation")

    def reset_prefix_cache(
        self, reset_running_requests: bool = True, reset_connector: bool = True
    ) -> list[bool]:
        """``reset_prefix_cache`` of every actor's ``LLM`` / ``AsyncLLM`` (same keywords); per
        actor, whether it reset. Running requests are preempted by default (they recompute)."""
        return [
            r is True
            for r in self._all(
                "reset_prefix_cache",
                reset_running_requests=reset_running_requests,
                reset_connector=reset_connector,
            )
        ]

    def reset_encoder_cache(self) -> None:
        """``reset_encoder_cache`` of every actor that has one (``AsyncLLM``; vLLM's offline
        ``LLM`` exposes none, and an actor without it is skipped with a warning once)."""
        have = [h for h in self.handles if _has_method(h, "reset_encoder_cache")]
        if len(have) < len(self.handles) and not self._warned_encoder:
            self._warned_encoder = True
            logger.warning(
                "%d actor(s) have no reset_encoder_cache: a multimodal model's "
                "encoder outputs cached before a round may be reused after it",
                len(self.handles) - len(have),
            )
        if have:
            RayWeightSyncClient(have, timeout=self.timeout)._all("reset_encoder_cache")

    def weight_info(self) -> list[dict[str, Any]]:
        return [{"weight_version": v} for v in self._all("get_weight_version")]

    def version(self) -> str:
        if self._server_version is None:
            raise ConfigError(
                "RayWeightSyncClient(server_version=...) is required to gate wire features"
            )
        return self._server_version
