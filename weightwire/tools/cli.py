"""``weightwire``: the command line (also ``python -m weightwire``).

- ``weightwire demo``    an RL loop (JAX policy, vLLM-style server) syncing weights every step.
- ``weightwire serve``   the reference server (``weightwire.tools.server.serve_main``).
- ``weightwire bench``   the data-plane benchmark (``weightwire.tools.bench.comm``; ``--sync``:
                         whole rounds on two GPUs, ``weightwire.tools.bench.sync``).
- ``weightwire doctor``  what a server supports and whether a sync can work against it.

Exit codes (``weightwire.tools._cli``, the same for every command): 0 success; 1 the command ran
and its verdict is negative; 2 bad arguments; 3 an error stopped the command; 130 Ctrl-C;
143 SIGTERM (129 SIGHUP), its child processes stopped with it.
No expected failure prints a traceback (``WEIGHTWIRE_DEBUG=1`` shows it).
"""

from __future__ import annotations

import argparse
import sys

from weightwire import __version__
from weightwire._lifetime import stop_on_signals
from weightwire.shared.checks import check_seconds
from weightwire.shared.errors import ConfigError
from weightwire.tools._cli import (
    BACKEND_ALIASES,
    BACKENDS,
    EXIT_CODES_HELP,
    EXIT_USAGE,
    HelpFormatter,
    add_api_key,
    guarded,
    server_url,
)
from weightwire.tools.demo import command as demo_command

DESCRIPTION = (
    "Push fresh weights from a JAX or PyTorch trainer into vLLM inference workers, every RL step."
)

_BENCH_EPILOG = """\
examples:
  weightwire bench                                 # TCP data plane on loopback (CPU is fine)
  weightwire bench --backend nccl                  # NCCL data plane, two GPUs
  weightwire bench --sync --help                   # whole weight-sync rounds on two GPUs

"""


def _run_bench(argv: list[str]) -> int:
    """``bench [--sync] ARGS``: the benchmark module's own parser reads ARGS (its --help
    included)."""
    if argv[:1] == ["--"]:  # `bench -- --help`, the pass-through spelling of earlier versions
        argv = argv[1:]
    if "--sync" in argv:
        from weightwire.tools.bench import sync

        rest = [a for a in argv if a != "--sync"]
        return guarded(
            "weightwire bench --sync", lambda: sync.main(rest, prog="weightwire bench --sync")
        )
    from weightwire.tools.bench import comm

    def run() -> int:
        parser = comm.build_parser("weightwire bench")
        parser.epilog = _BENCH_EPILOG + EXIT_CODES_HELP
        parser.add_argument(
            "--sync",
            action="store_true",
            help="run whole weight-sync rounds on two GPUs instead (see "
            "`weightwire bench --sync --help`)",
        )
        parser.parse_args(
            argv
        )  # --help and usage errors, with this command's name and the --sync line
        return comm.main(argv, prog="weightwire bench")

    return guarded("weightwire bench", run)


_DOCTOR_DESCRIPTION = """\
Check whether a trainer can sync weights into a running server (vLLM or the weightwire
reference server), and say what to fix if not: the server's version and the features it
implies, vLLM's dev-mode weight-sync routes, the configured weight-transfer backend, the
world size and NCCL versions, and, on the reference server, a timed 1-tensor round that
leaves the served weights unchanged. Every probe is bounded by --timeout and the whole
check by --deadline, whatever the server sends."""

_DOCTOR_EPILOG = """\
examples:
  weightwire doctor 127.0.0.1:8000                 # http:// is assumed
  WEIGHTWIRE_API_KEY=... weightwire doctor https://vllm.internal:8000
  weightwire doctor http://127.0.0.1:8000 --no-round --timeout 5

exit codes:
  0    nothing blocks a weight sync
  1    the server answered and a blocking problem was found (each FAIL line says what)
  2    bad arguments
  3    no usable answer: nothing listens there, the address is wrong, or the server
       did not answer within --timeout / --deadline
  130  interrupted by Ctrl-C
"""


def _seconds(value: str) -> float:
    """argparse ``type=``: a finite number of seconds > 0."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    try:
        return check_seconds(repr(value), seconds)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _doctor_parser(sub: argparse._SubParsersAction) -> None:
    doc = sub.add_parser(
        "doctor",
        help="check a server: version, dev-mode routes, backend, NCCL, a 1-tensor round",
        description=_DOCTOR_DESCRIPTION,
        epilog=_DOCTOR_EPILOG,
        formatter_class=HelpFormatter,
    )
    doc.add_argument(
        "url",
        type=server_url,
        help="server base URL, e.g. http://127.0.0.1:8000 (a bare host:port gets http://)",
    )
    add_api_key(doc)
    doc.add_argument(
        "--timeout",
        type=_seconds,
        default=15.0,
        help="seconds for each HTTP probe, its whole reply included (default 15)",
    )
    doc.add_argument(
        "--deadline",
        type=_seconds,
        default=None,
        help="seconds for the whole check; each wait of the 1-tensor round gets at most what "
        "is left (default: 4 x --timeout, at least 120)",
    )
    doc.add_argument("--no-round", action="store_true", help="skip the timed 1-tensor round")


def _run_doctor(args: argparse.Namespace) -> int:
    from weightwire.tools.demo.doctor import run_doctor

    deadline = args.deadline if args.deadline is not None else max(120.0, 4 * args.timeout)
    return run_doctor(
        args.url,
        api_key=args.api_key,
        timeout=args.timeout,
        deadline=deadline,
        round_trip=not args.no_round,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightwire",
        description=DESCRIPTION,
        epilog="`weightwire COMMAND --help` shows each command's options.\n\n" + EXIT_CODES_HELP,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"weightwire {__version__}",
        help="print the version and exit",
    )
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="{demo,serve,bench,doctor}",
        help="the command to run",
    )
    demo_command.add_parser(sub)
    # serve and bench parse their own arguments (main() hands them over before this parser runs);
    # these entries only list them in `weightwire --help`.
    sub.add_parser(
        "serve", help="run the reference server (see `weightwire serve --help`)", add_help=False
    )
    sub.add_parser(
        "bench",
        help="data-plane and sync benchmarks (see `weightwire bench --help`)",
        add_help=False,
    )
    _doctor_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the entry point (a caller passing argv keeps its own signal handling)
        # SIGTERM / SIGHUP unwind like Ctrl-C: children (the demo's server, the bench's receivers)
        # stop too.
        stop_on_signals()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        # Everything after `serve` belongs to the server's own parser (its --help included).
        def serve() -> int:
            from weightwire.tools.server import serve_main

            return serve_main(argv[1:])

        return guarded("weightwire serve", serve)
    if argv and argv[0] == "bench":
        return _run_bench(argv[1:])
    parser = build_parser()
    if not argv:
        # A bare `weightwire` is someone finding out what it does: the help, not argparse's
        # "the following arguments are required" line. Still exit 2 (bad arguments), not 0: no
        # command ran, and a script that calls it with an empty variable must not pass.
        parser.print_help()
        return EXIT_USAGE
    args = parser.parse_args(argv)
    if args.command == "demo":
        return guarded("weightwire demo", lambda: demo_command.run(args))
    if args.command == "doctor":
        return guarded("weightwire doctor", lambda: _run_doctor(args))
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USAGE


__all__ = ["BACKENDS", "BACKEND_ALIASES", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
