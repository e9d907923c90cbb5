"""Hypothesis strategies for the reference server's routes: random JSON of every shape,
raw bytes, and near-valid bodies (one valid payload with one field broken)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from weightwire.shared.info import encode_secret
from weightwire.shared.routes import ROUTES, Route

# Strings are valid Unicode here: lone UTF-16 surrogates ("\ud800") have their own
# test (test_memory_bounds.py), kept apart so that one known defect cannot mask others.
_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=24)
_long_text = st.sampled_from([1_000, 70_000, 300_000]).map(lambda n: "x" * n)
_numbers = (
    st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, 10**300, -(10**300), 10**4000])
    | st.floats(allow_nan=False, allow_infinity=False)
)
scalars = st.none() | st.booleans() | _numbers | _text | _long_text
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(_text, inner, max_size=6),
    max_leaves=24,
)


def dumps(value: Any) -> bytes:
    """JSON text as a client would send it (NaN/Infinity tokens stay possible via raw bytes)."""
    return json.dumps(value).encode()


@st.composite
def deep_bodies(draw: st.DrawFn) -> bytes:
    """Nesting right around (and far beyond) the JSON parser's recursion limit."""
    depth = draw(st.sampled_from([10, 500, 900, 950, 980, 990, 1000, 1100, 5000, 100_000]))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    inner = opener * depth + "1" + closer * depth
    wrap = draw(
        st.sampled_from(
            [
                "{}",
                '{"init_info": {}}',
                '{"update_info": {}}',
                '{"action": {}}',
                '{"new_version": {}}',
                '{"weight_version": {}}',
                '{"prompt": {}}',
                '{"action": "compare", "baseline": {}}',
                '{"prompt": "hi", "max_tokens": {}}',
            ]
        )
    )
    return wrap.replace("{}", inner, 1).encode() if wrap != "{}" else inner.encode()


raw_bodies = st.one_of(
    st.binary(max_size=600),
    st.sampled_from(
        [
            b"\xff\xfe\x00{",
            b"\xef\xbb\xbf{}",
            b'{"a": NaN}',
            b'{"a": Infinity}',
            b"[1,",
            b"nul",
            b"{}}",
            b'{"init_info": {"host": "\xc3\x28"}}',
            b'"just a string"',
            b"1e999999",
            b"-",
            b"\x00" * 64,
            b'{"a": 1, "a": 2}',
            b'{"' + b"k" * 5000 + b'": 1}',
            b"[" + b"1," * 20000 + b"1]",
        ]
    ),
    deep_bodies(),
)

# ---------------------------------------------------------------------------- near-valid
_SECRET = encode_secret(bytes(range(128)))
VALID_TCP_INIT = {
    "host": "127.0.0.1",
    "port": 9,
    "secret_b64": _SECRET,
    "rank_offset": 1,
    "world_size": 2,
    "packed": True,
    "packed_buffer_size_bytes": 1 << 16,
    "packed_num_buffers": 2,
    "timeout_s": 1.0,
}
_ODD = st.one_of(
    json_values,
    st.sampled_from(
        [
            0,
            -1,
            65536,
            2**64,
            True,
            1.5,
            "",
            " ",
            "\x00",
            "127.0.0.1\n",
            "0.0.0.0",
            86401,
            1e-300,
            10**4000,
            _SECRET[:-4] + "-_==",
            "=" * 172,
            [],
            {},
            None,
        ]
    ),
)


@st.composite
def broken_dict(draw: st.DrawFn, valid: dict[str, Any]) -> dict[str, Any]:
    """``valid`` with 1-3 edits: a field replaced by an odd value, dropped, or an unknown key
    added."""
    out = dict(valid)
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        key = draw(st.sampled_from(sorted(valid)))
        if action == "replace":
            out[key] = draw(_ODD)
        elif action == "drop":
            out.pop(key, None)
        else:
            out[draw(_text | st.sampled_from(["master_port", "backend", "nccl_unique_id_b64"]))] = (
                draw(_ODD)
            )
    return out


_dtype = st.sampled_from(
    ["float32", "bfloat16", "float8_e4m3fn", "int64", "bool", "float128", "", "complex64", 7]
)
_huge_dim = st.sampled_from([0, 1, 7, 2**20, 2**31, 2**40, 2**41, 2**62, 2**63, 2**64, -1, 10**30])
_shape = st.lists(_huge_dim, max_size=20) | json_values
_name = (
    st.sampled_from(["model.norm.weight", "lm_head.weight", "", "x" * 2000]) | _text | json_values
)


@st.composite
def update_infos(draw: st.DrawFn) -> Any:
    n = draw(st.integers(0, 4))
    body: dict[str, Any] = {
        "names": [draw(_name) for _ in range(n)],
        "dtype_names": [
            draw(_dtype) for _ in range(draw(st.sampled_from([n, n, n + 1, max(0, n - 1)])))
        ],
        "shapes": [draw(_shape) for _ in range(draw(st.sampled_from([n, n, n + 1])))],
    }
    if draw(st.booleans()):
        body = draw(broken_dict(body))
    return [body, body] if draw(st.integers(0, 9)) == 0 else body  # the per-worker list form too


@st.composite
def completion_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A cheap valid completion (<= 3 tokens), then broken or extended at random."""
    body: dict[str, Any] = {
        "prompt": draw(st.sampled_from(["Hello", [5, 6, 7], ["a", [3]]])),
        "max_tokens": draw(st.integers(1, 3)),
        "temperature": 0,
    }
    extra = st.sampled_from(
        [
            "top_p",
            "top_k",
            "logprobs",
            "seed",
            "n",
            "ignore_eos",
            "stream",
            "echo",
            "stop",
            "logit_bias",
            "best_of",
            "user",
            "model",
            "return_token_ids",
            "suffix",
            "bogus",
        ]
    )
    for _ in range(draw(st.integers(0, 3))):
        body[draw(extra)] = draw(_ODD | st.integers(-3, 3))
    if draw(st.booleans()):
        body = draw(broken_dict(body))
    # A body that happens to be valid must stay cheap to generate.
    if isinstance(body.get("max_tokens"), int) and not isinstance(body.get("max_tokens"), bool):
        body["max_tokens"] = max(-5, min(body["max_tokens"], 3))
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool):
        body["n"] = min(body["n"], 2)
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 3:
        body["prompt"] = body["prompt"][:3]
    return body


def route_strategy(routes: list[Route]) -> st.SearchStrategy[Route]:
    return st.sampled_from(routes)


ALL_ROUTES = list(ROUTES.values())
POST_BODY_ROUTES = [r for r in ALL_ROUTES if r.method == "POST"]
