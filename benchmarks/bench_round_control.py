"""A paused round's control calls against the reference server, on CPU: how many HTTP steps
are on the critical path and what they cost.

    python benchmarks/bench_round_control.py [--rounds 60] [--warmup 5] [--json PATH]
        [--pause-mode keep|abort|wait] [--one-request]

A JAX trainer engine sends the tiny-llama weights (~1 MB: the bytes cost little) to
``weightwire serve`` (one replica, its real worker process, ``weightwire_tcp``) with
``pause_mode="keep"``: every round is paused as a whole, as a colocated write-through round
is (the control sequence is the same: pause, start, update beside the bytes, finish, cache
resets, resume). ``--pause-mode abort`` pauses as a write-through round does by default
(in flight generation cancelled: the start's cancel reaches the worker process too).
Every HTTP call of a round is timed on the client (``HTTPWeightSyncClient``'s
per-call path), and the round's calls are merged into *steps*: calls whose time spans overlap
form one step (the update POST overlaps the transfer and is its own step). Reported per round
(medians): the round, its ``control`` phase (pause + start, as the engine books it), its
``finish`` phase (finish + resets + resume), the number of steps, and the steps outside the
update (the calls one after another on the critical path).

Per call (``--per-call`` table, medians over the rounds): the call as the trainer sees it
(``client``: from the request's first byte out to its reply read), as the server spends it
(``app``: its handler, from the reply's ``Server-Timing`` header), the part of that spent
waiting for the worker process (``worker``), the pause a start does (``pause``) and the
commit an update that finishes does (``commit``, ``--finish-apart``: none); ``http``
is ``client - app``: the client's encode and parse, the socket, uvicorn and FastAPI;
``sent`` and ``back``: when the request went out and its reply was read, since
``send_weights()`` was called (the gaps between calls are the trainer's own work).

Run it on two trees to compare (the script only uses the public API)::

    PYTHONPATH=/path/to/old/tree python benchmarks/bench_round_control.py
    PYTHONPATH=$PWD python benchmarks/bench_round_control.py [--separate | --finish-apart]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any


def _steps(calls: list[tuple[float, float, str]]) -> list[list[str]]:
    """Calls merged into steps: a call that starts before the running step ended joins it."""
    steps: list[list[str]] = []
    end = -1.0
    for t0, t1, name in sorted(calls):
        if steps and t0 < end:
            steps[-1].append(name)
            end = max(end, t1)
        else:
            steps.append([name])
            end = t1
    return steps


def _per_call(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per route: the medians over the rounds of each time (and of ``client - app``)."""
    names: list[str] = []
    for r in rows:
        names.extend(n for n in r["calls"] if n not in names)
    out: dict[str, dict[str, float]] = {}
    for name in names:
        seen = [r["calls"][name] for r in rows if name in r["calls"]]
        med: dict[str, float] = {"n": float(len(seen))}
        for key in ("client", "app", "worker", "pause", "commit", "sent", "back"):
            values = [c[key] for c in seen if key in c]
            if values:
                med[key] = statistics.median(values)
        http = [c["client"] - c["app"] for c in seen if "app" in c]
        if http:
            med["http"] = statistics.median(http)
        out[name] = med
    return out


