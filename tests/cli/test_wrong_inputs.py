"""A newcomer's wrong inputs through the public API (issue #50): each one is accepted as meant
(a bare ``host:port``) or refused with a ``WeightwireError`` subclass whose message names the
fix, before any request where the trainer can know it; a wait for a server never hangs.

(Checks of tensors against the served model: tests of the engines' checks.)"""

from __future__ import annotations

import pickle
import socket
import time
from collections.abc import Iterator

import pytest

import weightwire
from tests.cli.conftest import run_cli
from weightwire import (
    ConfigError,
    HTTPWeightSyncClient,
    JAXTrainerEngine,
    ModuleSource,
    Naming,
    PytreeSource,
    Rule,
    ServerNotReady,
    TorchTrainerEngine,
    TrainerInitInfo,
    WeightSyncError,
    WeightwireError,
    wait_until_ready,
)
from weightwire.shared.errors import WrongType
from weightwire.tools.demo.server import EmbeddedServer

pytestmark = pytest.mark.timeout(120)


def _dead_port() -> int:
    with socket.socket() as s:  # bound, closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield int(s.getsockname()[1])


# ------------------------------------------------------------------ server URLs
@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("localhost:8000/", "http://localhost:8000"),
        (" http://127.0.0.1:8000 ", "http://127.0.0.1:8000"),
        ("https://vllm.internal:443", "https://vllm.internal:443"),
    ],
)
def test_a_bare_host_port_means_http(given: str, meant: str) -> None:
    assert HTTPWeightSyncClient(given).base_urls == [meant]
    assert HTTPWeightSyncClient([given, "other:1"]).base_urls == [meant, "http://other:1"]


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ("ftp://127.0.0.1:8000", "the scheme must be http:// or https://, not ftp://"),
        ("http://", "it names no host"),
        ("127.0.0.1:99999", "its port is not a number in [0, 65535]"),
        ("127.0.0.1:eighty", "its port is not a number in [0, 65535]"),
        ("http://[::1", "Invalid IPv6 URL"),
        ("http://my host:8000", "it contains white space"),
        (
            "http://127.0.0.1:8000/v1/",
            "it ends in /v1, the OpenAI API's prefix; the weight-sync routes are at the root",
        ),
        ("127.0.0.1:8000/?key=1", "a base URL has no ?query or #fragment"),
    ],
)
def test_a_url_that_is_none_is_refused_naming_the_form(given: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        HTTPWeightSyncClient(given)
    message = str(info.value)
    assert message.startswith(f"{given!r} is not a server URL ({problem})"), message
    assert "give http://HOST:PORT, e.g. http://127.0.0.1:8000" in message
    with pytest.raises(ConfigError, match="is not a server URL"):
        wait_until_ready(["http://127.0.0.1:1", given], timeout=1)


def test_no_url_a_non_string_and_a_repeated_server_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="empty list: give at least one server URL"):
        HTTPWeightSyncClient([])
    with pytest.raises(ConfigError, match="a server URL .* or a list of them, got int"):
        HTTPWeightSyncClient(8000)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must be a str such as http://127.0.0.1:8000"):
        HTTPWeightSyncClient([b"http://a:1"])  # type: ignore[list-item]
    # The same server spelled two ways is still the same server.
    with pytest.raises(ConfigError, match="same server twice .*list each server once"):
        HTTPWeightSyncClient(["a:1", "http://a:1/"])


def test_the_cli_reads_a_url_as_the_client_does() -> None:
    done = run_cli("doctor", "ftp://127.0.0.1:8000", timeout=120)
    assert done.returncode == 2
    assert (
        "'ftp://127.0.0.1:8000' is not a server URL (the scheme must be http:// or https://, "
        "not ftp://): give http://HOST:PORT"
    ) in done.stderr


# ------------------------------------------------------------------ engine and source
_INFO = TrainerInitInfo(backend="weightwire_tcp")


def test_a_torch_source_given_to_the_jax_engine_is_refused_at_init() -> None:
    torch = pytest.importorskip("torch")
    # A dead URL: a request made before the check would fail as a WeightSyncError instead.
    client = HTTPWeightSyncClient(f"127.0.0.1:{_dead_port()}", timeout=5)
    with pytest.raises(ConfigError) as info:
        JAXTrainerEngine.trainer_init(
            _INFO, client=client, source=ModuleSource(torch.nn.Linear(2, 2))
        )
    assert str(info.value) == (
        "JAXTrainerEngine sends JAX arrays, but the source is a PyTorch ModuleSource: use "
        "TorchTrainerEngine with ModuleSource for a PyTorch model, or JAXTrainerEngine with a "
        "PytreeSource"
    )


def test_a_jax_source_given_to_the_torch_engine_is_refused_at_init() -> None:
    jnp = pytest.importorskip("jax.numpy")
    client = HTTPWeightSyncClient(f"127.0.0.1:{_dead_port()}", timeout=5)
    source = PytreeSource(lambda: {"w": jnp.ones(2)}, Naming([Rule("w", "w")]))
    with pytest.raises(ConfigError) as info:
        TorchTrainerEngine.trainer_init(_INFO, client=client, source=source)
    assert str(info.value) == (
        "TorchTrainerEngine sends torch tensors, but the source is a JAX PytreeSource: use "
        "JAXTrainerEngine with PytreeSource for a JAX model, or TorchTrainerEngine with a "
        "ModuleSource"
    )


