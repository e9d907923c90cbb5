"""The reference inference server: vLLM's weight-sync routes over Hugging Face models.

``weightwire serve --model DIR|tiny-llama|tiny-qwen2`` (or
``python -m weightwire.torch_side.server``) starts an API process (FastAPI +
uvicorn, loopback by default) and ``--replicas`` worker processes, each one rank of
the transfer group. It prints exactly one line ``weightwire server ready on
http://HOST:PORT`` once it accepts requests (``--port 0`` picks a free port and
prints the real one).

Layout: ``app`` (routes) -> ``session`` (round rules) -> ``replicas`` (JSON-lines
fan-out) -> ``worker_proc`` (model + ``HFModelHost`` + engine) -> ``generate``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["build_parser", "serve_main"]

BACKENDS = ("weightwire_tcp", "weightwire_nccl", "weightwire_ipc")


def build_parser(prog: str = "weightwire serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve a model with vLLM's weight-sync API (reference server).")
    p.add_argument("--model", required=True, help="HF model directory, or tiny-llama / tiny-qwen2 (built locally)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default 8000)")
    p.add_argument("--backend", choices=BACKENDS, default="weightwire_tcp")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /version "
                        "(default: $WEIGHTWIRE_API_KEY if set)")
    p.add_argument("--replicas", type=int, default=1, help="worker processes = ranks in the transfer group")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: cores / replicas)")
    p.add_argument("--max-body-bytes", type=int, default=64 << 20)
    p.add_argument("--op-timeout", type=float, default=300.0, help="seconds for start/finish/shutdown/checks")
    p.add_argument("--round-timeout", type=float, default=3600.0, help="backstop seconds for one update_weights")
    p.add_argument("--generate-timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for workers to load the model")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    return p


def _check(args: argparse.Namespace) -> str | None:
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}"
    if not 1 <= args.replicas <= 64:
        return f"--replicas must be in [1, 64], got {args.replicas}"
    if args.backend in ("weightwire_nccl", "weightwire_ipc") and args.device != "cuda":
        return f"--backend {args.backend} needs --device cuda"
    for name in ("op_timeout", "round_timeout", "generate_timeout", "startup_timeout"):
        if not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be > 0"
    if args.max_body_bytes < 1024:
        return "--max-body-bytes must be >= 1024"
    return None


def serve_main(argv: list[str] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM. Returns the process exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage error
        return int(exc.code or 0)
    problem = _check(args)
    if problem:
        print(f"weightwire serve: error: {problem}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(args))
    except KeyboardInterrupt:
        return 0
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"weightwire serve: error: {exc}", file=sys.stderr)
        return 1


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP;
    # with proto 0 every reply on a kept-alive connection waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _graceful_server(uvicorn: Any, config: Any) -> Any:
    """uvicorn's server, except that after a SIGINT/SIGTERM shutdown it returns instead
    of re-raising the signal: the workers are then closed in order and we exit 0."""

    class Server(uvicorn.Server):  # type: ignore[misc, name-defined]
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                getattr(self, "_captured_signals", []).clear()

    return Server(config)


async def _serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from weightwire.torch_side.server.app import ServerOptions, ServerState, create_app
    from weightwire.torch_side.server.replicas import ReplicaError, ReplicaPool, WorkerSpec
    from weightwire.torch_side.server.tiny import TINY_NAMES, resolve_model

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    model_dir = resolve_model(args.model)
    # Bind before the (slow) worker start: a taken port fails in milliseconds, not after loading.
    sock = _bind(args.host, args.port)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
    spec = WorkerSpec(model_dir=model_dir, backend=args.backend, device=args.device,
                      replicas=args.replicas, threads=threads)
    try:
        pool = await ReplicaPool.start(spec, startup_timeout=args.startup_timeout)
    except ReplicaError as exc:
        sock.close()
        raise RuntimeError(f"worker start failed: {exc}") from None
    try:
        options = ServerOptions(
            backend=args.backend,
            model_name=args.model if args.model in TINY_NAMES else os.path.basename(os.path.normpath(model_dir)),
            api_key=args.api_key or os.environ.get("WEIGHTWIRE_API_KEY") or None,
            max_body_bytes=args.max_body_bytes, op_timeout_s=args.op_timeout,
            round_timeout_s=args.round_timeout, generate_timeout_s=args.generate_timeout,
        )
        app = create_app(ServerState(pool=pool, options=options))
        config = uvicorn.Config(app, log_level=args.log_level, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, server_header=False)
        server = _graceful_server(uvicorn, config)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if server.started:
            host, port = sock.getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            print(f"weightwire server ready on http://{shown}:{port}", flush=True)
        await serving
        return 0 if server.started else 1
    finally:
        await pool.close()
        sock.close()
