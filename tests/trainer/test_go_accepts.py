"""The round's acceptance at the workers' go (``Outgoing.go_accepts``), on the trainer's side:
which rounds get it, and a start that fails after the data path wrote at the go fails the round
as one failed after its first byte (``Transfer.broken``: the engine needs a new init), where a
start that failed before any write keeps the engine usable."""

from __future__ import annotations

import types
from typing import Any

import pytest

from weightwire.backends.base import Outgoing, Sent
from weightwire.trainer.early import go_accepts
from weightwire.trainer.metrics import PhaseClock
from weightwire.trainer.transfer import Transfer


class Comm:
    def __init__(self) -> None:
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1


class Pipeline:
    """Writes at the go (``early``) or not, then runs ``begin`` (the start), as the
    write-through data path does when every worker's go came from inside its start."""

    def __init__(self, early: bool) -> None:
        self.early, self.settled, self.seen = early, 0, False

    def send(self, out: Outgoing) -> Sent:
        self.seen = out.go_accepts
        if self.early and out.go_accepts:
            out.wrote_early.set()
        assert out.begin is not None
        out.begin()
        return Sent(0, 0)

    def settle(self) -> None:
        self.settled += 1


class StartFailed(Exception):
    pass


def _transfer(early: bool) -> tuple[Transfer, Pipeline, Comm]:
    def start() -> None:
        raise StartFailed("start_weight_update: 500 replica 0 did not answer")

    pipe, comm = Pipeline(early), Comm()
    step = Transfer(
        comm,
        pipe,  # type: ignore[arg-type]
        post_update=lambda: None,
        control=start,
        clock=PhaseClock(),
        http_s=5.0,
        go_accepts=True,
    )
    return step, pipe, comm


def test_a_start_failing_after_a_write_at_the_go_breaks_the_engine() -> None:
    step, pipe, comm = _transfer(early=True)
    with pytest.raises(StartFailed) as got:
        step.run([], [])
    assert pipe.seen is True
    assert step.broken is got.value and comm.aborted == 1 and pipe.settled == 0
    assert "refuse generation until a whole round commits" in "".join(got.value.__notes__)


def test_a_start_failing_before_any_write_keeps_the_engine() -> None:
    step, pipe, comm = _transfer(early=False)
    with pytest.raises(StartFailed):
        step.run([], [])
    assert step.broken is None and comm.aborted == 0 and pipe.settled == 1


@pytest.mark.parametrize("finishes", [False, True], ids=["update", "update_and_finish"])
def test_an_update_that_carries_the_finish_names_the_commit_when_it_does_not_answer(
    finishes: bool,
) -> None:
    """The wait after the last broadcast is the update's, and with the finish riding on it
    (``UPDATE_FINISHES``) the servers' commit's too (a generation holding the model lock):
    its timeout says so."""
    import threading

    from weightwire.shared.errors import ControlTimeout

    answer = threading.Event()
    step = Transfer(
        Comm(),
        Pipeline(early=False),  # type: ignore[arg-type]
        post_update=lambda: answer.wait(5.0),
        control=lambda: None,
        clock=PhaseClock(),
        http_s=0.05,
        finishes=finishes,
    )
    try:
        with pytest.raises(ControlTimeout) as got:
            step.run([], [])
    finally:
        answer.set()
    assert got.value.route == "update_weights" and step.broken is got.value
    assert ("it carries the round's finish" in got.value.message) is finishes


def _client(urls: Any) -> Any:
    return types.SimpleNamespace(base_urls=urls)


@pytest.mark.parametrize(
    ("urls", "start_pauses", "accepts"),
    [
        (["http://a:1"], True, True),  # one server, its start pauses first
        (["http://a:1", "http://b:1"], True, False),  # another server may still refuse
        (["http://a:1"], False, False),  # a pause beside the start may land after the go
        (None, True, False),  # a client that does not tell its servers
    ],
)
def test_the_go_accepts_a_round_of_one_server_whose_start_pauses_first(
    urls: Any, start_pauses: bool, accepts: bool
) -> None:
    early = types.SimpleNamespace(start_pauses=start_pauses)
    assert go_accepts(_client(urls), early) is accepts  # type: ignore[arg-type]
    assert go_accepts(_client(urls), None) is False  # no early start: sent in line


