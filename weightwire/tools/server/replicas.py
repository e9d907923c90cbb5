"""All worker processes of one reference server: spawn them, fan weight operations out, pick
one for a generation.

One replica's protocol (JSON lines, bounded waits, cancellation) lives in ``replica.py``;
this module adds what concerns the group: a fan-out's failures are one ``FanOutError``, and
with ``abort_on_failure`` the first failure aborts every replica's transfer engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from weightwire.shared.errors import ReferenceServerError
from weightwire.tools.server.replica import LINE_SLACK, Replica, ReplicaError, WorkerSpec


class FanOutError(ReferenceServerError):
    """A fan-out in which at least one replica failed; ``errors[0]`` is the first failure.

    ``aborted`` lists replicas that failed only because the fan-out aborted them after
    that first failure; their (secondary) errors are left out of the message.
    """

    def __init__(
        self, op: str, errors: Sequence[ReplicaError], aborted: Sequence[int] = ()
    ) -> None:
        self.op, self.errors, self.aborted = op, list(errors), list(aborted)
        self.status = self.errors[0].status
        text = "; ".join(str(e) for e in self.errors)
        if self.aborted:
            text += f"; replica(s) {self.aborted} failed too (or were aborted after it)"
        super().__init__(text)


class ReplicaPool:
    """All worker processes of one server; fans weight operations out to every one."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas

    @classmethod
    async def start(cls, spec: WorkerSpec, *, startup_timeout: float = 300.0) -> ReplicaPool:
        """Spawn ``spec.replicas`` workers and wait until each loaded its model."""
        replicas: list[Replica] = []
        try:
            for i in range(spec.replicas):
                payload = json.dumps(asdict(WorkerSpec(**{**asdict(spec), "index": i})))
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "weightwire.tools.server.worker_proc",
                    payload,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=None,
                    limit=spec.max_reply_bytes + LINE_SLACK,
                    env={**os.environ, "WEIGHTWIRE_PARENT_PID": str(os.getpid())},
                )
                replicas.append(Replica(i, proc))
            await asyncio.gather(*(r.wait_ready(startup_timeout) for r in replicas))
        except BaseException:
            await asyncio.gather(*(r.close(2.0) for r in replicas), return_exceptions=True)
            raise
        return cls(replicas)

    def __len__(self) -> int:
        return len(self.replicas)

    async def fan_out(
        self,
        op: str,
        args: Sequence[dict[str, Any]] | dict[str, Any] | None = None,
        *,
        timeout: float,
        abort_on_failure: bool = False,
    ) -> list[Any]:
        """Run ``op`` on every replica concurrently; return their results in order.

        ``args`` is one dict for all or one per replica. With ``abort_on_failure`` the
        first failure aborts the transfer engine on every replica at once, so the
        others (and the trainer) stop waiting for bytes that will never come.
        """
        per = list(args) if isinstance(args, Sequence) else [args or {}] * len(self.replicas)
        if len(per) != len(self.replicas):
            raise ValueError(f"{op}: {len(per)} argument sets for {len(self.replicas)} replicas")
        if len(self.replicas) == 1:  # one replica: the same outcome without a task and as_completed
            try:
                return [await self.replicas[0].call(op, per[0], timeout=timeout)]
            except ReplicaError as exc:
                if abort_on_failure:
                    await self.abort_all()
                raise FanOutError(op, [exc]) from None
        tasks = [
            asyncio.ensure_future(r.call(op, a, timeout=timeout))
            for r, a in zip(self.replicas, per, strict=True)
        ]
        errors: list[ReplicaError] = []
        secondary: list[int] = []
        for fut in asyncio.as_completed(tasks):
            try:
                await fut
            except ReplicaError as exc:
                if errors and abort_on_failure and exc.kind != "dead":
                    secondary.append(exc.replica)
                    continue
                errors.insert(0, exc) if exc.kind == "dead" else errors.append(exc)
                if abort_on_failure:
                    await self.abort_all()
        if errors:
            raise FanOutError(op, errors, sorted(secondary))
        return [t.result() for t in tasks]

    def post(self, op: str) -> None:
        """``op`` to every live replica without awaiting a reply (``Replica.post``): each
        worker reads it before any call sent after it."""
        for r in self.replicas:
            if r.alive:
                r.post(op)

    async def abort_all(self, timeout: float = 30.0) -> None:
        """Tear down every replica's transfer engine now (handled out of band by workers)."""
        await asyncio.gather(
            *(r.call("abort", timeout=timeout) for r in self.replicas if r.alive),
            return_exceptions=True,
        )

    def pick(self) -> Replica:
        """The live replica with the fewest generations in flight (lowest index on ties)."""
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise ReplicaError(-1, "dead", "no live replica to serve the request")
        return min(live, key=lambda r: (r.inflight_generations, r.index))

    def health(self) -> list[dict[str, Any]]:
        return [
            {
                "replica": r.index,
                "alive": r.alive,
                "generations_in_flight": r.inflight_generations,
                "error": r._dead_reason,
            }
            for r in self.replicas
        ]

    async def close(self, grace: float = 5.0) -> None:
        await asyncio.gather(*(r.close(grace) for r in self.replicas), return_exceptions=True)
