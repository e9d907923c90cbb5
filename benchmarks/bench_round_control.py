"""A paused round's control calls against the reference server, on CPU: how many HTTP steps
are on the critical path and what they cost.

    python benchmarks/bench_round_control.py [--rounds 60] [--warmup 5] [--json PATH]

A JAX trainer engine sends the tiny-llama weights (~1 MB: the bytes cost little) to
``weightwire serve`` (one replica, its real worker process, ``weightwire_tcp``) with
``pause_mode="keep"``: every round is paused as a whole, as a colocated write-through round
is (the control sequence is the same: pause, start, update beside the bytes, finish, cache
resets, resume). Every HTTP call of a round is timed on the client (``HTTPWeightSyncClient``'s
per-call path), and the round's calls are merged into *steps*: calls whose time spans overlap
form one step (the update POST overlaps the transfer and is its own step). Reported per round
(medians): the round, its ``control`` phase (pause + start, as the engine books it), its
``finish`` phase (finish + resets + resume), the number of steps, and the steps outside the
update (the calls one after another on the critical path).

Run it on two trees to compare (the script only uses the public API)::

    PYTHONPATH=/path/to/old/tree python benchmarks/bench_round_control.py
    PYTHONPATH=$PWD python benchmarks/bench_round_control.py [--separate]
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
    args = p.parse_args(argv)

    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from weightwire.control import HTTPWeightSyncClient
    from weightwire.jax_side.dtypes import describe
    from weightwire.jax_side.engine import JAXTrainerEngine
    from weightwire.shared.timeouts import Timeouts
    from weightwire.testing.sources import DictSource
    from weightwire.tools.demo.server import EmbeddedServer
    from weightwire.tools.server.tiny import resolve_model
    from weightwire.trainer import TrainerInitInfo

    calls: list[tuple[float, float, str]] = []
    lock = threading.Lock()

    class Timed(HTTPWeightSyncClient):
        def finishes_with_resume(self) -> bool:
            return not args.separate and super().finishes_with_resume()

        def starts_with_pause(self) -> bool:
            return not args.separate and super().starts_with_pause()

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
        info = TrainerInitInfo(backend="weightwire_tcp", pause_mode="keep", timeouts=timeouts)
        engine = JAXTrainerEngine.trainer_init(
            info, client=client, source=DictSource(params, describe)
        )
        try:
            for i in range(args.warmup + args.rounds):
                with lock:
                    calls.clear()
                t0 = time.perf_counter()
                m = engine.send_weights()
                total = time.perf_counter() - t0
                if i < args.warmup:
                    continue
                with lock:
                    steps = _steps(list(calls))
                rows.append(
                    {
                        "round": total,
                        "control": m.seconds.get("control", 0.0),
                        "finish": m.seconds.get("finish", 0.0),
                        "steps": len(steps),
                        "http_calls": getattr(m, "http_calls", None),  # an older tree: none
                        "serial": sum(1 for s in steps if "update_weights" not in s),
                        "shape": " | ".join("+".join(s) for s in steps),
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"median": med, "serial": serial, "http_calls": calls, "shapes": shapes},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
