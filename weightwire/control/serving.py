"""``ServingRoutes``: vLLM's serving-state routes on every server of a ``ServerSet``.

What a trainer asks around its rounds but never inside one: pause / resume, cache resets,
sleep / wake-up, request aborts, the weight version and checksums, the round guard
(``weightwire.vllm_guard``) and the servers' version. ``client.HTTPWeightSyncClient`` adds the
weight-sync routes on top. Every call reaches every server (``ServerSet._all``) and raises
``WeightSyncError`` on a non-2xx answer, as the weight-sync routes do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from weightwire import vllm_guard
from weightwire.control.servers import ServerSet
from weightwire.shared import routes
from weightwire.shared.errors import ConfigError, WeightSyncError, WrongType
from weightwire.shared.routes import CHECKER_ACTIONS, PAUSE_MODES


class ServingRoutes(ServerSet):
    """The serving-state routes of one or more vLLM servers, called as one."""

    def pause(self, mode: str = "keep", *, clear_cache: bool | None = None) -> None:
        if mode not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        params: dict[str, Any] = {"mode": mode, **self._wait_bound(mode)}
        if clear_cache is not None:
            params["clear_cache"] = "true" if clear_cache else "false"
        self._all(routes.PAUSE, params=params)

    def _wait_bound(self, mode: str) -> dict[str, str]:
        """The query field that bounds a pause's (or a sleep's) wait (``routes.PAUSE_BOUNDS``),
        where the servers take it; none here (a stock server's /pause and /sleep take no such
        field)."""
        return {}

    def resume(self) -> None:
        self._all(routes.RESUME)

    def reset_prefix_cache(
        self, reset_running_requests: bool = True, reset_external: bool = True
    ) -> list[bool]:
        """vLLM's ``/reset_prefix_cache`` on every server; per server, its ``success``.

        By default (what a trainer needs after a round) running requests are preempted, so
        they recompute their KV instead of keeping it (vLLM's own default is ``False``: the
        reset then fails while requests run), and a KV connector's external cache is reset too."""
        params = {
            "reset_running_requests": "true" if reset_running_requests else "false",
            "reset_external": "true" if reset_external else "false",
        }
        return [
            isinstance(r, dict) and r.get("success") is True
            for r in self._all(routes.RESET_PREFIX_CACHE, params=params)
        ]

    def reset_encoder_cache(self) -> None:
        """vLLM's ``/reset_encoder_cache`` on every server (multimodal encoder outputs)."""
        self._all(routes.RESET_ENCODER_CACHE)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's ``/sleep``: level 0 pauses generation, 1 offloads weights to host memory,
        2 discards them (send a full round after ``wake_up``). ``mode`` is the pause mode; a
        ``wait`` carries the pause's bound where the servers take it (``_wait_bound``), so a
        sleep this client gave up on never takes effect later."""
        if type(level) is not int or level not in routes.SLEEP_LEVELS:
            raise ConfigError(f"sleep level must be one of {routes.SLEEP_LEVELS}, got {level!r}")
        if mode not in PAUSE_MODES:
            raise ConfigError(f"sleep mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._all(routes.SLEEP, params={"level": level, "mode": mode, **self._wait_bound(mode)})

    def wake_up(self, tags: Sequence[str] | None = None) -> list[bool]:
        """vLLM's ``/wake_up`` (``tags``: weights / kv_cache / scheduling; None: all);
        per server, whether it is fully awake now."""
        if isinstance(tags, str):
            raise WrongType("tags must be a list of tag names, not one string")
        bad = [t for t in tags or () if t not in routes.WAKE_TAGS]
        if bad:
            raise ConfigError(f"unknown wake_up tags {bad}; known: {list(routes.WAKE_TAGS)}")
        replies = self._all(routes.WAKE_UP, params={"tags": list(tags)} if tags else None)
        return [isinstance(r, dict) and r.get("status") == "awake" for r in replies]

    def is_sleeping(self) -> list[bool]:
        return [
            bool(r.get("is_sleeping")) if isinstance(r, dict) else False
            for r in self._all(routes.IS_SLEEPING)
        ]

    def is_paused(self) -> list[bool]:
        return [
            bool(r.get("is_paused")) if isinstance(r, dict) else False
            for r in self._all(routes.IS_PAUSED)
        ]

    def weight_info(self) -> list[dict[str, Any]]:
        """Each server's ``{"weight_version": ...}``."""
        return self._all(routes.WEIGHT_INFO)

    def abort_requests(self, request_ids: Sequence[str] | None = None) -> list[Any]:
        """Abort in-flight requests on every server without pausing; ``None``: all of them."""
        if request_ids is not None and (
            isinstance(request_ids, str) or not all(isinstance(r, str) for r in request_ids)
        ):
            raise WrongType("request_ids must be a list of request id strings (or None for all)")
        return self._all(
            routes.ABORT_REQUESTS, {} if request_ids is None else {"request_ids": list(request_ids)}
        )

    def update_weight_version(self, new_version: str) -> None:
        self._all(routes.UPDATE_VERSION, {"new_version": new_version})

    def weight_checker(
        self, action: str, baseline: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """Each server's answer to ``/weight_checker`` (``checksum``: ``{"checksums": {...}}``)."""
        if action not in CHECKER_ACTIONS:
            raise ConfigError(
                f"weight_checker action must be one of {CHECKER_ACTIONS}, got {action!r}"
            )
        body: dict[str, Any] = {"action": action}
        if baseline is not None:
            body["baseline"] = baseline
        return self._all(routes.WEIGHT_CHECKER, body)

    def round_guard(self) -> list[dict[str, Any] | None]:
        """Per server, the round guard's state (``weightwire.vllm_guard``), or None where none
        is installed."""
        return [self._guard_state(i) for i in range(len(self._clients))]

    def _guard_state(self, i: int) -> dict[str, Any] | None:
        try:
            reply = self._request(i, vllm_guard.STATUS)
        except WeightSyncError as exc:
            if exc.status in (404, 405):
                return None
            raise
        return reply if isinstance(reply, dict) and reply.get("guard") == "weightwire" else None

    def hold_round(self, round_id: str, session: str | None = None) -> None:
        """Hold every server's round guard: requests that run the model are refused, with the
        reason."""
        self._all(vllm_guard.HOLD, {"round": round_id, "session": session})

    def release_round(self, *, resume: bool = True) -> None:
        """Release every server's round guard (409 while its workers' weights are not whole);
        ``resume``: also resume generation where it is paused."""
        self._all(vllm_guard.RELEASE, params={"resume": "true" if resume else "false"})

    def version(self) -> str:
        """The servers' version string; servers that disagree are an error."""
        replies = self._all(routes.VERSION)
        versions = []
        for i, reply in enumerate(replies):
            v = reply.get("version") if isinstance(reply, dict) else reply
            if not isinstance(v, str) or not v:
                raise WeightSyncError(
                    routes.VERSION.name,
                    200,
                    f"reply has no version string: {reply!r:.200}",
                    self.base_urls[i],
                )
            versions.append(v)
        if len(set(versions)) > 1:
            listed = ", ".join(f"{u}={v}" for u, v in zip(self.base_urls, versions, strict=True))
            raise ConfigError(
                f"servers run different versions ({listed}); drive one version at a time"
            )
        return versions[0]
