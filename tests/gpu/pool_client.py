"""A trainer engine's weight-sync client answered by the reference server's ``ReplicaPool``
directly, without the HTTP layer (the GPU host has no fastapi/uvicorn, and the API adds
nothing to what the logits test checks)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

STARTUP_S = 300.0
OP_S = 60.0
ROUND_S = 180.0


class PoolClient:
    """The weight-sync client calls a trainer engine makes, answered by a ``ReplicaPool``.

    The pool is asyncio; the engine calls from several threads at once (the init POST
    runs on a side thread while rank 0 joins NCCL, the update POST alongside the
    broadcasts). So the pool lives on its own event loop in a background thread and
    every call is ``run_coroutine_threadsafe(...).result(timeout)``: thread-safe and
    bounded. Fan-outs of weight ops abort every replica's link on the first failure,
    as the reference server's API does, so a failed worker cannot leave the sender
    blocked in a broadcast.
    """

    def __init__(self, spec: Any, *, startup_timeout: float = STARTUP_S) -> None:
        from weightwire.tools.server.replicas import ReplicaPool

        self.update_stats: list[dict[str, Any]] = []
        self.versions: list[str | None] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="test-pool-loop", daemon=True
        )
        self._thread.start()
        self.pool: Any = None
        try:
            self.pool = self._run(
                ReplicaPool.start(spec, startup_timeout=startup_timeout), startup_timeout + 30
            )
        except BaseException:
            self.close()
            raise

    def _run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except FutureTimeout:
            fut.cancel()
            raise TimeoutError(f"pool call did not finish within {timeout} s") from None

    def _fan(
        self, op: str, args: dict[str, Any] | None = None, *, timeout: float = OP_S
    ) -> list[Any]:
        coro = self.pool.fan_out(op, args, timeout=timeout, abort_on_failure=op != "shutdown")
        return self._run(coro, timeout + 30)

    @property
    def worker_info(self) -> dict[str, Any]:
        return self.pool.replicas[0].info

    # -- the calls TrainerEngine makes (server_version / world size come from TrainerInitInfo)
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        answers = self._fan("init", {"init_info": init_info}, timeout=ROUND_S)
        assert [a["rank"] for a in answers] == [1]  # a replica may also tell its served model

    def start_weight_update(self) -> None:
        self._fan("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.update_stats.append(
            self._fan("update", {"update_info": update_info}, timeout=ROUND_S)[0]
        )

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._fan("finish")
        self.versions.append(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._fan("shutdown")

    def reset_prefix_cache(self) -> list[bool]:
        return [
            True
        ]  # the reference workers keep no KV past one request: nothing computed before a round

    # -- what the test asks the worker
    def checksums(self) -> dict[str, str]:
        return self._fan("checksum")[0]

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        from weightwire.tools.server.completions import parse_completion_request

        info = self.worker_info
        request = parse_completion_request(
            body, vocab_size=info["vocab_size"], max_model_len=info["max_model_len"]
        )
        coro = self.pool.replicas[0].call(
            "generate", {"request": request.to_worker()}, timeout=OP_S
        )
        return self._run(coro, OP_S + 30)

    def close(self) -> None:
        try:
            if self.pool is not None:
                self._run(self.pool.close(), 60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            if not self._thread.is_alive():
                self._loop.close()
