"""``shared.waiting.poll_until``: the one spin-then-back-off wait of every device poll."""

from __future__ import annotations

import time

import pytest

from weightwire.shared.errors import PeerLost, TransferTimeout
from weightwire.shared.waiting import poll_until


def test_returns_once_done_and_checks_between_polls() -> None:
    polls, checks = iter([False, False, True]), []
    poll_until(
        lambda: next(polls),
        deadline=time.monotonic() + 30,
        check=lambda: checks.append(1),
        expired=lambda: TransferTimeout("never"),
    )
    assert len(checks) == 2  # check_every_s 0: once per poll that found the work unfinished


def test_a_passed_deadline_raises_what_expired_makes() -> None:
    with pytest.raises(TransferTimeout, match="the stream did not finish"):
        poll_until(
            lambda: False,
            deadline=time.monotonic() - 1,
            expired=lambda: TransferTimeout("the stream did not finish"),
        )


def test_a_failing_check_wins_over_the_timeout() -> None:
    def gone() -> None:
        raise PeerLost("the trainer closed the channel")

    with pytest.raises(PeerLost, match="closed the channel"):
        poll_until(
            lambda: False,
            deadline=time.monotonic() - 1,
            check=gone,
            expired=lambda: TransferTimeout("late"),
        )


def test_a_spaced_check_waits_its_interval() -> None:
    checks: list[int] = []
    with pytest.raises(TransferTimeout):
        poll_until(
            lambda: False,
            deadline=time.monotonic() - 1,
            check=lambda: checks.append(1),
            check_every_s=3600,
            expired=lambda: TransferTimeout("late"),
        )
    assert checks == []  # not due yet: the deadline ends the wait first
