"""``weightwire demo``'s command line: its options (defaults from ``DemoConfig``) and its run.

``cli.py`` adds this parser to the ``weightwire`` command and calls ``run`` inside its
guard (exit codes, one-line errors). Importing this module loads neither jax nor torch.
"""

from __future__ import annotations

import argparse
import os

from weightwire.tools._cli import (
    EXIT_CODES_HELP,
    EXIT_OK,
    EXIT_USAGE,
    EXIT_VERDICT,
    HelpFormatter,
    add_api_key,
    backend_name,
    fail,
    server_url,
)

EPILOG = """\
examples:
  weightwire demo                                  # embedded reference server (tiny Llama, CPU)
  weightwire demo --server http://127.0.0.1:8000 --model-dir DIR
                                                   # a running vLLM (plugin backend) or \
reference server

"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    from weightwire.tools.demo.config import DEMO_BACKENDS, DemoConfig  # light: no jax at import

    d = DemoConfig()
    p = sub.add_parser(
        "demo",
        help="RL loop: JAX policy -> server, weights synced every step",
        description="On-policy RL against a vLLM-style server with a weight sync after every step.",
        epilog=EPILOG + EXIT_CODES_HELP,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--server",
        type=server_url,
        default=None,
        help="base URL of a running server, http://HOST:PORT (a bare HOST:PORT means http://) "
        "(default: start the reference server)",
    )
    p.add_argument(
        "--wait-ready",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --server: wait up to SECONDS for it to answer GET /health (a server started "
        "beside the demo, still loading) instead of failing at once",
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="the model directory the server loaded (required with --server): initial "
        "weights + tokenizer; `weightwire serve --model tiny-llama` prints the "
        "directory of its tiny model",
    )
    p.add_argument(
        "--model", default=d.model, help=f"embedded server: tiny model to serve (default {d.model})"
    )
    p.add_argument("--steps", type=int, default=d.steps, help=f"RL steps (default {d.steps})")
    p.add_argument(
        "--backend",
        type=backend_name,
        choices=DEMO_BACKENDS,
        default=None,
        help="weight-transfer backend: weightwire_tcp (CPU is fine; alias tcp), nccl "
        "(stock vLLM, GPUs; the embedded server runs it as weightwire_nccl), "
        f"weightwire_nccl (GPUs) (default {d.backend})",
    )
    p.add_argument(
        "--transport",
        choices=("tcp", "nccl"),
        default=None,
        help="another name for --backend: tcp = weightwire_tcp, nccl = nccl",
    )
    p.add_argument(
        "--batch", type=int, default=d.batch, help=f"completions per step (default {d.batch})"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=d.max_tokens,
        help=f"tokens per completion (default {d.max_tokens})",
    )
    p.add_argument("--lr", type=float, default=d.lr, help=f"Adam learning rate (default {d.lr})")
    p.add_argument(
        "--target",
        default=d.target,
        help=f"reward: fraction of tokens containing this character (default {d.target!r})",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=d.tolerance,
        help=f"max |logprob diff| of a sync check (default {d.tolerance})",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help=f"seed of the prompts the demo draws (default {d.seed})",
    )
    add_api_key(p)
    p.add_argument(
        "--served-model",
        default=None,
        help="'model' field of completion requests (if the server needs it)",
    )
    p.add_argument(
        "--resync",
        action="store_true",
        help="with --server: if its weights differ from --model-dir, push the policy's first",
    )
    p.add_argument(
        "--server-gpu",
        default=d.server_gpu,
        help="embedded server with an NCCL backend: its CUDA_VISIBLE_DEVICES (default "
        f"{d.server_gpu})",
    )
    p.add_argument(
        "--colocated",
        action="store_true",
        help="trainer and embedded server on ONE GPU, synced over CUDA IPC (weightwire_ipc); "
        "the server sleeps while the policy trains",
    )
    p.add_argument(
        "--sleep-level",
        type=int,
        default=d.sleep_level,
        choices=(0, 1, 2),
        help=f"--colocated: the server's sleep level during training (default {d.sleep_level})",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="sync the first quarter of the steps blocking, the rest overlapped (the round "
        "streams while the next step runs); prints the trainer's stall per step next to the "
        "blocking rounds' time",
    )
    p.add_argument(
        "--metrics-file",
        default=None,
        metavar="PATH",
        help="write one JSON line per step to PATH (reward, sync bytes and seconds, checks); "
        "with matplotlib installed, the reward curve goes to PATH with a .png suffix",
    )
    p.add_argument(
        "--no-dummy-start",
        dest="dummy_start",
        action="store_false",
        help="embedded server: load the policy's own weights instead of dummy ones (by default it "
        "starts from other random weights, so the first push visibly changes its text)",
    )


def run(args: argparse.Namespace) -> int:
    # JAX would otherwise grab most of every visible GPU, starving an inference server there.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from rich.console import Console

    from weightwire.tools.demo.config import DemoConfig
    from weightwire.tools.demo.loop import run_demo

    if args.backend is not None and args.transport is not None:
        return fail(
            "weightwire demo",
            "--transport and --backend name the same setting: pass one of them",
            EXIT_USAGE,
        )
    # --transport's values are the alias tcp and the name nccl: the registry maps both.
    backend = args.backend or (
        backend_name(args.transport) if args.transport else DemoConfig.backend
    )
    try:
        cfg = DemoConfig(
            server=args.server,
            model_dir=args.model_dir,
            model=args.model,
            steps=args.steps,
            backend=backend,
            batch=args.batch,
            max_tokens=args.max_tokens,
            lr=args.lr,
            target=args.target,
            tolerance=args.tolerance,
            seed=args.seed,
            api_key=args.api_key,
            served_model=args.served_model,
            resync=args.resync,
            server_gpu=args.server_gpu,
            colocated=args.colocated,
            sleep_level=args.sleep_level,
            dummy_start=args.dummy_start,
            overlap=args.overlap,
            metrics_file=args.metrics_file,
            wait_ready=args.wait_ready,
        )
    except ValueError as exc:
        return fail("weightwire demo", str(exc), EXIT_USAGE)
    result = run_demo(cfg, Console())
    return EXIT_OK if result.ok else EXIT_VERDICT
