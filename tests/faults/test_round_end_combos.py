"""How a round ends on the real reference server (``weightwire serve``), each a property of the
round checked in combination with the features it meets: a ``weightwire_ipc`` write-through
round whose previous round's copies fail to settle (the data path on the fake CUDA runtime of
``tests/backends/test_ipc_write_through.py``, its start going to the real server); what the
trainer says of the servers' pause after a round applied in place whose start (which carried
the pause, ``START_PAUSES``) the server refused; a round whose start meets a generation step
in progress (the worker's start waits for that step, not for the request)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import (
    AUTH,
    HOLD_ARGS,
    Probe,
    TensorSource,
    assert_weights,
    engine_for,
    observe,
    quiet_shutdown,
)
from tests.faults.servers import Server, serving
from tests.server._server_sender import released, running_generation
from weightwire.shared.errors import WeightSyncError
from weightwire.trainer import EngineBroken


def _paused(probe: Probe) -> bool:
    return bool(probe.http.get("/is_paused").json()["is_paused"])


def test_a_refused_start_that_carried_the_pause_logs_the_pause_the_server_left(
    shared_server: Server, probe: Probe, source: TensorSource, caplog: pytest.LogCaptureFixture
) -> None:
    """A round applied in place whose start, carrying its pause, the server refused (asleep):
    the refusal says the start paused nothing (its error body's ``pause`` field), and the
    trainer says generation is not paused by the round (it is not, once awake), never that
    the servers stay paused; with a pause held before the round, both say it stays (it
    does)."""
    engine = engine_for(shared_server.url, source, stage_budget_bytes=0)
    try:
        want = source.perturb(31)
        engine.send_weights("before")
        assert probe.http.post("/sleep", params={"level": 1}).status_code == 200
        source.perturb(32)
        with (
            caplog.at_level(logging.WARNING, logger="weightwire"),
            pytest.raises(WeightSyncError, match="the server is asleep") as refused,
        ):
            engine.send_weights("refused")
        observe(refused=refused.value.message)
        assert refused.value.route == "start_weight_update"
        assert "this start paused nothing" in refused.value.message  # for a person
        assert refused.value.pause == "none"  # for the trainer: the error body's field
        assert "not paused by this round" in caplog.text and "stay paused" not in caplog.text
        assert probe.http.post("/wake_up").status_code == 200
        assert not _paused(probe)
        caplog.clear()
        assert probe.http.post("/pause", params={"mode": "keep"}).status_code == 200
        assert probe.http.post("/sleep", params={"level": 1}).status_code == 200
        with (
            caplog.at_level(logging.WARNING, logger="weightwire"),
            pytest.raises(WeightSyncError, match="the pause held before it stays") as held,
        ):
            engine.send_weights("refused-held")
        assert held.value.pause == "held"
        assert "the servers stay paused" in caplog.text
        assert "says a pause held before it stays" in caplog.text
        assert probe.http.post("/wake_up").status_code == 200
        assert _paused(probe)  # the operator's pause stays
        assert probe.http.post("/resume").status_code == 200
        assert_weights(probe, want, "before")  # nothing of the refused rounds served
        want = source.perturb(33)
        engine.send_weights("after")  # the engine stays usable: no round was opened
        assert_weights(probe, want, "after")
        assert not _paused(probe)
    finally:
        probe.http.post("/wake_up")
        probe.http.post("/resume")
        quiet_shutdown(engine)


def _served_by(model_dir: Path, tensors: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """``body``'s first choice as the reference server's generator answers it over a model
    holding ``tensors`` (loaded here, apart from the server)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from weightwire.tools.server.completions import parse_completion_request
    from weightwire.tools.server.generate import Generator

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, tensor in tensors.items():
            if name in params:
                params[name].copy_(tensor)
    cfg = model.config
    generator = Generator(
        model,
        AutoTokenizer.from_pretrained(model_dir),
        device=torch.device("cpu"),
        model_name=model_dir.name,
        max_model_len=cfg.max_position_embeddings,
    )
    req = parse_completion_request(
        body, vocab_size=cfg.vocab_size, max_model_len=cfg.max_position_embeddings
    )
    return generator.complete(req.to_worker(), lambda: False)["choices"][0]


@pytest.fixture(scope="module")
def held_server(fault_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose decode steps wait (``HOLD_ARGS``): its generation is still running
    when the round starts, on any machine."""
    with serving(fault_model, tmp_path_factory.mktemp("round-end-held"), *HOLD_ARGS) as s:
        yield s


@pytest.mark.slow  # ~8 s: a server of its own, and the model loaded again to check the answer
def test_a_round_in_place_meets_a_generation_step_in_progress_and_serves_the_new_weights(
    held_server: Server, source: TensorSource, fault_model: Path
) -> None:
    """A long generation in flight when a round applied in place starts with ``pause=abort``:
    the worker's start waits for the step in progress only (the request stops at its next
    step, aborted, long before it would have ended), the round commits, and a generation
    after it is the new weights' (the same generator over a model loaded with them)."""
    probe = Probe(held_server.url)
    engine = engine_for(held_server.url, source, stage_budget_bytes=0)
    running = None
    try:
        engine.send_weights("warm")
        running = running_generation(held_server.url, AUTH)
        want = source.perturb(34)
        engine.send_weights("mid-generation")
        thread, generation = running
        thread.join(60)  # not released: the round's start must have stopped it
        assert generation and generation[0].status_code == 200, generation
        running = None
        reasons = {c["finish_reason"] for c in generation[0].json()["choices"]}
        assert reasons == {"abort"}, reasons  # stopped at its next step
        assert generation[0].json()["usage"]["completion_tokens"] < 240
        assert_weights(probe, want, "mid-generation")
        assert not probe.http.get("/is_paused").json()["is_paused"]
        body = {"prompt": "The trainer sends", "max_tokens": 4, "temperature": 0, "logprobs": 1}
        served = probe.http.post("/v1/completions", json=body).json()["choices"][0]
        expected = _served_by(fault_model, source.tensors, body)
        assert served["text"] == expected["text"]
        assert served["logprobs"]["token_logprobs"] == pytest.approx(
            expected["logprobs"]["token_logprobs"], abs=1e-4
        )
    finally:
        if running is not None:
            released(held_server.url, *running, AUTH)
        quiet_shutdown(engine)
        probe.close()


def test_a_write_through_round_whose_last_copies_fail_to_settle_opens_no_round(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """A round applied in place through ``weightwire_ipc`` write-through (one server, its start
    carrying the pause: the start goes as soon as the first chunk was made), while the
    previous round's copies, never waited for, fail on the device when settled: the round
    fails naming that, before any call (the server neither paused nor in a round, the
    previous weights served), the engine is broken (its device is), and a new init
    at once commits the next round."""
    from tests.backends.test_ipc_write_through import _fused, _send, _setup

    metas, table = _fused()
    _, _, worker, pipe = _setup(table, metas)
    worker.start()
    assert _send(pipe, metas, [64, 32, 16], worker) == (112, 1)  # its copies left unsettled
    pipe._comm.cp.cuda.runtime.eventQuery = lambda e: 600  # not done: settled in full

    def device_error() -> None:
        raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")

    pipe.settle = device_error
    engine = engine_for(shared_server.url, source, stage_budget_bytes=0)
    fresh = None
    try:
        want = source.perturb(35)
        engine.send_weights("before")
        failed = probe.session()["rounds_failed"]
        session = engine.session
        tcp = session.sender, session.link
        session.sender, session.link = pipe, pipe._comm  # the round's data path: write-through
        calls = engine.client.http_calls
        source.perturb(36)
        try:
            with pytest.raises(RuntimeError, match="illegal memory access") as got:
                engine.send_weights("never")
        finally:
            session.sender, session.link = tcp
        observe(trainer=str(got.value), notes=" ".join(got.value.__notes__))
        assert "this round sent nothing (no start)" in "".join(got.value.__notes__)
        assert engine.client.http_calls == calls  # no pause, no start, no update
        info = probe.session()
        assert info["state"] != "round_active" and info["rounds_failed"] == failed, info
        assert not _paused(probe)
        assert_weights(probe, want, "before")  # nothing half-new served
        with pytest.raises(EngineBroken):
            engine.send_weights("refused")
        quiet_shutdown(engine)
        fresh = engine_for(shared_server.url, source, stage_budget_bytes=0)  # at once
        want = source.perturb(37)
        fresh.send_weights("after")
        assert_weights(probe, want, "after")
    finally:
        quiet_shutdown(engine)
        if fresh is not None:
            quiet_shutdown(fresh)
        worker.join(5)
