"""The round in one request (``routes.UPDATE_STARTS``: the reference server's
``/update_weights?start=true&pause=..&finish=true``), against the real server (``weightwire
serve``), over a data path that writes nothing before its workers' word from inside the
round (``tests.faults.one_request``: the TCP data path told so, as ``weightwire_ipc`` written
through is): one HTTP call a round in every pause mode; a start refused (asleep, a bad
``weight_version`` or update info) writes, pauses and starts nothing and the engine stays
usable; a server gated as any vLLM release still takes it; a source failing on its first
tensor sends nothing; one failing mid-round, or a
trainer killed mid-round, fails the server's round (nothing half-new served, the engine needs
a new init); a second trainer's init during the request is refused; an overlapped round and
a delta round keep their rules; a start whose ``wait`` pause met a sleep undoes that pause."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.faults.harness import (
    AUTH,
    FAULT_TIMEOUTS,
    GRACE_S,
    Probe,
    TensorSource,
    assert_weights,
    elapsed,
    engine_for,
    hook_at,
    observe,
    quiet_shutdown,
    sha256_of,
)
from tests.faults.one_request import (
    ONE_REQUEST,
    hearing,
    pause_query,
    recorded_engine,
    recording,
)
from tests.faults.servers import Server
from tests.faults.test_finish_in_update_combos import _sparse
from weightwire.shared.errors import ConfigError, RoundError, WeightSyncError
from weightwire.shared.limits import LIMITS
from weightwire.shared.routes import start_left_paused

IN_PLACE = {"stage_budget_bytes": 0}  # a round applied in place: paused as a whole
IN_UPDATE_FINISH = "update_weights?finish=true&reset_caches=true&resume=true"


def _paused(probe: Probe) -> bool:
    return bool(probe.http.get("/is_paused").json()["is_paused"])


def _awake(probe: Probe) -> None:
    """Wake the shared server and lift any pause a failed case left."""
    probe.http.post("/wake_up")
    probe.http.post("/resume")


def _one(mode: str = "abort", reset: str = "true") -> str:
    return ONE_REQUEST.format(pause=pause_query(mode), reset=reset)


@pytest.mark.parametrize(
    ("info", "mode", "reset"),
    [
        ({"pause_mode": "abort"}, "abort", "true"),
        ({"pause_mode": "wait"}, "wait", "true"),
        # keep would queue requests behind a round applied in place: paused with abort
        ({"pause_mode": "keep"}, "abort", "true"),
        ({"reset_prefix_cache": False}, "abort", "false"),
    ],
    ids=["abort", "wait", "keep", "no_reset"],
)
def test_a_round_is_one_request_in_every_pause_mode_and_serves_what_it_sent(
    shared_server: Server,
    probe: Probe,
    source: TensorSource,
    info: dict[str, Any],
    mode: str,
    reset: str,
) -> None:
    client, engine, wire = recorded_engine(shared_server.url, source, **IN_PLACE, **info)
    try:
        for step, version in ((11, "one-a"), (12, "one-b")):
            want = source.perturb(step)
            client.sent.clear()
            metrics = engine.send_weights(version)
            # (the session's first round applied in place asks once for a round guard)
            assert client.sent[-1] == _one(mode, reset) and len(client.sent) in (1, 3)
            assert metrics.http_calls == len(client.sent) and wire.rounds[-1] is True
            assert_weights(probe, want, version)
            assert not _paused(probe)  # the request's commit resumed it
        assert client.sent == [_one(mode, reset)] and metrics.http_calls == 1
        probe.greedy()  # generation runs on what was sent
    finally:
        quiet_shutdown(engine)


@pytest.mark.parametrize("release", ["0.28", "0.33"])
def test_the_round_is_one_request_whatever_vllm_release_the_server_is_gated_as(
    shared_server: Server, probe: Probe, source: TensorSource, release: str
) -> None:
    """The server's version gates (``version_override``) decide the update info's features
    (metadata reuse); whether the round goes in one request is what its init reply named."""
    client, engine, _ = recorded_engine(
        shared_server.url, source, version_override=release, **IN_PLACE
    )
    try:
        engine.send_weights(f"gated-{release}")
        want = source.perturb(24)
        client.sent.clear()
        metrics = engine.send_weights(f"gated-{release}-2")
        assert client.sent == [_one()] and metrics.http_calls == 1
        assert_weights(probe, want, f"gated-{release}-2")
    finally:
        quiet_shutdown(engine)


def test_an_asleep_server_refuses_the_request_before_anything_and_the_engine_stays_usable(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    client, engine, _ = recorded_engine(shared_server.url, source, **IN_PLACE)
    try:
        want = source.perturb(13)
        engine.send_weights("awake")
        failed = probe.session()["rounds_failed"]
        assert probe.http.post("/sleep", params={"level": 1}).status_code == 200
        source.perturb(14)
        client.sent.clear()
        with pytest.raises(WeightSyncError, match="asleep") as got:
            engine.send_weights("asleep")
        assert got.value.route == "start_weight_update" and got.value.status == 409
        assert start_left_paused(got.value.pause) is False  # the field: it paused nothing
        assert client.sent == [_one()]  # the one request, refused: no resume sent after it
        session = probe.session()
        assert session["rounds_failed"] == failed and session["state"] != "round_active"
        assert probe.http.post("/wake_up").status_code == 200
        assert not _paused(probe)  # the refused start paused nothing (a trainer pause stays)
        assert_weights(probe, want, "awake")  # nothing written
        want = source.perturb(15)
        client.sent.clear()
        engine.send_weights("after-sleep")  # the same engine, its link intact
        assert client.sent == [_one()]
        assert_weights(probe, want, "after-sleep")
    finally:
        quiet_shutdown(engine)


def test_a_round_while_asleep_at_level_0_commits_and_the_wake_resumes_generation(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """``/sleep?level=0`` holds generation but keeps the weights: the round's start is taken,
    and its commit lifts the round's pause without an error; generation stays held by the
    sleep until ``/wake_up``, which then serves the new weights (was: the resume was refused,
    the committed round raised ``WeightSyncError`` for ``resume`` saying that ``/wake_up``
    resumes generation, and after the wake the round's pause still refused every request)."""
    client, engine, _ = recorded_engine(shared_server.url, source, **IN_PLACE)
    try:
        engine.send_weights("awake")
        assert probe.http.post("/sleep", params={"level": 0}).status_code == 200
        want = source.perturb(35)
        client.sent.clear()
        engine.send_weights("at-level-0")
        assert client.sent == [_one()]
        assert_weights(probe, want, "at-level-0")
        assert _paused(probe)  # by the sleep
        assert probe.http.post("/wake_up").json()["status"] == "awake"
        assert not _paused(probe)  # the round's pause went with its commit
        probe.greedy()
        want = source.perturb(36)
        engine.send_weights("after-wake")
        assert_weights(probe, want, "after-wake")
    finally:
        _awake(probe)
        quiet_shutdown(engine)


def test_a_partial_round_after_level_2_commits_its_tensors_but_names_no_version(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """``/sleep?level=2`` discarded every tensor; a round of some of them
    (``partial=True``) commits those, yet ``weight_version`` stays unset (and generation
    refused) while any discarded tensor is unsent; the full round that follows names its
    version and serves (was: the partial round's version was named over zeroed tensors,
    which ``/update_weight_version`` refuses to do)."""
    some = sorted(source.tensors)[:-3]
    part = TensorSource({name: source.tensors[name] for name in some})
    client, engine, _ = recorded_engine(shared_server.url, part, partial=True, **IN_PLACE)
    try:
        assert probe.http.post("/sleep", params={"level": 2}).status_code == 200
        assert probe.http.post("/wake_up").json()["status"] == "awake"
        client.sent.clear()
        engine.send_weights("some")
        assert client.sent[-1] == _one()  # (after the first round's ask for a round guard)
        info = probe.http.get("/weight_info").json()
        assert info["weight_version"] is None and info["sleep"]["discarded_tensors"] == 3, info
        served = probe.checksums()[0]
        assert all(served[name] == sha256_of(part.tensors[name]) for name in some)
        refused = probe.http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert refused.status_code == 503 and "discarded by /sleep?level=2" in refused.text
        observe(weight_info=info["weight_version"], generation=refused.json()["error"]["message"])
    finally:
        quiet_shutdown(engine)
    engine = engine_for(shared_server.url, source, **IN_PLACE)
    try:
        want = source.perturb(37)
        engine.send_weights("all")
        assert_weights(probe, want, "all")
        probe.greedy()
    finally:
        quiet_shutdown(engine)


def test_a_bad_version_or_update_info_is_refused_by_the_start_before_its_pause(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """The server checks the request's ``weight_version`` and update info with the start's
    own checks: a refusal names ``start_weight_update``, pauses and starts nothing, and the
    session lives on (the trainer refuses an over-long version before any call)."""
    client, engine, _ = recorded_engine(shared_server.url, source, **IN_PLACE)
    try:
        want = source.perturb(16)
        engine.send_weights("good")
        failed = probe.session()["rounds_failed"]
        too_long = "v" * (LIMITS.max_weight_version_chars + 1)
        client.sent.clear()
        with pytest.raises(ConfigError, match="over the 1024 a server takes"):
            engine.send_weights(too_long)
        assert client.sent == []
        bad = [
            ({"names": ["a"], "dtype_names": ["float32"], "shapes": [[2]]}, too_long, "weight_v"),
            ({"names": ["a"], "dtype_names": ["float99"], "shapes": [[2]]}, "v", "update's"),
        ]
        for update_info, version, needle in bad:
            with pytest.raises(WeightSyncError, match=needle) as got:
                client.start_update_finish(
                    update_info, version, pause="abort", reset_caches=True, resume=True
                )
            assert got.value.route == "start_weight_update" and got.value.status == 422
            assert "start_weight_update refused" in got.value.message
            assert "nothing was paused or started" in got.value.message
            assert not _paused(probe)
            assert probe.session()["rounds_failed"] == failed
        want = source.perturb(17)
        engine.send_weights("still-good")
        assert_weights(probe, want, "still-good")
    finally:
        quiet_shutdown(engine)


def test_a_source_failing_on_its_first_tensor_sends_nothing_and_the_next_is_one_request(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    client, engine, _ = recorded_engine(shared_server.url, source, **IN_PLACE)

    def broken(i: int) -> None:
        if i == 0:
            raise RuntimeError("the source broke on its first tensor")

    try:
        engine.send_weights("first")
        failed = probe.session()["rounds_failed"]
        client.sent.clear()
        source.hook = broken
        source.perturb(18)
        with pytest.raises(RuntimeError, match="broke on its first tensor"):
            engine.send_weights("never")
        assert client.sent == [] and not _paused(probe)
        source.hook = None
        want = source.perturb(19)
        engine.send_weights("next")
        assert client.sent == [_one()]
        assert_weights(probe, want, "next")
        assert probe.session()["rounds_failed"] == failed
    finally:
        source.hook = None
        quiet_shutdown(engine)


def test_a_source_failing_mid_round_fails_the_servers_round_and_breaks_the_engine(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """After the workers' word the trainer wrote: its link is aborted, the workers' update
    fails, the server's round fails (version kept, the model refused until a whole round
    commits); the engine refuses rounds until a new init, whose round commits in one request."""
    client, engine, _ = recorded_engine(shared_server.url, source, **IN_PLACE)

    def fail() -> None:
        raise RuntimeError("the source broke mid-round")

    try:
        engine.send_weights("before")
        failed = probe.session()["rounds_failed"]
        source.perturb(20)
        source.hook = hook_at(3, fail)
        client.sent.clear()
        with pytest.raises(RuntimeError, match="broke mid-round"):
            engine.send_weights("half")
        assert client.sent == [_one()]
        probe.wait_session(
            lambda s: s["rounds_failed"] == failed + 1 and s["busy"] is None, timeout=15
        )
        assert probe.version() == "before"  # nothing half-new named as served
        info = probe.http.get("/weight_info").json()
        assert info["round_incomplete"] or _paused(probe), info  # and nothing half-new served
        source.hook = None
        with pytest.raises(RoundError):
            engine.send_weights("refused")
        with elapsed() as took:
            quiet_shutdown(engine)
        assert took[0] < GRACE_S  # the server's round settled: nothing to wait out
    finally:
        source.hook = None
        quiet_shutdown(engine)
    _, engine, _ = recorded_engine(shared_server.url, source, client=client, **IN_PLACE)
    try:
        want = source.perturb(21)
        client.sent.clear()
        engine.send_weights("whole")
        assert client.sent[-1] == _one()
        assert_weights(probe, want, "whole")
        assert not _paused(probe)
    finally:
        quiet_shutdown(engine)


def test_a_second_trainers_init_during_the_request_is_refused_and_the_round_commits(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    client, engine, _ = recorded_engine(shared_server.url, source, **IN_PLACE)
    refused: list[BaseException] = []

    def intruder() -> None:  # mid-round, inside the one request
        other = TensorSource(dict(source.tensors))
        try:
            engine_for(shared_server.url, other)
        except WeightSyncError as exc:
            refused.append(exc)

    try:
        engine.send_weights("owner")
        want = source.perturb(22)
        source.hook = hook_at(3, intruder)
        client.sent.clear()
        engine.send_weights("kept")
        assert client.sent == [_one()]
        assert_weights(probe, want, "kept")
        (exc,) = refused  # the round's request holds the session: refused, not queued
        assert isinstance(exc, WeightSyncError) and exc.route == "init_weight_transfer_engine"
        assert exc.status == 409 and "(update_weights) is in progress" in exc.message
    finally:
        source.hook = None
        quiet_shutdown(engine)


def test_an_overlapped_round_is_not_one_request(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """``wait=False``: shutdown may stop the round right before its commit, so its finish is
    its own call, and so its start is too."""
    client, engine, wire = recorded_engine(shared_server.url, source, **IN_PLACE)
    try:
        want = source.perturb(23)
        client.sent.clear()
        engine.send_weights("overlapped", wait=False).result(timeout=60)
        assert wire.rounds[-1] is False
        assert "start_weight_update?pause=abort" in client.sent
        assert "update_weights" in client.sent
        assert any(sent.startswith("finish_weight_update") for sent in client.sent)
        assert_weights(probe, want, "overlapped")
    finally:
        quiet_shutdown(engine)


@pytest.mark.slow  # ~4 s: two rounds of the 64 MB model's delta extraction on the CPU
def test_a_delta_round_goes_in_one_request(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    client, engine, _ = recorded_engine(shared_server.url, source, delta="auto", **IN_PLACE)
    try:
        _sparse(source, 31)
        engine.send_weights("base")  # dense: the base
        want = _sparse(source, 32)
        client.sent.clear()
        delta = engine.send_weights("patched")
        assert delta.nbytes < delta.dense_bytes // 100  # patches only
        assert client.sent == [_one()] and delta.http_calls == 1
        assert_weights(probe, want, "patched")
    finally:
        quiet_shutdown(engine)


@pytest.mark.slow  # ~4 s: two rounds of the 64 MB model's delta extraction on the CPU
def test_a_delta_round_with_no_changed_element_goes_in_one_request_and_commits_at_once(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """``send_weights`` twice with no training step between (``delta="auto"``): nothing
    changed, yet the round still carries a patch (its workers check its base), so it has bytes
    to write and its data path hears the workers at its first chunk (``weightwire_ipc``
    written through); it is one request and commits well inside ``http_s``."""
    timeouts = replace(FAULT_TIMEOUTS, http_s=6.0)
    client, engine, wire = recorded_engine(
        shared_server.url, source, delta="auto", timeouts=timeouts, **IN_PLACE
    )
    try:
        want = _sparse(source, 41)
        engine.send_weights("base")  # dense: the base
        client.sent.clear()
        with elapsed() as took:
            same = engine.send_weights("unchanged")
        assert 0 < same.nbytes < 1024  # a patch of no change: bytes all the same
        assert client.sent == [_one()] and same.http_calls == 1 and wire.rounds[-1] is True
        assert took[0] < timeouts.http_s / 2
        assert_weights(probe, want, "unchanged")
    finally:
        quiet_shutdown(engine)


@pytest.mark.slow  # ~5 s: three rounds of the 64 MB model's delta extraction on the CPU
def test_a_delta_round_whose_base_a_sleep_dropped_is_refused_in_its_update_and_resent_dense(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """``/sleep?level=2`` drops the workers' base: the next delta round's one request passes
    the start's checks, opens the round, and its update refuses the base before any worker's
    word (``DeltaBaseMismatch``), which fails the server's round and ends its session. The
    trainer then takes a new session and resends the round dense in the same call (was: the
    engine was kept as after a refused start, so the dense resend went to a session the
    server had ended: ``start_weight_update refused: this trainer's session ... has
    ended``)."""
    client, engine, _ = recorded_engine(
        shared_server.url, source, hears=False, delta="auto", **IN_PLACE
    )
    hearing(engine, shared_server.url, first_s=0.5)  # the workers' word after the update's check
    try:
        _sparse(source, 51)
        engine.send_weights("base")  # dense: the base
        want = _sparse(source, 52)
        client.sent.clear()
        assert engine.send_weights("patched").nbytes < 1024
        assert client.sent == [_one()]
        assert_weights(probe, want, "patched")
        failed = probe.session()["rounds_failed"]
        assert probe.http.post("/sleep", params={"level": 2}).status_code == 200
        assert probe.http.post("/wake_up").status_code == 200
        want = _sparse(source, 53)
        client.sent.clear()
        metrics = engine.send_weights("after-sleep")
        assert client.sent[0] == _one()  # the delta round, refused by its update
        assert "init_weight_transfer_engine" in client.sent[1:]  # a new session for the resend
        assert metrics.nbytes == metrics.dense_bytes  # resent dense
        assert_weights(probe, want, "after-sleep")
        assert probe.session()["rounds_failed"] == failed + 1
        assert not _paused(probe)  # the dense round's commit resumed what the refused one held
        observe(refused=client.sent[0], then=client.sent[1])
    finally:
        quiet_shutdown(engine)


@pytest.mark.slow  # ~5 s: a trainer process of its own
def test_a_trainer_killed_mid_request_settles_the_servers_round(
    shared_server: Server, probe: Probe, fault_model: Path, source: TensorSource
) -> None:
    """SIGKILL mid-round, inside its one request: the workers see the link close, the
    server's round fails (nothing committed, the previous version named), and a new
    trainer's round in one request commits."""
    repo = Path(__file__).resolve().parents[2]
    cfg = {
        "url": shared_server.url,
        "model_dir": str(fault_model),
        "kill_at": 3,
        "stage_budget_bytes": 0,
        "one_request": True,
    }
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
    }
    failed = probe.session()["rounds_failed"]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.faults._trainer_proc", json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=repo,
        env=env,
    )
    assert proc.returncode == -signal.SIGKILL, f"rc={proc.returncode}\n{proc.stderr[-3000:]}"
    assert json.loads(proc.stdout.splitlines()[0])["one_request"] is True  # its first round
    probe.wait_session(lambda s: s["busy"] is None and s["rounds_failed"] == failed + 1, timeout=15)
    assert probe.version() == "t1"
    client, engine, _ = recorded_engine(shared_server.url, source, **IN_PLACE)
    try:
        want = source.perturb(33)
        engine.send_weights("after-kill")
        assert client.sent[-1] == _one()
        assert_weights(probe, want, "after-kill")
    finally:
        quiet_shutdown(engine)


def test_without_the_servers_offer_the_round_keeps_its_two_calls(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """A server that did not name ``update_starts`` (stock vLLM names nothing): the start
    that pauses and the update that finishes, as before."""

    client = recording(shared_server.url)
    client.updates_with_start = lambda: False  # what a server that named none answers
    _, engine, wire = recorded_engine(shared_server.url, source, client=client, **IN_PLACE)
    try:
        want = source.perturb(34)
        client.sent.clear()
        engine.send_weights("two")
        assert client.sent[-2:] == [
            "start_weight_update?pause=abort",
            "update_weights?finish=true&reset_caches=true&resume=true",
        ]
        assert wire.rounds[-1] is False
        assert_weights(probe, want, "two")
    finally:
        quiet_shutdown(engine)


@pytest.mark.parametrize("one", [True, False], ids=["one_request", "separate_calls"])
def test_a_sleep_that_took_the_session_while_the_starts_pause_drained_undoes_that_pause(
    shared_server: Server, probe: Probe, source: TensorSource, one: bool
) -> None:
    """A start with ``pause=wait`` drains a running generation; a ``/sleep?mode=wait`` posted
    meanwhile holds the session while it drains too. The generation ends (aborted): the
    start, first to wake, is refused (the sleep's operation runs) and undoes its pause, the
    sleep sleeps, and after ``/wake_up`` the server serves (was: the refusal, "another weight
    operation (sleep) is in progress", left the start's pause held, saying nothing of it: the
    server refused every request after the wake until someone POSTed ``/resume``); the same
    whether the start rode on the update or went alone, and the engine's next round commits."""
    client = recording(shared_server.url)
    if not one:
        client.updates_with_start = lambda: False  # a server that offers no round in one call
    _, engine, _ = recorded_engine(
        shared_server.url, source, client=client, pause_mode="wait", **IN_PLACE
    )
    failed: list[BaseException] = []
    slept: list[httpx.Response] = []

    def generation() -> None:
        with httpx.Client(base_url=shared_server.url, headers=AUTH, timeout=120) as http:
            http.post(
                "/v1/completions",
                # minutes of decoding: it runs until the abort below, on any machine
                json={"prompt": [[5]] * 64, "n": 64, "max_tokens": 250, "ignore_eos": True},
            )

    def round_() -> None:
        try:
            engine.send_weights("drained")
        except BaseException as exc:
            failed.append(exc)

    def sleep() -> None:
        slept.append(probe.http.post("/sleep", params={"level": 1, "mode": "wait"}))

    def busy() -> int:
        return int(probe.http.get("/health").json()["replicas"][0]["generations_in_flight"])

    threads = [threading.Thread(target=f) for f in (generation, round_, sleep)]
    try:
        want = source.perturb(38)
        engine.send_weights("before")
        assert_weights(probe, want, "before")
        threads[0].start()
        probe.wait_session(lambda _: busy() == 1, timeout=30)
        source.perturb(39)
        threads[1].start()  # its start's pause drains the generation
        probe.wait_session(lambda _: _paused(probe), timeout=30)
        threads[2].start()  # the sleep takes the session, and drains too
        probe.wait_session(lambda s: s["busy"] == "sleep", timeout=30)
        assert probe.http.post("/abort_requests", json={}).status_code == 200
        for thread in threads:
            thread.join(60)
        (exc,) = failed
        assert isinstance(exc, WeightSyncError) and exc.route == "start_weight_update", exc
        assert exc.status == 409 and "start_weight_update refused" in exc.message
        assert "(sleep)" in exc.message and start_left_paused(exc.pause) is False, exc.message
        assert slept[0].status_code == 200, slept[0].text
        assert_weights(probe, want, "before")  # nothing written
        assert probe.http.post("/wake_up").status_code == 200
        assert not _paused(probe)  # the start's pause went with its refusal
        probe.greedy()
        want = source.perturb(40)
        engine.send_weights("after-wake")  # the engine kept: nothing was started
        assert_weights(probe, want, "after-wake")
        observe(start=exc.message)
    finally:
        probe.http.post("/abort_requests", json={})  # a case that failed early: stop it
        for thread in threads:
            if thread.ident is not None:
                thread.join(60)
        _awake(probe)
        quiet_shutdown(engine)


@pytest.mark.parametrize("one", [True, False], ids=["one_request", "separate_calls"])
def test_a_whole_staged_round_after_a_failed_round_in_place_lifts_the_pause_it_left(
    shared_server: Server, probe: Probe, source: TensorSource, one: bool
) -> None:
    """A round applied in place fails mid-round (its source): the server stays paused (its
    model holds part of it), and a new trainer's whole round that stages (the default
    budget: it asks no pause and no resume) commits and lifts that pause: generation serves
    the new weights (was: the pause outlived the whole round, every request refused until an
    operator's ``/resume``, though the failed round's trainer logged that the next complete
    round resumes the servers)."""
    client = recording(shared_server.url)
    if not one:
        client.updates_with_start = lambda: False
    _, engine, _ = recorded_engine(shared_server.url, source, client=client, **IN_PLACE)

    def fail() -> None:
        raise RuntimeError("the source broke mid-round")

    try:
        engine.send_weights("before")
        source.perturb(42)
        source.hook = hook_at(3, fail)
        with pytest.raises(RuntimeError, match="broke mid-round"):
            engine.send_weights("half")
        assert client.sent[-1] == (_one() if one else IN_UPDATE_FINISH)
    finally:
        source.hook = None
        quiet_shutdown(engine)
    probe.wait_session(lambda s: s["busy"] is None and s["state"] != "round_active", timeout=15)
    assert _paused(probe)  # the failed round's trainer left it: its model may hold part of it
    staged = recording(shared_server.url)
    engine = engine_for(shared_server.url, source, client=staged)  # the default budget: staged
    try:
        want = source.perturb(43)
        engine.send_weights("whole")
        assert "start_weight_update" in staged.sent  # no pause asked, no resume
        assert staged.sent[-1] == "update_weights?finish=true&reset_caches=true&resume=false"
        assert_weights(probe, want, "whole")
        assert not _paused(probe) and not probe.http.get("/weight_info").json()["round_incomplete"]
        probe.greedy()
    finally:
        _awake(probe)
        quiet_shutdown(engine)


@pytest.mark.parametrize("one", [True, False], ids=["one_request", "separate_calls"])
def test_a_wait_pause_the_engine_waits_less_for_than_its_client_undoes_itself_in_time(
    shared_server: Server, probe: Probe, source: TensorSource, one: bool
) -> None:
    """``Timeouts.http_s`` (4 s) below the client's request timeout (12 s), ``pause_mode=
    "wait"``, a generation that outlasts both: the start's drain is bounded by the engine's
    wait, not the client's, so the server answers 504 with its pause undone before the
    engine gives up: the round fails with that answer and the engine is kept, in one request
    and in separate calls alike (was: the drain ran to the client's 10.8 s; in one request the
    engine gave up at ``http_s`` with a bare timeout and broke, in separate calls it waited
    past its own bound), and the round after the generation commits."""
    client = recording(shared_server.url)
    if not one:
        client.updates_with_start = lambda: False  # a server that offers no round in one call
    timeouts = replace(FAULT_TIMEOUTS, http_s=4.0)
    _, engine, _ = recorded_engine(
        shared_server.url, source, client=client, pause_mode="wait", timeouts=timeouts, **IN_PLACE
    )

    def generation() -> None:
        with httpx.Client(base_url=shared_server.url, headers=AUTH, timeout=120) as http:
            http.post(
                "/v1/completions",
                # minutes of decoding: it runs until the abort below, on any machine
                json={"prompt": [[5]] * 64, "n": 64, "max_tokens": 250, "ignore_eos": True},
            )

    running = threading.Thread(target=generation)
    try:
        want = source.perturb(41)
        engine.send_weights("before")
        running.start()
        probe.wait_session(
            lambda _: probe.http.get("/health").json()["replicas"][0]["generations_in_flight"] == 1,
            timeout=30,
        )
        source.perturb(42)
        with elapsed() as took, pytest.raises(WeightSyncError) as caught:
            engine.send_weights("drained")
        exc = caught.value
        assert exc.status == 504 and exc.route == "start_weight_update", exc
        assert "the pause this start took was undone" in exc.message, exc.message
        assert took[0] < timeouts.http_s + GRACE_S
        assert not _paused(probe) and probe.session()["state"] == "ready"
        assert probe.http.post("/abort_requests", json={}).status_code == 200
        running.join(60)
        assert_weights(probe, want, "before")  # nothing written (read once the model is free)
        want = source.perturb(43)
        engine.send_weights("after")  # the engine kept: nothing was started
        assert_weights(probe, want, "after")
        observe(start=exc.message, took_s=round(took[0], 2))
    finally:
        probe.http.post("/abort_requests", json={})
        running.join(60)
        _awake(probe)
        quiet_shutdown(engine)
