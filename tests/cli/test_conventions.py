"""The command line's conventions, held by every command: ``--version``, ``python -m
weightwire``, the documented exit codes, no traceback on an expected error or Ctrl-C,
help text on every option, one backend naming, progress that shows in a pipe."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import weightwire
from tests.cli.conftest import run_cli, run_module, start_weightwire
from weightwire._extras import EXTRA_OF, MissingExtra, install_command, missing_extra, require
from weightwire.tools import _cli, cli
from weightwire.tools.bench import comm, sync
from weightwire.tools.server.serve_args import build_parser as serve_parser


def _python_m(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_module("weightwire", *args, timeout=timeout)


def test_version_and_python_m_weightwire() -> None:
    done = _python_m("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"weightwire {weightwire.__version__}"
    assert run_cli("--version").stdout == done.stdout
    listing = _python_m("--help")
    assert listing.returncode == 0 and all(
        c in listing.stdout for c in ("demo", "serve", "bench", "doctor")
    )


def test_the_version_has_one_source() -> None:
    text = (Path(weightwire.__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text and 'path = "weightwire/__init__.py"' in text
    assert "\nversion =" not in text


# ------------------------------------------------------------------ help on every option
def _subparsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.values()


def _all_parsers() -> dict[str, argparse.ArgumentParser]:
    main = cli.build_parser()
    found = {"weightwire": main, **{p.prog: p for p in _subparsers(main)}}
    found["weightwire serve (own)"] = serve_parser()
    found["weightwire bench (own)"] = comm.build_parser("weightwire bench")
    found["weightwire bench --sync (own)"] = sync.build_parser("weightwire bench --sync")
    return found


@pytest.mark.parametrize(("name", "parser"), list(_all_parsers().items()))
def test_every_option_has_help_and_no_markup(name: str, parser: argparse.ArgumentParser) -> None:
    texts = [parser.description or "", parser.epilog or ""]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue  # internal (child-process roles), hidden from --help on purpose
        assert action.help and action.help.strip(), (
            f"{name}: {action.option_strings or action.dest} has no help"
        )
        texts.append(action.help)
    rendered = parser.format_help()
    assert "``" not in rendered and "``" not in " ".join(texts), f"{name}: reST markup in --help"


def test_one_backend_naming_across_commands() -> None:
    seen = {}
    for name, parser in _all_parsers().items():
        for action in parser._actions:
            if "--backend" in action.option_strings:
                seen[name] = set(action.choices or ())
                assert action.type is _cli.backend_name, f"{name}: --backend takes no aliases"
    assert set(seen) >= {"weightwire demo", "weightwire serve (own)", "weightwire bench (own)"}
    for name, choices in seen.items():
        assert choices - {"all"} <= set(_cli.BACKENDS), (
            f"{name}: backend names {choices - set(_cli.BACKENDS)}"
        )
    # The alias works wherever a backend is taken.
    assert (
        serve_parser().parse_args(["--model", "m", "--backend", "tcp"]).backend == "weightwire_tcp"
    )
    assert comm.build_parser().parse_args(["--backend", "tcp"]).backend == "weightwire_tcp"


# ------------------------------------------------------------------ exit codes, one line, no
# traceback
def _one_clean_error(done: subprocess.CompletedProcess[str], code: int, message: str) -> None:
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_serve_exit_codes() -> None:
    _one_clean_error(
        run_cli("serve", "--model", "/no/such/dir"), 2, "--model '/no/such/dir': no such directory"
    )
    _one_clean_error(
        run_cli("serve", "--model", "tiny-llama", "--replicas", "0"), 2, "--replicas must be in"
    )
    _one_clean_error(
        run_cli("serve", "--model", "tiny-llama", "--nonsense"),
        2,
        "unrecognized arguments: --nonsense",
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli("serve", "--model", "tiny-llama", "--port", str(port), timeout=180)
    _one_clean_error(done, 3, f"cannot listen on 127.0.0.1:{port}: the address is already in use")
    assert "[Errno" not in done.stderr


def test_bench_sync_on_a_cpu_host_fails_clearly() -> None:
    done = run_cli("bench", "--sync", "--rounds", "1")
    _one_clean_error(done, 3, "weightwire bench --sync needs two CUDA GPUs")
    assert done.stdout == ""  # no empty result table


def test_bench_help_is_the_benchmarks_own() -> None:
    for argv in (["bench", "--help"], ["bench", "--", "--help"]):
        done = run_cli(*argv)
        assert done.returncode == 0, done.stderr
        assert (
            "--total-mib" in done.stdout
            and "--sync" in done.stdout
            and "exit codes:" in done.stdout
        )
    done = run_cli("bench", "--sync", "--help")
    assert done.returncode == 0 and "--buffers-mib" in done.stdout and "--engines" in done.stdout


def test_exit_codes_are_documented_where_users_look() -> None:
    helps = [
        run_cli("--help").stdout,
        run_cli("demo", "--help").stdout,
        run_cli("serve", "--help").stdout,
    ]
    for text in helps:
        assert "exit codes:" in text and "130" in text and "bad arguments" in text
    assert cli.__doc__ is not None and "130 Ctrl-C" in cli.__doc__


def test_an_unexpected_error_is_one_line_unless_debugging(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def boom() -> int:
        raise OSError("disk on fire")

    assert _cli.guarded("weightwire x", boom) == 3
    err = capsys.readouterr().err
    assert (
        err.startswith("weightwire x: error: OSError: disk on fire") and "WEIGHTWIRE_DEBUG=1" in err
    )
    monkeypatch.setenv("WEIGHTWIRE_DEBUG", "1")
    with pytest.raises(OSError, match="disk on fire"):
        _cli.guarded("weightwire x", boom)

    def interrupted() -> int:
        raise KeyboardInterrupt

    monkeypatch.delenv("WEIGHTWIRE_DEBUG")
    assert _cli.guarded("weightwire x", interrupted) == 130
    assert capsys.readouterr().err == "weightwire x: interrupted\n"


# ------------------------------------------------------------------ optional dependencies
def test_a_missing_extra_is_named_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(MissingExtra) as exc:
        require("numpy", "weightwire_no_such_module_x", purpose="the thing")
    assert str(exc.value).startswith("the thing needs 'weightwire_no_such_module_x': ")
    assert str(exc.value).endswith(" install weightwire_no_such_module_x")
    assert str(MissingExtra("safetensors.numpy", "reading a checkpoint")) == (
        f"reading a checkpoint needs 'safetensors': {install_command('jax')}"
    )
    assert str(MissingExtra("uvicorn")).endswith(install_command("torch"))
    assert install_command("cuda12") in str(MissingExtra("cupy")) and "[cuda13]" in str(
        MissingExtra("cupy")
    )
    # A bare ModuleNotFoundError of a known optional module, even wrapped, maps to its extra.
    try:
        try:
            raise ModuleNotFoundError("No module named 'tokenizers'", name="tokenizers")
        except ModuleNotFoundError as inner:
            raise RuntimeError("child failed") from inner
    except RuntimeError as outer:
        found = missing_extra(outer)
    assert found is not None and found.extra == "jax"
    assert missing_extra(ModuleNotFoundError("x", name="weightwire_internal")) is None

    def needs_torch() -> int:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    assert _cli.guarded("weightwire serve", needs_torch) == 3
    assert (
        capsys.readouterr().err
        == f"weightwire serve: error: 'torch' is not installed: {install_command('torch')}\n"
    )
    assert set(EXTRA_OF.values()) <= {"jax", "torch", "cuda12", "ray", "test"}


@pytest.mark.parametrize("folder", ["weightwire", "my-clone"])
def test_the_install_hint_works_for_a_clone_and_names_the_venv_pip(
    tmp_path: Path, folder: str
) -> None:
    # From a checkout the package is not on any index: the hint is an editable install of the
    # checkout with this interpreter's pip (the README's set-up never activates its venv).
    # A clone of its own, in a folder named as ``git clone`` names it and in another: the hint
    # must not depend on the checkout's folder name (issue #50).
    import shutil

    here_root = Path(weightwire.__file__).resolve().parents[1]
    root = tmp_path / folder
    shutil.copytree(
        here_root / "weightwire", root / "weightwire", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(here_root / "pyproject.toml", root / "pyproject.toml")
    elsewhere_dir = tmp_path / "elsewhere"
    elsewhere_dir.mkdir()
    probe = "from weightwire._extras import MissingExtra; print(MissingExtra('flax'))"
    env = {**os.environ, "PYTHONPATH": str(root)}

    def hint(cwd: Path) -> str:
        return subprocess.run(
            [sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=env,
            timeout=60,
            check=True,
        ).stdout.strip()

    pip = Path(sys.prefix, "bin", "pip")
    shown = str(pip)  # the venv is not below the temporary clone
    if sys.prefix == sys.base_prefix or not pip.exists():
        shown = f"{sys.executable} -m pip"
    assert hint(root) == f"'flax' is not installed: {shown} install -e \".[jax]\""
    # Not the index name (``"weightwire[jax]"``, which no index serves), the clone's path.
    assert hint(elsewhere_dir) == f"'flax' is not installed: {shown} install -e \"{root}[jax]\""


# ------------------------------------------------------------------ serve: what it loads, routes,
# Ctrl-C
def test_serve_says_what_it_loads_and_serves_and_stops_cleanly_on_ctrl_c(tiny_dir: str) -> None:
    proc = start_weightwire("serve", "--model", tiny_dir, "--port", "0")
    try:
        assert proc.stdout is not None and proc.stderr is not None
        loading = proc.stdout.readline()  # printed before the (slow) model load
        ready = proc.stdout.readline()
        routes = proc.stdout.readline()
        # Ctrl-C in a terminal signals the whole foreground process group: the server and its
        # workers.
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert loading.startswith(
        f"weightwire serve: loading {os.path.abspath(tiny_dir)} into 1 worker process(es) on cpu"
    )
    assert ready.startswith("weightwire server ready on http://127.0.0.1:") and out == ""
    assert "OpenAI /v1/chat/completions, /v1/completions, /v1/models" in routes, routes
    assert "/init_weight_transfer_engine" in routes and "/health" in routes, routes
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert (
        err.strip().splitlines()[-1]
        == "weightwire serve: stopped by Ctrl-C (SIGINT); the workers were closed"
    ), err


def test_ctrl_c_during_the_demo_exits_130_without_a_traceback() -> None:
    # ``python -m weightwire demo`` with SIGINT handled as in a terminal: a runner started in the
    # background of a non-interactive shell (no job control) hands its children SIGINT *ignored*,
    # which CPython then keeps (it installs KeyboardInterrupt only where SIGINT was not ignored),
    # and the demo would rightly run to its end.
    entry = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = ['weightwire', 'demo']; runpy.run_module('weightwire', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", entry],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:  # plain progress lines (a pipe); the test timeout bounds this
            seen.append(line)
            if line.startswith("[4/6] "):
                break
        assert seen and seen[-1].startswith("[4/6] "), "".join(seen)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does to the foreground group
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 130, (proc.returncode, err)
    assert err.strip().endswith("weightwire demo: interrupted") and "Traceback" not in err, err
