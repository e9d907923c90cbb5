"""``trainer.handoff``: a round runs with a short GIL switch interval, restored after."""

from __future__ import annotations

import re
import sys
import threading

import pytest

from tests.trainer.fakes import FAKE, FakeComm, FakeServer
from tests.trainer.test_engine_rounds import make
from weightwire.shared.errors import ConfigError
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.handoff import ENV, quick_handoffs, round_interval_s


@pytest.fixture(autouse=True)
def fresh_comm() -> None:
    FAKE.comm = FakeComm()
    FAKE.opened.clear()


def test_a_round_runs_with_the_short_interval_and_restores_the_old_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    before = sys.getswitchinterval()
    server = FakeServer()
    seen: dict[str, float] = {}
    server.hooks["start_weight_update"] = lambda body: seen.setdefault(
        "start", sys.getswitchinterval()
    )
    server.hooks["update_weights"] = lambda body: seen.setdefault("update", sys.getswitchinterval())
    engine, _ = make(server)
    engine.send_weights()
    assert seen == {
        "start": pytest.approx(100e-6, abs=2e-6),
        "update": pytest.approx(100e-6, abs=2e-6),
    }
    assert sys.getswitchinterval() == before


def test_a_failed_round_restores_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    before = sys.getswitchinterval()
    server = FakeServer()
    server.fail["update_weights"] = (500, "worker exploded")
    engine, _ = make(server)
    with pytest.raises(Exception, match="worker exploded"):
        engine.send_weights()
    assert sys.getswitchinterval() == before


def test_overlapping_rounds_restore_only_after_the_last() -> None:
    before = sys.getswitchinterval()
    inner_entered, release = threading.Event(), threading.Event()

    def other_round() -> None:
        with quick_handoffs():
            inner_entered.set()
            assert release.wait(10)

    with quick_handoffs():
        t = threading.Thread(target=other_round)
        t.start()
        assert inner_entered.wait(10)
    assert sys.getswitchinterval() == pytest.approx(100e-6, abs=2e-6)  # the other round still runs
    release.set()
    t.join(10)
    assert sys.getswitchinterval() == before


def test_never_lengthens_an_interval_the_user_shortened() -> None:
    before = sys.getswitchinterval()
    sys.setswitchinterval(20e-6)
    try:
        with quick_handoffs():
            assert sys.getswitchinterval() == pytest.approx(20e-6, abs=2e-6)
        assert sys.getswitchinterval() == pytest.approx(20e-6, abs=2e-6)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize(("raw", "want"), [("", 100e-6), ("250", 250e-6), ("0", None)])
def test_env_sets_or_disables_the_interval(
    monkeypatch: pytest.MonkeyPatch, raw: str, want: float | None
) -> None:
    monkeypatch.setenv(ENV, raw)
    assert round_interval_s() == (None if want is None else pytest.approx(want, abs=2e-6))


def test_env_zero_leaves_the_interval_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "0")
    before = sys.getswitchinterval()
    with quick_handoffs():
        assert sys.getswitchinterval() == before


@pytest.mark.parametrize("raw", ["fast", "-5", "nan", "inf"])
def test_bad_env_is_refused_before_anything_is_sent(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    server = FakeServer()
    engine, _ = make(server)
    monkeypatch.setenv(
        ENV, raw
    )  # set after the config was built (which would refuse it): the round still refuses
    with pytest.raises(ValueError, match=f"{ENV}={raw!r}: expected microseconds"):
        engine.send_weights()
    assert "start_weight_update" not in server.routes()
    monkeypatch.delenv(ENV)
    engine.send_weights()  # the engine stays usable: nothing went out


@pytest.mark.parametrize("raw", ["1e-320", "1e-300", "0.5", "-1", "nan", "inf", "fast"])
def test_env_refuses_an_interval_the_interpreter_cannot_keep(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    # 1e-320 us underflowed to 0 s (Python's own "must be strictly positive"); 1e-300 set 0.0.
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(
        ConfigError, match=f"{ENV}='{re.escape(raw)}': expected microseconds, 0 .* or a number >= 1"
    ):
        round_interval_s()
    with pytest.raises(
        ConfigError, match=ENV
    ):  # the trainer's config refuses it before anything is sent
        TrainerInitInfo(backend="weightwire_tcp")


def test_a_bad_timeout_variable_is_refused_by_the_trainers_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WEIGHTWIRE_TIMEOUT_CONNECT_S", "soon")
    with pytest.raises(
        ConfigError, match="WEIGHTWIRE_TIMEOUT_CONNECT_S must be a number of seconds, got 'soon'"
    ):
        TrainerInitInfo(backend="weightwire_tcp")