# -- the start released before the data path's first work ---------------------------------


def test_release_returns_once_the_helper_took_the_start_it_carries() -> None:
    import threading
    import time

    from weightwire.trainer.early import EarlyStart

    started = threading.Event()
    early = EarlyStart(None, started.set, 5.0)  # the start pauses (START_PAUSES)
    time.sleep(0.05)  # the helper is waiting for the data path
    assert not early.start_sent
    early.release(bound_s=10.0)  # the round's bound is 2 ms; a loaded test box may be slower
    assert early.start_sent  # the helper is in its start call, ahead of the caller's work
    early.wait()
    assert started.is_set()


def test_release_does_not_wait_for_a_start_behind_its_own_pause() -> None:
    import threading
    import time

    from weightwire.trainer.early import EarlyStart

    pause_out = threading.Event()  # the pause answers only once the test lets it

    def held_pause() -> bool:
        return pause_out.wait(30)

    early = EarlyStart(held_pause, lambda: None, 5.0)
    t0 = time.perf_counter()
    try:
        early.release(bound_s=10.0)
        returned_s = time.perf_counter() - t0
        assert not early.start_sent  # still behind the pause: release did not wait for it
    finally:
        pause_out.set()
    # waiting for the start would have taken the whole 10 s bound (the pause is held)
    assert returned_s < 5.0, returned_s
    early.wait()
    assert early.paused and early.start_returned


# -- the round in one request (UPDATE_STARTS) ----------------------------------------------


class Hearing:
    """A data path that hears its workers (``RoundSender.hears_workers``): ``begin`` on a
    helper (as ``weightwire_ipc``'s starter runs it), every worker's word heard (``hear``)
    or not, then its own failure (``fail``) or none."""

    hears_workers = True

    def __init__(
        self, hear: bool, fail: BaseException | None = None, *, order: list[str] | None = None
    ) -> None:
        """``order``: the data path sends the request itself first (``Outgoing.request``, as
        ``weightwire_ipc``'s does), appending "sent" to it once that returned."""
        self.hear, self.fail, self.settled, self.order = hear, fail, 0, order

    def send(self, out: Outgoing) -> Sent:
        import threading

        assert out.one_request and out.heard is not None and out.begin is not None
        if self.order is not None:
            assert out.request is not None
            out.request()
            self.order.append("sent")
        errors: list[BaseException] = []

        def run() -> None:
            try:
                out.begin()  # type: ignore[misc]
            except BaseException as exc:
                errors.append(exc)

        helper = threading.Thread(target=run)
        helper.start()
        if self.hear:
            out.heard()
        helper.join(5.0)
        assert not helper.is_alive(), "begin did not return"
        if self.fail is not None:
            raise self.fail
        if errors:
            raise errors[0]
        return Sent(0, 0)

    def settle(self) -> None:
        self.settled += 1


def _one_request(pipe: Hearing, post: Any, order: list[str] | None = None) -> tuple[Transfer, Comm]:
    comm = Comm()
    log = [] if order is None else order
    step = Transfer(
        comm,
        pipe,  # type: ignore[arg-type]
        post_update=lambda: (log.append("request"), post())[1],
        control=lambda: log.append("control"),
        clock=PhaseClock(),
        http_s=5.0,
        finishes=True,
        one_request=True,
    )
    return step, comm


def test_a_round_in_one_request_runs_control_then_sends_it_and_returns_its_answer() -> None:
    order: list[str] = []
    step, comm = _one_request(Hearing(hear=True), lambda: None, order)
    assert step.run([], []) == Sent(0, 0)
    assert order == ["control", "request"]  # control sends nothing: it records the request
    assert step.broken is None and comm.aborted == 0


