"""Rounds cover the served model: the reference server (a tied Qwen2) tells the trainer at init
which tensors its model takes, and the public API refuses a round that leaves some out, names
one it lacks, or sends one in another dtype or shape, before any byte or round call; with
``TrainerInitInfo(partial=True)`` a round that leaves a layer out on purpose commits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from torch_tensors import Tensors

from weightwire.control import HTTPWeightSyncClient
from weightwire.shared.routes import Route
from weightwire.shared.served import ServedModelMismatch


@pytest.fixture(scope="module")
def qwen2_tied(tiny_cache) -> str:
    from weightwire.tools.server.tiny import tiny_model_dir

    return tiny_model_dir("tiny-qwen2-tied")


@pytest.fixture(scope="module")
def server(server_factory, qwen2_tied: str):
    return server_factory(["--model", qwen2_tied])


@pytest.fixture(scope="module")
def weights(qwen2_tied: str) -> dict[str, Any]:
    """The served checkpoint's parameters (the tied head once, as ``named_parameters``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen2_tied)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class Recording(HTTPWeightSyncClient):
    """Records every route called after the init (a refused round must call none);
    ``tells_served=False``: as under stock vLLM's routes, the init reply says no model."""

    calls: list[str]
    tells_served: bool = True

    def served_model(self) -> Any:
        return super().served_model() if self.tells_served else None

    def _all(
        self,
        route: Route,
        body: Any = None,
        params: dict[str, Any] | None = None,
        bodies: Sequence[Any] | None = None,
    ) -> list[Any]:
        self.calls.append(route.name)
        return super()._all(route, body, params, bodies)


def engine(
    url: str, source: Tensors, *, tells_served: bool = True, **info: Any
) -> tuple[Any, Recording]:
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.trainer import TrainerInitInfo

    client = Recording(url, timeout=60)
    client.calls = []
    client.tells_served = tells_served
    init = TrainerInitInfo(backend="weightwire_tcp", **info)
    return TorchTrainerEngine.trainer_init(init, client=client, source=source), client


def checksums(http: httpx.Client) -> dict[str, str]:
    r = http.post("/weight_checker", json={"action": "checksum"})
    assert r.status_code == 200, r.text
    return r.json()["replica_checksums"][0]


def sha(tensors: dict[str, Any]) -> dict[str, str]:
    from weightwire.torch_side.worker.hf_host import tensor_sha256

    return {n: tensor_sha256(t) for n, t in tensors.items()}


