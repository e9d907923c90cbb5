"""CLI faults, process-level (the real ``weightwire`` entry point in a fresh interpreter):
hostile or broken servers against ``doctor``, bad configuration against ``serve``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from tests.cli.conftest import run_cli

HeaderThenBody = Callable[[socket.socket], None]


@contextmanager
def raw_server(serve: HeaderThenBody) -> Iterator[str]:
    """A loopback server running ``serve(conn)`` for each connection; every loop in ``serve``
    is bounded, so a doctor that never stops still lets this server end."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=_serve_one, args=(serve, conn), daemon=True).start()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def _serve_one(serve: HeaderThenBody, conn: socket.socket) -> None:
    with conn, suppress(OSError):
        conn.recv(65536)  # the request (small)
        serve(conn)


def _trickle(conn: socket.socket, data: bytes, every_s: float = 0.5, for_s: float = 40.0) -> None:
    end = time.monotonic() + for_s
    for byte in data:
        if time.monotonic() > end:
            return
        conn.sendall(bytes([byte]))
        time.sleep(every_s)


def _trickle_headers(conn: socket.socket) -> None:
    _trickle(conn, b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"a" * 500 + b"\r\n\r\n")


def _trickle_body(conn: socket.socket) -> None:
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    _trickle(conn, b'{"version": "' + b"0" * 990)


