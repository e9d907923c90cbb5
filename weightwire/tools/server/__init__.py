"""The reference inference server: vLLM's weight-sync routes over Hugging Face models.

``weightwire serve --model DIR|tiny-llama|tiny-qwen2`` (or
``python -m weightwire.tools.server``) starts an API process (FastAPI +
uvicorn, loopback by default) and ``--replicas`` worker processes, each one rank of
the transfer group. It prints the line ``weightwire server ready on http://HOST:PORT`` once, when it
accepts requests (``--port 0`` picks a free port and prints the real one); lines
before it say what it loads, the line after it which routes it serves.

Layout: ``serve_args`` (the command line) -> ``app`` (routes) -> ``session`` (round
rules) -> ``replicas`` (JSON-lines fan-out) -> ``worker_proc`` (the request loop) ->
``replica_worker`` (model + ``HFModelHost`` + engine) -> ``generate``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from weightwire._extras import MissingExtra, require
from weightwire._lifetime import die_with_parent, signal_name
from weightwire.tools._cli import EXIT_ERROR, EXIT_OK, EXIT_USAGE, Progress, fail, interrupted
from weightwire.tools.server.serve_args import (
    PROG,
    build_parser,
    check_args,
    check_env,
    check_model,
    resolve_api_key,
)

__all__ = ["serve_main"]


def serve_main(argv: list[str] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM. Returns the process exit code
    (``weightwire.tools._cli``'s codes: 0 stopped after serving, 2 bad arguments, 3 an error
    stopped it, 130 Ctrl-C while starting)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage error
        return int(exc.code or 0)
    problem = check_args(args) or check_env() or check_model(args.model)
    if problem is None:
        try:
            args.api_key, warning = resolve_api_key(args, os.environ)
        except ValueError as exc:
            problem = str(exc)
        else:
            if warning:
                print(f"weightwire serve: warning: {warning}", file=sys.stderr)
    if problem:
        return fail(PROG, problem, EXIT_USAGE)
    try:
        # Before anything starts: a host without the extra gets one line naming it.
        require("torch", "transformers", "fastapi", "uvicorn", "safetensors", purpose=PROG)
    except MissingExtra as exc:
        return fail(PROG, str(exc))
    if args.device == "cuda" and not _cuda_visible():
        return fail(
            PROG,
            "--device cuda: torch sees no CUDA GPU on this host (torch.cuda.is_available() is "
            "False); use --device cpu, or check CUDA_VISIBLE_DEVICES and the driver",
            EXIT_USAGE,
        )
    # Launched by the demo (or another launcher that asked): go when the launcher goes, even if
    # SIGKILLed.
    die_with_parent()
    served: list[bool] = []
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(_serve(args, served))
    except KeyboardInterrupt:
        if served:
            return EXIT_OK
        return interrupted(PROG, what=" while starting")
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return fail(
                PROG,
                f"cannot listen on {args.host}:{args.port}: the address is already "
                "in use (is another server running there? choose another --port, "
                "or --port 0 for a free one)",
            )
        return fail(PROG, str(exc))
    except (ValueError, RuntimeError) as exc:
        return fail(PROG, str(exc))


def _cuda_visible() -> bool:
    """Whether torch can use a GPU here: checked in this process (one torch import) before a
    worker tries and fails with a traceback."""
    import torch

    return bool(torch.cuda.is_available())


def event_loop_factory() -> Any:
    """``uvloop.new_event_loop`` where uvloop is installed (the ``[torch]`` extra brings it
    on Linux/macOS), else ``None`` (asyncio's default loop).

    The server runs uvicorn inside its own ``asyncio.Runner`` (the workers start first), so
    uvicorn's ``loop="auto"`` never applies: the choice is made here. uvloop's lower
    per-callback cost is a share of every weight call's fixed cost
    (``benchmarks/bench_control.py``)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP;
    # with proto 0 every reply on a kept-alive connection waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _graceful_server(uvicorn: Any, config: Any, stopped_by: list[int]) -> Any:
    """uvicorn's server, except that after a SIGINT/SIGTERM/SIGHUP shutdown it returns instead
    of re-raising the signal (the signals land in ``stopped_by``): the workers are then closed
    in order and we exit 0 with one line saying why."""

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                # A closed terminal (SIGHUP) stops the server as SIGTERM does; uvicorn handles only
                # INT/TERM.
                hup = signal.signal(signal.SIGHUP, self.handle_exit) if _main_thread() else None
                try:
                    yield
                finally:
                    if hup is not None:
                        signal.signal(signal.SIGHUP, hup)
                    captured = getattr(self, "_captured_signals", [])
                    stopped_by.extend(captured)
                    captured.clear()

    return Server(config)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


async def _serve(args: argparse.Namespace, served: list[bool]) -> int:
    import logging

    import uvicorn

    from weightwire.tools.server.app import ServerOptions, ServerState, create_app
    from weightwire.tools.server.openai import describe_routes
    from weightwire.tools.server.replica import ReplicaError, WorkerSpec
    from weightwire.tools.server.replicas import ReplicaPool
    from weightwire.tools.server.tiny import TINY_NAMES, resolve_model

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    # stdout, before and after the ready line (launchers match that one line and ignore the rest).
    say = Progress(PROG)
    if args.model in TINY_NAMES:
        from weightwire.tools.server.tiny import cache_root

        say(
            f"{args.model}: a tiny random model, built on first use and cached under "
            f"{cache_root()} ($WEIGHTWIRE_CACHE)"
        )
    model_dir = resolve_model(args.model)
    # Bind before the (slow) worker start: a taken port fails in milliseconds, not after loading.
    sock = _bind(args.host, args.port)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
    say(
        f"loading {os.path.abspath(model_dir)} into {args.replicas} worker process(es) on "
        f"{args.device} (backend {args.backend}, {threads} torch thread(s) each)"
    )
    spec = WorkerSpec(
        model_dir=model_dir,
        backend=args.backend,
        device=args.device,
        replicas=args.replicas,
        threads=threads,
        max_reply_bytes=args.max_reply_bytes,
        check_finite=args.check_finite,
        max_lora_rank=args.max_lora_rank if args.enable_lora else 0,
        decode_step_delay_s=args.decode_step_delay,
    )
    try:
        pool = await ReplicaPool.start(spec, startup_timeout=args.startup_timeout)
    except ReplicaError as exc:
        sock.close()
        raise RuntimeError(f"worker start failed: {exc}") from None
    try:
        options = ServerOptions(
            backend=args.backend,
            model_name=args.model
            if args.model in TINY_NAMES
            else os.path.basename(os.path.normpath(model_dir)),
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            op_timeout_s=args.op_timeout,
            round_timeout_s=args.round_timeout,
            generate_timeout_s=args.generate_timeout,
            max_reply_bytes=args.max_reply_bytes,
            lease_s=args.round_lease,
            model_dir=os.path.abspath(model_dir),
            model_aliases=(args.model, model_dir, os.path.abspath(model_dir)),
            max_lora_rank=spec.max_lora_rank,
        )
        app = create_app(ServerState(pool=pool, options=options))
        config = uvicorn.Config(
            app,
            log_level=args.log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            server_header=False,
        )
        stopped_by: list[int] = []
        server = _graceful_server(uvicorn, config, stopped_by)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if server.started:
            host, port = sock.getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            print(f"weightwire server ready on http://{shown}:{port}", flush=True)
            served.append(True)
            say(describe_routes(app, options.model_name))
        await serving
        return EXIT_OK if server.started else EXIT_ERROR
    finally:
        await pool.close()
        sock.close()
        if served and stopped_by:
            print(
                f"{PROG}: stopped by {signal_name(stopped_by[0])}; the workers were closed",
                file=sys.stderr,
                flush=True,
            )
