"""The reference inference server: vLLM's weight-sync routes over Hugging Face models.

``weightwire serve --model DIR|tiny-llama|tiny-qwen2`` (or
``python -m weightwire.tools.server``) starts an API process (FastAPI +
uvicorn, loopback by default) and ``--replicas`` worker processes, each one rank of
the transfer group. It prints the line ``weightwire server ready on http://HOST:PORT`` once, when it
accepts requests (``--port 0`` picks a free port and prints the real one); lines
before it say what it loads, the line after it which routes it serves.

Layout: ``app`` (routes) -> ``session`` (round rules) -> ``replicas`` (JSON-lines
fan-out) -> ``worker_proc`` (model + ``HFModelHost`` + engine) -> ``generate``.
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
from pathlib import Path
from typing import Any

from weightwire import backends
from weightwire._extras import MissingExtra, require
from weightwire._lifetime import die_with_parent, signal_name
from weightwire.tools._cli import (
    EXIT_CODES_HELP,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_USAGE,
    HelpFormatter,
    Progress,
    backend_name,
    env_log_level,
    fail,
    interrupted,
)

__all__ = ["build_parser", "serve_main"]

BACKENDS = backends.PLUGIN_BACKENDS
"""``--backend`` choices: the reference server stands in for a vLLM with the weightwire plugin."""
PROG = "weightwire serve"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Serve a model with vLLM's weight-sync API and OpenAI-compatible completions "
        "(the reference server).",
        epilog="examples:\n"
        "  weightwire serve --model tiny-llama --port 0     # a tiny random Llama, built "
        "and cached\n"
        "  WEIGHTWIRE_API_KEY=$KEY weightwire serve --model ./qwen2.5-0.5b\n"
        "\n" + EXIT_CODES_HELP,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--model",
        required=True,
        help="HF model directory (config.json + safetensors + tokenizer), or "
        "tiny-llama / tiny-qwen2: a tiny random model built on first use and "
        "cached under $WEIGHTWIRE_CACHE (default ~/.cache/weightwire); the "
        "directory is printed at start-up",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default 8000)")
    p.add_argument(
        "--backend",
        type=backend_name,
        choices=BACKENDS,
        default=backends.TCP,
        help="weight-transfer backend the workers run: weightwire_tcp (CPU or GPU; alias tcp), "
        "weightwire_nccl or weightwire_ipc (CUDA IPC, trainer on the same GPU) (both need "
        "--device cuda) (default weightwire_tcp)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the workers hold the model (default cpu)",
    )
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="require 'Authorization: Bearer KEY' on every route but /health and /version, KEY "
        "being this file's content (trailing newline stripped); default: $WEIGHTWIRE_API_KEY",
    )
    key.add_argument(
        "--api-key",
        default=None,
        help="the key itself; avoid: a command line is visible to every user of the host "
        "(ps, /proc/PID/cmdline)",
    )
    p.add_argument(
        "--replicas", type=int, default=1, help="worker processes = ranks in the transfer group"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per worker (default: cores / replicas)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=64 << 20,
        help="largest request body accepted, bytes (default 64 MiB); larger ones get 413",
    )
    p.add_argument(
        "--max-reply-bytes",
        type=int,
        default=256 << 20,
        help="largest completion reply a worker sends, bytes (default 256 MiB); a "
        "request whose reply could be larger (prompts x n x max_tokens, "
        "logprobs, token ids) gets 400 before it runs",
    )
    p.add_argument(
        "--check-finite",
        action="store_true",
        help="refuse to commit a weight round whose floating-point tensors hold NaN "
        "or infinity (the finish gets 400 and the previous weights stay served); "
        "costs one pass over the round",
    )
    p.add_argument(
        "--op-timeout",
        type=float,
        default=300.0,
        help="seconds for start/finish/shutdown/checks on every worker (default 300)",
    )
    p.add_argument(
        "--round-timeout",
        type=float,
        default=3600.0,
        help="backstop seconds for one update_weights (default 3600)",
    )
    p.add_argument(
        "--generate-timeout",
        type=float,
        default=600.0,
        help="seconds for one completion request, and for /pause?mode=wait to drain (default 600)",
    )
    p.add_argument(
        "--round-lease",
        type=float,
        default=None,
        help="abort a round after this many idle seconds without a weight call from its trainer "
        "(default: the trainer's per-broadcast timeout from its init info)",
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters: POST /v1/load_lora_adapter registers one from a PEFT "
        "directory, completions name it as their model, adapter rounds replace it",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        help="the highest adapter rank --enable-lora accepts (default 16)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds for the workers to load the model (default 600)",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug"),
        help="server log level, on stderr (default warning)",
    )
    return p


def _check(args: argparse.Namespace) -> str | None:
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}"
    if not 1 <= args.replicas <= 64:
        return f"--replicas must be in [1, 64], got {args.replicas}"
    if not 1 <= args.max_lora_rank <= 4096:
        return f"--max-lora-rank must be in [1, 4096], got {args.max_lora_rank}"
    if backends.get(args.backend).needs_cuda and args.device != "cuda":
        return f"--backend {args.backend} needs --device cuda"
    for name in (
        "op_timeout",
        "round_timeout",
        "generate_timeout",
        "startup_timeout",
        "round_lease",
    ):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be > 0"
    if args.max_body_bytes < 1024:
        return "--max-body-bytes must be >= 1024"
    if args.max_reply_bytes < 1024:
        return "--max-reply-bytes must be >= 1024"
    return None


def _check_env() -> str | None:
    """The environment the server and its workers read later, checked before anything starts
    (a bad value would otherwise fail every init, or every worker, after "ready")."""
    from weightwire.shared.timeouts import Timeouts

    try:
        Timeouts.from_env()
        env_log_level(os.environ)
    except ValueError as exc:
        return str(exc)
    return None


def _check_model(model: str) -> str | None:
    from weightwire.tools.server.tiny import TINY_NAMES  # light: no torch at import

    if model in TINY_NAMES:
        return None
    path = Path(model)
    if not path.exists():
        return f"--model {model!r}: no such directory (or pass tiny-llama / tiny-qwen2)"
    if not (path / "config.json").is_file():
        return (
            f"--model {model!r} is neither {' / '.join(TINY_NAMES)} nor a directory with "
            "config.json"
        )
    from weightwire.tools.server.model_check import model_dir_problem

    return model_dir_problem(path, model)


def resolve_api_key(
    args: argparse.Namespace, environ: dict[str, str] | os._Environ[str]
) -> tuple[str | None, str | None]:
    """``(key, warning)``: from ``--api-key-file``, ``--api-key`` (with a warning: the
    process list shows it) or ``$WEIGHTWIRE_API_KEY``. Raises ``ValueError`` for an
    unreadable key file, and for a key that is given but empty or blank or has whitespace
    at either end: an empty one would silently start an open server, a blank one a server
    nobody can authenticate to (HTTP strips a header value's ends)."""
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.read().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"--api-key-file {args.api_key_file!r}: cannot read it ({type(exc).__name__})"
            ) from None
        if not key.strip():
            raise ValueError(f"--api-key-file {args.api_key_file!r} is empty")
        return _usable_key(key, f"--api-key-file {args.api_key_file!r}"), None
    if args.api_key is not None:
        return _usable_key(args.api_key, "--api-key"), (
            "--api-key on the command line is visible to every user of this host (ps, "
            "/proc/PID/cmdline); pass it in $WEIGHTWIRE_API_KEY or --api-key-file instead"
        )
    env_key = environ.get("WEIGHTWIRE_API_KEY")
    return (None if env_key is None else _usable_key(env_key, "WEIGHTWIRE_API_KEY")), None


def _usable_key(key: str, source: str) -> str:
    if not key.strip():
        raise ValueError(
            f"{source} is {'empty' if not key else 'blank'}: that would start a "
            "server with no working key; give a real key, or "
            f"{'unset it' if source.isupper() else 'leave the option out'} to run "
            "without authentication"
        )
    if key != key.strip():
        raise ValueError(
            f"{source} has whitespace at its start or end, which no client can send in an "
            "Authorization header: remove it"
        )
    return key


def serve_main(argv: list[str] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM. Returns the process exit code
    (``weightwire.tools._cli``'s codes: 0 stopped after serving, 2 bad arguments, 3 an error
    stopped it, 130 Ctrl-C while starting)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage error
        return int(exc.code or 0)
    problem = _check(args) or _check_env() or _check_model(args.model)
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
    from weightwire.tools.server.replicas import ReplicaError, ReplicaPool, WorkerSpec
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
