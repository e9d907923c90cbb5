"""Fuzz every shared parser: whatever arrives over HTTP, only ``ValueError`` escapes.

A request handler maps ``ValueError`` to a 400; any other exception type (TypeError,
RecursionError, OverflowError, KeyError...) would be a 500 or a crashed worker.
Accepted inputs must also round-trip, so "no exception" cannot hide a half-parsed object.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.shared.vllm_nccl import NCCL_KEYS
from weightwire import NCCLInitInfo, TCPInitInfo, WeightwireNCCLInitInfo
from weightwire.shared import WIRE_DTYPES, ParamMeta, UpdateInfo
from weightwire.shared.info import encode_secret

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, 2, -1, 2**31, 2**63, 2**64, 10**400, -(10**400)])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["", "float32", "bfloat16", "x" * 5000, "\ud800", "+/==", "127.0.0.1"])
)
json_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)


def deep(depth: int, leaf: object = 1) -> object:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


_UID = encode_secret(bytes(range(128)))
_plausible = {
    "master_address": st.sampled_from(["10.0.0.1", "", "h" * 300, "a b"]),
    "master_port": st.sampled_from([1, 29500, 0, 65536, True]),
    "nccl_unique_id_b64": st.sampled_from([_UID, _UID[:-4], _UID.replace("A", "-"), "=" * 172]),
    "host": st.sampled_from(["127.0.0.1", "::1", "", "\x00"]),
    "port": st.sampled_from([1, 40000, 0, -5]),
    "secret_b64": st.sampled_from([_UID, _UID + "AAAA", "é" * 172]),
    "rank_offset": st.integers(min_value=-2, max_value=5),
    "world_size": st.integers(min_value=-1, max_value=6),
    "packed": st.booleans(),
    "packed_buffer_size_bytes": st.sampled_from([1, 4096, 0, 1 << 36, (1 << 36) + 1]),
    "packed_num_buffers": st.integers(min_value=-1, max_value=20),
    "timeout_s": st.sampled_from([0.5, 5, 86_400, 86_401, float("nan"), float("inf"), -1.0]),
    "names": st.lists(st.sampled_from(["a", "b", "model.layers.0.w", ""]), max_size=4),
    "dtype_names": st.lists(st.sampled_from([*WIRE_DTYPES, "int4", "torch.float32"]), max_size=4),
    "shapes": st.lists(
        st.lists(st.integers(min_value=-2, max_value=2**40), max_size=4), max_size=4
    ),
    "name": st.sampled_from(["w", "", "x" * 2000]),
    "dtype": st.sampled_from([*WIRE_DTYPES, "complex64"]),
    "shape": st.lists(st.integers(min_value=-1, max_value=2**45), max_size=5),
    "owners": st.lists(st.integers(min_value=-1, max_value=70_000), max_size=3),
}


def payloads(keys: tuple[str, ...]) -> st.SearchStrategy[object]:
    """Mostly objects with the parser's own keys, holding plausible or random values."""
    field = {k: _plausible[k] | json_values for k in keys}
    objects = st.fixed_dictionaries({}, optional=field)
    junk_keys = st.dictionaries(
        st.sampled_from([*keys, "extra", "Packed"]), json_values, max_size=4
    )
    deep_values = st.builds(
        lambda k, d: {k: deep(d)}, st.sampled_from(keys), st.integers(900, 3000)
    )
    return objects | junk_keys | deep_values | json_values


def only_value_error(parse: Callable[[object], object], data: object) -> object | None:
    try:
        return parse(data)
    except ValueError as exc:
        assert str(exc), "a ValueError must say what is wrong"
        return None


PARSERS: dict[str, tuple[type, tuple[str, ...]]] = {
    "nccl": (NCCLInitInfo, NCCL_KEYS),
    "weightwire_nccl": (WeightwireNCCLInitInfo, (*NCCL_KEYS, "timeout_s")),
    "tcp": (
        TCPInitInfo,
        (
            "host",
            "port",
            "secret_b64",
            "rank_offset",
            "world_size",
            "packed",
            "packed_buffer_size_bytes",
            "packed_num_buffers",
            "timeout_s",
        ),
    ),
    "update": (UpdateInfo, ("names", "dtype_names", "shapes")),
    "param": (ParamMeta, ("name", "dtype", "shape", "owners")),
}


def _check_dict(cls: type, data: object) -> None:
    parsed = only_value_error(cls.from_dict, data)
    if parsed is not None:
        assert cls.from_dict(json.loads(json.dumps(parsed.to_dict()))) == parsed
        assert cls.from_json(parsed.to_json()) == parsed


def _check_text(cls: type, data: object) -> None:
    try:
        text = json.dumps(data)
    except (ValueError, RecursionError):  # not representable as JSON text: nothing to send
        return
    parsed = only_value_error(cls.from_json, text)
    if parsed is not None:
        assert cls.from_json(parsed.to_json()) == parsed


@pytest.mark.parametrize("which", list(PARSERS))
@FUZZ
@given(data=st.data())
def test_fuzz_parser(which: str, data: st.DataObject) -> None:
    cls, keys = PARSERS[which]
    payload = data.draw(payloads(keys), label=which)
    _check_dict(cls, payload)
    _check_text(cls, payload)


_texts = (
    st.binary(max_size=64)
    | st.text(max_size=64)
    | st.sampled_from(
        [
            b"\xff\xfe{}",
            b'{"names": "\xc3\x28"}',
            "\ud800",
            "1" * 5000,
            "[" * 100_000,
            '{"a":' * 20_000,
            "NaN",
            "-Infinity",
            "null",
            '{"names": [1e999]}',
        ]
    )
    | st.integers(min_value=1, max_value=5000).map(lambda n: "[" * n + "]" * n)
    | json_values.map(lambda v: json.dumps(v).encode("utf-16"))
)


@FUZZ
@given(text=_texts, which=st.sampled_from(sorted(PARSERS)))
def test_fuzz_raw_text(text: str | bytes, which: str) -> None:
    cls = PARSERS[which][0]
    parsed = only_value_error(cls.from_json, text)
    if parsed is not None:
        assert cls.from_json(parsed.to_json()) == parsed


def test_deep_nesting_every_field() -> None:
    # Python objects nested past the interpreter's recursion limit: error messages must
    # not recurse into them.
    for cls, keys in PARSERS.values():
        for key in keys:
            only_value_error(cls.from_dict, {key: deep(50_000)})
            only_value_error(
                cls.from_json, "{" + json.dumps(key) + ": " + "[" * 50_000 + "]" * 50_000 + "}"
            )
