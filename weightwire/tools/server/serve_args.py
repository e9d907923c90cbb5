"""``weightwire serve``'s command line: its options, and the checks that refuse a bad
one (exit 2, one line) before anything starts.

Light at import (no torch): ``weightwire --help`` and the CLI's checks read it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from weightwire import backends
from weightwire.backends.tcp.spec import TCP
from weightwire.shared.errors import ConfigError
from weightwire.tools._cli import EXIT_CODES_HELP, HelpFormatter, backend_name, env_log_level

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
        default=TCP.name,
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
        "--decode-step-delay",
        type=float,
        default=0.0,
        help="seconds each worker waits after every decode step, outside the step lock "
        "(default 0): stands in for a larger model's step time, so drills of pause, "
        "sleep and abort against a running generation hold on a tiny model",
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


def check_args(args: argparse.Namespace) -> str | None:
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
    if not 0 <= args.decode_step_delay <= 10:  # also refuses NaN
        return f"--decode-step-delay must be in [0, 10] seconds, got {args.decode_step_delay}"
    if args.max_body_bytes < 1024:
        return "--max-body-bytes must be >= 1024"
    if args.max_reply_bytes < 1024:
        return "--max-reply-bytes must be >= 1024"
    return None


def check_env() -> str | None:
    """The environment the server and its workers read later, checked before anything starts
    (a bad value would otherwise fail every init, or every worker, after "ready")."""
    from weightwire.shared.timeouts import Timeouts

    try:
        Timeouts.from_env()
        env_log_level(os.environ)
    except ValueError as exc:
        return str(exc)
    return None


def check_model(model: str) -> str | None:
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
            raise ConfigError(
                f"--api-key-file {args.api_key_file!r}: cannot read it ({type(exc).__name__})"
            ) from None
        if not key.strip():
            raise ConfigError(f"--api-key-file {args.api_key_file!r} is empty")
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
        raise ConfigError(
            f"{source} is {'empty' if not key else 'blank'}: that would start a "
            "server with no working key; give a real key, or "
            f"{'unset it' if source.isupper() else 'leave the option out'} to run "
            "without authentication"
        )
    if key != key.strip():
        raise ConfigError(
            f"{source} has whitespace at its start or end, which no client can send in an "
            "Authorization header: remove it"
        )
    return key
