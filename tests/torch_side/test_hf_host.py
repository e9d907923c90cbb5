"""HFModelHost: staged, validated, transactional loading into a Hugging Face model."""

from __future__ import annotations

import hashlib

import pytest
import torch

from weightwire.torch_side.worker.hf_host import HFModelHost, close_engine, tensor_sha256

from ._tiny import tiny_llama, to_numpy


@pytest.fixture(scope="module")
def fresh():
    return lambda **kw: HFModelHost(tiny_llama(seed=3, **kw))


def test_stage_then_commit_applies_and_abort_drops(fresh):
    host = fresh()
    name = "model.layers.0.mlp.up_proj.weight"
    before = host.state_checksums()
    new = torch.full_like(host.model.get_parameter(name), 0.5)
    host.begin_round()
    assert host.load_weights([(name, new)]) == {name}
    assert host.state_checksums() == before, "staging must not touch the served weights"
    host.abort_round()
    assert host.state_checksums() == before and not host.in_round
    host.begin_round()
    host.load_weights([(name, new)])
    assert host.commit_round() == 1
    assert torch.equal(host.model.get_parameter(name), new)
    after = host.state_checksums()
    assert [n for n in after if after[n] != before[n]] == [name]


def test_close_engine_shuts_the_engine_down_then_drops_the_stage(fresh):
    """A replica's teardown (the server's worker, the Ray replica): the engine first (it aborts
    an open round), then what the host staged; the served weights stay. No engine: the stage
    alone."""
    host = fresh()
    name = "model.layers.0.mlp.up_proj.weight"
    before = host.state_checksums()
    calls: list[str] = []

    class Engine:
        def shutdown(self) -> None:
            calls.append(f"shutdown (round open: {host.in_round})")

    host.begin_round()
    host.load_weights([(name, torch.full_like(host.model.get_parameter(name), 0.5))])
    close_engine(Engine(), host)
    assert calls == ["shutdown (round open: True)"]
    assert not host.in_round and host.state_checksums() == before
    host.begin_round()
    close_engine(None, host)
    assert not host.in_round


def test_validation_names_the_tensor(fresh):
    host = fresh()
    p = host.model.get_parameter("model.norm.weight")
    with pytest.raises(RuntimeError, match="outside a round"):
        host.load_weights([("model.norm.weight", p.detach().clone())])
    host.begin_round()
    with pytest.raises(RuntimeError, match="while a round is open"):
        host.begin_round()
    with pytest.raises(
        ValueError, match=r"unknown weight name 'model.nrom.weight' \(model has \d+ parameters"
    ):
        host.load_weights([("model.nrom.weight", p)])
    with pytest.raises(
        ValueError, match=r"'model.norm.weight' has shape \[31\], the parameter has \[32\]"
    ):
        host.load_weights([("model.norm.weight", torch.zeros(31))])
    with pytest.raises(
        ValueError,
        match=r"dtype torch.bfloat16, the parameter has torch.float32; refusing a silent cast",
    ):
        host.load_weights([("model.norm.weight", torch.zeros(32, dtype=torch.bfloat16))])
    host.abort_round()
    with pytest.raises(RuntimeError, match="commit_round without begin_round"):
        host.commit_round()


def test_documented_cast_option():
    host = HFModelHost(tiny_llama(seed=3), cast_to_param_dtype=True)
    value = torch.linspace(-1, 1, 32, dtype=torch.bfloat16)
    host.begin_round()
    host.load_weights([("model.norm.weight", value)])
    host.commit_round()
    got = host.model.get_parameter("model.norm.weight")
    assert got.dtype == torch.float32 and torch.equal(got, value.float())


def test_tied_lm_head_alias_lands_in_the_shared_embedding():
    host = HFModelHost(tiny_llama(seed=3, tied=True))
    assert "lm_head.weight" not in host.param_names()
    emb = host.model.model.embed_tokens.weight
    new = torch.randn_like(emb)
    host.begin_round()
    assert host.load_weights([("lm_head.weight", new)]) == {"model.embed_tokens.weight"}
    host.load_weights(
        [("model.embed_tokens.weight", new.clone())]
    )  # same bytes under both names: fine
    with pytest.raises(
        ValueError,
        match=r"'lm_head.weight' received twice in one round with different values \(alias of",
    ):
        host.load_weights([("lm_head.weight", new + 1)])
    host.commit_round()
    assert (
        torch.equal(host.model.lm_head.weight, new)
        and host.model.lm_head.weight is host.model.model.embed_tokens.weight
    )
    logits = host.model(torch.tensor([[1, 2, 3]])).logits
    assert torch.allclose(
        logits[0, -1],
        host.model.model.norm(host.model.model(torch.tensor([[1, 2, 3]])).last_hidden_state)[0, -1]
        @ new.T,
        atol=1e-5,
    )


def test_checksums_are_sha256_of_raw_bytes():
    host = HFModelHost(tiny_llama(seed=3, dtype=torch.bfloat16))
    sums = host.state_checksums()
    assert list(sums) == [n for n, _ in host.model.named_parameters()]
    for name, p in host.model.named_parameters():
        assert sums[name] == hashlib.sha256(to_numpy(p).tobytes()).hexdigest()
    assert (
        tensor_sha256(torch.tensor(1.5))
        == hashlib.sha256(torch.tensor(1.5).numpy().tobytes()).hexdigest()
    )
    with pytest.raises(TypeError, match="torch.nn.Module"):
        HFModelHost(object())  # type: ignore[arg-type]
