"""The worker's reply: its computed bound holds for real replies, and a reply that cannot
be sent as is (too big, NaN) becomes an error reply for its call, never an exception."""

from __future__ import annotations

import json
from typing import Any

import pytest

from weightwire.tools.server.completions import CompletionRequestError, parse_completion_request
from weightwire.tools.server.reply_size import check_reply_size, encode_reply, reply_bound


def test_encode_reply_never_raises_and_keeps_the_id() -> None:
    ok = encode_reply({"id": 3, "ok": True, "result": {"x": [1.5]}}, 1 << 20)
    assert ok.problem is None and json.loads(ok.data) == {
        "id": 3,
        "ok": True,
        "result": {"x": [1.5]},
    }

    nan = json.loads(
        encode_reply(
            {"id": 4, "ok": True, "result": {"lp": float("nan")}}, 1 << 20, op="generate"
        ).data
    )
    assert (nan["id"], nan["ok"], nan["kind"]) == (4, False, "internal")
    assert "JSON cannot carry" in nan["error"] and "weights are probably not finite" in nan["error"]

    big = {"id": 5, "ok": True, "result": "x" * 5000}
    gen = json.loads(encode_reply(big, 4096, op="generate").data)
    assert (gen["id"], gen["kind"]) == (
        5,
        "invalid",
    ) and "limit of 4096 bytes (--max-reply-bytes); lower n" in gen["error"]
    other = json.loads(encode_reply(big, 4096, op="checksum").data)
    assert other["kind"] == "internal" and "the checksum's reply was" in other["error"]


def _request(**body: Any) -> Any:
    return parse_completion_request({"prompt": "Hello", **body}, vocab_size=1000, max_model_len=256)


def test_a_reply_over_the_limit_is_refused_naming_the_fields() -> None:
    req = _request(prompt=[[5]] * 24, n=64, max_tokens=200, logprobs=20, return_token_ids=True)
    with pytest.raises(
        CompletionRequestError,
        match=r"24 prompt\(s\), n=64, max_tokens=200, logprobs=20, "
        r"return_token_ids; every token counted at 20 bytes, this "
        r"vocabulary's longest as JSON\), over this server's limit of "
        r"1000000",
    ):
        check_reply_size(req, limit=1_000_000, piece_bytes=20, vocab_size=1000, max_model_len=256)
    check_reply_size(
        _request(max_tokens=16), limit=1_000_000, piece_bytes=20, vocab_size=1000, max_model_len=256
    )


def test_a_tiny_temperature_is_raised_to_vllms_floor() -> None:
    assert [_request(temperature=t).temperature for t in (0, 1e-40, 5e-324, 0.005, 0.5)] == [
        0.0,
        0.01,
        0.01,
        0.01,
        0.5,
    ]


@pytest.fixture(scope="module")
def worker(tiny_llama: str) -> Any:
    from weightwire.tools.server.replica import WorkerSpec
    from weightwire.tools.server.replica_worker import Worker

    return Worker(
        WorkerSpec(
            model_dir=tiny_llama, backend="weightwire_tcp", device="cpu", replicas=1, threads=1
        )
    )


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "Hello there", "max_tokens": 12, "n": 2},
        {"prompt": ["a", [3, 4, 5]], "max_tokens": 10, "logprobs": 5, "return_token_ids": True},
        {
            "prompt": [7],
            "max_tokens": 9,
            "n": 3,
            "logprobs": 20,
            "return_tokens_as_token_ids": True,
            "seed": 3,
        },
        {
            "prompt": "x",
            "max_tokens": 16,
            "logprobs": 0,
            "temperature": 100,
            "seed": 1,
            "return_token_ids": True,
        },
    ],
    ids=["text", "batch-logprobs", "as-ids", "hot"],
)
def test_the_bound_holds_for_real_replies(worker: Any, body: dict[str, Any]) -> None:
    """Random-weight tiny-llama samples unusual tokens (byte pieces, escapes): the reply as
    the worker sends it never exceeds the bound the API computed."""
    info = worker.describe()
    req = parse_completion_request(
        {**body, "ignore_eos": True},
        vocab_size=info["vocab_size"],
        max_model_len=info["max_model_len"],
    )
    result = worker.op_generate(req.to_worker(), epoch=worker.cancel_epoch, call_id=1)
    sent = len(encode_reply({"id": 1, "ok": True, "result": result}, 1 << 30).data)
    bound = reply_bound(
        req,
        piece_bytes=info["max_piece_bytes"],
        vocab_size=info["vocab_size"],
        max_model_len=info["max_model_len"],
    )
    assert sent <= bound, (sent, bound)
