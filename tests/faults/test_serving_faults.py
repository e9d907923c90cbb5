"""Completions that used to take a replica down or hold it: an over-big reply, a generation
nobody waits for any more, weights that are not finite.

One server of its own, ``capped`` (``--generate-timeout 4``, ``--max-reply-bytes`` 50 MB,
``--check-finite``, a 0.3 s decode step delay, info logs), and the suite's shared server. A
"long" request below outlasts every client timeout used here, so a request that is answered
proves the long one stopped computing: one row of 250 tokens on ``capped`` (>= 75 s, held by
the step delay on any machine, at little CPU).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import torch

from tests.faults.harness import (
    AUTH,
    Probe,
    TensorSource,
    assert_weights,
    elapsed,
    engine_for,
    fresh_round,
    observe,
    quiet_shutdown,
)
from tests.faults.one_request import recorded_engine
from tests.faults.servers import Server, serving
from weightwire.shared.errors import WeightSyncError

pytestmark = pytest.mark.timeout(240)
GENERATE_TIMEOUT_S = 4
MAX_REPLY_BYTES = 50_000_000
CAPPED_STEP_DELAY_S = 0.3
"""``capped``'s decode step delay: ``HELD_LONG`` runs >= 75 s, past ``FOLLOW_UP_TIMEOUT_S``."""
HELD_LONG = {"prompt": [[5]], "max_tokens": 250, "ignore_eos": True}
ONE_TOKEN = {"prompt": "The trainer sends", "max_tokens": 1, "temperature": 0}
FOLLOW_UP_TIMEOUT_S = 60.0
"""The follow-up request's client bound: an uncancelled long request holds the lane for minutes."""


@pytest.fixture(scope="module")
def capped(fault_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(
        fault_model,
        tmp_path_factory.mktemp("serving-capped"),
        "--generate-timeout",
        str(GENERATE_TIMEOUT_S),
        "--max-reply-bytes",
        str(MAX_REPLY_BYTES),
        "--check-finite",
        "--decode-step-delay",
        str(CAPPED_STEP_DELAY_S),
        "--log-level",
        "info",  # the disconnect case reads the server's word that it cancelled the generation
    ) as s:
        yield s


def _http(server: Server, timeout: float = FOLLOW_UP_TIMEOUT_S) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=AUTH, timeout=timeout)


def _served_after(server: Server) -> httpx.Response:
    """A one-token completion on a fresh connection; the replica must be live and free."""
    with _http(server) as http:
        assert http.get("/health").status_code == 200, http.get("/health").text
        return http.post("/v1/completions", json=ONE_TOKEN)


def test_a_reply_over_the_limit_is_refused_before_it_runs(capped: Server) -> None:
    """A completion whose reply could exceed the worker-to-API line limit (24 prompts, n=64,
    255 tokens, 20 logprobs, token ids)."""
    body = {
        "prompt": [[5]] * 24,
        "n": 64,
        "max_tokens": 255,
        "logprobs": 20,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
    }
    with _http(capped) as http, elapsed() as t:
        resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    for field in (
        "24 prompt(s)",
        "n=64",
        "max_tokens=255",
        "logprobs=20",
        f"limit of {MAX_REPLY_BYTES} bytes",
        "--max-reply-bytes",
    ):
        assert field in message, message
    after = _served_after(capped)
    assert after.status_code == 200, after.text
    observe(server=message, server_s=t[0])


def test_a_generation_past_the_generate_timeout_stops(capped: Server, source: TensorSource) -> None:
    """A long completion runs past `--generate-timeout`, then a one-token completion and a
    trainer's round follow."""
    probe = Probe(capped.url)
    with _http(capped) as http, elapsed() as t:
        resp = http.post("/v1/completions", json=HELD_LONG)
    assert resp.status_code == 504, resp.text
    after = _served_after(capped)
    assert after.status_code == 200, after.text
    with elapsed() as t_round:
        want = fresh_round(
            capped.url, source, probe, 401, "gen-timeout-1"
        )  # its finish needs the model lock
    probe.close()
    observe(
        server=resp.json()["error"]["message"],
        server_s=t[0],
        round_after_s=t_round[0],
        weights=len(want),
    )


def test_non_finite_weights_fail_a_completion_at_once(
    shared_server: Server, source: TensorSource
) -> None:
    """A round pushes NaN into one weight (no `--check-finite`); then completions with and
    without logprobs."""
    server = shared_server
    probe = Probe(server.url)
    poisoned = TensorSource(source.tensors)
    poisoned.tensors["model.norm.weight"] = torch.full_like(
        source.tensors["model.norm.weight"], float("nan")
    )
    engine = engine_for(server.url, poisoned)
    try:
        engine.send_weights("nan-1")
    finally:
        engine.shutdown()
    with _http(server) as http, elapsed() as t:
        resp = http.post("/v1/completions", json={**ONE_TOKEN, "max_tokens": 4, "logprobs": 5})
        greedy = http.post("/v1/completions", json={**ONE_TOKEN, "max_tokens": 4})
    for r in (resp, greedy):
        assert r.status_code == 500, r.text
        assert "logits are not finite" in r.json()["error"]["message"], r.text
        assert "--check-finite" in r.json()["error"]["message"]
    assert probe.http.get("/health").status_code == 200
    fresh_round(server.url, source, probe, 402, "finite-again")
    assert probe.greedy()["logprobs"]  # served again
    probe.close()
    observe(server=resp.json()["error"]["message"], server_s=t[0])


def _in_flight(server: Server) -> int:
    return sum(
        r["generations_in_flight"] for r in httpx.get(server.url + "/health").json()["replicas"]
    )


CANCELLED = "the client disconnected; its generation was cancelled"


