"""What every ``weightwire`` command shares: exit codes, backend names, error lines, progress.

Why one module: ``weightwire serve`` is also ``python -m weightwire.tools.server``
and the benchmarks are ``python -m weightwire.tools.bench.*``; each must exit with the same
codes, name backends the same way and print one line (never a traceback) for an
expected failure, or the CLI's conventions hold for one command and not the next.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TextIO

from weightwire import backends
from weightwire._extras import missing_extra
from weightwire._lifetime import received, signal_name
from weightwire.shared import routes
from weightwire.shared.errors import ConfigError, WeightwireError

EXIT_OK = 0
"""Success; also ``serve`` stopped by Ctrl-C / SIGTERM after it was serving."""
EXIT_VERDICT = 1
"""The command ran and its verdict is negative (demo reward did not rise or a sync check
failed; doctor found a blocking problem)."""
EXIT_USAGE = 2
"""Bad arguments: unknown option, a value out of range, a ``--model`` path that does not exist."""
EXIT_ERROR = 3
"""An error stopped the command: a missing optional dependency (the line names the extra),
a port in use, a server that does not answer, a failed child process."""
EXIT_INTERRUPTED = 130
"""Interrupted by Ctrl-C (SIGINT) before the command finished (128 + SIGINT, the shell's
convention)."""
EXIT_TERMINATED = 143
"""Stopped by SIGTERM (128 + 15); SIGHUP gives 129. The command's child processes stopped with
it."""

EXIT_CODES_HELP = f"""\
exit codes:
  {EXIT_OK}    success (serve: stopped by Ctrl-C or SIGTERM)
  {EXIT_VERDICT}    the command ran and its verdict is negative (demo: reward did not rise or a
       sync check failed; doctor: a blocking problem)
  {EXIT_USAGE}    bad arguments
  {EXIT_ERROR}    an error stopped the command (missing extra, port in use, no server, ...)
  {EXIT_INTERRUPTED}  interrupted by Ctrl-C before it finished
  {EXIT_TERMINATED}  stopped by SIGTERM (129: SIGHUP) before it finished; its child processes
       stop with it (serve, once serving: 0, as for Ctrl-C)
"""

BACKENDS = backends.BACKEND_NAMES
"""vLLM weight-transfer backend names (the registry's), spelled the same on every command
(each command takes the ones it can run)."""
BACKEND_ALIASES = backends.ALIASES
"""Short spellings accepted wherever a backend is (``tcp`` is unambiguous; ``nccl`` is vLLM's
own)."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Epilogs keep their layout (examples, exit codes); an option whose help does not
    already say its default gets ``(default: X)``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or action.default in (None, False, argparse.SUPPRESS)
            or text == argparse.SUPPRESS
        ):
            return action.help
        return f"{text} (default: %(default)s)"


class CommandError(WeightwireError):
    """An expected failure a command reports as one line (no type name, no traceback hint)."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


def env_log_level(
    environ: dict[str, str] | os._Environ[str],
    var: str = "WEIGHTWIRE_LOG_LEVEL",
    default: str = "WARNING",
) -> str:
    """``$var`` as a logging level name (any case), or ``default`` when unset or empty.
    Raises ``ConfigError`` naming the variable for anything else."""
    raw = environ.get(var, "").strip()
    if not raw:
        return default
    if raw.upper() not in LOG_LEVELS:
        raise ConfigError(
            f"{var}={raw[:40]!r} is not a log level: use one of {', '.join(LOG_LEVELS)}"
        )
    return raw.upper()


def backend_name(value: str) -> str:
    """argparse ``type=``: an alias -> its backend name (``choices`` then checks the result)."""
    return backends.canonical(value)


def server_url(value: str) -> str:
    """argparse ``type=`` for a server's base URL: ``routes.server_url``, its ``ConfigError`` as
    argparse's usage error."""
    try:
        return routes.server_url(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def summary_parser(doc: str, prog: str | None = None) -> argparse.ArgumentParser:
    """A command's parser described by the first line of its module docstring ``doc``."""
    return argparse.ArgumentParser(
        prog=prog,
        description=doc.split("\n\n")[0].split("\n")[0],
        formatter_class=HelpFormatter,
    )


def add_api_key(parser: argparse.ArgumentParser) -> None:
    """``--api-key``, spelled and defaulted alike on every command that talks to a server."""
    parser.add_argument(
        "--api-key",
        default=os.environ.get("WEIGHTWIRE_API_KEY"),
        help="bearer token for the server (default: $WEIGHTWIRE_API_KEY)",
    )


def probe_server(url: str, *, timeout: float = 5.0) -> None:
    """``CommandError`` unless something answers HTTP at ``url`` (any status: a 401 is an answer).

    Run before a slow start-up (importing JAX, compiling) so a wrong URL or a stopped server
    fails in a second, not after it."""
    import httpx

    try:
        httpx.get(f"{url}/health", timeout=timeout)
    except httpx.TimeoutException:
        raise CommandError(
            f"the server at {url} did not answer within {timeout:g} s: is it up and is --server "
            "right?"
        ) from None
    except httpx.HTTPError as exc:
        reason = str(exc) or type(exc).__name__
        raise CommandError(
            f"cannot reach a server at {url} ({reason}): start one (weightwire serve --model "
            "tiny-llama --port 8000) or fix --server"
        ) from None


def fail(prog: str, message: str, code: int = EXIT_ERROR, *, stream: TextIO | None = None) -> int:
    """Print ``prog: error: message`` (one line per message line) and return ``code``."""
    print(f"{prog}: error: {message}", file=stream or sys.stderr, flush=True)
    return code


def guarded(prog: str, run: Callable[[], int]) -> int:
    """Run a command body; expected failures become one line and an exit code, not a traceback.

    ``WEIGHTWIRE_DEBUG=1`` re-raises, for the traceback.
    """
    debug = bool(os.environ.get("WEIGHTWIRE_DEBUG"))
    try:
        return run()
    except KeyboardInterrupt:
        return interrupted(prog)
    except SystemExit:
        raise
    except CommandError as exc:
        return fail(prog, str(exc), exc.code)
    except Exception as exc:  # one clear line instead of a traceback
        if debug:
            raise
        extra = missing_extra(exc)
        if extra is not None:
            return fail(prog, str(extra))
        return fail(
            prog, f"{type(exc).__name__}: {exc}\n(set WEIGHTWIRE_DEBUG=1 for the traceback)"
        )


def interrupted(prog: str, *, what: str = "") -> int:
    """Print the one line for a command stopped by Ctrl-C, SIGTERM or SIGHUP; return its exit code.

    ``_lifetime.stop_on_signals`` turns SIGTERM / SIGHUP into the ``KeyboardInterrupt`` this
    follows, so by now every clean-up (children included) has run."""
    sig = received()
    if sig is None:
        print(f"{prog}: interrupted{what}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    print(
        f"{prog}: stopped by {signal_name(sig)}{what}; its child processes were stopped",
        file=sys.stderr,
        flush=True,
    )
    return 128 + sig


class Progress:
    """Start-up progress as plain lines: ``prog: message`` on ``stream`` (stdout), flushed at once.

    Used where output goes to a pipe or a CI log (no live terminal widget), so a slow
    start shows what it is doing while it does it.
    """

    def __init__(self, prog: str, stream: TextIO | None = None) -> None:
        self.prog, self.stream = prog, stream

    def __call__(self, message: str) -> None:
        print(f"{self.prog}: {message}", file=self.stream or sys.stdout, flush=True)
