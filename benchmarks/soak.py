"""Soak: many weight-sync rounds on the TCP lane; resources must stay flat.

    python benchmarks/soak.py [--rounds 1000] [--time-limit 600] [--replicas 2]
        [--engine jax|torch] [--reinit-every 100] [--verify-every 100] [--json soak.json]

A JAX trainer (``JAXTrainerEngine`` over ``PytreeSource`` with the llama preset, the
product path; ``--engine torch``: ``TorchTrainerEngine`` over a tensor dict) pushes
tiny-llama into the reference server (``--replicas`` worker processes) every round,
with changed values each time. Every ``--reinit-every`` rounds the engine is shut down
and a fresh one initialized, so rendezvous, sockets and threads of whole sessions are
soaked too. Every ``--verify-every`` rounds each replica's per-tensor sha256 must
equal what was sent.

Sampled from /proc for the trainer process, the API process and every worker: RSS,
open file descriptors and threads. The report compares round 1, round ``--settle``
(after allocator and JIT warm-up) and the last round; "flat" means the last is within
a small margin of the settled value. Stops at ``--rounds`` or ``--time-limit``,
whichever comes first, and says which. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from weightwire.tools.demo.server import ReadyLine

REPO = Path(__file__).resolve().parents[1]


def proc_stats(pid: int | str) -> dict[str, int]:
    """RSS (KiB), open fds and threads of one process."""
    out = {"rss_kib": 0, "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": 0}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_kib"] = int(line.split()[1])
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    return out


def children(pid: int) -> list[int]:
    kids: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
            kids += [int(x) for x in f.read().split()]
    return sorted(kids)


class Server:
    def __init__(self, replicas: int, log: Path) -> None:
        cmd = [
            sys.executable,
            "-m",
            "weightwire.tools.server",
            "--model",
            "tiny-llama",
            "--port",
            "0",
            "--backend",
            "weightwire_tcp",
            "--replicas",
            str(replicas),
        ]
        self.log = open(log, "w")  # noqa: SIM115  (the server writes to it for its lifetime)
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        ready = ReadyLine(self.proc)
        if not ready.wait(300) or ready.url is None:
            self.stop()
            raise RuntimeError(f"server did not start; see {log}")
        self.url = ready.url
        self.workers = children(self.proc.pid)

    def stats(self) -> dict[str, dict[str, int]]:
        out = {"server-api": proc_stats(self.proc.pid)}
        for i, pid in enumerate(self.workers):
            out[f"server-worker{i}"] = proc_stats(pid)
        return out

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)


# ------------------------------------------------------------------------------ trainers
class JaxTrainer:
    """The product path: a Flax-style pytree, the llama preset, PytreeSource."""

    def __init__(self, model_dir: str) -> None:
        import jax

        from weightwire.jax_side.source import PytreeSource
        from weightwire.tools.models import decoder
        from weightwire.tools.models.loading import load_decoder

        self.cfg, self.params = load_decoder(model_dir)
        self.source = PytreeSource(lambda: self.params, decoder.naming(self.cfg))
        self._step = jax.jit(lambda p, d: jax.tree.map(lambda x: x + d.astype(x.dtype), p))

    def perturb(self, step: int) -> None:
        import jax.numpy as jnp

        self.params = self._step(self.params, jnp.float32(1e-4 * (1 + step % 7)))

    def digests(self) -> dict[str, str]:
        import numpy as np

        return {n: hashlib.sha256(np.asarray(a).tobytes()).hexdigest() for n, a in self.source}

    def engine(self, info: Any, client: Any) -> Any:
        from weightwire.jax_side.engine import JAXTrainerEngine

        return JAXTrainerEngine.trainer_init(info, client=client, source=self.source)


class TorchTrainer:
    def __init__(self, model_dir: str) -> None:
        from safetensors.torch import load_file

        from weightwire.shared.meta import ParamMeta
        from weightwire.shared.source import WeightSource
        from weightwire.torch_side.dtypes import wire_name

        tensors = load_file(os.path.join(model_dir, "model.safetensors"))

        class Source(WeightSource):
            def metadata(self) -> list[ParamMeta]:
                return [
                    ParamMeta(n, wire_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()
                ]

            def __iter__(self) -> Any:
                yield from tensors.items()

        self.tensors, self.source = tensors, Source()

    def perturb(self, step: int) -> None:
        for n in self.tensors:
            self.tensors[n].add_(1e-4 * (1 + step % 7))

    def digests(self) -> dict[str, str]:
        from weightwire.torch_side.sender.engine import tensor_bytes

        return {
            n: hashlib.sha256(tensor_bytes(t).numpy()).hexdigest() for n, t in self.tensors.items()
        }

    def engine(self, info: Any, client: Any) -> Any:
        from weightwire.torch_side.sender.engine import TorchTrainerEngine

        return TorchTrainerEngine.trainer_init(info, client=client, source=self.source)


# ------------------------------------------------------------------------------ the soak
def sample(server: Server, round_no: int, elapsed: float) -> dict[str, Any]:
    return {
        "round": round_no,
        "elapsed_s": round(elapsed, 2),
        "trainer": proc_stats("self"),
        **server.stats(),
    }


def verify(client: Any, want: dict[str, str], version: str) -> None:
    (reply,) = client.weight_checker("checksum")
    for i, replica in enumerate(reply["replica_checksums"]):
        bad = [n for n in want if replica.get(n) != want[n]]
        if bad:
            raise AssertionError(
                f"replica {i} differs from what was sent in {len(bad)} tensors, e.g. {bad[:3]}"
            )
    got = client.weight_info()[0]["weight_version"]
    if got != version:
        raise AssertionError(f"server reports weight_version {got!r}, sent {version!r}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from weightwire.control import HTTPWeightSyncClient
    from weightwire.tools.server.tiny import tiny_model_dir
    from weightwire.trainer import TrainerInitInfo

    model_dir = tiny_model_dir("tiny-llama")
    trainer = (JaxTrainer if args.engine == "jax" else TorchTrainer)(model_dir)
    server = Server(args.replicas, Path(args.log))
    client = HTTPWeightSyncClient(server.url, timeout=60)
    info = TrainerInitInfo(backend="weightwire_tcp", packed_buffer_size_bytes=args.buffer_bytes)
    samples: list[dict[str, Any]] = []
    seconds: list[float] = []
    control: list[
        float
    ] = []  # start + finish round trips (RoundMetrics), the control plane's share
    verified = sessions = 0
    start = time.monotonic()
    stop_reason = f"{args.rounds} rounds done"
    engine = None
    try:
        for r in range(1, args.rounds + 1):
            if engine is None:
                engine = trainer.engine(info, client)
                sessions += 1
            trainer.perturb(r)
            t0 = time.perf_counter()
            metrics = engine.send_weights(str(r))
            seconds.append(time.perf_counter() - t0)
            control.append(metrics.seconds.get("control", 0.0) + metrics.seconds.get("finish", 0.0))
            if r % args.verify_every == 0 or r == 1:
                verify(client, trainer.digests(), str(r))
                verified += 1
            # Sampled mid-session (before a re-init's shutdown), so every sample sees the same
            # phase.
            if r in (1, args.settle) or r % args.sample_every == 0:
                samples.append(sample(server, r, time.monotonic() - start))
            if args.reinit_every and r % args.reinit_every == 0:
                engine.shutdown()
                engine = None
            if time.monotonic() - start > args.time_limit:
                stop_reason = f"time limit of {args.time_limit:.0f} s reached after {r} rounds"
                break
        if samples[-1]["round"] != r:
            samples.append(sample(server, r, time.monotonic() - start))
    finally:
        if engine is not None:
            engine.shutdown()
        client.close()
        server.stop()
    return {
        "engine": args.engine,
        "replicas": args.replicas,
        "rounds": r,
        "sessions": sessions,
        "verified_rounds": verified,
        "stop": stop_reason,
        "wall_s": round(time.monotonic() - start, 1),
        "round_ms": {"median": 1e3 * sorted(seconds)[len(seconds) // 2], "max": 1e3 * max(seconds)},
        "control_ms": {
            "median": 1e3 * sorted(control)[len(control) // 2],
            "p90": 1e3 * sorted(control)[int(len(control) * 0.9)],
        },
        "samples": samples,
    }


def table(result: dict[str, Any], settle: int) -> str:
    first = result["samples"][0]
    settled = next((s for s in result["samples"] if s["round"] >= settle), first)
    last = result["samples"][-1]
    rows = [
        f"| process | metric | round 1 | round {settled['round']} | round {last['round']} | "
        "last - settled |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for proc in [k for k in last if k not in ("round", "elapsed_s")]:
        for metric in ("rss_kib", "fds", "threads"):
            a, b, c = first[proc][metric], settled[proc][metric], last[proc][metric]
            unit = (lambda v: f"{v / 1024:.1f} MiB") if metric == "rss_kib" else str
            rows.append(
                f"| {proc} | {metric.replace('_kib', '')} | {unit(a)} | {unit(b)} | {unit(c)} | "
                f"{'+' if c >= b else ''}{unit(c - b)} |"
            )
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1000)
    p.add_argument(
        "--time-limit", type=float, default=600.0, help="seconds; stops early and says so"
    )
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--engine", choices=("jax", "torch"), default="jax")
    p.add_argument(
        "--reinit-every", type=int, default=100, help="0: one session for the whole soak"
    )
    p.add_argument("--verify-every", type=int, default=100)
    p.add_argument("--sample-every", type=int, default=50)
    p.add_argument(
        "--settle", type=int, default=50, help="round whose sample is the flatness baseline"
    )
    p.add_argument("--buffer-bytes", type=int, default=64 << 10)
    p.add_argument("--log", default="soak-server.log")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    result = run(args)
    print(
        f"soak: {result['rounds']} rounds ({result['stop']}), {result['sessions']} sessions, "
        f"{result['verified_rounds']} verified, {result['wall_s']} s, round median "
        f"{result['round_ms']['median']:.1f} ms (max {result['round_ms']['max']:.1f} ms), "
        f"control plane (start + finish) median {result['control_ms']['median']:.2f} ms (p90 "
        f"{result['control_ms']['p90']:.2f}); {args.engine} engine, {args.replicas} replica(s)"
    )
    print(table(result, args.settle))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