def test_a_users_own_source_of_the_other_framework_is_named_at_its_first_tensor() -> None:
    # A hand-written source's class says nothing; its first tensor does (instead of
    # "torch.float32 is not a dtype").
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    jax_engine = object.__new__(JAXTrainerEngine)
    with pytest.raises(ConfigError, match="the source's tensor is a PyTorch Tensor: use Torch"):
        jax_engine.describe(torch.ones(2))
    torch_engine = object.__new__(TorchTrainerEngine)
    with pytest.raises(ConfigError, match="the source's tensor is a JAX .*: use JAXTrainerEngine"):
        torch_engine.describe(jnp.ones(2))
    with pytest.raises(WrongType, match="source yielded list, expected torch.Tensor"):
        torch_engine.describe([1.0])


def test_arguments_of_the_wrong_kind_are_wrong_type_errors() -> None:
    # Each is also the TypeError it was before it had a class in the tree.
    client = HTTPWeightSyncClient(f"127.0.0.1:{_dead_port()}", timeout=5)
    with pytest.raises(WrongType, match="init_info must be a TrainerInitInfo, got dict"):
        JAXTrainerEngine.trainer_init({"backend": "weightwire_tcp"}, client=client)  # type: ignore[arg-type]
    with pytest.raises(WrongType, match="a weight source needs metadata and iteration; .* lacks"):
        JAXTrainerEngine.trainer_init(_INFO, client=client, source=object())
    with pytest.raises(WrongType, match="naming must be a weightwire Naming, got dict"):
        PytreeSource(lambda: {}, {"w": "w"})  # type: ignore[arg-type]
    with pytest.raises(WrongType, match="weight_version must be a str, got int"):
        client.finish_weight_update(3)  # type: ignore[arg-type]
    assert issubclass(WrongType, TypeError) and issubclass(WrongType, ConfigError)


# ------------------------------------------------------------------ a server that is not there
def test_waiting_for_a_server_that_never_comes_is_bounded_and_names_it(silent_port: int) -> None:
    dead = f"http://127.0.0.1:{_dead_port()}"
    start = time.monotonic()
    with pytest.raises(ServerNotReady) as info:
        HTTPWeightSyncClient(dead, ready_timeout=0.5)
    assert 0.5 <= time.monotonic() - start < 3
    err = info.value
    assert isinstance(err, WeightSyncError) and isinstance(err, TimeoutError)
    assert (err.server, err.route, err.status) == (dead, "health", None)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)  # crosses processes intact
    assert str(err).startswith(f"the server at {dead} was not ready after 0.")
    assert "(last GET /health: ConnectError" in str(err)
    assert str(err).endswith(
        "start it, check the URL, or wait longer (a larger timeout / ready_timeout)"
    )
    # A server that accepts and never answers: each poll is cut at the deadline, not at its own
    # bound; of several servers, the one not ready is named.
    silent = f"http://127.0.0.1:{silent_port}"
    start = time.monotonic()
    with pytest.raises(ServerNotReady, match=f"the server at {silent} was not ready .*Timeout"):
        wait_until_ready([f"127.0.0.1:{silent_port}"], timeout=0.5)
    assert time.monotonic() - start < 3
    with pytest.raises(ConfigError, match="timeout must be a finite number of seconds > 0"):
        wait_until_ready(dead, timeout=float("inf"))


def test_every_wrong_input_here_is_a_weightwire_error() -> None:
    # What docs/errors.md promises: one `except WeightwireError` catches each of the above.
    for bad in (lambda: HTTPWeightSyncClient("ftp://x:1"), lambda: wait_until_ready([], 1)):
        with pytest.raises(WeightwireError):
            bad()
    assert {"wait_until_ready", "ServerNotReady"} <= set(weightwire.__all__)


# ------------------------------------------------------------------ a server that is starting
@pytest.mark.slow
def test_a_client_made_while_the_server_starts_waits_for_it(tiny_dir: str) -> None:
    # The port is fixed (the last --port wins over the launcher's 0): the URL is known before
    # the server listens, as in a job script that starts both.
    port = _dead_port()
    server = EmbeddedServer(tiny_dir, startup_timeout=180, extra_args=["--port", str(port)])
    server.launch()
    try:
        url = f"127.0.0.1:{port}"
        # Without a wait: the symptom, at once (the child is still importing).
        with pytest.raises(WeightSyncError, match=r"\(no response\): ConnectError"):
            HTTPWeightSyncClient(url, timeout=5).weight_info()
        client = HTTPWeightSyncClient(url, timeout=30, ready_timeout=180)
        assert "weight_version" in client.weight_info()[0]  # it serves
        assert server.wait_ready() == f"http://{url}"
        client.close()
    finally:
        server.stop()


def test_a_bare_weightwire_prints_the_help() -> None:
    # Not argparse's "the following arguments are required: {demo,...}"; exit 2: no command ran.
    done = run_cli(timeout=120)
    assert (done.returncode, done.stderr) == (2, "")
    assert done.stdout == run_cli("--help", timeout=120).stdout
    assert done.stdout.startswith("usage: weightwire ") and "exit codes:" in done.stdout


def test_the_demo_waits_for_its_server_only_when_asked_and_bounded(tiny_dir: str) -> None:
    url = f"127.0.0.1:{_dead_port()}"
    done = run_cli(
        "demo", "--server", url, "--model-dir", tiny_dir, "--wait-ready", "0.5", timeout=120
    )
    assert done.returncode == 3, done.stdout + done.stderr
    line = done.stderr.strip()
    assert line.startswith(
        f"weightwire demo: error: the server at http://{url} was not ready after"
    )
    assert line.endswith("start it, check --server, or raise --wait-ready"), line
    assert "importing JAX" not in done.stdout  # before the slow start-up
    done = run_cli("demo", "--wait-ready", "5", timeout=120)
    assert done.returncode == 2 and "--wait-ready waits for --server" in done.stderr