def test_rounds_that_do_not_fit_are_refused_before_any_byte(
    server, http: httpx.Client, weights: dict[str, Any]
) -> None:
    import torch

    new = {n: t + 0.01 for n, t in weights.items()}
    layer1 = [n for n in new if n.startswith("model.layers.1.")]
    biases = [n for n in new if n.endswith("_proj.bias")]
    assert layer1 and biases and "lm_head.weight" not in new
    embed = "model.embed_tokens.weight"
    q = "model.layers.0.self_attn.q_proj.weight"
    cases = {
        "missing layer": (
            {n: t for n, t in new.items() if n not in layer1},
            [f"{len(layer1)} tensor(s) [model.layers.1.", "TrainerInitInfo(partial=True)"],
        ),
        # a Llama-named tree: Qwen2 has q/k/v biases that Llama lacks
        "other family": (
            {n: t for n, t in new.items() if n not in biases},
            [f"{len(biases)} tensor(s) [model.layers.0.self_attn.q_proj.bias", "missing"],
        ),
        "unknown": (
            {**new, "model.layers.99.bogus.weight": new[q]},
            ["1 tensor(s) [model.layers.99.bogus.weight] unknown to the served model"],
        ),
        "dtype": (
            {**new, q: new[q].to(torch.bfloat16)},
            [f"[{q} (bfloat16)]", "cast the source to float32"],
        ),
        "shape": (
            {**new, embed: torch.cat([new[embed], new[embed][:1]])},
            [f"{embed} [{new[embed].shape[0] + 1}, ", "shape differs"],
        ),
    }
    before = checksums(http)
    version = http.get("/weight_info").json()["weight_version"]
    source = Tensors(new)
    eng, client = engine(server.url, source)
    try:
        assert "init_weight_transfer_engine" in client.calls
        for case, (tensors, words) in cases.items():
            client.calls.clear()
            source.tensors = tensors
            with pytest.raises(ServedModelMismatch) as refused:
                eng.send_weights(case)
            for word in words:
                assert word in str(refused.value), (case, str(refused.value))
            assert client.calls == [], case  # no pause, no start: nothing of the round left
        info = http.get("/weight_info").json()
        assert info["weight_version"] == version and not info["round_incomplete"]
        assert checksums(http) == before

        # the same engine then sends whole rounds: with and without the tied alias
        source.tensors = new
        eng.send_weights("whole")
        assert checksums(http) == sha(new)
        again = {n: t + 0.01 for n, t in new.items()}
        source.tensors = {**again, "lm_head.weight": again[embed]}
        eng.send_weights("whole+alias")
        assert checksums(http) == sha(again)
    finally:
        eng.shutdown()

    # rounds that leave a layer out on purpose (frozen): only the rest changes
    partial = {n: t + 0.01 for n, t in again.items() if n not in layer1}
    eng, _ = engine(server.url, Tensors(partial), partial=True)
    try:
        eng.send_weights("partial")
    finally:
        eng.shutdown()
    assert checksums(http) == {**sha(again), **sha(partial)}
    assert http.get("/weight_info").json()["weight_version"] == "partial"


def test_a_server_that_does_not_tell_is_checked_against_served_checkpoint(
    server, http: httpx.Client, weights: dict[str, Any], qwen2_tied: str, tmp_path
) -> None:
    """Stock vLLM's init reply names no model: the trainer reads the served checkpoint's
    names and shapes from ``served_checkpoint`` (dtypes: vLLM casts on load)."""
    from weightwire.shared.errors import ConfigError

    new = {n: t + 0.02 for n, t in weights.items()}
    source = Tensors({n: t for n, t in new.items() if not n.startswith("model.layers.1.")})
    eng, client = engine(server.url, source, tells_served=False, served_checkpoint=qwen2_tied)
    try:
        client.calls.clear()
        with pytest.raises(ServedModelMismatch, match=r"tensor\(s\) \[model.layers.1\."):
            eng.send_weights("no-layer-1")
        assert client.calls == []
        source.tensors = new  # the tied head left out: the checkpoint has none either
        eng.send_weights("checkpoint-checked")
    finally:
        eng.shutdown()
    assert checksums(http) == sha(new)
    with pytest.raises(ConfigError, match="holds no \\*.safetensors files"):
        engine(server.url, source, tells_served=False, served_checkpoint=str(tmp_path))


def test_an_fp8_spec_for_a_model_served_unquantized_is_refused_at_init(
    server, http: httpx.Client, weights: dict[str, Any]
) -> None:
    """The reference server's model holds every linear in float32 and tells no FP8 linears:
    an explicit FP8 spec, or ``auto``, is refused at ``trainer_init``, naming the tensor, and
    the served weights are untouched."""
    from weightwire.shared.quant import Fp8Block
    from weightwire.torch_side.sender.quant import fp8_source

    q = "model.layers.0.self_attn.q_proj.weight"
    before = checksums(http)
    with pytest.raises(ServedModelMismatch) as refused:
        engine(server.url, fp8_source(Tensors(dict(weights)), {q: Fp8Block()}))
    assert (
        f"the FP8 spec quantizes 1 tensor(s) [{q}], which the served model does not take in "
        f"FP8 (it holds {q} (float32))" in str(refused.value)
    )
    with pytest.raises(ServedModelMismatch, match="the served model takes no tensor in FP8"):
        engine(server.url, fp8_source(Tensors(dict(weights)), "auto"))
    assert checksums(http) == before