def _endless_body(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
    chunk = b"0" * (1 << 20)
    for _ in range(64):  # 64 MiB at most: a doctor that reads it all still ends, and says so
        conn.sendall(chunk)


@pytest.mark.parametrize("serve", [_trickle_headers, _trickle_body], ids=["headers", "body"])
def test_doctor_against_a_trickling_server_stops_at_its_timeout(serve: HeaderThenBody) -> None:
    """doctor against a server trickling one byte every 0.5 s (each read inside --timeout 2).
    It stops that probe at 2 s, says so, and exits 3 (no usable answer)."""
    with raw_server(serve) as url:
        done = run_cli("doctor", url, "--timeout", "2", "--deadline", "6", timeout=30)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "no complete answer within 2 s" in done.stdout and "doctor: stopped" in done.stdout
    assert "Traceback" not in done.stderr


def test_doctor_against_an_endless_body_stops_at_the_size_cap() -> None:
    """doctor against a server whose /version reply never ends. It stops reading at
    8 MiB, says so, and exits 3."""
    with raw_server(_endless_body) as url:
        done = run_cli("doctor", url, "--timeout", "20", timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "a reply body over 8 MiB; stopped reading it" in done.stdout


def test_doctor_against_a_dead_port_exits_3_as_its_help_says() -> None:
    """doctor against a port nobody listens on, given as a bare host:port. It adds http://,
    reports no answer and exits 3, the code --help gives for it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    done = run_cli("doctor", f"127.0.0.1:{port}", "--timeout", "3", timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"GET http://127.0.0.1:{port}/version -> no answer" in " ".join(done.stdout.split())
    help_text = run_cli("doctor", "--help", timeout=60).stdout
    assert "3    no usable answer: nothing listens there" in help_text


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "0"], ids=["negative", "nan", "inf", "zero"])
def test_doctor_refuses_a_bad_timeout_as_a_usage_error(value: str) -> None:
    """doctor --timeout with a value that is not a finite number of seconds > 0: exit 2, one
    line."""
    done = run_cli("doctor", "127.0.0.1:9", "--timeout", value, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"argument --timeout: '{value}' must be a finite number of seconds > 0" in done.stderr
    assert "Traceback" not in done.stderr


def _serve(
    *args: str, env: dict[str, str | None], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``weightwire serve ARGS`` in a fresh interpreter with ``env`` applied (None: unset)."""
    full = {k: v for k, v in os.environ.items() if k not in env}
    full.update({k: v for k, v in env.items() if v is not None})
    return subprocess.run(
        [sys.executable, "-m", "weightwire.tools.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=full,
    )


@pytest.mark.parametrize(
    ("flag", "env", "says"),
    [
        ([], "", "WEIGHTWIRE_API_KEY is empty"),
        ([], " ", "WEIGHTWIRE_API_KEY is blank"),
        ([], " key ", "WEIGHTWIRE_API_KEY has whitespace at its start or end"),
        (["--api-key", ""], None, "--api-key is empty"),
        (["--api-key", "  "], None, "--api-key is blank"),
    ],
    ids=["env-empty", "env-blank", "env-padded", "flag-empty", "flag-blank"],
)
def test_serve_refuses_an_empty_or_blank_api_key(
    flag: list[str], env: str | None, says: str
) -> None:
    """serve with an API key that is given but empty (would start an open server) or blank
    (a server nobody can authenticate to). One line naming where the key came from, exit 2,
    nothing started."""
    done = _serve("--model", "tiny-llama", "--port", "0", *flag, env={"WEIGHTWIRE_API_KEY": env})
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"weightwire serve: error: {says}" in done.stderr
    assert "Traceback" not in done.stderr and "ready" not in done.stdout


@pytest.mark.parametrize(
    ("var", "value", "says"),
    [
        (
            "WEIGHTWIRE_TIMEOUT_CONNECT_S",
            "abc",
            "WEIGHTWIRE_TIMEOUT_CONNECT_S must be a number of seconds, got 'abc'",
        ),
        (
            "WEIGHTWIRE_TIMEOUT_HTTP_S",
            "inf",
            "WEIGHTWIRE_TIMEOUT_HTTP_S must be a finite number of seconds > 0",
        ),
        (
            "WEIGHTWIRE_TIMEOUT_TRANSFER_S",
            "-1",
            "WEIGHTWIRE_TIMEOUT_TRANSFER_S must be a finite number of seconds > 0",
        ),
        ("WEIGHTWIRE_LOG_LEVEL", "bogus", "WEIGHTWIRE_LOG_LEVEL='bogus' is not a log level"),
    ],
    ids=["timeout-text", "timeout-inf", "timeout-negative", "log-level"],
)
def test_serve_refuses_a_bad_environment_variable_at_start(var: str, value: str, says: str) -> None:
    """serve with a bad ``WEIGHTWIRE_TIMEOUT_*`` or ``WEIGHTWIRE_LOG_LEVEL``: it refuses to start
    with one line naming the variable (exit 2), instead of printing "ready" and then failing
    every init with a 500 (timeouts) or every worker with a traceback (log level)."""
    done = _serve(
        "--model",
        "tiny-llama",
        "--port",
        "0",
        env={var: value, "WEIGHTWIRE_API_KEY": None},
        timeout=90,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"weightwire serve: error: {says}" in done.stderr
    assert "Traceback" not in done.stderr and "ready" not in done.stdout
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def _break_config(config: dict[str, Any]) -> None:
    config["hidden_size"] *= 2  # the weights no longer fit the architecture it describes


def _unknown_arch(config: dict[str, Any]) -> None:
    config.update(model_type="no_such_model", architectures=["NoSuchForCausalLM"])


def _damage(data: bytes) -> bytes:
    return data[:10] + b"\xff" * 10 + data[20:]


_BREAKS: dict[str, tuple[Callable[[Path], None], str]] = {
    "empty-config": (lambda d: (d / "config.json").write_text(""), "config.json is empty"),
    "bad-json": (
        lambda d: (d / "config.json").write_text('{"model_type": '),
        "config.json is not valid JSON",
    ),
    "not-an-object": (
        lambda d: (d / "config.json").write_text("[1]"),
        "config.json is a JSON list, not an object",
    ),
    "truncated-weights": (
        lambda d: _rewrite(d / "model.safetensors", lambda b: b[: len(b) // 2]),
        "model.safetensors is damaged: tensor",
    ),
    "oversized-header": (
        lambda d: _rewrite(d / "model.safetensors", lambda b: struct.pack("<Q", 1 << 40) + b[8:]),
        "model.safetensors is damaged: its header claims 1099511627776 bytes, over the 100 MiB",
    ),
    "damaged-header": (
        lambda d: _rewrite(d / "model.safetensors", _damage),
        "model.safetensors is damaged: its header is not valid JSON",
    ),
    "config-lies-about-shapes": (
        lambda d: _edit_config(d, _break_config),
        "config.json does not describe these weights: ",
    ),
    "unknown-architecture": (
        lambda d: _edit_config(d, _unknown_arch),
        "has model type `no_such_model` but Transformers does not recognize this architecture.",
    ),
}


def _rewrite(file: Path, change: Callable[[bytes], bytes]) -> None:
    file.write_bytes(change(file.read_bytes()))


def _edit_config(model: Path, change: Callable[[dict[str, Any]], None]) -> None:
    config = json.loads((model / "config.json").read_text())
    change(config)
    (model / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("case", list(_BREAKS), ids=list(_BREAKS))
def test_serve_names_what_is_wrong_with_a_broken_model_directory(case: str, tmp_path: Path) -> None:
    """serve --model DIR with a broken model directory (empty or invalid config, weights
    truncated or with a damaged or oversized header, a config that lies about shapes, an
    unknown architecture). One line naming the problem, no worker traceback."""
    from weightwire.tools.server.tiny import tiny_model_dir

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("tiny-llama"), model)
    breaker, says = _BREAKS[case]
    breaker(model)
    done = _serve(
        "--model", str(model), "--port", "0", env={"WEIGHTWIRE_API_KEY": None}, timeout=240
    )
    assert done.returncode in (2, 3), done.stdout + done.stderr
    assert "Traceback" not in done.stderr and 'File "' not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip().splitlines()[-1]], done.stderr
    assert says in done.stderr and done.stderr.startswith("weightwire serve: error: ")
