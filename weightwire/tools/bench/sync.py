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
  ``HTTPWeightSyncClient`` -- what a trainer pays against a server (``sync_http.py``);
- ``shim``: one JSON line per call over a fresh local socket (``sync_shim.py``),
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
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from weightwire._extras import require
from weightwire.tools._cli import CommandError, summary_parser
from weightwire.tools.bench.child import spawn_child
from weightwire.tools.bench.sync_models import MODELS, build_params, hf_shapes, make_source
from weightwire.tools.bench.sync_sender import error_row, sender_main
from weightwire.tools.bench.sync_shim import receiver_main, rpc

GIB = 1 << 30

__all__ = [
    "MODELS",
    "build_params",
    "hf_shapes",
    "main",
    "make_source",
]  # the parameter sets: sync_models


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


def _spawn(role: str, gpu: int | None, cfg: dict[str, Any], path: Path) -> subprocess.Popen[str]:
    path.write_text(json.dumps(cfg))
    return spawn_child(
        "sync",
        ["--role", role, "--config", str(path)],
        env={
            "CUDA_VISIBLE_DEVICES": "" if gpu is None else str(gpu),
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        },
        stdout=subprocess.PIPE if role == "sender" else None,
    )


def _gpus() -> int:
    """CUDA devices torch sees (the receiver is a torch worker engine)."""
    require("torch", purpose="weightwire bench --sync")
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    ap = summary_parser(__doc__, prog)
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
                            error_row(
                                engine,
                                control,
                                "-",
                                "-",
                                "the API process did not start (fastapi/uvicorn missing?)",
                            )
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
                            error_row(
                                engine, control, "-", "-", f"sender exited {sender.returncode}"
                            )
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
