"""``trainer.group``'s liveness over ``DictGroup`` (threads for ranks, the beat's periods
shortened): a wait on a rank whose beat stopped or ended fails at once naming it; a rank that
beats but posts late is waited for; a part already posted costs one read, as before. The real
processes (a SIGKILLed rank, torch and JAX stores) are test_multi_source_cpu's."""

from __future__ import annotations

import threading
import time

import pytest

from weightwire.trainer import group as group_mod
from weightwire.trainer.group import DictGroup, Exchange, GroupTimeout

BEAT_S = 0.05
STOPPED_AFTER_S = 0.3


@pytest.fixture(autouse=True)
def short_beats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group_mod, "BEAT_S", BEAT_S)
    monkeypatch.setattr(group_mod, "STOPPED_AFTER_S", STOPPED_AFTER_S)


class Mortal(DictGroup):
    """A rank whose beats stop landing once ``dead`` is set, as a killed process's do."""

    dead = False

    def _put(self, key: str, value: str) -> None:
        if not self.dead:
            super()._put(key, value)


def pair() -> tuple[Exchange, Exchange, Mortal]:
    groups = DictGroup.make(2)
    mortal = Mortal(1, 2, groups[1]._shared, groups[1]._cv)
    return Exchange(groups[0]), Exchange(mortal), mortal


def test_a_wait_on_a_rank_whose_beat_stopped_fails_within_a_few_beats_naming_it() -> None:
    zero, one, mortal = pair()
    one.start_beat()
    try:
        time.sleep(3 * BEAT_S)
        mortal.dead = True  # killed between rounds: no leave, no last word
        started = time.monotonic()
        with pytest.raises(GroupTimeout) as info:
            zero.get("round", 1, timeout=30)
        took = time.monotonic() - started
    finally:
        one.stop_beat()
    text = str(info.value)
    assert "trainer rank 1 stopped beating: its last beat, at " in text, text
    assert "while trainer rank 0 waited" in text and "for its 'round'" in text, text
    assert "Call shutdown() and trainer_init() again on every rank" in text, text
    assert took < STOPPED_AFTER_S + 10 * BEAT_S + 1, took  # was: the whole 30 s


def test_a_rank_that_beats_but_posts_late_is_waited_for() -> None:
    zero, one, _ = pair()
    one.start_beat()
    late = threading.Timer(4 * STOPPED_AFTER_S, one.post, args=("round", {"ok": 1}))
    late.start()
    try:
        assert zero.get("round", 1, timeout=30) == {"ok": 1}
    finally:
        late.cancel()
        one.stop_beat()


def test_a_wait_on_a_rank_that_ended_its_beat_fails_at_once_naming_why() -> None:
    zero, one, _ = pair()
    one.start_beat()
    one.stop_beat("shut down its engine")
    started = time.monotonic()
    with pytest.raises(GroupTimeout, match="trainer rank 1 shut down its engine at "):
        zero.get("verdict", 1, timeout=30)
    assert time.monotonic() - started < 2 * BEAT_S + 1


def test_a_part_posted_before_the_beat_ended_is_read() -> None:
    """``leave()`` posts the agreement, then the beat ends: the reader takes the post."""
    zero, one, _ = pair()
    one.start_beat()
    one.post("round", {"left": "trainer rank 1 shut down its engine"})
    one.stop_beat()
    assert zero.get("round", 1, timeout=30) == {"left": "trainer rank 1 shut down its engine"}


def test_a_rank_without_a_beat_is_waited_for_to_the_timeout_and_a_posted_part_is_one_read() -> None:
    zero, one, _ = pair()  # rank 1 never started beating (not yet at its trainer_init)
    with pytest.raises(GroupTimeout, match="did not publish 'round' within 0.5 s"):
        zero.get("round", 1, timeout=0.5)
    reads: list[str] = []
    read = zero.group.read

    def counted(key: str, timeout: float) -> str:
        reads.append(key)
        return read(key, timeout)

    zero.group.read = counted  # type: ignore[method-assign]
    one.start_beat()
    try:
        one.post("round", {"ok": 1})
        assert zero.get("round", 1, timeout=30) == {"ok": 1}
    finally:
        one.stop_beat()
    assert reads == [f"weightwire/{zero._ns}/0/round/1"]  # no beat read on the hot path


def test_the_beat_thread_ends_at_stop() -> None:
    _, one, _ = pair()
    one.start_beat()
    beat = one._beat
    assert beat is not None and beat._thread is not None and beat._thread.is_alive()
    one.stop_beat()
    assert not beat._thread.is_alive()
