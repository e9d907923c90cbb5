"""The round whose finish rides on its update (``routes.UPDATE_FINISHES``: the reference server
commits right after the update held) combined with the round's other features, against the
real server (``weightwire serve``, ``weightwire_tcp``): every pause mode and a round without
the caches reset resume once committed; a delta round's patches commit inside the update and
a refused base is resent dense; a source that yields an extra tensor after the last chunk
commits nothing; an overlapped round keeps its finish apart; ``verify`` reads the servers'
digests after it; a ``weight_version`` the server would refuse is refused before the round's
first call (not by the update that carries the finish, with the bytes on the wire)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.faults.harness import (
    Probe,
    TensorSource,
    assert_weights,
    engine_for,
    observe,
    quiet_shutdown,
)
from tests.faults.one_request import WAIT_S, recorded_engine, recording
from tests.faults.servers import Server
from weightwire.shared.errors import ConfigError, SourceMismatch, WeightSyncError
from weightwire.shared.limits import LIMITS

IN_UPDATE = "update_weights?finish=true"


def _sparse(source: TensorSource, step: int) -> dict[str, str]:
    """One element of every tensor moved (a delta round patches it); the expected checksums."""
    for name, t in source.tensors.items():
        t = t.clone()
        t.view(-1)[0] += 0.5 * step
        source.tensors[name] = t
    return source.expected()


def _paused(probe: Probe) -> bool:
    return bool(probe.http.get("/is_paused").json()["is_paused"])


def test_a_weight_version_over_the_servers_limit_fails_before_any_call(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    client, engine, _ = recorded_engine(
        shared_server.url, source, hears=False, stage_budget_bytes=0
    )
    try:
        failed = probe.session()["rounds_failed"]
        client.sent.clear()
        too_long = "v" * (LIMITS.max_weight_version_chars + 1)
        with pytest.raises(ConfigError, match="over the 1024 a server takes"):
            engine.send_weights(too_long)
        # nothing reached the server: no round failed there, nothing paused
        assert client.sent == [] and probe.session()["rounds_failed"] == failed
        assert not _paused(probe)
        with pytest.raises(ConfigError, match="over the 1024"):
            engine.send_weights(too_long, wait=False)  # an overlapped round: at the call
        want = source.perturb(1)
        engine.send_weights("v" * LIMITS.max_weight_version_chars)  # the limit itself holds
        assert_weights(probe, want, "v" * LIMITS.max_weight_version_chars)
    finally:
        quiet_shutdown(engine)


@pytest.mark.parametrize(
    ("info", "query"),
    [
        ({"pause_mode": "abort"}, "start_weight_update?pause=abort"),
        ({"pause_mode": "wait"}, f"start_weight_update?pause=wait&wait_s={WAIT_S}"),
        # keep would queue requests behind a round applied in place: paused with abort
        ({"pause_mode": "keep"}, "start_weight_update?pause=abort"),
        ({"reset_prefix_cache": False}, "start_weight_update?pause=abort"),
    ],
    ids=["abort", "wait", "keep", "no_reset"],
)
def test_a_round_applied_in_place_commits_in_its_update_and_resumes_in_every_pause_mode(
    shared_server: Server, probe: Probe, source: TensorSource, info: dict[str, Any], query: str
) -> None:
    client, engine, _ = recorded_engine(
        shared_server.url, source, hears=False, stage_budget_bytes=0, **info
    )
    reset = "false" if info.get("reset_prefix_cache") is False else "true"
    try:
        want = source.perturb(2)
        client.sent.clear()
        engine.send_weights("in-place")
        assert client.sent[-2:] == [query, f"{IN_UPDATE}&reset_caches={reset}&resume=true"]
        assert_weights(probe, want, "in-place")
        assert not _paused(probe)  # the update's commit resumed it, no /resume sent
    finally:
        quiet_shutdown(engine)


@pytest.mark.slow  # ~6 s: three rounds of the 64 MB model's delta extraction on the CPU
def test_a_delta_round_commits_its_patches_in_the_update_and_a_refused_base_goes_dense(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    client, engine, _ = recorded_engine(shared_server.url, source, hears=False, delta="auto")
    try:
        _sparse(source, 1)
        engine.send_weights("d1")  # dense: the base
        want = _sparse(source, 2)
        client.sent.clear()
        delta = engine.send_weights("d2")
        assert delta.nbytes < delta.dense_bytes // 100  # patches only
        assert client.sent[-1].startswith(IN_UPDATE)
        assert_weights(probe, want, "d2")
        # /sleep?level=2 drops the workers' weights and their base: the delta round is refused
        # by its update (nothing committed) and sent dense in the same call
        assert probe.http.post("/sleep", params={"level": 2}).status_code == 200
        assert probe.http.post("/wake_up").status_code == 200
        want = _sparse(source, 3)
        client.sent.clear()
        engine.send_weights("d3")
        assert sum(sent.startswith(IN_UPDATE) for sent in client.sent) == 2
        assert_weights(probe, want, "d3")
    finally:
        quiet_shutdown(engine)


def test_an_extra_tensor_after_the_last_chunk_commits_nothing(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """The source's end check fires after its last chunk was built: with the finish in the
    update, the last chunk must not reach the workers before it (it would complete the update
    and so commit a round the trainer fails)."""
    engine = engine_for(shared_server.url, source)
    try:
        want = source.perturb(4)
        engine.send_weights("whole")
        failed = probe.session()["rounds_failed"]
        source.perturb(5)
        source.mutate = lambda pairs: [*pairs, ("extra.weight", torch.zeros(4))]
        with pytest.raises(SourceMismatch, match="first extra is 'extra.weight'"):
            engine.send_weights("extra")
        probe.wait_session(lambda s: s["rounds_failed"] == failed + 1, timeout=10)
        assert_weights(probe, want, "whole")
    finally:
        source.mutate = None
        quiet_shutdown(engine)


def test_an_overlapped_round_keeps_its_finish_apart(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """``wait=False``: shutdown may stop the round right before its commit, so the finish is
    its own call (the update commits nothing)."""
    client, engine, _ = recorded_engine(shared_server.url, source, hears=False)
    try:
        want = source.perturb(6)
        client.sent.clear()
        engine.send_weights("overlapped", wait=False).result(timeout=60)
        assert "update_weights" in client.sent
        assert not any(sent.startswith(IN_UPDATE) for sent in client.sent)
        assert any(sent.startswith("finish_weight_update") for sent in client.sent)
        assert_weights(probe, want, "overlapped")
    finally:
        quiet_shutdown(engine)


def test_verify_reads_the_servers_digests_after_the_commit_in_the_update(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """``verify=True``: the round's check reads /weight_checker once the update that carried
    the finish returned (the committed weights), and passes."""
    client, engine, _ = recorded_engine(
        shared_server.url, source, hears=False, verify=True, stage_budget_bytes=0
    )
    try:
        want = source.perturb(7)
        client.sent.clear()
        metrics = engine.send_weights("verified")
        committed = next(i for i, sent in enumerate(client.sent) if sent.startswith(IN_UPDATE))
        assert client.sent[committed + 1 :] == ["weight_checker"], client.sent
        assert metrics.verify is not None
        assert_weights(probe, want, "verified")
        assert not _paused(probe)
    finally:
        quiet_shutdown(engine)


@pytest.mark.slow  # ~5 s: a trainer process of its own
@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["staged", "in_place"])
def test_a_trainer_killed_after_its_last_byte_commits_the_whole_round(
    shared_server: Server, probe: Probe, fault_model: Path, budget: int
) -> None:
    """SIGKILL once the data path sent the round's last byte, before its update answered:
    every worker holds the whole round and the update carries the finish, so the round
    commits (and, applied in place, resumes), where a separate finish would never have been
    sent (the round lease aborting it). A trainer killed mid-broadcast still commits nothing
    (``test_process_faults``)."""
    repo = Path(__file__).resolve().parents[2]
    cfg = {
        "url": shared_server.url,
        "model_dir": str(fault_model),
        "kill_at": "last_byte",
        "stage_budget_bytes": budget,
    }
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.faults._trainer_proc", json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=repo,
        env=env,
    )
    assert proc.returncode == -signal.SIGKILL, f"rc={proc.returncode}\n{proc.stderr[-3000:]}"
    sent = json.loads(proc.stdout.splitlines()[1])["sent"]
    probe.wait_session(lambda s: s["busy"] is None and s["state"] != "round_active", timeout=10)
    assert_weights(probe, sent, "t2")
    info = probe.http.get("/weight_info").json()
    assert not info["round_incomplete"] and not _paused(probe), info


def test_a_round_whose_source_fails_on_its_first_tensor_sends_nothing_and_the_next_commits(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """The start that pauses goes only once the first chunk was made (``announced``): a
    source failing on its first tensor sent no call (nothing paused, no round opened), the
    engine stays usable, and the next round, back to back, commits in its update."""
    client, engine, _ = recorded_engine(
        shared_server.url, source, hears=False, stage_budget_bytes=0
    )

    def broken(i: int) -> None:
        if i == 0:
            raise RuntimeError("the source broke on its first tensor")

    try:
        engine.send_weights("first")
        failed = probe.session()["rounds_failed"]
        client.sent.clear()
        source.perturb(8)
        source.hook = broken
        with pytest.raises(RuntimeError, match="broke on its first tensor"):
            engine.send_weights("never")
        assert client.sent == [] and not _paused(probe)
        source.hook = None
        want = source.perturb(9)
        engine.send_weights("next")
        assert client.sent[-1].startswith(IN_UPDATE)
        assert_weights(probe, want, "next")
        assert probe.session()["rounds_failed"] == failed and not _paused(probe)
    finally:
        source.hook = None
        quiet_shutdown(engine)


OLDER_ASLEEP = (
    "the server is asleep (/sleep level 0): POST /wake_up to wake it (that resumes "
    "generation); the round is committed"
)


def test_a_resume_an_older_server_refused_in_its_commits_reply_is_its_answer_and_a_committed_round(
    shared_server: Server, probe: Probe, source: TensorSource, caplog: pytest.LogCaptureFixture
) -> None:
    """An older server asleep committed the round its update carried but refused the resume in
    that reply (``resumed: false`` + ``resume_error``, its pause kept; emulated over the real
    server's reply): ``WeightSyncError`` for ``resume`` with the reply's status (200) and the
    server's words (was: status None, "no response"); logged as a committed round whose
    resume was refused, never as one the models may hold part of; the engine goes on."""
    client = recording(shared_server.url)
    request = client._request
    older = [True]

    def as_older(i: int, route: Any, body: Any = None, params: Any = None) -> Any:
        reply = request(i, route, body, params)
        if older[0] and (params or {}).get("resume") == "true" and isinstance(reply, dict):
            assert probe.http.post("/pause?mode=abort").status_code == 200  # kept, as it did
            reply = {**reply, "resumed": False, "resume_error": OLDER_ASLEEP}
        return reply

    client._request = as_older
    _, engine, _ = recorded_engine(
        shared_server.url, source, client=client, hears=False, stage_budget_bytes=0
    )
    try:
        want = source.perturb(7)
        with (
            caplog.at_level(logging.WARNING, logger="weightwire"),
            pytest.raises(WeightSyncError) as got,
        ):
            engine.send_weights("resume-refused")
        observe(error=got.value)
        assert got.value.route == "resume" and got.value.status == 200, got.value
        assert got.value.message == OLDER_ASLEEP and "no response" not in str(got.value)
        assert_weights(probe, want, "resume-refused")  # committed
        assert "may hold part of it" not in caplog.text, caplog.text
        assert "committed on every server (the model is whole)" in caplog.text, caplog.text
        assert "also failed" not in caplog.text  # its refused resume is not asked again
        assert _paused(probe)  # the older server's pause stays until a resume succeeds
        older[0] = False
        want = source.perturb(8)
        engine.send_weights("after-refused-resume")  # the engine goes on; this one resumes
        assert_weights(probe, want, "after-refused-resume")
        assert not _paused(probe)
    finally:
        quiet_shutdown(engine)
        probe.http.post("/resume")


def test_a_resume_the_server_refused_after_a_separate_commit_is_its_answer_and_a_committed_round(
    shared_server: Server, probe: Probe, source: TensorSource, caplog: pytest.LogCaptureFixture
) -> None:
    """A trainer that resumes with its own ``/resume`` (a server whose finish does not, as stock
    vLLM's): the server, put to sleep between the commit and the resume, refuses it (503 naming
    /wake_up): raised with that status and message, logged as a committed round whose resume
    was refused (not as one the models may hold part of)."""
    client = recording(shared_server.url)
    client.finishes_with_resume = lambda: False
    client.updates_with_finish = lambda: False
    resume = client.resume

    def asleep_first() -> None:
        assert probe.http.post("/sleep", params={"level": 0}).status_code == 200
        resume()

    client.resume = asleep_first
    _, engine, _ = recorded_engine(
        shared_server.url, source, client=client, hears=False, stage_budget_bytes=0
    )
    try:
        want = source.perturb(9)
        with (
            caplog.at_level(logging.WARNING, logger="weightwire"),
            pytest.raises(WeightSyncError) as got,
        ):
            engine.send_weights("separate-resume-refused")
        observe(error=got.value)
        assert got.value.route == "resume" and got.value.status == 503, got.value
        assert "the server is asleep (/sleep level 0): POST /wake_up" in got.value.message
        assert_weights(probe, want, "separate-resume-refused")  # committed
        assert "may hold part of it" not in caplog.text, caplog.text
        assert "committed on every server (the model is whole)" in caplog.text, caplog.text
    finally:
        quiet_shutdown(engine)
        probe.http.post("/wake_up")
        probe.http.post("/resume")
    assert not _paused(probe)