def test_the_data_path_sends_the_one_request_from_its_thread_and_begin_sends_none() -> None:
    order: list[str] = []
    calls: list[int] = []
    step, comm = _one_request(Hearing(hear=True, order=order), lambda: calls.append(1), order)
    assert step.run([], []) == Sent(0, 0)
    # the request went out (on its helper) before the data path's call returned: the data
    # path's next work never contends with it; begin, later, sent nothing more
    assert order == ["control", "request", "sent"] and calls == [1]
    assert step.broken is None and comm.aborted == 0


def test_the_data_path_waits_for_the_request_only_a_bounded_time() -> None:
    """A request whose bytes do not leave (a transport that never says, a stuck connect)
    holds the data path up for the bound only: the round goes on, and answers with it."""
    import threading
    import time

    order: list[str] = []
    stuck = threading.Event()
    early: list[bool] = []

    def unstick() -> None:  # the request answers only once the data path went on
        deadline = time.monotonic() + 3.0
        while "sent" not in order and time.monotonic() < deadline:
            time.sleep(0.001)
        early.append("sent" in order)
        stuck.set()

    step, _ = _one_request(Hearing(hear=True, order=order), lambda: stuck.wait(5.0), order)
    threading.Thread(target=unstick, daemon=True).start()
    assert step.run([], []) == Sent(0, 0)
    assert early == [True]  # went on before the stuck request answered
    assert order == ["control", "request", "sent"]


def test_a_request_refused_before_the_workers_spoke_keeps_the_engine() -> None:
    from weightwire.shared.errors import WeightSyncError

    refused = WeightSyncError("start_weight_update", 409, "start_weight_update refused", "s")

    def post() -> None:
        raise refused

    pipe = Hearing(hear=False)
    step, comm = _one_request(pipe, post)
    with pytest.raises(WeightSyncError) as got:
        step.run([], [])
    assert got.value is refused  # the server's own word, named for the start
    assert step.broken is None and comm.aborted == 0 and pipe.settled == 1


@pytest.mark.parametrize(
    ("route", "status", "pause", "kept"),
    [
        # its start's own pause failed (a wait that did not drain), undone: nothing started
        ("start_weight_update", 504, "undone", True),
        # past the start: a worker's update refused a delta round's base, the session ended
        ("update_weights", 409, None, False),
        # a worker's start failed: the server failed the round and ended the session
        ("start_weight_update", 502, None, False),
    ],
    ids=["pause_failed", "update_refused", "worker_start_failed"],
)
def test_a_request_failed_by_its_server_before_the_workers_spoke(
    route: str, status: int, pause: str | None, kept: bool
) -> None:
    """The engine is kept only where the server says its start opened no round (was: kept
    whatever failed, so after an update refused past the start the engine's next round, a
    delta round's dense resend too, went to a session its server had ended)."""
    from weightwire.shared.errors import WeightSyncError

    failed = WeightSyncError(route, status, f"{route} failed", "s", pause=pause)

    def post() -> None:
        raise failed

    pipe = Hearing(hear=False)
    step, comm = _one_request(pipe, post)
    with pytest.raises(WeightSyncError) as got:
        step.run([], [])
    assert got.value is failed and pipe.settled == 1
    if kept:
        assert step.broken is None and comm.aborted == 0
    else:
        assert step.broken is failed and comm.aborted >= 1


def test_a_request_failing_after_the_workers_spoke_breaks_the_engine() -> None:
    import threading

    from weightwire.shared.errors import WeightSyncError

    failed = WeightSyncError("update_weights", 500, "update_weights failed: replica 0", "s")
    heard = threading.Event()

    def post() -> None:
        heard.wait(5.0)  # the data path wrote: the workers are in the round
        raise failed

    pipe = Hearing(hear=True)
    original = pipe.send

    def send(out: Outgoing) -> Sent:
        sent = original(out)
        heard.set()
        return sent

    pipe.send = send  # type: ignore[method-assign]
    step, comm = _one_request(pipe, post)
    with pytest.raises(WeightSyncError) as got:
        step.run([], [])
    assert got.value is failed and step.broken is failed
    assert comm.aborted >= 1 and pipe.settled == 0


