"""The waits a trainer's init runs on the joined link while the init POST is in flight
(warm-up, the workers' hellos): a POST that fails meanwhile ends them at once, and its
error, not the data plane's, is what the caller sees."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from weightwire.control.fanout import spawn
from weightwire.shared.errors import TransferError, TransferTimeout
from weightwire.trainer.transfer import beside_init


class Link:
    """A link whose wait ends only when it is aborted (or after ``limit`` seconds)."""

    def __init__(self) -> None:
        self.aborted = threading.Event()

    def abort(self) -> None:
        self.aborted.set()

    def wait(self, limit: float = 30.0) -> list[bytes]:
        if self.aborted.wait(limit):
            raise TransferError("the link was aborted while the workers' hellos were awaited")
        raise TransferTimeout(f"no hello within {limit} s")


def failing_post(after_s: float, until: threading.Event | None = None) -> Future[None]:
    """An init POST that fails after ``after_s``, or once ``until`` is set."""

    def post() -> None:
        if until is None:
            time.sleep(after_s)
        else:
            until.wait(30)
        raise RuntimeError("POST /init_weight_transfer_engine: 400 the server refused the init")

    return spawn(post, name="test-init")


def test_a_post_that_fails_during_the_wait_ends_it_at_once_with_its_own_error() -> None:
    link = Link()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the server refused the init") as raised:
        beside_init(failing_post(0.1), link, link.wait)
    assert time.monotonic() - started < 5  # not the wait's 30 s
    assert link.aborted.is_set()
    assert "the data plane then failed: TransferError" in "".join(raised.value.__notes__)


def test_a_post_that_fails_after_the_wait_leaves_the_link_alone() -> None:
    link = Link()
    hellos_read = threading.Event()  # the POST fails only then (was: after 0.3 s, however late)
    post = failing_post(0.0, until=hellos_read)
    try:
        assert beside_init(post, link, lambda: [b"hello"]) == [b"hello"]  # the hellos first
    finally:
        hellos_read.set()
    with pytest.raises(RuntimeError):
        post.result(timeout=5)  # the POST's later failure is the caller's to read
    assert not link.aborted.is_set()
