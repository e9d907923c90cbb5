"""Pure pieces of the server: session rules, completion-body parsing, bearer check."""

from __future__ import annotations

import asyncio

import pytest

from weightwire.tools.server.auth import bearer_matches
from weightwire.tools.server.completions import CompletionRequestError, parse_completion_request
from weightwire.tools.server.session import Phase, Session, SessionError


def _raises(fn, status: int, match: str) -> None:
    with pytest.raises(SessionError, match=match) as info:
        fn()
    assert info.value.status == status


def test_session_rules_follow_vllm() -> None:
    s = Session()
    _raises(s.check_start, 409, "not initialized")
    _raises(s.check_update, 409, "not initialized")
    _raises(s.check_finish, 409, "not initialized")
    s.check_shutdown()  # idempotent without an engine
    s.initialized(object())
    _raises(s.check_update, 409, "no weight update is active.*start_weight_update")
    _raises(s.check_finish, 409, "no weight update is active")
    s.check_start()
    s.started()
    _raises(s.check_start, 409, "already active")
    _raises(s.check_shutdown, 409, "weight update is active")
    s.check_update()
    s.updated()
    s.check_finish()
    s.committed("v7")
    assert (s.phase, s.weight_version, s.rounds_committed) == (Phase.READY, "v7", 1)
    s.committed(None)  # finish without a version keeps the previous one
    assert s.weight_version == "v7"


def test_failed_round_clears_session_but_keeps_version() -> None:
    s = Session(weight_version="v1")
    s.initialized(object())
    s.started()
    s.failed("replica 1: PeerLost")
    assert (s.phase, s.weight_version, s.rounds_failed, s.init_info) == (
        Phase.NO_ENGINE,
        "v1",
        1,
        None,
    )
    assert s.describe()["last_error"] == "replica 1: PeerLost"
    _raises(s.check_start, 409, "not initialized")


def test_one_weight_operation_at_a_time() -> None:
    s = Session()

    async def scenario() -> None:
        async with s.operation("update_weights"):
            with pytest.raises(
                SessionError, match=r"another weight operation \(update_weights\) is in progress"
            ):
                async with s.operation("finish_weight_update"):
                    pass
        async with s.operation("finish_weight_update"):  # free again afterwards
            assert s.busy == "finish_weight_update"
        assert s.busy is None

    asyncio.run(scenario())


def _parse(body: object):
    return parse_completion_request(body, vocab_size=512, max_model_len=256)


