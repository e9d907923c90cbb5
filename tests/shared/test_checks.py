"""``shared.checks``: one check per kind of value, and every boundary that takes such a
value says the same thing about the same mistake."""

from __future__ import annotations

import math

import pytest

from weightwire.backends.tcp.info import TCPInitInfo
from weightwire.shared import LIMITS
from weightwire.shared.checks import (
    check_buffer_size,
    check_int_in,
    check_num_buffers,
    check_seconds,
)
from weightwire.shared.errors import ConfigError
from weightwire.shared.framing import plan_packed
from weightwire.shared.info import encode_secret
from weightwire.shared.meta import ParamMeta
from weightwire.shared.timeouts import Timeouts
from weightwire.trainer.config import TrainerInitInfo

BIG = LIMITS.max_buffer_size_bytes + 1


def test_int_ranges() -> None:
    assert check_int_in("n", 3, 1, 3) == 3
    for bad in (0, 4, True, 2.0, "2", None, 10**400):
        with pytest.raises(ConfigError, match=r"^n must be an int in \[1, 3\], got "):
            check_int_in("n", bad, 1, 3)
    assert check_buffer_size("b", LIMITS.max_buffer_size_bytes) == LIMITS.max_buffer_size_bytes
    assert check_num_buffers("k", LIMITS.max_num_buffers) == LIMITS.max_num_buffers


@pytest.mark.parametrize("bad", [0, -1.5, math.inf, math.nan, True, "5", None])
def test_seconds_refuses(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"^t must be a finite number of seconds > 0, got "):
        check_seconds("t", bad)


def test_seconds_accepts_and_bounds() -> None:
    assert check_seconds("t", 0.5) == 0.5 and check_seconds("t", 10**400) == 10**400
    assert check_seconds("t", 86_400, most=86_400) == 86_400
    with pytest.raises(
        ConfigError, match=r"t must be a finite number of seconds > 0 and <= 86400, got 86401"
    ):
        check_seconds("t", 86_401, most=86_400)


def test_buffer_size_reads_the_same_at_every_boundary() -> None:
    secret = encode_secret(bytes(128))
    calls = {
        "TrainerInitInfo": lambda: TrainerInitInfo(backend="tcp", packed_buffer_size_bytes=BIG),
        "TCPInitInfo": lambda: TCPInitInfo(
            host="h",
            port=1,
            secret_b64=secret,
            rank_offset=1,
            world_size=2,
            packed_buffer_size_bytes=BIG,
        ),
        "plan_packed": lambda: plan_packed([ParamMeta("w", "float32", (1,))], BIG),
    }
    want = (
        f"packed_buffer_size_bytes must be an int in [1, {LIMITS.max_buffer_size_bytes}], got {BIG}"
    )
    for where, call in calls.items():
        with pytest.raises(ConfigError) as err:
            call()
        assert str(err.value).endswith(want), (where, str(err.value))


def test_seconds_read_the_same_at_every_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightwire.control.client import HTTPWeightSyncClient

    monkeypatch.setenv("WEIGHTWIRE_TIMEOUT_HTTP_S", "-1")
    secret = encode_secret(bytes(128))
    calls = {
        "env": Timeouts.from_env,
        "TCPInitInfo": lambda: TCPInitInfo(
            host="h", port=1, secret_b64=secret, rank_offset=1, world_size=2, timeout_s=-1
        ),
        "client": lambda: HTTPWeightSyncClient("http://a:1", timeout=-1),
    }
    for call in calls.values():
        with pytest.raises(ConfigError, match="must be a finite number of seconds > 0"):
            call()
