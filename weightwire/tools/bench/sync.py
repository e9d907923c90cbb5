"""Full weight-sync rounds on two GPUs: trainer engine (GPU0) -> torch worker engine (GPU1).

    weightwire bench --sync --out bench_sync.md [--engines jax,torch] [--control http,shim]
        [--models qwen2-0.5b,qwen2-1.5b,llama3-8b] [--buffers-mib 256,1024] [--num-buffers 1,2,3]
        [--no-unpacked] [--rounds 5] [--warmup 2]

Parameter sets have the HF names and shapes of real models (synthetic bf16 values).
The sender drives ``JAXTrainerEngine`` (JAX arrays) or ``TorchTrainerEngine`` (torch
tensors) ``.trainer_init(TrainerInitInfo(backend="weightwire_nccl", ...))`` and
``send_weights()``. The receiver process runs ``WeightwireNCCLEngine.standalone(model=Sink)``
(``Sink.load_weights`` only counts what arrived) behind one of two control planes:

- ``http``: the reference server's routes (FastAPI app, uvicorn, loopback) driven by
  ``HTTPWeightSyncClient`` -- what a trainer pays against a server (``bench_sync_http.py``);
- ``shim``: one JSON line per call over a fresh local socket (``bench_sync_shim.py``),
  for hosts without fastapi/uvicorn.

Per config: seconds per round (median of ``--rounds`` after ``--warmup``), GB/s
(1e9 B/s), the ratio to raw NCCL (CuPy ``bcast`` of the same chunk sizes back to back
on one stream, same run, separate communicator), the control-plane ms per round
(``start`` + ``finish``, from ``RoundMetrics``), and peak extra GPU memory per side
next to the bound ``num_buffers x buffer + largest tensor``: sender = peak over the
measured round of (JAX or torch bytes in use + CuPy pool bytes in use) minus the same
before ``trainer_init`` (so the rotating buffers kept between rounds count); receiver =
torch peak allocated minus the level before the round. One more round per config is
traced (``bench_sync_trace.py``: control calls, broadcast enqueues, CUDA events) and
kept in the JSON rows as ``timeline``. A config that fails is reported as such.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from weightwire import backends
from weightwire._extras import require
from weightwire.tools._cli import CommandError, HelpFormatter
from weightwire.tools.bench.sync_models import MODELS, build_params, hf_shapes, make_source
from weightwire.tools.bench.sync_shim import ShimClient, raw_rounds, receiver_main, rpc
from weightwire.tools.bench.sync_trace import trace_round

REPO = Path(__file__).resolve().parents[2]  # the directory holding the weightwire package
GIB = 1 << 30

__all__ = [
    "MODELS",
    "build_params",
    "hf_shapes",
    "main",
    "make_source",
]  # the parameter sets: sync_models


# -- sender ----------------------------------------------------------------------------------


class MemSampler:
    """Peak of (framework + CuPy pool) device bytes in use, polled in a thread, above ``base``."""

    def __init__(self, engine: str, base: int | None = None) -> None:
        import cupy as cp

        self._pool = cp.get_default_memory_pool()
        if engine == "jax":
            import jax

            dev = jax.devices()[0]
            self._framework = lambda: int((dev.memory_stats() or {}).get("bytes_in_use", 0))
        else:
            import torch

            self._framework = lambda: int(torch.cuda.memory_allocated(0))
        self.base = self.sample() if base is None else base
        self.peak = self.sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        return self._framework() + int(self._pool.used_bytes())

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.sample())

    def __enter__(self) -> MemSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.peak = max(self.peak, self.sample())


def run_config(
    engine_kind: str,
    model: str,
    params: dict[str, Any],
    packed: bool,
    buf: int,
    nb: int,
    cfg: dict[str, Any],
) -> dict[str, Any]:
    from weightwire.backends.nccl.library import mint_unique_id
    from weightwire.shared.framing import plan
    from weightwire.shared.timeouts import Timeouts
    from weightwire.trainer.config import TrainerInitInfo
    from weightwire.trainer.engine import TrainerEngine

    Engine: type[TrainerEngine]
    if engine_kind == "jax":
        from weightwire.jax_side.engine import JAXTrainerEngine as Engine
    else:
        from weightwire.torch_side.sender.engine import TorchTrainerEngine as Engine
    t = cfg["timeout"]
    row: dict[str, Any] = {
        "engine": engine_kind,
        "control": cfg["control"],
        "model": model,
        "mode": f"packed {buf >> 20} MiB x{nb}" if packed else "unpacked",
        "nbytes": sum(int(a.nbytes) for a in params.values()),
        "tensors": len(params),
    }
    source = make_source(params)
    if cfg["control"] == "http":
        from weightwire.control.client import HTTPWeightSyncClient

        client: Any = HTTPWeightSyncClient(cfg["url"], timeout=t + 60)
    else:
        client = ShimClient(cfg["port"], timeout=t + 60)
    metas = source.metadata()
    row["largest"] = max(m.nbytes for m in metas)
    row["bound"] = nb * buf + row["largest"] if packed else row["largest"]
    wanted: dict[str, Any] = dict(
        backend=backends.WEIGHTWIRE_NCCL,
        packed=packed,
        packed_buffer_size_bytes=buf,
        packed_num_buffers=nb,
        device=0,
        server_version="0.33.0",
        inference_world_size=1,
        timeouts=Timeouts(http_s=t + 30, connect_s=t, warmup_s=t, transfer_s=t),
    )
    known = {f.name for f in dataclasses.fields(TrainerInitInfo)}
    if (
        cfg["control"] == "http"
    ):  # the floor of one round trip here: GET /version, no worker behind it
        samples = []
        for _ in range(30):
            began = time.perf_counter()
            client.version()
            samples.append(time.perf_counter() - began)
        row["http_rtt_ms"] = 1e3 * statistics.median(samples)
    base = MemSampler(engine_kind).sample()  # before the engine: its kept buffers count as extra
    engine = Engine.trainer_init(
        TrainerInitInfo(**{k: v for k, v in wanted.items() if k in known}),
        client=client,
        source=source,
    )
    try:
        for _ in range(cfg["warmup"]):
            engine.send_weights()
        walls, control, finish = [], [], []
        for _ in range(cfg["rounds"]):
            start = time.perf_counter()
            metrics = engine.send_weights()
            walls.append(time.perf_counter() - start)
            control.append(metrics.seconds.get("control", 0.0))
            finish.append(metrics.seconds.get("finish", 0.0))
        row["chunks"] = metrics.chunks
        row["phases_ms"] = {k: round(v * 1e3, 2) for k, v in metrics.seconds.items()}
        row["timeline"] = trace_round(engine, lambda: rpc(cfg["port"], "trace", t))
        rpc(cfg["port"], "mem_reset", t)
        with MemSampler(engine_kind, base) as mem:
            engine.send_weights()
        got = rpc(cfg["port"], "mem_peak", t)
        row.update(
            send_extra=mem.peak - mem.base,
            recv_extra=got["peak_extra"],
            loaded_ok=got["nbytes"] == row["nbytes"] and got["tensors"] == row["tensors"],
        )
    finally:
        engine.shutdown()
        close = getattr(client, "close", None)
        if close is not None:
            close()
    row.update(
        round_s=statistics.median(walls),
        control_ms=1e3 * statistics.median(control),
        finish_ms=1e3 * statistics.median(finish),
        walls=walls,
    )
    sizes = [c.nbytes for c in plan(metas, packed=packed, buffer_size_bytes=buf) if c.nbytes]
    uid = mint_unique_id()
    rpc(
        cfg["port"],
        "raw_begin",
        t,
        uid_b64=base64.b64encode(uid).decode(),
        sizes=sizes,
        rounds=cfg["warmup"] + cfg["rounds"],
        timeout=t,
    )
    raw = raw_rounds(uid, 0, sizes, cfg["warmup"] + cfg["rounds"], t)[cfg["warmup"] :]
    rx = rpc(cfg["port"], "raw_end", t + 30, timeout=t)
    if "error" in rx:
        raise RuntimeError(f"raw receiver: {rx['error']}")
    row.update(raw_s=statistics.median(raw), raw_walls=raw)
    return row


def sender_main(cfg: dict[str, Any]) -> None:
    from weightwire.backends.nccl.library import nccl_available

    engine, control = cfg["engine"], cfg["control"]
    rows: list[dict[str, Any]] = []
    if not nccl_available():
        rows.append(
            {
                "engine": engine,
                "control": control,
                "model": "-",
                "mode": "-",
                "error": "no CuPy NCCL / CUDA device on the sender",
            }
        )
        cfg["models"] = []
    for model in cfg["models"]:
        if time.time() > cfg["deadline"] - 60:
            rows.append(
                {
                    "engine": engine,
                    "control": control,
                    "model": model,
                    "mode": "-",
                    "error": "skipped: out of time",
                }
            )
            continue
        params = build_params(model, engine)
        configs = [(True, b, n) for b in cfg["buffers"] for n in cfg["num_buffers"]]
        configs += [(False, cfg["buffers"][0], 1)] if cfg["unpacked"] else []
        for packed, buf, nb in configs:
            mode = f"packed {buf >> 20} MiB x{nb}" if packed else "unpacked"
            if time.time() > cfg["deadline"] - 30:
                rows.append(
                    {
                        "engine": engine,
                        "control": control,
                        "model": model,
                        "mode": mode,
                        "error": "skipped: out of time",
                    }
                )
                continue
            try:
                rows.append(run_config(engine, model, params, packed, buf, nb, cfg))
            except Exception as exc:
                rows.append(
                    {
                        "engine": engine,
                        "control": control,
                        "model": model,
                        "mode": mode,
                        "error": f"{type(exc).__name__}: {exc}"[:300],
                    }
                )
            print(json.dumps(rows[-1], default=str), file=sys.stderr, flush=True)
        del params
    print(json.dumps(rows), flush=True)
    os._exit(0)


# -- parent ----------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| engine | control | model | GB/round | mode | chunks | s/round | GB/s | raw NCCL s | "
        "ratio | start ms | finish ms | ratio w/o start+finish | sender extra GiB | receiver "
        "extra GiB | bound GiB | loaded |\n" + "|---" * 17 + "|\n"
    )
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r.get('engine', '-')} | {r.get('control', '-')} | {r['model']} | | "
                f"{r['mode']} | | | | | | | | | | | | {r['error']} |"
            )
            continue
        gb = r["nbytes"] / 1e9
        lines.append(
            f"| {r['engine']} | {r['control']} | {r['model']} | {gb:.2f} | {r['mode']} | "
            f"{r['chunks']} | {r['round_s']:.4f} | {gb / r['round_s']:.1f} | {r['raw_s']:.4f} | "
            f"{r['raw_s'] / r['round_s']:.3f} | {r['control_ms']:.2f} | {r['finish_ms']:.2f} | "
            f"{r['raw_s'] / (r['round_s'] - (r['control_ms'] + r['finish_ms']) / 1e3):.3f} | "
            f"{r['send_extra'] / GIB:.2f} | {r['recv_extra'] / GIB:.2f} | {r['bound'] / GIB:.2f} "
            f"| {'ok' if r['loaded_ok'] else 'MISMATCH'} |"
        )
    return head + "\n".join(lines) + "\n"


def _spawn(role: str, gpu: int | None, cfg: dict[str, Any], path: Path) -> subprocess.Popen:
    path.write_text(json.dumps(cfg))
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="" if gpu is None else str(gpu),
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weightwire.tools.bench.sync",
            "--role",
            role,
            "--config",
            str(path),
        ],
        env=env,
        stdout=subprocess.PIPE if role == "sender" else None,
        text=True,
    )


def _gpus() -> int:
    """CUDA devices torch sees (the receiver is a torch worker engine)."""
    require("torch", purpose="weightwire bench --sync")
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0].split("\n")[0],
        formatter_class=HelpFormatter,
    )
    ap.add_argument(
        "--engines",
        default="jax,torch",
        help="trainer engines to run: jax, torch (comma-separated)",
    )
    ap.add_argument(
        "--control", default="http", help="control planes to run: http, shim (comma-separated)"
    )
    ap.add_argument(
        "--models",
        default=",".join(MODELS),
        help="parameter sets (HF names and shapes of these models)",
    )
    ap.add_argument(
        "--buffers-mib",
        default="256,1024",
        help="packed buffer sizes to try, MiB (comma-separated)",
    )
    ap.add_argument(
        "--num-buffers", default="1,2,3", help="packed buffer counts to try (comma-separated)"
    )
    ap.add_argument(
        "--no-unpacked",
        action="store_true",
        help="skip the unpacked (one broadcast per tensor) mode",
    )
    ap.add_argument(
        "--rounds", type=int, default=5, help="timed rounds per config (the median is reported)"
    )
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds per config first")
    ap.add_argument(
        "--timeout", type=float, default=60.0, help="per-wait timeout (NCCL, control calls)"
    )
    ap.add_argument(
        "--deadline-s", type=float, default=540.0, help="stop starting new configs after this"
    )
    ap.add_argument(
        "--out", help="also write the markdown table here (and the raw rows to OUT.json)"
    )
    ap.add_argument("--role", choices=("sender", "receiver", "api"), help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    if args.role:
        cfg = json.loads(Path(args.config).read_text())
        if args.role == "api":
            from weightwire.tools.bench.sync_http import api_main

            api_main(cfg)
        (sender_main if args.role == "sender" else receiver_main)(cfg)
        return 0
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    engines, controls = args.engines.split(","), args.control.split(",")
    if set(engines) - {"jax", "torch"} or set(controls) - {"http", "shim"}:
        ap.error("--engines takes jax,torch and --control takes http,shim")
    gpus = _gpus()
    if gpus < 2:
        # Refuse before spawning anything: on a CPU host every config would fail and the table be
        # empty.
        raise CommandError(
            f"weightwire bench --sync needs two CUDA GPUs (trainer on GPU 0, receiver on GPU 1); "
            f"torch sees {gpus}. On a CPU host run `weightwire bench` (the TCP data plane)"
        )
    import signal
    import tempfile

    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # run the finally below: kill both children
    deadline = time.time() + args.deadline_s
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="weightwire-bench-sync-") as tmp:
        port_file = Path(tmp, "port")
        receiver = _spawn(
            "receiver",
            1,
            {"port_file": str(port_file), "deadline": deadline + 60},
            Path(tmp, "r.json"),
        )
        sender = api = None
        try:
            while not port_file.exists():
                if receiver.poll() is not None or time.time() > deadline:
                    raise RuntimeError("receiver process did not start its control shim")
                time.sleep(0.1)
            where: dict[str, Any] = {"port": int(port_file.read_text()), "url": None}
            if "http" in controls:
                url_file = Path(tmp, "url")
                api = _spawn(
                    "api",
                    None,
                    {
                        "port": where["port"],
                        "url_file": str(url_file),
                        "timeout": args.timeout + 60,
                        "deadline": deadline + 60,
                    },
                    Path(tmp, "a.json"),
                )
                while not url_file.exists() and api.poll() is None and time.time() < deadline:
                    time.sleep(0.1)
                if url_file.exists():
                    where["url"] = json.loads(url_file.read_text())["url"]
            for engine in engines:
                for control in controls:
                    if control == "http" and where["url"] is None:
                        rows.append(
                            {
                                "engine": engine,
                                "control": control,
                                "model": "-",
                                "mode": "-",
                                "error": "the API process did not start (fastapi/uvicorn missing?)",
                            }
                        )
                        continue
                    cfg = {
                        "port": where["port"],
                        "url": where["url"],
                        "engine": engine,
                        "control": control,
                        "models": args.models.split(","),
                        "deadline": deadline,
                        "timeout": args.timeout,
                        "buffers": [int(b) << 20 for b in args.buffers_mib.split(",")],
                        "rounds": max(1, args.rounds),
                        "num_buffers": [int(n) for n in args.num_buffers.split(",")],
                        "warmup": args.warmup,
                        "unpacked": not args.no_unpacked,
                    }
                    sender = _spawn("sender", 0, cfg, Path(tmp, f"s-{engine}-{control}.json"))
                    out, _ = sender.communicate(timeout=max(30.0, deadline - time.time() + 120))
                    got = [line for line in out.splitlines() if line.startswith("[")]
                    rows += (
                        json.loads(got[-1])
                        if got
                        else [
                            {
                                "engine": engine,
                                "control": control,
                                "model": "-",
                                "mode": "-",
                                "error": f"sender exited {sender.returncode}",
                            }
                        ]
                    )
            with contextlib.suppress(OSError):
                rpc(where["port"], "quit", 10)
        finally:
            for proc in (sender, api, receiver):
                if proc is not None and proc.poll() is None:
                    proc.kill()
    text = table(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out + ".json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
