"""``weightwire`` argument handling, ``serve`` / ``bench`` delegation and ``doctor``."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tests.cli.conftest import run_cli
from weightwire.tools import cli


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "serve", "bench", "doctor"):
        assert command in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--server", "http://127.0.0.1:9"], "--server needs --model-dir"),
        (["demo", "--batch", "10"], "--batch 10 must be a multiple of --samples-per-prompt 4"),
        (["demo", "--steps", "0"], "--steps must be >= 1"),
    ],
)
def test_demo_rejects_bad_arguments(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv", [["--backend", "nccl"], ["--backend", "weightwire_nccl"], ["--transport", "nccl"]]
)
def test_demo_nccl_on_a_cpu_host_fails_before_starting_anything(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["demo", *argv]) == 3
    err = capsys.readouterr().err
    assert (
        "needs JAX on a CUDA GPU" in err
        and "use --backend weightwire_tcp on a CPU-only host" in err
    )
    assert "Traceback" not in err and "RuntimeError" not in err


def test_serve_is_the_reference_servers_own_parser(capsys: pytest.CaptureFixture[str]) -> None:
    # serve_main validates before loading anything: a bad port fails in milliseconds.
    assert cli.main(["serve", "--model", "tiny-llama", "--port", "70000"]) == 2
    assert "--port must be in [0, 65535]" in capsys.readouterr().err


def test_bench_defaults_to_tcp_and_passes_arguments_through() -> None:
    done = run_cli("bench", "--total-mib", "8", "--buffer-mib", "4", "--repeats", "1", timeout=120)
    assert done.returncode == 0, done.stderr
    assert "TCP loopback, 8 MiB in 4 MiB buffers" in done.stdout
    assert "weightwire TCPCommunicator" in done.stdout


def test_bench_refuses_bad_sizes_as_a_usage_error() -> None:
    done = run_cli(
        "bench", "--transport", "tcp", "--total-mib", "5", "--buffer-mib", "4", timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "--total-mib 5 must be a multiple of --buffer-mib 4" in done.stderr
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------------------ doctor
class _Stub(BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, Any]] = {}

    def do_GET(self) -> None:
        status, body = self.routes.get(self.path.split("?")[0], (404, {"detail": "Not Found"}))
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stub() -> Iterator[tuple[str, dict[str, tuple[int, Any]]]]:
    """A fake server answering GET routes from a dict the test fills in."""
    routes: dict[str, tuple[int, Any]] = {}
    handler = type("Handler", (_Stub,), {"routes": routes})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", routes
    finally:
        server.shutdown()
        server.server_close()


def _vllm_routes(backend: str | None) -> dict[str, tuple[int, Any]]:
    config = None if backend is None else {"backend": backend}
    return {
        "/version": (200, {"version": "0.32.0"}),
        "/weight_info": (200, {"weight_version": "default"}),
        "/get_world_size": (200, {"world_size": 2}),
        "/is_paused": (200, {"is_paused": False}),
        "/server_info": (
            200,
            {"vllm_config": {"weight_transfer_config": config}, "system_env": {}},
        ),
    }


def test_doctor_says_dev_mode_is_off(
    stub: tuple[str, dict], capsys: pytest.CaptureFixture[str]
) -> None:
    url, routes = stub
    routes["/version"] = (200, {"version": "0.33.1"})
    assert cli.main(["doctor", url]) == 1
    out = capsys.readouterr().out
    assert "without VLLM_SERVER_DEV_MODE=1" in out and "FAIL" in out


def test_doctor_names_a_missing_backend(
    stub: tuple[str, dict], capsys: pytest.CaptureFixture[str]
) -> None:
    url, routes = stub
    routes.update(_vllm_routes(None))
    assert cli.main(["doctor", url]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "no weight-transfer backend configured" in out
    assert "world size 2" in out and "reuse_metadata NO" in out


def test_doctor_accepts_a_configured_vllm(
    stub: tuple[str, dict], capsys: pytest.CaptureFixture[str]
) -> None:
    url, routes = stub
    routes.update(_vllm_routes("nccl"))
    assert cli.main(["doctor", url]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "backend nccl (trainer needs GPUs + cupy" in out
    assert (
        "skip 1-tensor round not run: it runs only against the weightwire reference server" in out
    )


def test_doctor_reports_an_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    assert cli.main(["doctor", f"http://127.0.0.1:{port}", "--timeout", "3"]) == 3
    assert "no answer" in capsys.readouterr().out


@pytest.mark.parametrize("body", [[1, 2], None, "text"], ids=["list", "null", "string"])
def test_doctor_reads_routes_answering_json_that_is_not_an_object(
    stub: tuple[str, dict], body: Any
) -> None:
    url, routes = stub
    routes.update(_vllm_routes("nccl"))
    for path in ("/weight_info", "/get_world_size", "/is_paused", "/server_info"):
        routes[path] = (200, body)
    done = run_cli("doctor", url, timeout=60)
    out = " ".join(done.stdout.split())
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "AttributeError" not in done.stdout + done.stderr
    assert (
        "'/weight_info': 'not a JSON object'" in out
        and "cannot read the weight-transfer config" in out
    )


@pytest.mark.parametrize(
    ("key", "says"),
    [
        (None, "the server needs an API key: pass --api-key (or set WEIGHTWIRE_API_KEY)"),
        ("wrong", "the server rejected the API key given (--api-key / WEIGHTWIRE_API_KEY)"),
    ],
    ids=["no-key", "wrong-key"],
)
def test_doctor_tells_a_missing_key_from_a_rejected_one(
    stub: tuple[str, dict], key: str | None, says: str
) -> None:
    url, routes = stub
    routes.update(_vllm_routes("nccl"))
    for path in ("/weight_info", "/get_world_size", "/is_paused"):
        routes[path] = (401, {"error": "unauthorized"})
    done = run_cli("doctor", url, *(["--api-key", key] if key else []), timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert says in " ".join(done.stdout.split())


def test_doctor_help_has_a_description_examples_and_its_exit_codes() -> None:
    done = run_cli("doctor", "--help", timeout=60)
    assert done.returncode == 0
    assert "Check whether a trainer can sync weights into a running server" in done.stdout
    assert "examples:\n  weightwire doctor 127.0.0.1:8000" in done.stdout
    assert "1    the server answered and a blocking problem was found" in done.stdout


def test_doctor_times_a_round_without_changing_the_reference_server(
    launch_server: Any, tiny_dir: str
) -> None:
    url = launch_server(tiny_dir).wait_ready()
    before = httpx.post(f"{url}/weight_checker", json={"action": "checksum"}).json()["checksums"]
    version = httpx.get(f"{url}/weight_info").json()["weight_version"]
    done = run_cli("doctor", url, timeout=120)
    out = " ".join(done.stdout.split())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(weightwire reference server)" in out and "all answer 200" in out
    assert (
        "ok 1-tensor round weightwire_tcp: rendezvous" in out and "served weights unchanged" in out
    )
    assert (
        httpx.post(f"{url}/weight_checker", json={"action": "checksum"}).json()["checksums"]
        == before
    )
    assert httpx.get(f"{url}/weight_info").json()["weight_version"] == version
    # The doctor released the session: a trainer can initialise right after.
    assert httpx.get(f"{url}/weight_info").json()["session"]["state"] == "uninitialized"
