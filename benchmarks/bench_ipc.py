"""Colocated weight sync on ONE GPU over ``weightwire_ipc``, through the reference server's HTTP
routes (or the shim).

    python benchmarks/bench_ipc.py --out bench_ipc.md [--engines jax,torch]
        [--models llama3-8b,qwen2-0.5b] [--rounds 5] [--warmup 2] [--control http|shim]
        [--modes default,pull,push,write_through] [--sink] [--two-calls]

Three processes on the same GPU: the trainer (``JAXTrainerEngine`` torch-free, or
``TorchTrainerEngine``) with synthetic bf16 weights of the model's HF shapes; the
reference server's FastAPI routes served by uvicorn (``weightwire.tools.bench.sync_http``); and the
worker (``WeightwireIPCEngine.standalone``). By default the worker loads into a parameter set
laid out as vLLM lays out Llama (``tests/torch_side/vllm_stub.py``'s ``FakeLlama``: fused
``qkv_proj`` / ``gate_up_proj``, vLLM-style narrowing loaders; Qwen2-0.5B with its head tied
to the embedding), and every Hugging Face tensor read back out of it is checked against the
trainer's digest. ``--sink``: **transport only**, the worker loads into a sink that counts
what arrived and keeps nothing (no write-through rows: a sink has nothing to write into).
Push mode: the trainer copies into its slots, the worker copies each piece out (two device
copies per byte); pull mode: the trainer copies straight into the worker's pooled receive
buffers (one copy); write-through: straight into the serving parameters (one copy, no
receive buffer); ``default``: ``TrainerInitInfo``'s own ``ipc_mode`` left unset (``auto``:
write-through where the worker's model takes it, else pull), the row a user who sets nothing
gets (its mode column names the data path it resolved to).

Per config: seconds per round (median of ``--rounds`` after ``--warmup``: the whole
``send_weights``, start / update / finish included), GB/s, and the ratio to the same run's
ceilings: two device copies of the same bytes back to back (every tensor into one buffer,
then that buffer into another; CUDA events, median) and one (the parameter set: one copy of
every tensor into its place in the parameters, measured in the worker; the sink: every
tensor into one buffer); the control ms (start) and finish ms; trainer extra memory
(push: the slot ring, raw ``cudaMalloc``; pull, write-through: none) and worker extra (torch
peak over a round, plus pull mode's receive pool); the HTTP calls per round
(``RoundMetrics.http_calls``, median; none over the shim: a written-through round on the
reference routes is one request, ``--two-calls`` keeps its start apart). Same-host-other-GPU
is not measured (one GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.torch_side.vllm_stub: the vLLM-layout parameter set

from ipc_layout import TRACING, IPCShimReceiver, layout_digests, layout_params  # noqa: E402
from ipc_probes import TracedClient, ceilings_s, profiled  # noqa: E402

from weightwire._trace import dump_trace, trace  # noqa: E402
from weightwire.tools.bench import sync_shim as bench_sync_shim  # noqa: E402
from weightwire.tools.bench.sync import MODELS, build_params, make_source  # noqa: E402
from weightwire.tools.bench.sync_shim import control_client, receiver_main, rpc  # noqa: E402

GIB = 1 << 30
# (model, packed, buffer MiB, buffers, release after round, engines, IPC modes)
CONFIGS = [
    ("llama3-8b", True, 1024, 2, False, "jax,torch", "default,pull,push,write_through"),
    ("llama3-8b", True, 2048, 2, False, "jax", "pull,push"),
    ("llama3-8b", True, 256, 2, False, "jax", "pull"),
    ("llama3-8b", True, 1024, 1, False, "jax", "pull"),
    ("llama3-8b", True, 1024, 2, True, "jax", "pull,push"),
    ("llama3-8b", False, 1024, 2, False, "jax", "push"),
    ("qwen2-0.5b", True, 1024, 2, False, "jax,torch", "default,pull,push,write_through"),
    ("qwen2-0.5b", True, 256, 2, False, "jax,torch", "pull,push"),
    ("qwen2-0.5b", True, 1024, 2, True, "jax", "pull"),
    ("qwen2-0.5b", False, 1024, 2, False, "jax", "push"),
]


def run_config(
    kind: str,
    model: str,
    params: dict[str, Any],
    packed: bool,
    buf: int,
    nb: int,
    release: bool,
    ipc_mode: str,
    cfg: dict[str, Any],
) -> dict[str, Any]:
    from weightwire.shared.timeouts import Timeouts
    from weightwire.trainer.config import TrainerInitInfo

    if kind == "jax":
        from weightwire.jax_side.engine import JAXTrainerEngine as Engine
    else:
        from weightwire.torch_side.sender.engine import TorchTrainerEngine as Engine
    t = cfg["timeout"]
    nbytes = sum(int(a.nbytes) for a in params.values())
    # "default": the ipc_mode a user who sets none gets (TrainerInitInfo's own default)
    asked = {} if ipc_mode == "default" else {"ipc_mode": ipc_mode}
    if ipc_mode == "default":
        ipc_mode = f"default ({TrainerInitInfo(backend='weightwire_ipc').ipc_mode})"
    mode = (f"{ipc_mode} packed {buf >> 20} MiB x{nb}" if packed else "push unpacked") + (
        " release" if release else ""
    )
    row: dict[str, Any] = {
        "engine": kind,
        "control": cfg["control"],
        "model": model,
        "mode": mode,
        "nbytes": nbytes,
        "tensors": len(params),
        "target": "transport only (sink)" if cfg["sink"] else "vLLM-layout parameters",
    }
    client = control_client(cfg, t + 60)
    if cfg.get("two_calls"):  # as a server that offers no round in one request (UPDATE_STARTS)
        client.updates_with_start = lambda: False
    info = TrainerInitInfo(
        backend="weightwire_ipc",
        packed=packed,
        packed_buffer_size_bytes=buf,
        packed_num_buffers=nb,
        device=0,
        server_version="0.33.0",
        inference_world_size=1,
        ipc_release_after_round=release,
        **asked,
        timeouts=Timeouts(http_s=t + 30, connect_s=t, warmup_s=t, transfer_s=t),
    )
    engine = Engine.trainer_init(info, client=client, source=make_source(params))
    if TRACING:
        engine.client = TracedClient(engine.client)
    try:
        for _ in range(cfg["warmup"]):
            engine.send_weights()
        walls, control, finish, calls = [], [], [], []
        helper_walls: list[float] = []
        for n in range(cfg["rounds"]):
            helper = bool(cfg.get("ab_request")) and n % 2 == 1
            start = time.perf_counter()
            trace(f"send> {kind} {model} {mode}")
            with request_on_helper(helper):
                metrics = engine.send_weights()
            (helper_walls if helper else walls).append(time.perf_counter() - start)
            trace("send<")
            control.append(metrics.seconds.get("control", 0.0))
            finish.append(metrics.seconds.get("finish", 0.0))
            calls.append(metrics.http_calls)
        dump_trace("trainer")
        row.update(
            pieces=metrics.chunks,
            phases_ms={k: round(v * 1e3, 2) for k, v in metrics.seconds.items()},
        )
        rpc(cfg["port"], "mem_reset", t)
        if os.environ.get("BENCH_PROFILE") and nbytes < 4 * GIB:
            profiled(f"trainer round {kind} {model} {mode}", engine.send_weights)
        else:
            engine.send_weights()
        got = rpc(cfg["port"], "mem_peak", t)
        path = type(engine.session.sender).__name__
        pull = path != "IPCPipeline"  # pull and write-through hold nothing on the trainer
        if cfg["sink"]:
            loaded = got["nbytes"] == nbytes and got["tensors"] == len(params)
        else:
            loaded = rpc(cfg["port"], "digests", t) == cfg["want"]
        row.update(
            ipc_mode=path,
            trainer_extra=0 if pull else nb * buf,
            trainer_between=engine.session.sender.held_bytes(),
            worker_extra=got["peak_extra"] + got.get("pool", 0),
            worker_pool=got.get("pool", 0),
            loaded_ok=loaded,
        )
        if not release:
            if cfg["sink"] or path != "IPCWriteThroughPipeline":
                # the two-copy ceiling is push's; written through, it would only take two more
                # round-sized buffers on the trainer's GPU (an 8B torch row then passes 80 GB)
                row["ceiling_s"], row["ceiling1_s"] = ceilings_s(engine, params, nbytes, 5)
            if not cfg["sink"]:  # the floor of a whole round: one copy into the parameters
                row["ceiling1_s"] = float(rpc(cfg["port"], "floor", t, reps=5))
                # the same copy with the write-through's own batching: a launch per chunk
                row["ceiling1b_s"] = float(rpc(cfg["port"], "floor", t, reps=5, batched=True))
    finally:
        engine.shutdown()
        getattr(client, "close", lambda: None)()
    if helper_walls:  # --ab-request: the same rounds with the request sent from its helpers
        row["helper_request_s"] = statistics.median(helper_walls)
        row["pairs_faster"] = sum(a < b for a, b in zip(walls, helper_walls, strict=False))
    row.update(
        round_s=statistics.median(walls),
        control_ms=1e3 * statistics.median(control),
        finish_ms=1e3 * statistics.median(finish),
        http_calls=None if None in calls else statistics.median(calls),
        walls=walls,
    )
    return row


@contextlib.contextmanager
def request_on_helper(on: bool) -> Iterator[None]:
    """``--ab-request``'s baseline: a round of one request sent as before the data path sent
    it itself (``Outgoing.request`` withheld: ``begin`` sends it from its helper threads),
    alternating round by round with the default in the same process."""
    if not on:
        yield
        return
    from weightwire.backends.ipc import pipeline as ipc_pipeline

    own = ipc_pipeline.IPCDataPath.send

    def send(self: Any, out: Any) -> Any:
        return own(self, dataclasses.replace(out, request=None))

    ipc_pipeline.IPCDataPath.send = send  # type: ignore[method-assign]
    try:
        yield
    finally:
        ipc_pipeline.IPCDataPath.send = own  # type: ignore[method-assign]


def sender_main(cfg: dict[str, Any]) -> None:
    rows = []
    kind = cfg["engine"]
    for model in cfg["models"]:
        todo = [
            (*c[:5], m)
            for c in CONFIGS
            if c[0] == model and kind in c[5].split(",")
            for m in c[6].split(",")
            # a sink has no parameters to write through (nor a default row that resolves to it)
            if m in cfg["modes"] and not (cfg["sink"] and m in ("write_through", "default"))
        ]
        if not todo:
            continue
        if cfg["sink"]:
            params = build_params(model, kind)
        else:
            rpc(cfg["port"], "layout", cfg["timeout"] + 60, model=model)
            params = layout_params(model, kind)
            cfg["want"] = layout_digests(params, kind)
        for _, packed, mib, nb, release, ipc_mode in todo:
            if time.time() > cfg["deadline"] - 20:
                rows.append(
                    {
                        "engine": kind,
                        "model": model,
                        "mode": f"{ipc_mode} {mib} MiB x{nb}",
                        "error": "skipped: out of time",
                    }
                )
                continue
            try:
                rows.append(
                    run_config(kind, model, params, packed, mib << 20, nb, release, ipc_mode, cfg)
                )
            except Exception as exc:
                rows.append(
                    {
                        "engine": kind,
                        "model": model,
                        "mode": f"{ipc_mode} {mib} MiB x{nb}",
                        "error": f"{type(exc).__name__}: {exc}"[:300],
                    }
                )
            print(json.dumps(rows[-1], default=str), file=sys.stderr, flush=True)
        del params
    print(json.dumps(rows), flush=True)
    os._exit(0)


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| engine | control | model | into | GB/round | mode | chunks | ms/round | GB/s | 2-copy "
        "ceiling ms | ratio | 1-copy ceiling ms | ratio | 1-copy batched ms | ratio | start ms "
        "| finish ms | HTTP calls | trainer extra GiB (between rounds) | worker extra GiB "
        "| loaded |\n" + "|---" * 21 + "|\n"
    )
    out = []
    for r in rows:
        if "error" in r:
            out.append(
                f"| {r['engine']} | | {r['model']} | | | {r['mode']} | | | | | | | | | | | | | | | "
                f"{r['error']} |"
            )
            continue
        gb, s = r["nbytes"] / 1e9, r["round_s"]
        c2, c1, c1b = r.get("ceiling_s"), r.get("ceiling1_s"), r.get("ceiling1b_s")
        n = r.get("http_calls")
        out.append(
            f"| {r['engine']} | {r['control']} | {r['model']} | {r.get('target', '')} | {gb:.2f} "
            f"| {r['mode']} ({r['ipc_mode']}) | "
            f"{r['pieces']} | {s * 1e3:.2f} | {gb / s:.0f} | "
            f"{'' if c2 is None else f'{c2 * 1e3:.2f}'} | "
            f"{'' if c2 is None else f'{c2 / s:.3f}'} | "
            f"{'' if c1 is None else f'{c1 * 1e3:.2f}'} | "
            f"{'' if c1 is None else f'{c1 / s:.3f}'} | "
            f"{'' if c1b is None else f'{c1b * 1e3:.2f}'} | "
            f"{'' if c1b is None else f'{c1b / s:.3f}'} | {r['control_ms']:.2f} | "
            f"{r['finish_ms']:.2f} | {'-' if n is None else f'{n:g}'} | "
            f"{r['trainer_extra'] / GIB:.2f} "
            f"({r['trainer_between'] / GIB:.2f}) | {r['worker_extra'] / GIB:.2f} | "
            f"{'ok' if r['loaded_ok'] else 'MISMATCH'} |"
        )
    return head + "\n".join(out) + "\n"


def _spawn(role: str, cfg: dict[str, Any], path: Path) -> subprocess.Popen:
    path.write_text(json.dumps(cfg))
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), str(REPO / "benchmarks"), env.get("PYTHONPATH", "")) if p
    )
    return subprocess.Popen(
        [sys.executable, __file__, "--role", role, "--config", str(path)],
        env=env,
        stdout=subprocess.PIPE if role == "sender" else None,
        text=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="jax,torch")
    ap.add_argument("--models", default="llama3-8b,qwen2-0.5b")
    ap.add_argument("--control", default="http", choices=("http", "shim"))
    ap.add_argument(
        "--modes",
        default="default,pull,push,write_through",
        help="IPC data paths to run: default (TrainerInitInfo's own ipc_mode: auto), pull (one "
        "copy), push (slot ring), write_through (one copy, into the parameters)",
    )
    ap.add_argument(
        "--sink",
        action="store_true",
        help="transport only: the worker loads into a sink that keeps nothing (default: a "
        "vLLM-layout parameter set)",
    )
    ap.add_argument(
        "--ab-request",
        action="store_true",
        help="alternate rounds with the one request sent from the begin helper (the baseline "
        "before the data path sent it itself); reports both medians",
    )
    ap.add_argument(
        "--two-calls",
        action="store_true",
        help="never send the round in one request (the reference server's UPDATE_STARTS): "
        "its start apart, as before it (the same tree's baseline)",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--deadline-s", type=float, default=400.0)
    ap.add_argument("--out")
    ap.add_argument("--role", choices=("sender", "receiver", "api"), help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        cfg = json.loads(Path(args.config).read_text())
        if args.role == "receiver":
            bench_sync_shim.Receiver = (
                IPCShimReceiver  # receiver_main builds the class it finds here
            )
            receiver_main(cfg)
        elif args.role == "api":
            from weightwire.tools.bench.sync_http import api_main

            api_main(cfg)
        else:
            sender_main(cfg)
        return 0
    if not args.sink:
        from tests.torch_side.vllm_stub import SHAPES

        known: Any = SHAPES
    else:
        known = MODELS
    unknown = [m for m in args.models.split(",") if m not in known]
    if unknown:
        ap.error(f"unknown models {unknown}")
    deadline = time.time() + args.deadline_s
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="weightwire-bench-ipc-") as tmp:
        port_file = Path(tmp, "port")
        procs = [
            _spawn(
                "receiver",
                {"port_file": str(port_file), "deadline": deadline + 60},
                Path(tmp, "r.json"),
            )
        ]
        try:
            while not port_file.exists():
                if procs[0].poll() is not None or time.time() > deadline:
                    raise RuntimeError("receiver process did not start its control shim")
                time.sleep(0.1)
            port, url = int(port_file.read_text()), None
            if args.control == "http":
                url_file = Path(tmp, "url")
                procs.append(
                    _spawn(
                        "api",
                        {
                            "port": port,
                            "url_file": str(url_file),
                            "timeout": args.timeout + 60,
                            "deadline": deadline + 60,
                            "backend": "weightwire_ipc",
                        },
                        Path(tmp, "a.json"),
                    )
                )
                while not url_file.exists() and procs[-1].poll() is None and time.time() < deadline:
                    time.sleep(0.1)
                if not url_file.exists():
                    raise RuntimeError("the API process did not start (fastapi/uvicorn missing?)")
                url = json.loads(url_file.read_text())["url"]
            for kind in args.engines.split(","):
                cfg = {
                    "port": port,
                    "url": url,
                    "engine": kind,
                    "control": args.control,
                    "models": args.models.split(","),
                    "deadline": deadline,
                    "timeout": args.timeout,
                    "rounds": args.rounds,
                    "warmup": args.warmup,
                    "modes": args.modes.split(","),
                    "sink": args.sink,
                    "two_calls": args.two_calls,
                    "ab_request": args.ab_request,
                }
                sender = _spawn("sender", cfg, Path(tmp, f"s-{kind}.json"))
                procs.append(sender)
                out, _ = sender.communicate(timeout=max(30.0, deadline - time.time() + 120))
                got = [line for line in out.splitlines() if line.startswith("[")]
                rows += (
                    json.loads(got[-1])
                    if got
                    else [
                        {
                            "engine": kind,
                            "model": "-",
                            "mode": "-",
                            "error": f"sender exited {sender.returncode}",
                        }
                    ]
                )
            rpc(port, "quit", 10)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
    text = table(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out + ".json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
