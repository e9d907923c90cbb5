"""Payloads that only matter inside a live round, and text the JSON layer lets through.

Inside a round the server parses ``update_info`` and a worker sizes receive buffers
from it: a declared shape must be bounded before anything is allocated, and a
refused update must tear the round down cleanly (the trainer is broadcasting). A
real ``TCPRendezvous`` in this process plays the trainer.

Lone UTF-16 surrogates (``"\\ud800"``) are valid JSON escapes but not encodable
text: a server that stores or echoes one cannot serialize its own reply.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.fuzz.inproc import FuzzServer, rss_kib
from tests.fuzz.strategies import update_infos
from weightwire.backends.tcp.rendezvous import TCPRendezvous
from weightwire.shared.routes import ROUTES
from weightwire.shared.update_info import UpdateInfo

RSS_SLACK_KIB = 64 << 10  # 64 MiB: allocator noise, never a buffer sized from a payload


def post(srv: FuzzServer, route: str, body: Any, *, count: bool = True) -> Any:
    r = ROUTES[route]
    raw = json.dumps(body).encode() if not isinstance(body, bytes) else body
    if not count:
        return srv.request(
            r.method, r.path, content=raw, headers={"content-type": "application/json"}
        )
    resp = srv.send(
        route, r.method, r.path, content=raw, headers={"content-type": "application/json"}
    )
    assert resp is not None and resp.status_code < 500, srv.errors[-1] if srv.errors else resp
    return resp


class FakeTrainer:
    """Rank 0 over TCP: init (accept concurrently with the POST) and start a round."""

    def __init__(self, srv: FuzzServer) -> None:
        self.srv = srv
        self.comm: Any = None

    def open_round(self) -> None:
        self.close()
        rv = TCPRendezvous(world_size=2)
        info = {
            **rv.init_fields(),
            "rank_offset": 1,
            "world_size": 2,
            "packed": True,
            "packed_buffer_size_bytes": 1 << 16,
            "packed_num_buffers": 2,
            "timeout_s": 2.0,
        }
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["comm"] = rv.accept(timeout=20)
                box["comm"].warmup(timeout=20)
            except Exception as exc:
                box["error"] = exc
            finally:
                rv.close()

        t = threading.Thread(target=join, daemon=True)
        t.start()
        resp = post(self.srv, "init_weight_transfer_engine", {"init_info": info}, count=False)
        t.join(30)
        assert resp.status_code == 200 and "comm" in box, (resp.text, box)
        self.comm = box["comm"]
        assert post(self.srv, "start_weight_update", None, count=False).status_code == 200

    def close(self) -> None:
        if self.comm is not None:
            self.comm.abort()
            self.comm = None


@pytest.fixture()
def trainer(fuzz_server: FuzzServer) -> Any:
    t = FakeTrainer(fuzz_server)
    yield t
    t.close()
    post(fuzz_server, "shutdown_weight_transfer_engine", None, count=False)


def session(srv: FuzzServer) -> dict[str, Any]:
    return srv.request("GET", ROUTES["weight_info"].path).json()["session"]


# ---------------------------------------------------------------------------- huge shapes
def test_one_terabyte_tensor_is_refused_without_allocating(
    fuzz_server: FuzzServer, trainer: FakeTrainer
) -> None:
    """1e12 bytes is under the per-tensor limit (1 TiB), so it reaches a worker: the round
    must fail without the worker ever holding that memory, and the session must reset."""
    before = rss_kib(fuzz_server.worker_pid)
    for shape, dtype in (([10**12], "uint8"), ([2**39, 2], "uint8"), ([5 * 10**10, 5], "float32")):
        trainer.open_round()
        resp = post(
            fuzz_server,
            "update_weights",
            {
                "update_info": {
                    "names": ["model.norm.weight"],
                    "dtype_names": [dtype],
                    "shapes": [shape],
                }
            },
        )
        assert 400 <= resp.status_code < 500, resp.text
        assert "round" in resp.json()["error"]["message"]
        assert session(fuzz_server)["state"] == "uninitialized"
        assert rss_kib(fuzz_server.worker_pid) - before < RSS_SLACK_KIB


def test_tensor_over_the_limit_is_refused_by_the_api_and_aborts_the_round(
    fuzz_server: FuzzServer, trainer: FakeTrainer
) -> None:
    trainer.open_round()
    resp = post(
        fuzz_server,
        "update_weights",
        {"update_info": {"names": ["a"], "dtype_names": ["float32"], "shapes": [[2**40, 2]]}},
    )
    assert resp.status_code == 422, resp.text
    message = resp.json()["error"]["message"]
    assert "over the per-tensor limit" in message and "the round was aborted" in message
    assert session(fuzz_server)["state"] == "uninitialized"
    with pytest.raises(
        Exception, match="lost|closed|aborted"
    ):  # the trainer's side was torn down too
        trainer.comm.broadcast(bytearray(16), timeout=5)
        trainer.comm.broadcast(bytearray(1 << 20), timeout=5)


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(info=update_infos())
def test_invalid_update_infos_inside_a_round(fuzz_server: FuzzServer, info: Any) -> None:
    """Every invalid update is a 4xx naming the field; the round is torn down, nothing allocated."""
    try:
        items = info if isinstance(info, list) else [info]
        for item in items:
            UpdateInfo.from_dict(item)
        valid = not isinstance(info, list)  # a 2-entry list never fits this 1-worker server
    except ValueError:
        valid = False
    assume(not valid)  # a valid update makes the worker wait for bytes nobody sends
    before = rss_kib(fuzz_server.worker_pid)
    trainer = FakeTrainer(fuzz_server)
    try:
        trainer.open_round()
        resp = post(fuzz_server, "update_weights", {"update_info": info})
        assert resp.status_code in (400, 413, 422), resp.text
        if resp.status_code != 413:  # refused by size before the route ran: the round is untouched
            assert session(fuzz_server)["state"] == "uninitialized"
    finally:
        trainer.close()
    assert rss_kib(fuzz_server.worker_pid) - before < RSS_SLACK_KIB


# ---------------------------------------------------------------------------- lone surrogates
SURROGATE = "\ud800"


@pytest.fixture()
def unpoison(fuzz_server: FuzzServer) -> Any:
    """A stored surrogate version would fail every later test of the session too (one defect,
    one failure): put a valid version back."""
    yield
    post(fuzz_server, "update_weight_version", {"new_version": "after-surrogates"}, count=False)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("update_weight_version", {"new_version": SURROGATE}),
        ("update_weight_version", {"new_version": "v" + SURROGATE}),
        ("finish_weight_update", {"weight_version": SURROGATE}),
        ("weight_checker", {"action": "compare", "baseline": {SURROGATE: "x"}}),
        ("weight_checker", {"action": SURROGATE}),
        ("init_weight_transfer_engine", {"init_info": {SURROGATE: 1}}),
        ("completions", {"prompt": SURROGATE, "max_tokens": 1}),
        ("completions", {"prompt": "hi", "max_tokens": 1, "model": SURROGATE}),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_lone_surrogates_are_refused_and_never_stored(
    fuzz_server: FuzzServer, route: str, body: Any, unpoison: None
) -> None:
    """json.dumps escapes the surrogate as ``\\ud800`` (valid JSON); the server must answer
    with a 4xx (or a 2xx that does not echo it) and keep serving ``/weight_info``."""
    post(fuzz_server, route, body)
    info = fuzz_server.request("GET", ROUTES["weight_info"].path)
    assert info.status_code == 200, info.text
    json.dumps(info.json(), ensure_ascii=False).encode("utf-8")


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    route=st.sampled_from(
        [
            "update_weight_version",
            "finish_weight_update",
            "weight_checker",
            "completions",
            "init_weight_transfer_engine",
            "update_weights",
        ]
    ),
    text=st.text(st.characters(codec=None, categories=("Cs", "Lu", "Nd")), min_size=1, max_size=6),
)
def test_any_text_in_any_field(
    fuzz_server: FuzzServer, route: str, text: str, unpoison: None
) -> None:
    key = {
        "update_weight_version": "new_version",
        "finish_weight_update": "weight_version",
        "weight_checker": "action",
        "completions": "prompt",
        "init_weight_transfer_engine": "init_info",
        "update_weights": "update_info",
    }[route]
    body: dict[str, Any] = {key: text}
    if route == "completions":
        body["max_tokens"] = 1
    post(fuzz_server, route, body)
    post(fuzz_server, route, {key: {text: text}})
    assert fuzz_server.request("GET", ROUTES["weight_info"].path).status_code == 200
