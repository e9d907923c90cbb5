"""A per-expert MoE round is driven one layer group at a time: the JAX engine asks the
``PytreeSource`` for ``iter_groups()``, and each group is one jitted call however many
experts it holds; the bytes on the wire are the checkpoint's, in metadata order."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import weightwire.jax_side.source as source_mod
from tests.trainer.fakes import FAKE, FakeComm, FakeServer
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.layouts import preset_for_hf, preset_layout
from weightwire.jax_side.source import PytreeSource
from weightwire.shared.framing import pack_host, plan
from weightwire.shared.timeouts import Timeouts
from weightwire.trainer import TrainerInitInfo

HF = {
    "vocab_size": 32,
    "hidden_size": 8,
    "intermediate_size": 16,
    "moe_intermediate_size": 4,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "num_experts": 16,
    "tie_word_embeddings": False,
}


def materialized(layout):
    leaves, treedef = jax.tree_util.tree_flatten(layout)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    return jax.tree_util.tree_unflatten(
        treedef, [jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, leaves, strict=True)]
    )


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    seen: list[int] = []
    real = source_mod._compiled

    def counting(signature):
        fn = real(signature)

        def wrapped(*args):
            seen.append(len(signature))
            return fn(*args)

        return wrapped

    monkeypatch.setattr(source_mod, "_compiled", counting)
    return seen


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_engine_round_dispatches_per_layer_group_not_per_expert(
    calls: list[int], scan: bool
) -> None:
    params = materialized(preset_layout("qwen3_moe", HF, scan_layers=scan))
    source = PytreeSource(params, preset_for_hf("qwen3_moe", HF, scan_layers=scan))
    metas = source.metadata()
    per_layer = 8 + 1 + 3 * HF["num_experts"]  # attention + norms, router, 3 projections per expert
    assert len(metas) == 1 + 3 * per_layer + 2
    FAKE.comm = FakeComm()
    info = TrainerInitInfo(
        backend="fake_host", timeouts=Timeouts(http_s=10, connect_s=5, warmup_s=5, transfer_s=5)
    )
    engine = JAXTrainerEngine.trainer_init(info, client=FakeServer().client(), source=source)
    try:
        calls.clear()
        m = engine.send_weights()
    finally:
        engine.shutdown()
    assert m.tensors == len(metas)
    # embedding and final norm are leaves handed out as is (no call), and so are an
    # unrolled layer's 4 norms; each layer is one call building all the rest of it
    # (scanned: its norms are slices too); lm_head's transpose is the last
    assert calls == [per_layer - (0 if scan else 4)] * 3 + [1]
    # the wire carries exactly each tensor's bytes, in metadata order
    arrays = [np.asarray(a) for _, a in source]
    chunks = plan(metas, packed=True, buffer_size_bytes=info.packed_buffer_size_bytes)
    assert FAKE.comm.broadcasts == [
        pack_host(arrays[c.start : c.stop], c).tobytes() for c in chunks
    ]
    expert = params["params"]["model"]["layers" if scan else "layers_2"]["mlp"]["experts"][
        "down_proj"
    ]["kernel"]
    name = "model.layers.2.mlp.experts.15.down_proj.weight"
    assert (
        arrays[[m.name for m in metas].index(name)].tobytes()
        == np.asarray((expert[2] if scan else expert)[15]).T.tobytes()
    )
