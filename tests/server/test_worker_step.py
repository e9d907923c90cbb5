"""A round's start on the reference server's worker runs between two generation steps, as
vLLM's ``collective_rpc`` does: a worker written through sends its go from inside its start,
and the trainer writes the parameters from that go on, so the forward pass in progress must
have ended first (a ``pause=abort`` cancel stops the request only after it).

Drives the worker process's real request loop (``worker_proc.Loop``) over a real
``replica_worker.Worker`` serving tiny-llama; each forward pass is slowed and recorded. The
engine stands in for a write-through worker's: its start is where the go goes out, and the
test, as the trainer, writes the new weights into the parameters at that go (no lock, as
CUDA IPC writes)."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import pytest
import torch

from tests.server.test_worker_commit import Replies, settle
from weightwire.tools.server.completions import parse_completion_request
from weightwire.tools.server.replica import WorkerSpec
from weightwire.tools.server.replica_worker import Worker
from weightwire.tools.server.worker_proc import Loop

pytestmark = pytest.mark.timeout(120)

STEP_S = 0.03


class Steps:
    """Wraps the model's forward: each pass sleeps ``STEP_S`` and is recorded."""

    def __init__(self, model: Any) -> None:
        self.events: list[str] = []
        self.running = 0
        self.first = threading.Event()
        forward = model.forward

        def slow(*args: Any, **kwargs: Any) -> Any:
            self.running += 1
            self.events.append("step")
            self.first.set()
            try:
                time.sleep(STEP_S)
                return forward(*args, **kwargs)
            finally:
                self.running -= 1

        model.forward = slow


class GoEngine:
    """A write-through worker's engine: its start sends the go (recorded, with whether a
    step was running then); the trainer writes at it."""

    def __init__(self, steps: Steps) -> None:
        self.steps = steps
        self.go = threading.Event()
        self.commits = 0

    def start_weight_update(self) -> None:
        self.steps.events.append(f"go(running={self.steps.running})")
        self.go.set()
        time.sleep(2 * STEP_S)  # the start's own work: no step may begin meanwhile

    def finish_weight_update(self) -> None:
        self.commits += 1

    def shutdown(self) -> None:
        pass

    def abort_transfer(self) -> None:
        pass


@pytest.fixture(scope="module")
def worker() -> Worker:
    from weightwire.tools.server.tiny import tiny_model_dir

    spec = WorkerSpec(
        model_dir=str(tiny_model_dir("tiny-llama")),
        backend="weightwire_tcp",
        device="cpu",
        replicas=1,
        threads=1,
    )
    return Worker(spec)


def _generate(loop: Loop, w: Worker, msg_id: int, max_tokens: int) -> None:
    body = {"prompt": "The trainer sends", "max_tokens": max_tokens, "temperature": 0}
    body |= {"ignore_eos": True, "logprobs": 1}
    req = parse_completion_request(body, vocab_size=w.vocab_size, max_model_len=w.max_model_len)
    loop.dispatch({"id": msg_id, "op": "generate", "args": {"request": req.to_worker()}})


def _new_weights(model: Any) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {
        n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
        for n, p in model.named_parameters()
    }


def test_the_start_waits_for_the_running_step_and_the_round_lands_between_steps(
    worker: Worker,
) -> None:
    """A long greedy generation in flight, then what the server's ``start?pause=abort`` sends
    (a cancel, then the start): the go goes out with no step running, no step runs from the
    go until the writes landed (the request stops at its next step, aborted), and a
    generation after the round is the new weights' (an independent copy's answer)."""
    out = Replies()
    loop = Loop(worker, out)  # type: ignore[arg-type]
    reference = copy.deepcopy(worker.model)
    steps = Steps(worker.model)
    engine = worker.engine = GoEngine(steps)
    new = _new_weights(worker.model)
    _generate(loop, worker, 1, max_tokens=200)  # ~6 s of steps unless cancelled
    assert steps.first.wait(30)
    time.sleep(STEP_S / 2)  # mid-step
    loop.dispatch({"id": 2, "op": "cancel", "args": {}})
    loop.dispatch({"id": 3, "op": "start", "args": {"timeout_s": 10}})

    def trainer() -> None:  # writes at the go, as write-through does
        assert engine.go.wait(30)
        steps.events.append(f"write(running={steps.running})")
        with torch.no_grad():
            for n, p in worker.model.named_parameters():
                p.copy_(new[n])
        steps.events.append("written")

    writer = threading.Thread(target=trainer)
    writer.start()
    assert out.wait(3)["ok"] is True
    aborted = out.wait(1)
    writer.join(30)
    assert aborted["ok"] is True, aborted
    assert aborted["result"]["choices"][0]["finish_reason"] == "abort"
    go = next(i for i, e in enumerate(steps.events) if e.startswith("go"))
    assert steps.events[go] == "go(running=0)", steps.events  # the step in progress ended first
    assert steps.events[go + 1 :] == ["write(running=0)", "written"], steps.events
    loop.dispatch({"id": 4, "op": "finish", "args": {"timeout_s": 5}})
    assert out.wait(4)["ok"] is True and engine.commits == 1
    _generate(loop, worker, 5, max_tokens=4)
    after = out.wait(5)["result"]["choices"][0]
    with torch.no_grad():
        for n, p in reference.named_parameters():
            p.copy_(new[n])
    worker.generator.model, original = reference, worker.generator.model
    try:
        _generate(loop, worker, 6, max_tokens=4)
        expected = out.wait(6)["result"]["choices"][0]
    finally:
        worker.generator.model = original
    assert after["text"] == expected["text"]
    assert after["logprobs"]["token_logprobs"] == expected["logprobs"]["token_logprobs"]
    settle(loop)


def test_a_step_that_outlasts_the_op_timeout_starts_nothing(worker: Worker) -> None:
    out = Replies()
    loop = Loop(worker, out)  # type: ignore[arg-type]
    steps = Steps(torch.nn.Linear(1, 1))
    engine = worker.engine = GoEngine(steps)
    worker.step_lock.acquire()  # a forward pass that does not end in time
    try:
        loop.dispatch({"id": 1, "op": "start", "args": {"timeout_s": 0.2}})
        reply = out.wait(1)
    finally:
        worker.step_lock.release()
    settle(loop)
    assert reply["ok"] is False and reply["kind"] == "timeout", reply
    assert "the round was not started" in reply["error"]
    assert not engine.go.is_set() and worker.engine is None  # torn down, no go sent
