"""Version gates, timeouts from the environment, ``checked_iter``, route table and dtype
table (layer grouping: ``test_layer_groups``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from weightwire.shared import (
    DEFAULT_TIMEOUTS,
    ROUTES,
    VERSION_GATES,
    WIRE_DTYPES,
    ParamMeta,
    ServerFeatures,
    SourceMismatch,
    Timeouts,
    parse_version,
    wire_dtype,
)
from weightwire.shared.dtypes import wire_name_of_numpy
from weightwire.shared.errors import ConfigError
from weightwire.shared.source import checked_iter

# --- version gates ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "release"),
    [
        ("0.33.0", (0, 33, 0)),
        ("0.32.0+cpu", (0, 32, 0)),
        ("0.33.1.dev4+gabc", (0, 33, 1)),
        ("v0.30.1", (0, 30, 1)),
        ("0.33.0+weightwire.0.1.0", (0, 33, 0)),
        (" 1.2", (1, 2)),
        ("0.28", (0, 28)),
    ],
)
def test_parse_version(text: str, release: tuple[int, ...]) -> None:
    assert parse_version(text).release == release


@pytest.mark.parametrize(
    "text", ["", "garbage", "v", "0.x.1", "1" * 5000 + ".2", "0." + "3" * 200, None, 33]
)
def test_parse_version_garbage(text: object) -> None:
    with pytest.raises(ValueError, match="cannot parse server version"):
        parse_version(text)  # type: ignore[arg-type]


_ALL = (
    "packed_in_init",
    "draft_route",
    "abort_route",
    "unique_id_rendezvous",
    "shutdown_route",
    "weight_checker_route",
    "packed_scalars",
    "sparse_nccl",
    "nccl_m2n",
    "reuse_metadata",
)


def _on(*names: str) -> set[str]:
    return set(names)


_R28 = _on("packed_in_init", "draft_route", "abort_route")
_R30 = _R28 | {"unique_id_rendezvous", "sparse_nccl"}
_R32 = _R30 | {"shutdown_route", "weight_checker_route", "packed_scalars"}
_R33 = _R32 | {"reuse_metadata", "nccl_m2n"}
_NEWER = _R32 - {"sparse_nccl"}  # features whose wire form may change are not carried forward


@pytest.mark.parametrize(
    ("version", "enabled", "release"),
    [
        # release
        ("0.28.0", _R28, (0, 28)),
        ("0.29.1", _R28, (0, 29)),
        ("0.30.0", _R30, (0, 30)),
        ("0.31.0", _R30, (0, 31)),
        ("0.32.0", _R32, (0, 32)),
        ("0.33.0", _R33, (0, 33)),
        ("0.33.2", _R33, (0, 33)),
        ("0.33.0.post1", _R33, (0, 33)),
        # local build of a release: gated as the release
        ("0.32.0+cpu", _R32, (0, 32)),
        ("0.33.0+weightwire.0.1.0", _R33, (0, 33)),
        # pre-release / dev build of a known minor: before it, so gated as the previous one
        ("0.33.0rc1", _R32, (0, 32)),
        ("0.32.0rc2", _R30, (0, 31)),
        ("0.33.0.dev5+g1a2b", _R32, (0, 32)),
        ("0.30.0b1", _R28, (0, 29)),
        ("0.33.1rc1", _R33, (0, 33)),
        # unknown future: newest known row, minus what may have changed
        ("0.34.0.dev12+g0123abc", _NEWER, (0, 33)),
        ("0.35.1", _NEWER, (0, 33)),
        ("1.0.0", _NEWER, (0, 33)),
        # too old
        ("0.27.9", set(), None),
        ("0.28.0rc1", set(), None),
    ],
)
def test_server_features(version: str, enabled: set[str], release: tuple[int, int] | None) -> None:
    f = ServerFeatures.for_version(version)
    assert set(f.enabled()) == enabled
    assert {n for n in _ALL if getattr(f, n)} == enabled
    assert f.release == release


def test_gate_table_rows() -> None:
    assert [(first, name) for first, name, _ in VERSION_GATES] == [
        ((0, 28), "packed_in_init"),
        ((0, 28), "draft_route"),
        ((0, 28), "abort_route"),
        ((0, 30), "unique_id_rendezvous"),
        ((0, 30), "sparse_nccl"),
        ((0, 32), "shutdown_route"),
        ((0, 32), "weight_checker_route"),
        ((0, 32), "packed_scalars"),
        ((0, 33), "nccl_m2n"),
        ((0, 33), "reuse_metadata"),
    ]


def test_require_names_feature_version_and_basis() -> None:
    ServerFeatures.for_version("0.33.0").require("reuse_metadata", "empty update info")
    with pytest.raises(
        ValueError,
        match=r"0\.32\.0\+cpu lacks reuse_metadata \(needs >= 0\.33; server is release "
        r"0\.32\): empty",
    ):
        ServerFeatures.for_version("0.32.0+cpu").require("reuse_metadata", "empty update info")
    with pytest.raises(ValueError, match=r"lacks unique_id_rendezvous \(needs >= 0\.30"):
        ServerFeatures.for_version("0.29.0").require("unique_id_rendezvous", "torch-free trainer")
    with pytest.raises(
        ValueError,
        match=r"0\.33\.0rc1 lacks reuse_metadata \(needs >= 0\.33; server is a "
        r"pre-release of 0\.33: gated as 0\.32\)",
    ):
        ServerFeatures.for_version("0.33.0rc1").require("reuse_metadata", "x")
    with pytest.raises(
        ValueError,
        match=r"0\.35\.1 lacks reuse_metadata \(its wire form changed in 0\.33 and "
        r"the server \(newer than the newest known release 0\.33\) may have changed it again",
    ):
        ServerFeatures.for_version("0.35.1").require("reuse_metadata", "x")
    with pytest.raises(ValueError, match=r"older than the oldest supported release 0\.28"):
        ServerFeatures.for_version("0.27.0").require("packed_in_init", "x")


def test_version_override_is_explicit_and_reported() -> None:
    f = ServerFeatures.for_version("0.35.1", override="0.33")
    assert f.reuse_metadata and f.release == (0, 33)
    assert f.basis == "user override: gated as 0.33 (server says 0.35.1)"
    assert not ServerFeatures.for_version("0.33.0", override="0.31.0").packed_scalars
    with pytest.raises(
        ValueError, match=r"version override '0\.40' is not a known release \(0\.28, .*0\.33\)"
    ):
        ServerFeatures.for_version("0.33.0", override="0.40")
    with pytest.raises(ValueError, match="cannot parse server version 'nope'"):
        ServerFeatures.for_version("0.33.0", override="nope")


# --- Timeouts -------------------------------------------------------------------


def test_timeouts_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HTTP_S", "CONNECT_S", "WARMUP_S", "TRANSFER_S"):
        monkeypatch.delenv(f"WEIGHTWIRE_TIMEOUT_{var}", raising=False)
    assert Timeouts.from_env() == DEFAULT_TIMEOUTS == Timeouts(300.0, 60.0, 60.0, 300.0)
    monkeypatch.setenv("WEIGHTWIRE_TIMEOUT_CONNECT_S", "2.5")
    monkeypatch.setenv("WEIGHTWIRE_TIMEOUT_TRANSFER_S", "10")
    t = Timeouts.from_env()
    assert (t.http_s, t.connect_s, t.warmup_s, t.transfer_s) == (300.0, 2.5, 60.0, 10.0)


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "abc", ""])
def test_timeouts_from_env_rejects(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("WEIGHTWIRE_TIMEOUT_WARMUP_S", raw)
    with pytest.raises(ValueError, match="WEIGHTWIRE_TIMEOUT_WARMUP_S"):
        Timeouts.from_env()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("http_s", -1),
        ("transfer_s", 0),
        ("connect_s", float("nan")),
        ("round_s", float("inf")),
        ("warmup_s", "5"),
        ("http_s", True),
    ],
)
def test_timeouts_refuse_a_bound_that_is_no_finite_positive_number(
    field: str, value: object
) -> None:
    """``Timeouts(...)`` refuses a bound that is no finite number of seconds > 0, naming the
    field, where it is written (was: accepted; ``http_s=-1`` then gave up on the init POST
    at once, leaving the server busy with the half-made session: the next trainer's init
    got 409 "another weight operation (init_weight_transfer_engine) is in progress")."""
    with pytest.raises(ConfigError, match=rf"Timeouts\.{field} must be a finite number"):
        Timeouts(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=rf"Timeouts\.{field}"):
        dataclasses.replace(DEFAULT_TIMEOUTS, **{field: value})


# --- checked_iter --------------------------------------------------------------------


def describe(arr: np.ndarray) -> tuple[str, tuple[int, ...]]:
    return wire_name_of_numpy(arr.dtype), arr.shape


DECLARED = [
    ParamMeta("a", "float32", (2,)),
    ParamMeta("b", "int8", (3, 1)),
    ParamMeta("c", "float16", ()),
]
GOOD = [
    ("a", np.zeros(2, np.float32)),
    ("b", np.zeros((3, 1), np.int8)),
    ("c", np.float16(1).reshape(())),
]


def test_checked_iter_passes_matching_stream() -> None:
    out = list(checked_iter(iter(GOOD), DECLARED, describe))
    assert [n for n, _ in out] == ["a", "b", "c"]
    assert all(x is y for (_, x), (_, y) in zip(out, GOOD, strict=True))


@pytest.mark.parametrize(
    ("pairs", "match", "ok_before"),
    [
        (
            GOOD + [("d", np.zeros(1, np.float32))],
            "more tensors than metadata declared \\(3\\); first extra is 'd'",
            3,
        ),
        (GOOD[:2], "source yielded 2 tensors but metadata declared 3; first missing is 'c'", 2),
        (
            [GOOD[1], GOOD[0], GOOD[2]],
            "index 0: declared 'a' float32 \\[2\\], got 'b' int8 \\[3, 1\\]",
            0,
        ),
        (
            [GOOD[0], ("b", np.zeros((3, 1), np.uint8)), GOOD[2]],
            "index 1: declared 'b' int8 .*got 'b' uint8",
            1,
        ),
        (
            [GOOD[0], ("b", np.zeros((1, 3), np.int8)), GOOD[2]],
            "index 1: declared 'b' int8 \\[3, 1\\], got 'b' int8 \\[1, 3\\]",
            1,
        ),
        (
            [GOOD[0], GOOD[1], ("c", np.zeros(1, np.float16))],
            "declared 'c' float16 \\[\\], got 'c' float16 \\[1\\]",
            2,
        ),
    ],
    ids=["extra", "missing", "reordered", "redtyped", "reshaped", "scalar_vs_vector"],
)
def test_checked_iter_mismatch(pairs: list, match: str, ok_before: int) -> None:
    seen: list[str] = []
    with pytest.raises(SourceMismatch, match=match):
        for name, _ in checked_iter(iter(pairs), DECLARED, describe):
            seen.append(name)
    # The bad tensor is never handed on: only the matching prefix was yielded.
    assert len(seen) == ok_before
    assert issubclass(SourceMismatch, ValueError)


def test_checked_iter_takes_any_sequence_as_a_shape() -> None:
    """A ``describe`` may give a list or a ``torch.Size``-like tuple subclass: compared by value."""

    class Size(tuple):
        pass

    for spell in (list, Size):

        def described(arr: np.ndarray, spell: type = spell) -> tuple[str, object]:
            return wire_name_of_numpy(arr.dtype), spell(arr.shape)

        assert [n for n, _ in checked_iter(iter(GOOD), DECLARED, described)] == ["a", "b", "c"]  # type: ignore[arg-type]
        with pytest.raises(
            SourceMismatch, match="declared 'b' int8 \\[3, 1\\], got 'b' int8 \\[1, 3\\]"
        ):
            list(
                checked_iter(iter([GOOD[0], ("b", np.zeros((1, 3), np.int8))]), DECLARED, described)
            )  # type: ignore[arg-type]


# --- tables --------------------------------------------------------------------


def test_dtype_table() -> None:
    assert {n: r.itemsize for n, r in WIRE_DTYPES.items()} == {
        "bfloat16": 2,
        "float16": 2,
        "float32": 4,
        "float64": 8,
        "int8": 1,
        "uint8": 1,
        "int32": 4,
        "int64": 8,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
        "bool": 1,
    }
    for name, row in WIRE_DTYPES.items():
        assert wire_name_of_numpy(row.numpy) == name
        assert wire_dtype(name) is row
    with pytest.raises(ValueError, match="unsupported dtype 'complex64'"):
        wire_dtype("complex64")
    with pytest.raises(ValueError, match="complex64 has no wire name"):
        wire_name_of_numpy(np.complex64)


def test_route_table() -> None:
    got = {n: (r.method, r.path, r.body_key) for n, r in ROUTES.items() if r.weight_route}
    assert got == {
        "init_weight_transfer_engine": ("POST", "/init_weight_transfer_engine", "init_info"),
        "start_weight_update": ("POST", "/start_weight_update", None),
        "start_draft_weight_update": ("POST", "/start_draft_weight_update", None),
        "update_weights": ("POST", "/update_weights", "update_info"),
        "finish_weight_update": ("POST", "/finish_weight_update", "weight_version"),
        "shutdown_weight_transfer_engine": ("POST", "/shutdown_weight_transfer_engine", None),
        "update_weight_version": ("POST", "/update_weight_version", "new_version"),
        "weight_info": ("GET", "/weight_info", None),
        "weight_checker": ("POST", "/weight_checker", "action"),
        "get_world_size": ("GET", "/get_world_size", None),
        "server_info": ("GET", "/server_info", None),
        "pause": ("POST", "/pause", None),
        "resume": ("POST", "/resume", None),
        "is_paused": ("GET", "/is_paused", None),
        "abort_requests": ("POST", "/abort_requests", "request_ids"),
        "sleep": ("POST", "/sleep", None),
        "wake_up": ("POST", "/wake_up", None),
        "is_sleeping": ("GET", "/is_sleeping", None),
        "reset_prefix_cache": ("POST", "/reset_prefix_cache", None),
        "reset_encoder_cache": ("POST", "/reset_encoder_cache", None),
    }
