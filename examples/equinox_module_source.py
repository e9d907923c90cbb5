"""Send an Equinox module's weights (``leaf_style="torch"``).

Equinox layers follow torch's conventions: ``eqx.nn.Linear.weight`` is ``[out, in]`` and
norms and embeddings hold ``weight``, so a model whose attribute names mirror HF's maps
with ``preset(family, leaf_style="torch")``: the same rules without the Flax transposes.
``PytreeSource`` sends only the module's arrays (activation functions, dropout rates and
other fields are skipped). Equinox models are immutable, each optimizer step returns a
new one, so the source takes a getter.

    pip install equinox
    python examples/equinox_module_source.py [--server URL]
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
from _send import parser, report_and_send

from weightwire import PytreeSource, preset

D, F, V, H, KV, HD, LAYERS = 64, 128, 256, 4, 2, 16, 2


def linear(i: int, o: int, key: jax.Array) -> eqx.nn.Linear:
    return eqx.nn.Linear(i, o, use_bias=False, key=key)


class Attention(eqx.Module):
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        k = jax.random.split(key, 4)
        self.q_proj, self.k_proj = linear(D, H * HD, k[0]), linear(D, KV * HD, k[1])
        self.v_proj, self.o_proj = linear(D, KV * HD, k[2]), linear(H * HD, D, k[3])


class MLP(eqx.Module):
    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        k = jax.random.split(key, 3)
        self.gate_proj, self.up_proj, self.down_proj = (
            linear(D, F, k[0]),
            linear(D, F, k[1]),
            linear(F, D, k[2]),
        )


class Layer(eqx.Module):
    self_attn: Attention
    mlp: MLP
    input_layernorm: eqx.nn.RMSNorm
    post_attention_layernorm: eqx.nn.RMSNorm

    def __init__(self, key: jax.Array) -> None:
        k = jax.random.split(key)
        self.self_attn, self.mlp = Attention(k[0]), MLP(k[1])
        self.input_layernorm = eqx.nn.RMSNorm(D, use_bias=False)
        self.post_attention_layernorm = eqx.nn.RMSNorm(D, use_bias=False)


class Model(eqx.Module):
    embed_tokens: eqx.nn.Embedding
    layers: list
    norm: eqx.nn.RMSNorm

    def __init__(self, key: jax.Array) -> None:
        k = jax.random.split(key, 1 + LAYERS)
        self.embed_tokens = eqx.nn.Embedding(V, D, key=k[0])
        self.layers = [Layer(x) for x in k[1:]]
        self.norm = eqx.nn.RMSNorm(D, use_bias=False)


class LlamaForCausalLM(eqx.Module):
    model: Model
    lm_head: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        k = jax.random.split(key)
        self.model, self.lm_head = Model(k[0]), linear(D, V, k[1])


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    state = {"model": LlamaForCausalLM(jax.random.key(0))}
    source = PytreeSource(lambda: state["model"], preset("llama", leaf_style="torch"))
    report_and_send(source, args, "equinox module")
    # An optimizer step returns a new model; the getter hands the source the new one.
    state["model"] = eqx.tree_at(
        lambda m: m.model.norm.weight, state["model"], replace_fn=lambda w: w * 2
    )
    norm = np.asarray(dict(source)["model.norm.weight"])
    assert np.array_equal(norm, np.full((D,), 2.0, np.float32))
    q = np.asarray(dict(source)["model.layers.0.self_attn.q_proj.weight"])
    assert np.array_equal(
        q, np.asarray(state["model"].model.layers[0].self_attn.q_proj.weight)
    )  # no transpose
    print("ok: torch-style weights sent as they are; the getter's latest model is what goes out")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
