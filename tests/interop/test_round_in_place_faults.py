"""Fault cases of a round applied in place (``stage_budget_bytes=0``) against a real vLLM
(the tiny Llama), with the round guard (``weightwire.vllm_guard``) installed.

A round that fails midway leaves the model incomplete: the guard refuses every request that
runs the model, with the reason, until a complete round lands; an operator's release works
only while the workers' weights are whole. The rest of the fault cases, and the states (a) and
(b) every case ends in, are ``test_round_faults.py``'s; this module shares its vLLM (the
launcher keeps one per model) and, like it, ends with the checkpoint restored.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.interop.helpers import assert_same_greedy
from tests.interop.models import jax_params, load_into_hf, perturbed
from tests.interop.round_harness import Served, dying_trainer, serve_tiny_llama, trainer_info
from weightwire.control.client import HTTPWeightSyncClient
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.source import PytreeSource

pytestmark = [pytest.mark.interop, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def served(launcher, model_dirs, tmp_path_factory) -> Iterator[Served]:
    yield from serve_tiny_llama(launcher, model_dirs, tmp_path_factory)


def _log_count(log: Path, text: str) -> int:
    return log.read_text(errors="replace").count(text)


INCOMPLETE = "the model holds an incomplete weight round"


@pytest.mark.parametrize("failure", ["trainer_killed", "worker_timeout"])
def test_round_in_place_fails_midway_refuses_until_a_complete_round(
    served: Served, launcher, failure: str
) -> None:
    """``stage_budget_bytes=0``: the worker applies the round in place. The trainer holds the
    round guard (``weightwire.vllm_guard``) and pauses generation with ``abort``; mid-update it
    is SIGKILLed (``trainer_killed``) or stalls past the worker's 3 s receive bound
    (``worker_timeout``: the worker fails the round itself). The worker reports the model
    incomplete; completions are answered at once with 503 and the reason (never by the
    half-updated model, never left hanging); an operator's release is refused (409) with the
    worker's reason. A fresh trainer's round (in place too) lands, releases, resumes, and
    greedy equals Hugging Face."""
    url = served.server.url
    log = launcher.current.log
    seen, whole = _log_count(log, INCOMPLETE), _log_count(log, "the model is whole again")
    extra = ["3"] if failure == "worker_timeout" else []
    with dying_trainer(url, served.server.model_dir, "mid_update", "8", "0", *extra) as child:
        deadline = time.monotonic() + 60
        if failure == "worker_timeout":  # the trainer lives on, stalled: the worker gives up
            while _log_count(log, INCOMPLETE) == seen:
                assert time.monotonic() < deadline, "the worker never gave up on the stalled round"
                time.sleep(0.5)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    while _log_count(log, INCOMPLETE) == seen:
        assert time.monotonic() < deadline, "the worker never reported the incomplete round"
        time.sleep(0.5)
    guard = httpx.get(f"{url}/weightwire/round_guard", timeout=30).json()
    assert guard["held"] and guard["hold"]["round"] == "dying-mid_update", guard
    # Bounded: a request queued behind the pause would time out here and fail the test.
    refused = httpx.post(
        f"{url}/v1/completions",
        timeout=30,
        json={"prompt": [[5, 17, 42]], "max_tokens": 2, "temperature": 0.0},
    )
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["reason"] == "weight_round_incomplete", error
    expected = "the served weights are incomplete: weight round 'dying-mid_update'"
    assert expected in error["message"], error
    assert "has not committed" in error["message"], error
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=30,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert chat.status_code == 503 and "weights are incomplete" in chat.text, chat.text
    # The operator's way out is refused while the workers' weights are not whole.
    release = httpx.post(f"{url}/weightwire/round_guard/release", timeout=60)
    assert release.status_code == 409, release.text
    assert INCOMPLETE in release.json()["error"]["message"], release.text
    assert httpx.get(f"{url}/weightwire/round_guard", timeout=30).json()["held"]
    # A fresh trainer's complete round, in place too: hold, pause, commit, resume, release.
    served.seed += 1
    params, naming = jax_params(served.server.model_dir)
    params = perturbed(params, served.seed)
    source = PytreeSource(lambda: params, naming)
    with HTTPWeightSyncClient(url, timeout=120) as client:
        engine = JAXTrainerEngine.trainer_init(
            trainer_info(stage_budget_bytes=0), client=client, source=source
        )
        try:
            engine.send_weights(weight_version="in-place-fresh")
        finally:
            engine.shutdown()
    assert not httpx.get(f"{url}/is_paused", timeout=30).json()["is_paused"]
    assert not httpx.get(f"{url}/weightwire/round_guard", timeout=30).json()["held"]
    assert _log_count(log, "the model is whole again") == whole + 1
    load_into_hf(served.hf, source)
    served.version = "in-place-fresh"
    assert served.server.weight_version() == "in-place-fresh"
    assert_same_greedy(served.server, served.hf, "after a complete round in place")


def test_round_guard_operator_release_when_whole(served: Served) -> None:
    """A hold left by a trainer that died before its first write: the workers are whole, so
    the operator's release lifts it and resumes generation; the model answers as before."""
    url = served.server.url
    held = httpx.post(
        f"{url}/weightwire/round_guard/hold", json={"round": "never-written"}, timeout=30
    )
    assert held.status_code == 200 and held.json()["held"], held.text
    httpx.post(f"{url}/pause", params={"mode": "abort"}, timeout=30).raise_for_status()
    refused = httpx.post(
        f"{url}/v1/completions",
        timeout=30,
        json={"prompt": [[5, 17, 42]], "max_tokens": 2, "temperature": 0.0},
    )
    assert refused.status_code == 503, refused.text
    assert "'never-written'" in refused.json()["error"]["message"], refused.text
    # Closed by default: a model route outside vLLM's --api-key prefixes is refused too; what
    # is known not to run the model passes.
    invocations = httpx.post(f"{url}/invocations", json={"prompt": [5, 17]}, timeout=30)
    assert invocations.status_code == 503, invocations.text
    for path in ("/health", "/v1/models", "/is_paused"):
        assert httpx.get(f"{url}{path}", timeout=30).status_code == 200, path
    release = httpx.post(f"{url}/weightwire/round_guard/release", timeout=60)
    assert release.status_code == 200, release.text
    assert release.json()["released"] and release.json()["resumed"], release.text
    assert not httpx.get(f"{url}/is_paused", timeout=30).json()["is_paused"]
    assert_same_greedy(served.server, served.hf, "after the operator's release")