def test_a_generation_whose_client_disconnected_stops(capped: Server) -> None:
    """A long completion (``HELD_LONG``: >= 75 s on any machine) whose client disconnects
    once a replica runs it (the connection closed by the test, no client timeout racing
    the request's way in); `--generate-timeout` 4 s is the only other end it could meet,
    and the server's log tells which one it met. A one-token completion follows."""
    url = urlsplit(capped.url)
    cancelled_before = capped.log().count(CANCELLED)
    body = httpx.Request(
        "POST", capped.url + "/v1/completions", json=HELD_LONG, headers=AUTH
    )  # the bytes httpx would send, written on a socket the test closes itself
    head = "".join(f"{k}: {v}\r\n" for k, v in body.headers.items())
    raw = f"POST /v1/completions HTTP/1.1\r\n{head}\r\n".encode() + body.read()
    assert _in_flight(capped) == 0
    with socket.create_connection((url.hostname, url.port), timeout=30) as conn:
        conn.sendall(raw)
        deadline = time.monotonic() + 30
        while _in_flight(capped) == 0:
            assert time.monotonic() < deadline, "the completion never reached a replica"
            time.sleep(0.005)
    with elapsed() as t:  # the client is gone: the generation must stop at its next step
        deadline = time.monotonic() + 30
        while _in_flight(capped):
            assert time.monotonic() < deadline, (
                "the generation still runs 30 s after its client left"
            )
            time.sleep(0.02)
    log = capped.log()
    assert log.count(CANCELLED) == cancelled_before + 1, log[-2000:]  # not the generate timeout
    after = _served_after(capped)
    assert after.status_code == 200, after.text
    observe(follow_up=after.status_code, stopped_s=t[0])


@pytest.mark.parametrize("in_place", [False, True], ids=["staged", "in_place_one_request"])
def test_check_finite_refuses_a_round_with_nan(
    capped: Server, source: TensorSource, in_place: bool
) -> None:
    """With `--check-finite`, a round whose tensors hold NaN / inf arrives: staged, or applied
    in place in one request (its finish in its update; was: a round applied in place was not
    checked, its tensors being in the parameters rather than staged, so it committed and
    every completion then failed on non-finite logits). In place the model holds part of the
    refused round: generation is refused until a whole round commits, which the next does."""
    probe = Probe(capped.url)
    want = fresh_round(capped.url, source, probe, 403, "finite-1")
    poisoned = TensorSource(dict(source.tensors))
    bad = poisoned.tensors["model.layers.1.mlp.up_proj.weight"].clone()
    bad[0, 0] = float("inf")
    poisoned.tensors["model.layers.1.mlp.up_proj.weight"] = bad
    if in_place:
        client, engine, _ = recorded_engine(capped.url, poisoned, stage_budget_bytes=0)
    else:
        engine = engine_for(capped.url, poisoned)
    try:
        with elapsed() as t, pytest.raises(WeightSyncError) as info:
            engine.send_weights("nan-round")
    finally:
        quiet_shutdown(engine)
    assert info.value.status == 400, info.value
    assert "'model.layers.1.mlp.up_proj.weight'" in str(info.value) and "NaN or infinite" in str(
        info.value
    )
    assert "nothing was committed" in str(info.value)
    assert probe.version() == "finite-1"
    if in_place:
        assert any(sent.startswith("update_weights?start=true") for sent in client.sent)
        assert "generation is refused until a whole round commits" in str(info.value)
        assert "replica(s) [0] hold part of this round" in str(info.value)
        assert "still served" not in str(info.value)  # (was: said of the half-written model)
        assert probe.http.get("/weight_info").json()["round_incomplete"] is True
        refused = probe.http.post("/v1/completions", json=ONE_TOKEN)
        assert refused.status_code == 503, refused.text
    else:
        assert_weights(probe, want, "finite-1")
    # the way out: a whole round (in place after one in place: it resumes the pause it held)
    fresh_round(
        capped.url,
        source,
        probe,
        404,
        "finite-2",
        **({"stage_budget_bytes": 0} if in_place else {}),
    )
    probe.greedy()
    probe.close()
    observe(trainer=info.value, trainer_s=t[0])


@pytest.mark.slow  # ~4 s: three rounds of the 64 MB model's delta extraction on the CPU
def test_check_finite_refuses_a_delta_round_whose_patches_hold_nan(
    capped: Server, source: TensorSource
) -> None:
    """A delta round's patches are applied at the commit, which rides on its update
    (``UPDATE_FINISHES``): a NaN among their values fails that update naming the finish,
    nothing is committed, the previous round is served."""
    probe = Probe(capped.url)
    engine = engine_for(capped.url, source, delta="auto")

    def moved(step: int, nan: bool = False) -> dict[str, str]:
        for i, (name, t) in enumerate(source.tensors.items()):
            t = t.clone()
            t.view(-1)[0] += 0.5 * step
            if nan and i == 3:
                t.view(-1)[1] = float("nan")
            source.tensors[name] = t
        return source.expected()

    try:
        moved(1)
        engine.send_weights("dn-1")  # dense: the base
        want = moved(2)
        assert engine.send_weights("dn-2").nbytes < 1 << 12  # patches only
        moved(3, nan=True)
        with pytest.raises(WeightSyncError) as info:
            engine.send_weights("dn-3")
    finally:
        quiet_shutdown(engine)
    assert info.value.route == "finish_weight_update" and info.value.status == 400, info.value
    assert "@values' hold NaN or infinite" in str(info.value), info.value
    assert "nothing was committed" in str(info.value)
    assert_weights(probe, want, "dn-2")
    for name, t in source.tensors.items():  # the NaN out of the source
        source.tensors[name] = torch.nan_to_num(t)
    fresh_round(capped.url, source, probe, 405, "finite-3")
    probe.close()
