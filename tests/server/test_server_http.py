"""One real server (1 replica, ``--api-key``): auth, session rules, body validation,
pause modes. Every error must be JSON with the reason, never a 500 or a traceback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _server_sender import DRILL_ARGS, TCPSender, VLLMStyleClient
from malformed_bodies import MALFORMED_BODIES

from weightwire.shared.routes import ROUTES

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(server_factory, tiny_llama: str, tmp_path_factory: pytest.TempPathFactory):
    # The key from a file (with the trailing newline an editor leaves): every auth case of
    # this module runs against --api-key-file, and the key is on no command line.
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(KEY + "\n")
    return server_factory(
        [
            "--model",
            tiny_llama,
            "--replicas",
            "1",
            "--api-key-file",
            str(key_file),
            "--max-body-bytes",
            "65536",
            *DRILL_ARGS,
        ],
        env={"WEIGHTWIRE_TIMEOUT_CONNECT_S": "2"},
    )  # the dead-sender test waits this long


def test_api_key_is_not_on_the_server_command_line(server) -> None:
    cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode()
    assert KEY not in cmdline and "--api-key-file" in cmdline
    assert "warning" not in server.log()


def test_a_huge_text_prompt_is_refused_before_tokenizing(http: httpx.Client) -> None:
    """The 64 KiB body limit of this server allows ~60 K characters; tiny-llama's 256
    positions hold far fewer, which the API knows without tokenizing."""
    resp = http.post("/v1/completions", json={"prompt": "word " * 12_000, "max_tokens": 1})
    assert resp.status_code == 400, resp.text
    assert (
        "60000 characters: more tokens than the model's positions"
        in resp.json()["error"]["message"]
    )


def test_a_huge_chat_message_is_refused_before_tokenizing(http: httpx.Client) -> None:
    """As for /v1/completions: the characters of every message (text parts joined) decide,
    before the chat template renders them and the tokenizer runs on the serve lane."""
    parts = [{"type": "text", "text": "word " * 3_000}] * 2
    messages = [{"role": "system", "content": "word " * 6_000}, {"role": "user", "content": parts}]
    resp = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "messages"
    assert (
        "messages hold 60000 characters: more tokens than the model's positions" in error["message"]
    )


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_a_tiny_temperature_samples_at_vllms_floor(http: httpx.Client, temperature: float) -> None:
    """Dividing logits by 1e-40 overflows; like vLLM, a positive temperature below 0.01 samples at
    0.01."""
    body = {"prompt": "Hello", "max_tokens": 8, "seed": 7, "ignore_eos": True, "logprobs": 1}
    tiny = http.post("/v1/completions", json={**body, "temperature": temperature})
    floor = http.post("/v1/completions", json={**body, "temperature": 0.01})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == floor.json()["choices"][0]["text"]
    assert tiny.json()["choices"][0]["logprobs"] == floor.json()["choices"][0]["logprobs"]


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture()
def clean(http: httpx.Client) -> Iterator[None]:
    """Each test starts and ends with no open round, no engine, not paused."""
    yield
    http.post("/resume")
    info = http.get("/weight_info").json()["session"]
    if info["state"] == "round_active":
        http.post("/finish_weight_update")
    http.post("/shutdown_weight_transfer_engine")


def err(resp: httpx.Response, status: int, *fragments: str) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert "Traceback" not in resp.text
    body = resp.json()
    message = body["error"]["message"]
    assert body["detail"] == message and body["error"]["code"] == status
    for frag in fragments:
        assert frag in message, (frag, message)
    return body


def sender(server) -> TCPSender:
    return TCPSender(VLLMStyleClient(server.url, headers=AUTH), replicas=1)


# ---------------------------------------------------------------- auth
@pytest.mark.parametrize(
    "route",
    [r for r in ROUTES.values() if r.weight_route or r.path.startswith("/v1")],
    ids=lambda r: r.name,
)
def test_every_guarded_route_needs_the_key(server, route) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}):
        resp = httpx.request(route.method, server.url + route.path, headers=headers, timeout=30)
        body = err(resp, 401, "API key")
        assert resp.headers["www-authenticate"] == "Bearer"
        assert body["error"]["type"] == "authentication_error"


def test_right_key_passes_and_open_routes_need_none(server, http: httpx.Client) -> None:
    assert http.get("/get_world_size").json() == {"world_size": 1}
    assert http.get("/get_world_size", params={"include_dp": "false"}).json() == {"world_size": 1}
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json() == {
        "version": "0.33.0+weightwire.0.1.0",
        "features": ["pause_bounds"],  # server-wide: a client learns it before any init
    }
    assert http.get("/weight_info").json()["weight_version"] == "default"


# ---------------------------------------------------------------- session rules
def test_rules_before_init(http: httpx.Client, clean) -> None:
    err(http.post("/start_weight_update"), 409, "not initialized", "/init_weight_transfer_engine")
    err(
        http.post(
            "/update_weights", json={"update_info": {"names": [], "dtype_names": [], "shapes": []}}
        ),
        409,
        "cannot update weights",
        "not initialized",
    )
    err(http.post("/finish_weight_update"), 409, "cannot finish", "not initialized")
    err(http.post("/start_draft_weight_update"), 400, "no speculative-decoding draft model")
    assert http.post("/shutdown_weight_transfer_engine").status_code == 200  # idempotent


def test_rules_within_a_session(server, http: httpx.Client, clean) -> None:
    s = sender(server)
    try:
        s.init()
        err(
            http.post(
                "/update_weights",
                json={"update_info": {"names": [], "dtype_names": [], "shapes": []}},
            ),
            409,
            "no weight update is active",
            "/start_weight_update",
        )
        err(http.post("/finish_weight_update"), 409, "no weight update is active")
        assert http.post("/start_weight_update").status_code == 200
        err(http.post("/start_weight_update"), 409, "already active", "/finish_weight_update")
        err(http.post("/shutdown_weight_transfer_engine"), 409, "weight update is active")
        err(
            http.post("/weight_checker", json={"action": "reset"}),
            409,
            "while a weight update is active",
        )
        assert http.get("/weight_info").json()["session"]["state"] == "round_active"
        # A round with no update commits nothing: the version must not move (a trainer
        # whose update never arrived must not see its version reported as served).
        before = http.get("/weight_info").json()["weight_version"]
        err(
            http.post("/finish_weight_update", json={"weight_version": "empty-1"}),
            409,
            "no weights were sent",
        )
        assert http.get("/weight_info").json()["weight_version"] == before
        assert http.post("/shutdown_weight_transfer_engine").json() == {
            "message": "Weight transfer shut down"
        }
        err(http.post("/start_weight_update"), 409, "not initialized")
    finally:
        s.close()


def test_malformed_update_in_a_round_aborts_the_session(server, http: httpx.Client, clean) -> None:
    s = sender(server)
    try:
        s.init()
        http.post("/start_weight_update").raise_for_status()
        bad = {"names": ["model.norm.weight"], "dtype_names": ["float32"]}
        err(
            http.post("/update_weights", json={"update_info": bad}),
            422,
            "update_info",
            "shapes has 0 entries but names has 1",
            "round was aborted",
        )
        info = http.get("/weight_info").json()
        assert (
            info["session"]["state"] == "uninitialized"
            and "shapes" in info["session"]["last_error"]
        )
        err(http.post("/finish_weight_update"), 409, "not initialized")
    finally:
        s.close()


def test_init_info_is_validated_before_any_worker_dials(http: httpx.Client, clean) -> None:
    info = {
        "host": "127.0.0.1",
        "port": 1,
        "secret_b64": "QUJD" * 42 + "QUI=",
        "rank_offset": 1,
        "world_size": 2,
    }
    err(
        http.post("/init_weight_transfer_engine", json={"init_info": {**info, "rank_offset": 2}}),
        422,
        "rank_offset must be in [1, world_size)",
    )
    err(
        http.post(
            "/init_weight_transfer_engine", json={"init_info": {**info, "secret_b64": "QUJD"}}
        ),
        422,
        "TCPInitInfo.secret_b64",
        "128 bytes",
    )
    err(
        http.post("/init_weight_transfer_engine", json={"init_info": {**info, "port": 0}}),
        422,
        "TCPInitInfo.port must be in [1, 65535]",
    )
    err(
        http.post("/init_weight_transfer_engine", json={"init_info": {**info, "master_port": 5}}),
        422,
        "unknown keys ['master_port']",
    )


def test_init_against_a_dead_sender_fails_cleanly(http: httpx.Client, clean) -> None:
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    info = {
        "host": "127.0.0.1",
        "port": port,
        "secret_b64": "QUJD" * 42 + "QUI=",
        "rank_offset": 1,
        "world_size": 2,
    }
    started = time.monotonic()
    body = err(
        http.post("/init_weight_transfer_engine", json={"init_info": info}), 504, "replica 0"
    )
    assert time.monotonic() - started < 20  # the worker's connect timeout (2 s here), not a hang
    assert (
        "init_weight_transfer_engine failed" in body["detail"]
        and "TransferTimeout" in body["detail"]
    )
    assert http.get("/weight_info").json()["session"]["state"] == "uninitialized"


# ---------------------------------------------------------------- malformed bodies
POSTS = [r for r in ROUTES.values() if r.method == "POST"]


@pytest.mark.parametrize("route", POSTS, ids=lambda r: r.name)
@pytest.mark.parametrize("raw", [b"{", b"\xff\xfe{}", b"[1,", b'{"a": NaN}', b"nul"], ids=repr)
def test_non_json_and_non_utf8_bodies_are_400(http: httpx.Client, route, raw: bytes) -> None:
    resp = http.post(route.path, content=raw, headers={"content-type": "application/json"})
    body = err(resp, 400, "request body is not valid")
    assert body["error"]["param"] == "body"


@pytest.mark.parametrize(("path", "payload", "status", "fragments"), MALFORMED_BODIES)
def test_malformed_bodies_name_the_field(
    http: httpx.Client, path, payload, status, fragments, clean
) -> None:
    resp = http.post(path, json=payload) if payload is not None else http.post(path)
    err(resp, status, *fragments)


def test_query_params_are_validated(http: httpx.Client, clean) -> None:
    err(
        http.post("/pause", params={"mode": "nap"}),
        422,
        "mode must be one of ['abort', 'wait', 'keep']",
    )
    err(
        http.get("/get_world_size", params={"include_dp": "maybe"}),
        422,
        "include_dp must be true or false",
    )
    # a flag given twice: a 422 naming it, nothing paused or put to sleep (not the last one)
    for route, flag, values in (("/pause", "mode", ("keep", "abort")), ("/sleep", "level", "12")):
        err(
            http.post(route, params=[(flag, v) for v in values]),
            422,
            f"query parameter {flag} is given 2 times",
        )
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.get("/is_paused").json() == {"is_paused": False}


def test_cache_resets_answer_truthfully(http: httpx.Client, clean) -> None:
    """No KV or encoder output outlives a request here and none spans a commit: nothing to drop."""
    params = {"reset_running_requests": "true", "reset_external": "true"}
    assert http.post("/reset_prefix_cache", params=params).json() == {"success": True}
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    assert http.post("/reset_encoder_cache").json() == {"success": True}
    err(
        http.post("/reset_prefix_cache", params={"reset_running_requests": "soon"}),
        422,
        "reset_running_requests must be true or false",
    )


def test_body_size_limit_is_413(http: httpx.Client) -> None:
    big = b'{"init_info": "' + b"x" * 70000 + b'"}'
    err(
        http.post("/init_weight_transfer_engine", content=big),
        413,
        "exceeds the limit of 65536 bytes",
    )

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must hold while streaming
        for _ in range(20):
            yield b" " * 8192

    err(http.post("/update_weights", content=chunks()), 413, "exceeds the limit")


def test_unknown_route_and_method_are_json(http: httpx.Client) -> None:
    err(http.get("/nope"), 404, "Not Found")
    err(http.get("/init_weight_transfer_engine"), 405, "Method Not Allowed")


# ---------------------------------------------------------------- pause
def _complete(http: httpx.Client, **kw) -> httpx.Response:
    return http.post(
        "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0, **kw}
    )


def test_pause_abort_and_wait_refuse_new_requests(http: httpx.Client, clean) -> None:
    for mode in ("abort", "wait"):
        assert http.post("/pause", params={"mode": mode}).json() == {"status": "paused"}
        assert http.get("/is_paused").json() == {"is_paused": True}
        err(_complete(http), 503, f"paused (mode={mode})", "/resume")
        assert http.post("/resume").json() == {"status": "resumed"}
        assert _complete(http).status_code == 200


def _held(http: httpx.Client) -> int:
    return int(http.get("/health").json()["requests_held"])


def test_pause_keep_queues_until_resume(http: httpx.Client, clean) -> None:
    """A request posted while paused with mode=keep waits at the gate (``/health`` counts it
    in ``requests_held`` once it got there, not while it is on its way) until ``/resume``."""
    http.post("/pause", params={"mode": "keep"}).raise_for_status()
    assert _held(http) == 0
    out: list[httpx.Response] = []
    t = threading.Thread(target=lambda: out.append(_complete(http)))
    t.start()
    try:
        deadline = time.monotonic() + 30
        while _held(http) == 0:
            assert time.monotonic() < deadline and not out, (
                f"the request never waited at the pause gate: {out and out[0].text}"
            )
            time.sleep(0.005)
        health = http.get("/health").json()
        assert health["requests_held"] == 1 and not out, (health, out and out[0].text)
        assert health["replicas"][0]["generations_in_flight"] == 0, health
    finally:
        http.post("/resume").raise_for_status()
        t.join(60)
    assert (
        out
        and out[0].status_code == 200
        and out[0].json()["choices"][0]["finish_reason"] == "length"
    )
    assert _held(http) == 0


def test_pause_abort_stops_a_running_generation(http: httpx.Client, clean) -> None:
    out: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: out.append(_complete(http, max_tokens=240, ignore_eos=True))
    )
    t.start()
    deadline = time.monotonic() + 30
    while http.get("/health").json()["replicas"][0]["generations_in_flight"] == 0:
        assert time.monotonic() < deadline and not out, "the request never reached the replica"
        time.sleep(0.005)
    http.post("/pause", params={"mode": "abort"}).raise_for_status()
    t.join(60)
    assert out, "the aborted request must return"
    if out[0].status_code == 200:
        choice = out[0].json()["choices"][0]
        assert choice["finish_reason"] == "abort"
        assert out[0].json()["usage"]["completion_tokens"] < 240
    else:  # cancelled while still queued in the worker: refused, never a 500
        err(out[0], 503, "aborted by /pause")


def test_server_info_reports_the_backend_like_vllm(http: httpx.Client) -> None:
    """Doctor and trainers read the backend from vLLM's /server_info shape."""
    got = http.get("/server_info").json()
    assert got["vllm_config"]["weight_transfer_config"]["backend"] == "weightwire_tcp"
