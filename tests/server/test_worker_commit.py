"""A worker's finish never commits, and its sleep never sleeps, once the API gave up on it.

Drives the worker process's real request loop (``worker_proc.Loop``: lanes, out-of-band
abort, replies) with the model lock held as a long generation would hold it. The
engine is a recorder: what is asserted is whether the loop let a commit through.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import torch

from weightwire.tools.server.replica import WorkerSpec
from weightwire.tools.server.replica_worker import Worker
from weightwire.tools.server.sleep import WorkerSleep
from weightwire.tools.server.worker_proc import Loop
from weightwire.torch_side.worker.weight_state import WeightState

pytestmark = pytest.mark.timeout(60)


class RecordingEngine:
    def __init__(self) -> None:
        self.commits = 0
        self.shutdowns = 0

    def finish_weight_update(self) -> None:
        self.commits += 1

    def shutdown(self) -> None:
        self.shutdowns += 1

    def abort_transfer(self) -> None:
        pass


class Host:
    last_committed = frozenset({"weight"})

    def abort_round(self) -> None:
        pass


class Replies:
    """The loop's output stream: one JSON reply per line, waitable by id."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.by_id: dict[int, dict[str, Any]] = {}

    def write(self, data: bytes) -> None:
        with self.cv:
            for line in data.decode().splitlines():
                msg = json.loads(line)
                self.by_id[msg["id"]] = msg
            self.cv.notify_all()

    def flush(self) -> None:
        pass

    def wait(self, msg_id: int, timeout: float = 30) -> dict[str, Any]:
        with self.cv:
            assert self.cv.wait_for(lambda: msg_id in self.by_id, timeout), (
                f"no reply to request {msg_id}"
            )
            return self.by_id[msg_id]


def make_loop() -> tuple[Loop, Worker, RecordingEngine, Replies]:
    worker = Worker.__new__(Worker)  # no model: only the lanes and the lock are under test
    worker.spec = WorkerSpec(
        model_dir="", backend="weightwire_tcp", device="cpu", replicas=1, threads=1
    )
    worker.model_lock = threading.Lock()
    worker.engine = engine = RecordingEngine()
    worker.host = Host()
    worker.weights = WeightState()
    worker.cancel_epoch = 0
    worker.abort_epoch = 0
    worker.model = torch.nn.Linear(4, 2)
    worker.sleep = WorkerSleep(
        worker.model,
        torch.device("cpu"),
        worker.model_lock,
        lambda: [n for n, _ in worker.model.named_parameters()],
    )
    out = Replies()
    return Loop(worker, out), worker, engine, out  # type: ignore[arg-type]


def settle(loop: Loop) -> None:
    """Wait until every request queued on the control lane has run."""
    loop.control.submit(lambda: None).result(timeout=30)


def test_finish_that_cannot_take_the_model_in_time_commits_nothing_ever() -> None:
    loop, worker, engine, out = make_loop()
    worker.model_lock.acquire()  # a long generation is running
    try:
        loop.dispatch({"id": 1, "op": "finish", "args": {"timeout_s": 0.2}})
        reply = out.wait(1)  # answered while the generation still holds the model
    finally:
        worker.model_lock.release()  # ... and then it ends
    settle(loop)
    assert reply["ok"] is False and reply["kind"] == "timeout", reply
    assert "was not committed" in reply["error"]
    assert engine.commits == 0, "the finish committed after it had been reported as timed out"
    assert engine.shutdowns == 1 and worker.engine is None  # the staged round was dropped


def test_abort_cancels_a_finish_waiting_for_the_model() -> None:
    """The API's backstop: after its own timeout it aborts; a finish still waiting for the
    lock must then never commit, even once the lock is free."""
    loop, worker, engine, out = make_loop()
    worker.model_lock.acquire()
    try:
        loop.dispatch({"id": 1, "op": "finish", "args": {}})
        loop.dispatch({"id": 2, "op": "abort", "args": {}})
        reply = out.wait(1)
    finally:
        worker.model_lock.release()
    out.wait(2)
    settle(loop)
    assert reply["ok"] is False and "aborted" in reply["error"], reply
    assert engine.commits == 0, "a finish committed after the round was aborted"


def test_finish_commits_when_the_model_is_free() -> None:
    loop, _, engine, out = make_loop()
    loop.dispatch({"id": 1, "op": "finish", "args": {"timeout_s": 5}})
    assert out.wait(1) == {"id": 1, "ok": True, "result": {"level": 0, "discarded": 0}}
    assert engine.commits == 1


def test_sleep_that_cannot_take_the_model_in_time_never_sleeps() -> None:
    loop, worker, _, out = make_loop()
    worker.model_lock.acquire()  # a long generation is running
    try:
        loop.dispatch({"id": 1, "op": "sleep", "args": {"level": 2, "timeout_s": 0.2}})
        reply = out.wait(1)
    finally:
        worker.model_lock.release()
    settle(loop)
    assert (
        reply["ok"] is False and reply["kind"] == "timeout" and "did not sleep" in reply["error"]
    ), reply
    assert worker.sleep.sleeper.level == 0 and worker.model.weight.shape == (2, 4)


def test_cancel_sleep_cancels_a_sleep_waiting_for_the_model() -> None:
    """The API's backstop: a sleep still waiting for the lock never runs after cancel_sleep."""
    loop, worker, _, out = make_loop()
    worker.model_lock.acquire()
    try:
        loop.dispatch({"id": 1, "op": "sleep", "args": {"level": 2}})
        loop.dispatch({"id": 2, "op": "cancel_sleep", "args": {}})
        reply = out.wait(1)
    finally:
        worker.model_lock.release()
    settle(loop)
    assert reply["ok"] is False and "cancelled" in reply["error"], reply
    assert worker.sleep.sleeper.level == 0 and worker.model.weight.shape == (2, 4)


def test_level_2_weights_must_all_be_sent_again_before_serving() -> None:
    loop, worker, _, out = make_loop()
    worker.weights.adopt(worker.host, "t:1")
    loop.dispatch({"id": 1, "op": "sleep", "args": {"level": 2, "timeout_s": 5}})
    assert out.wait(1)["result"] == {"level": 2, "discarded": 2, "freed_bytes": 0}
    assert worker.weights.token(worker.host) is None  # the delta base went with the weights
    loop.dispatch({"id": 2, "op": "wake", "args": {}})
    assert out.wait(2)["result"] == {"level": 0, "discarded": 2, "awake": True}
    with pytest.raises(Exception, match=r"discarded by /sleep\?level=2 and 2 of them"):
        worker.sleep.check_serving()
    loop.dispatch(
        {"id": 3, "op": "finish", "args": {"timeout_s": 5}}
    )  # the round wrote "weight" only
    assert out.wait(3)["result"] == {"level": 0, "discarded": 1}
    with pytest.raises(Exception, match="'bias'"):
        worker.sleep.check_serving()