class _HeardAtOnce:
    """``--one-request``: the session's TCP data path, saying at once that it heard its
    workers (``RoundSender.hears_workers``), so the engine sends the round in one request.
    Only for measuring the control path: a real data path that hears its workers
    (``weightwire_ipc`` written through) writes nothing before their go."""

    hears_workers = True

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def send(self, out: Any) -> Any:
        if out.one_request and out.heard is not None:
            out.heard()
        return self._inner.send(out)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument(
        "--separate",
        action="store_true",
        help="never use the server's start that pauses nor its finish that resets and resumes "
        "(separate calls, as to stock vLLM)",
    )
    p.add_argument(
        "--finish-apart",
        action="store_true",
        help="never use the server's update that also finishes (the finish its own call, "
        "as before it)",
    )
    p.add_argument(
        "--one-request",
        action="store_true",
        help="the round in one request (the server's UPDATE_STARTS), as a colocated "
        "written-through round goes: the TCP data path is told it heard its workers at once "
        "(a stand-in for weightwire_ipc's go, which needs CUDA: its bytes wait in the socket "
        "until the workers read them in the update)",
    )
    p.add_argument("--pause-mode", default="keep", choices=("keep", "abort", "wait"))
    args = p.parse_args(argv)

    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from weightwire._trace import dump_trace, trace
    from weightwire.control import HTTPWeightSyncClient
    from weightwire.jax_side.dtypes import describe
    from weightwire.jax_side.engine import JAXTrainerEngine
    from weightwire.shared.timeouts import Timeouts
    from weightwire.testing.sources import DictSource
    from weightwire.tools.demo.server import EmbeddedServer
    from weightwire.tools.server.call_clock import HEADER, parse_server_timing
    from weightwire.tools.server.tiny import resolve_model
    from weightwire.trainer import TrainerInitInfo

    calls: list[tuple[float, float, str]] = []
    lock = threading.Lock()
    told: dict[str, dict[str, float]] = {}
    """Per call (route name) of the running round: what its Server-Timing header said."""

    class Timed(HTTPWeightSyncClient):
        def finishes_with_resume(self) -> bool:
            return not args.separate and super().finishes_with_resume()

        def starts_with_pause(self) -> bool:
            return not args.separate and super().starts_with_pause()

        def updates_with_finish(self) -> bool:  # an older tree has none: never called there
            return not (args.separate or args.finish_apart) and super().updates_with_finish()

        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            for path in self._paths:
                path.send = self._read_timing(path.send)  # type: ignore[method-assign]

        @staticmethod
        def _read_timing(send: Any) -> Any:
            def timed(route: Any, *a: Any, **k: Any) -> Any:
                response = send(route, *a, **k)
                value = response.headers.get(HEADER)
                if value is not None:
                    with lock:
                        told[route.name] = parse_server_timing(value)
                return response

            return timed

        def _request(self, i: int, route: Any, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super()._request(i, route, *a, **k)
            finally:
                with lock:
                    calls.append((t0, time.perf_counter(), route.name))

    params = {
        k: jnp.asarray(v)
        for k, v in load_file(
            os.path.join(resolve_model("tiny-llama"), "model.safetensors")
        ).items()
    }
    timeouts = Timeouts(http_s=60, connect_s=60, warmup_s=60, transfer_s=60)
    rows: list[dict[str, Any]] = []
    with EmbeddedServer("tiny-llama", startup_timeout=180) as server:
        assert server.url is not None
        client = Timed(server.url, timeout=60)
        info = TrainerInitInfo(
            backend="weightwire_tcp", pause_mode=args.pause_mode, timeouts=timeouts
        )
        engine = JAXTrainerEngine.trainer_init(
            info, client=client, source=DictSource(params, describe)
        )
        if args.one_request:
            engine.session.sender = _HeardAtOnce(engine.session.sender)
        try:
            for i in range(args.warmup + args.rounds):
                with lock:
                    calls.clear()
                    told.clear()
                began = time.perf_counter()
                trace("send> round")  # WEIGHTWIRE_IPC_TRACE: benchmarks/ipc_timeline.py reads
                m = engine.send_weights()
                total = time.perf_counter() - began
                trace("send<")
                dump_trace("trainer")
                if i < args.warmup:
                    continue
                with lock:
                    steps = _steps(list(calls))
                    per = {
                        name: {
                            "client": t1 - t0,
                            "sent": t0 - began,
                            "back": t1 - began,
                            **told.get(name, {}),
                        }
                        for t0, t1, name in calls
                    }
                rows.append(
                    {
                        "round": total,
                        "control": m.seconds.get("control", 0.0),
                        "finish": m.seconds.get("finish", 0.0),
                        "steps": len(steps),
                        "http_calls": getattr(m, "http_calls", None),  # an older tree: none
                        "serial": sum(1 for s in steps if "update_weights" not in s),
                        "shape": " | ".join("+".join(s) for s in steps),
                        "calls": per,
                        "phases": dict(m.seconds),
                    }
                )
        finally:
            engine.shutdown()
            client.close()
    med = {
        k: statistics.median(r[k] for r in rows) for k in ("round", "control", "finish", "steps")
    }
    serial = statistics.median(r["serial"] for r in rows)
    shapes: dict[str, int] = {}
    for r in rows:
        shapes[r["shape"]] = shapes.get(r["shape"], 0) + 1
    print(f"{len(rows)} rounds after {args.warmup} warm-up; medians:")
    print(
        f"  round {med['round'] * 1e3:.2f} ms   control (pause+start) {med['control'] * 1e3:.2f} ms"
        f"   finish (+resets+resume) {med['finish'] * 1e3:.2f} ms"
    )
    counted = [r["http_calls"] for r in rows if r["http_calls"] is not None]
    calls = statistics.median(counted) if counted else None
    print(
        f"  HTTP steps per round {med['steps']:.0f}, outside the update: {serial:.0f}; "
        f"HTTP calls per round (RoundMetrics.http_calls) {'-' if calls is None else f'{calls:g}'}"
    )
    for shape, n in sorted(shapes.items(), key=lambda kv: -kv[1])[:3]:
        print(f"  {n:4d} x  {shape}")
    phases: dict[str, float] = {}
    for key in dict.fromkeys(k for r in rows for k in r["phases"]):
        phases[key] = statistics.median(r["phases"].get(key, 0.0) for r in rows)
    print(
        "  the round's phases (RoundMetrics.seconds), medians in ms: "
        + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in phases.items())
    )
    per_call = _per_call(rows)
    print(
        "  per call, medians in ms (client: the trainer's; app, worker, pause: the server's; "
        "sent, back: since the round began)"
    )
    cols = ("client", "app", "worker", "pause", "commit", "http", "sent", "back")
    print(f"  {'call':<26} {'n':>4} " + " ".join(f"{c:>8}" for c in cols))
    for name, med_call in per_call.items():
        cells = ["-" if med_call.get(k) is None else f"{med_call[k] * 1e3:.3f}" for k in cols]
        print(f"  {name:<26} {med_call['n']:>4.0f} " + " ".join(f"{c:>8}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "median": med,
                    "serial": serial,
                    "http_calls": calls,
                    "shapes": shapes,
                    "per_call": per_call,
                    "phases": phases,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