def test_the_trainers_own_failure_with_the_request_out_closes_the_link() -> None:
    """Its source failed before any worker spoke, the request still out: the servers may
    open a round that gets no byte, so the link is aborted (the workers see it close) and
    the engine needs a new init."""
    import threading

    answer = threading.Event()
    pipe = Hearing(hear=False, fail=RuntimeError("the source broke"))
    step, comm = _one_request(pipe, lambda: answer.wait(5.0))

    def answered_late() -> None:
        answer.set()

    try:
        # begin waits for the workers' word or the answer: let the answer come late
        threading.Timer(0.2, answered_late).start()
        with pytest.raises(RuntimeError, match="the source broke") as got:
            step.run([], [])
    finally:
        answer.set()
    assert step.broken is got.value and comm.aborted >= 1


class _Offers:
    """The reference server's client, one URL: its start pauses first and rides on the update
    (``routes.START_PAUSES``, ``routes.UPDATE_STARTS``)."""

    base_urls = ["http://a:1"]

    def __init__(self) -> None:
        self.started: list[str] = []

    def starts_with_pause(self) -> bool:
        return True

    def updates_with_start(self) -> bool:
        return True

    def pause_and_start(self, mode: str) -> None:
        self.started.append(mode)


class _Finish:
    def __init__(self) -> None:
        self.start_in: list[str] = []

    def start_in_update(self, mode: str) -> None:
        self.start_in.append(mode)


@pytest.mark.parametrize(
    ("shapes", "one"),
    [
        ([(0,), (0, 4)], False),  # every tensor empty: no byte, so no worker's word is heard
        ([], False),  # no tensor at all
        ([(0,), (2, 4)], True),
    ],
    ids=["empty_tensors", "no_tensors", "one_byte_or_more"],
)
def test_a_round_with_no_byte_to_write_keeps_its_start_as_a_call_of_its_own(
    shapes: list[tuple[int, ...]], one: bool
) -> None:
    """The data path hears its workers' word at its first chunk with bytes; a round of one
    request with none would wait for the request, which waits for the trainer
    (``test_ipc_write_through``: ``..._never_hears_its_workers_...``). Such a round keeps its
    start (with its pause) as a call of its own, its finish still on the update."""
    from weightwire.shared.meta import ParamMeta
    from weightwire.trainer.broadcast_plan import BroadcastPlan, Turn
    from weightwire.trainer.caps import ClientCaps
    from weightwire.trainer.round import _Servers, send_early

    client = _Offers()
    metas = tuple(ParamMeta(f"t{i}", "float32", shape) for i, shape in enumerate(shapes))
    session = types.SimpleNamespace(
        client=client,
        caps=ClientCaps.of(client),
        sender=Hearing(hear=True),
        verifier=None,
        slicing=None,
        info=types.SimpleNamespace(timeouts=types.SimpleNamespace(http_s=5.0)),
    )
    turns = (Turn(0, 0, metas),) if metas else ()
    r = types.SimpleNamespace(
        early_pause=True,
        draft=False,
        plan=BroadcastPlan((0,), turns),
        wire=None,
        sender=session.sender,
    )
    pause = types.SimpleNamespace(mode="abort", guard=False)
    finish, servers = _Finish(), _Servers()
    early = send_early(session, r, pause, finish, servers)  # type: ignore[arg-type]
    assert servers.one_request is one
    assert finish.start_in == (["abort"] if one else [])
    assert (early is None) is one
    if early is not None:  # two calls: the start, with its pause, goes ahead of the update
        early.release(bound_s=10.0)
        early.wait()
        assert client.started == ["abort"]
