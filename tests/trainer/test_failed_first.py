"""``snapshot.FailedFirst``: which error a blocking call stopped by another thread's
``shutdown()`` raises. The round's own failure reported before the stop is raised (itself, or
the error it led to); one reported after it, or one the round recovered from, is not."""

from __future__ import annotations

from weightwire.trainer.snapshot import FailedFirst


def _raised_from(cause: BaseException, exc: BaseException, *, suppress: bool) -> BaseException:
    """``exc`` raised while handling ``cause`` (``raise exc from None`` when ``suppress``)."""
    try:
        try:
            raise cause
        except BaseException:
            if suppress:
                raise exc from None
            raise exc  # noqa: B904 - the implicit context is what the round leaves
    except BaseException as out:
        return out


def test_an_error_reported_before_the_stop_came_first() -> None:
    mark = FailedFirst()
    own = RuntimeError("the source failed")
    mark.failed(own)
    mark.stopping()
    mark.failed(OSError("the link closed"))  # the stop's: never replaces the round's own
    assert mark.came_first(own)


def test_the_error_it_led_to_came_first_too() -> None:
    """A failed data plane raises the server's verdict instead (``raise cause from None``)."""
    mark = FailedFirst()
    own = OSError("the broadcast failed")
    mark.failed(own)
    mark.stopping()
    assert mark.came_first(_raised_from(own, ValueError("the server refused"), suppress=True))
    assert mark.came_first(_raised_from(own, ValueError("the server refused"), suppress=False))


def test_an_error_after_the_stop_is_the_stops() -> None:
    mark = FailedFirst()
    mark.stopping()
    closed = OSError("the link closed")
    mark.failed(closed)
    assert not mark.came_first(closed)


def test_an_error_the_round_recovered_from_is_not_what_it_raises() -> None:
    """A delta round's base refusal, retried dense: the retry stopped by the shutdown raises
    an error of its own, in no chain of the refusal."""
    mark = FailedFirst()
    mark.failed(RuntimeError("DeltaBaseMismatch"))
    mark.stopping()
    assert not mark.came_first(OSError("the link closed"))


def test_a_new_call_forgets_the_last_ones_failure() -> None:
    mark = FailedFirst()
    old = RuntimeError("the last call's round failed")
    mark.failed(old)
    mark.begin()
    mark.stopping()
    assert not mark.came_first(old)