def test_completion_defaults_and_forms() -> None:
    r = _parse({"prompt": "hi"})
    assert (r.prompts, r.max_tokens, r.temperature, r.n, r.logprobs, r.seed) == (
        ["hi"],
        16,
        1.0,
        1,
        None,
        None,
    )
    assert _parse({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert _parse({"prompt": ["a", [5]], "n": 2, "logprobs": 0}).prompts == ["a", [5]]
    assert _parse(
        {"prompt": "x", "stream": False, "user": "u", "stop": None, "echo": False}
    ).prompts == ["x"]
    assert _parse({"prompt": "x", "top_k": 0}).top_k == -1


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ([1], "body", "must be a JSON object"),
        ({}, "prompt", "prompt is required"),
        ({"prompt": ""}, "prompt", "empty string"),
        ({"prompt": []}, "prompt", "non-empty string"),
        ({"prompt": [1, 512]}, "prompt", r"prompt\[1\] must be a token id in \[0, 512\)"),
        ({"prompt": [1, True]}, "prompt", "must be a string or a list of token ids"),
        ({"prompt": ["a", [1, -1]]}, "prompt", r"prompt\[1\]\[1\]"),
        (
            {"prompt": "x", "max_tokens": 0},
            "max_tokens",
            r"max_tokens must be an integer in \[1, 256\]",
        ),
        ({"prompt": "x", "max_tokens": 2.0}, "max_tokens", "max_tokens must be an integer"),
        ({"prompt": "x", "temperature": -0.1}, "temperature", "temperature must be a number"),
        ({"prompt": "x", "temperature": "hot"}, "temperature", "temperature must be a number"),
        ({"prompt": "x", "n": 0}, "n", "n must be an integer"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "logprobs must be an integer in"),
        ({"prompt": "x", "logprobs": True}, "logprobs", "logprobs must be an integer"),
        ({"prompt": "x", "seed": "1"}, "seed", "seed must be an integer"),
        ({"prompt": "x", "stream": True}, "stream", "stream=True is not supported"),
        ({"prompt": "x", "stream": 0}, "stream", "is not supported"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos", "ignore_eos must be true or false"),
        ({"prompt": "x", "best_of": 3}, "best_of", "not supported"),
        ({"prompt": "x", "tempurature": 1}, "tempurature", "unsupported fields"),
    ],
)
def test_completion_body_errors_name_the_field(body: object, param: str, match: str) -> None:
    with pytest.raises(CompletionRequestError, match=match) as info:
        _parse(body)
    assert info.value.param == param


def test_bearer_check() -> None:
    key = b"s3cret-key"
    assert bearer_matches(b"Bearer s3cret-key", key)
    assert bearer_matches(b"bearer  s3cret-key ", key)
    for bad in (
        None,
        b"",
        b"s3cret-key",
        b"Basic s3cret-key",
        b"Bearer s3cret-ke",
        b"Bearer s3cret-key2",
        b"Bearer",
    ):
        assert not bearer_matches(bad, key), bad


def test_api_key_sources(tmp_path) -> None:
    """--api-key-file (trailing newline stripped) and $WEIGHTWIRE_API_KEY carry no warning;
    --api-key on argv works but warns that the process list shows it; a bad file is an error."""
    from weightwire.tools.server.serve_args import build_parser, resolve_api_key

    key_file = tmp_path / "key"
    key_file.write_text("k-from-file\n")
    parse = build_parser().parse_args
    assert resolve_api_key(parse(["--model", "m", "--api-key-file", str(key_file)]), {}) == (
        "k-from-file",
        None,
    )
    assert resolve_api_key(parse(["--model", "m"]), {"WEIGHTWIRE_API_KEY": "k-env"}) == (
        "k-env",
        None,
    )
    assert resolve_api_key(parse(["--model", "m"]), {}) == (None, None)
    key, warning = resolve_api_key(
        parse(["--model", "m", "--api-key", "k-argv"]), {"WEIGHTWIRE_API_KEY": "k-env"}
    )
    assert key == "k-argv" and warning is not None and "visible to every user" in warning
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_api_key(parse(["--model", "m", "--api-key-file", str(tmp_path / "empty")]), {})
    with pytest.raises(ValueError, match="cannot read it"):
        resolve_api_key(parse(["--model", "m", "--api-key-file", str(tmp_path / "missing")]), {})
    with pytest.raises(SystemExit):  # one source of the key, not two
        parse(["--model", "m", "--api-key", "a", "--api-key-file", str(key_file)])


def test_session_ownership_rules() -> None:
    s = Session()
    first = s.initialized(object())
    s.check_owner(first, "start_weight_update")
    s.check_owner(None, "start_weight_update")  # stock clients send no session: vLLM's rules
    second = s.initialized(object())
    assert second != first
    _raises(lambda: s.check_owner(first, "start_weight_update"), 409, "replaced by a newer")
    _raises(
        lambda: s.check_owner(first, "shutdown_weight_transfer_engine", idempotent=True),
        409,
        "replaced",
    )
    s.failed("replica 0: PeerLost")
    _raises(
        lambda: s.check_owner(second, "finish_weight_update"),
        409,
        r"has ended \(replica 0: PeerLost\)",
    )
    s.check_owner(
        second, "shutdown_weight_transfer_engine", idempotent=True
    )  # ended: shutdown is a no-op
    with pytest.raises(SessionError) as info:
        s.initialized(object())
        s.check_owner(first, "update_weights")
    assert s.session_id is not None and s.session_id not in info.value.message  # never echoed


def test_the_adapter_an_open_round_writes_is_known_from_its_updates() -> None:
    """``/v1/unload_lora_adapter``'s 409: an update that lists an adapter's tensors marks it
    written by the open round, as does one reusing that listing (no names); a base-model
    listing or the next round clears it."""
    from weightwire.shared.lora import wire_name
    from weightwire.tools.server.state import ServerState

    state = ServerState(pool=None, options=None)  # type: ignore[arg-type]
    listing = {"names": [wire_name("model.layers.0.mlp.up_proj", "A", "pol")]}
    state.session.started()
    assert not state.writing_adapter("pol")  # no update yet: nothing of it written
    state.note_update([listing, listing])
    assert state.writing_adapter("pol") and not state.writing_adapter("other")
    state.session.committed("v1")
    assert not state.writing_adapter("pol")  # the round ended
    state.session.started()
    state.note_update([{"names": []}])  # the listing reused: the same adapter's tensors
    assert state.writing_adapter("pol")
    state.session.started()
    state.note_update([{"names": ["model.embed_tokens.weight"]}])
    assert not state.writing_adapter("pol")


def test_an_update_of_empty_lists_reuses_its_broadcasters_last_dense_listing_only() -> None:
    """``check_reuse``: empty lists pass once their broadcaster listed a dense round in this
    session; refused (400, naming the src) before, or after a delta round's patch listing."""
    from weightwire.tools.server.weight_rules import NothingToReuse, check_reuse, note_listing

    empty = {"names": [], "dtype_names": [], "shapes": []}
    listings: dict[int, bool] = {}
    with pytest.raises(NothingToReuse, match="no previous round's tensor list to reuse"):
        check_reuse([empty], listings, per_worker=False)
    note_listing([{"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]]}], listings)
    check_reuse([empty, empty], listings, per_worker=True)
    with pytest.raises(NothingToReuse, match=r"update_info\[1\] .* to reuse from src 1") as info:
        check_reuse([empty, {**empty, "src": 1}], listings, per_worker=True)
    assert info.value.status == 400
    note_listing(
        [{"names": ["a@index"], "patches": [["a", "float32", [1], 1, "flat_i32"]]}], listings
    )
    with pytest.raises(NothingToReuse, match="was a delta round's patch tensors"):
        check_reuse([empty], listings, per_worker=False)
    s = Session()  # a new session remembers no listing
    s.listings[0] = False
    s.initialized(None)
    assert s.listings == {}
