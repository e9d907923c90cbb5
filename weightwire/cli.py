"""``weightwire``: the command line.

- ``weightwire demo``    an RL loop (JAX policy, vLLM-style server) syncing weights every step.
- ``weightwire serve``   the reference server (``weightwire.torch_side.server.serve_main``).
- ``weightwire bench``   the transport benchmarks (``benchmarks/bench_comm.py``, ``--sync``: bench_sync.py).
- ``weightwire doctor``  what a server supports and whether a sync can work against it.

Exit codes: 0 success; 1 the command ran and its verdict is negative (demo reward did
not rise or a sync check failed; doctor found a blocking problem); 2 bad arguments;
3 an error stopped the command (the message says which).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

_DEMO_EPILOG = """\
examples:
  weightwire demo                                  # embedded reference server (tiny Llama, CPU)
  weightwire demo --server http://127.0.0.1:8000 --model-dir DIR
                                                   # a running vLLM (plugin backend) or reference server
"""


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    from weightwire.demo.loop import DemoConfig  # noqa: PLC0415  (light: no jax at import)

    d = DemoConfig()
    p = sub.add_parser("demo", help="RL loop: JAX policy -> server, weights synced every step",
                       description="On-policy RL against a vLLM-style server with a weight sync after every step.",
                       epilog=_DEMO_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", default=None, help="base URL of a running server (default: start the reference server)")
    p.add_argument("--model-dir", default=None,
                   help="the model directory the server loaded (required with --server): initial weights + tokenizer")
    p.add_argument("--model", default=d.model, help=f"embedded server: tiny model to serve (default {d.model})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"RL steps (default {d.steps})")
    p.add_argument("--transport", choices=("tcp", "nccl"), default=d.transport,
                   help="tcp: weightwire_tcp (CPU is fine); nccl: GPUs (stock vLLM 'nccl' backend with --server)")
    p.add_argument("--backend", default=None, help="override the weight-transfer backend name")
    p.add_argument("--batch", type=int, default=d.batch, help=f"completions per step (default {d.batch})")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help=f"tokens per completion (default {d.max_tokens})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"Adam learning rate (default {d.lr})")
    p.add_argument("--target", default=d.target, help=f"reward: fraction of tokens containing this character (default {d.target!r})")
    p.add_argument("--tolerance", type=float, default=d.tolerance, help=f"max |logprob diff| of a sync check (default {d.tolerance})")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--api-key", default=os.environ.get("WEIGHTWIRE_API_KEY"), help="bearer token for the server")
    p.add_argument("--served-model", default=None, help="'model' field of completion requests (if the server needs it)")
    p.add_argument("--resync", action="store_true",
                   help="with --server: if its weights differ from --model-dir, push the policy's first")
    p.add_argument("--server-gpu", default=d.server_gpu, help="embedded server + nccl: its CUDA_VISIBLE_DEVICES")
    p.add_argument("--colocated", action="store_true",
                   help="trainer and embedded server on ONE GPU, synced over CUDA IPC (weightwire_ipc); "
                        "the server sleeps while the policy trains")
    p.add_argument("--sleep-level", type=int, default=d.sleep_level, choices=(0, 1, 2),
                   help=f"--colocated: the server's sleep level during training (default {d.sleep_level})")


def _run_demo(args: argparse.Namespace) -> int:
    # JAX would otherwise grab most of every visible GPU, starving an inference server there.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from rich.console import Console  # noqa: PLC0415

    from weightwire.demo.loop import DemoConfig, run_demo  # noqa: PLC0415

    console = Console()
    try:
        cfg = DemoConfig(server=args.server, model_dir=args.model_dir, model=args.model, steps=args.steps,
                         transport=args.transport, backend=args.backend, batch=args.batch,
                         max_tokens=args.max_tokens, lr=args.lr, target=args.target, tolerance=args.tolerance,
                         seed=args.seed, api_key=args.api_key, served_model=args.served_model,
                         resync=args.resync, server_gpu=args.server_gpu,
                         colocated=args.colocated, sleep_level=args.sleep_level)
    except ValueError as exc:
        print(f"weightwire demo: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_demo(cfg, console)
    except KeyboardInterrupt:
        print("weightwire demo: interrupted", file=sys.stderr)
        return 3
    except Exception as exc:  # noqa: BLE001  (one clear line instead of a traceback for users)
        if os.environ.get("WEIGHTWIRE_DEBUG"):
            raise
        print(f"weightwire demo: error: {type(exc).__name__}: {exc}\n(set WEIGHTWIRE_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 3
    return 0 if result.ok else 1


def _bench_script(sync: bool) -> Path:
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    script = root / ("bench_sync.py" if sync else "bench_comm.py")
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: `weightwire bench` runs the benchmarks of a source checkout "
                                "(pip install -e .)")
    return script


def _run_bench(args: argparse.Namespace, rest: list[str]) -> int:
    try:
        script = _bench_script(args.sync)
    except FileNotFoundError as exc:
        print(f"weightwire bench: error: {exc}", file=sys.stderr)
        return 3
    if not args.sync and not any(a == "--transport" or a.startswith("--transport=") for a in rest):
        rest = ["--transport", "tcp", *rest]
    return subprocess.call([sys.executable, str(script), *rest])


def _run_doctor(args: argparse.Namespace) -> int:
    from weightwire.demo.doctor import run_doctor  # noqa: PLC0415

    try:
        return run_doctor(args.url, api_key=args.api_key, timeout=args.timeout, round_trip=not args.no_round)
    except KeyboardInterrupt:
        return 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightwire", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,serve,bench,doctor}")
    _demo_parser(sub)
    sub.add_parser("serve", help="run the reference server (see `weightwire serve --help`)", add_help=False)
    b = sub.add_parser("bench", help="transport benchmarks (extra arguments go to the benchmark script)")
    b.add_argument("--sync", action="store_true", help="run benchmarks/bench_sync.py instead of bench_comm.py")
    doc = sub.add_parser("doctor", help="check a server: version, dev-mode routes, backend, NCCL, a 1-tensor round")
    doc.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8000")
    doc.add_argument("--api-key", default=os.environ.get("WEIGHTWIRE_API_KEY"))
    doc.add_argument("--timeout", type=float, default=15.0, help="seconds per HTTP probe (default 15)")
    doc.add_argument("--no-round", action="store_true", help="skip the timed 1-tensor round")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        # Everything after `serve` belongs to the server's own parser (its --help included).
        from weightwire.torch_side.server import serve_main  # noqa: PLC0415

        return serve_main(argv[1:])
    parser = build_parser()
    if argv and argv[0] == "bench":
        args, rest = parser.parse_known_args(argv)
        return _run_bench(args, rest)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _run_demo(args)
    if args.command == "doctor":
        return _run_doctor(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
