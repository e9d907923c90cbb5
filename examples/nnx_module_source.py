"""Send a Flax NNX module's weights: a Qwen3-MoE-shaped model with stacked experts.

``PytreeSource(model, preset("qwen3_moe"))`` takes the module itself: it reads the
module's ``nnx.Param`` variables (RNG state and other non-weights are skipped), and since
an NNX optimizer updates the module in place, every round sends the current weights.
Layers in an ``nnx.List`` flatten as ``model/layers/3/...``; each layer's experts are one
``[experts, in, out]`` kernel per projection, sent as one HF tensor per expert.

    python examples/nnx_module_source.py [--server http://127.0.0.1:8000]
"""

from __future__ import annotations

import jax.numpy as jnp
from _send import parser, report_and_send
from flax import nnx

from weightwire import PytreeSource, preset

D, F, V, H, KV, HD, E, LAYERS = 64, 32, 256, 4, 2, 16, 8, 2


class Kernel(nnx.Module):
    """One projection of every expert, ``kernel [experts, in, out]``."""

    def __init__(self, *shape: int, rngs: nnx.Rngs) -> None:
        self.kernel = nnx.Param(0.02 * nnx.initializers.normal()(rngs.params(), shape))


class Experts(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.gate_proj, self.up_proj, self.down_proj = (
            Kernel(E, D, F, rngs=rngs),
            Kernel(E, D, F, rngs=rngs),
            Kernel(E, F, D, rngs=rngs),
        )


class MoE(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.gate = nnx.Linear(D, E, use_bias=False, rngs=rngs)  # the router
        self.experts = Experts(rngs)


class Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.q_proj = nnx.Linear(D, H * HD, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(D, KV * HD, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(D, KV * HD, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(H * HD, D, use_bias=False, rngs=rngs)
        self.q_norm, self.k_norm = nnx.RMSNorm(HD, rngs=rngs), nnx.RMSNorm(HD, rngs=rngs)


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.self_attn, self.mlp = Attention(rngs), MoE(rngs)
        self.input_layernorm, self.post_attention_layernorm = (
            nnx.RMSNorm(D, rngs=rngs),
            nnx.RMSNorm(D, rngs=rngs),
        )
        self.dropout = nnx.Dropout(
            0.1, rngs=rngs
        )  # RNG state in the module: not a weight, not sent


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed_tokens = nnx.Embed(V, D, rngs=rngs)
        self.layers = nnx.List([Layer(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(D, rngs=rngs)


class CausalLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.model, self.lm_head = Model(rngs), nnx.Linear(D, V, use_bias=False, rngs=rngs)


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    model = CausalLM(nnx.Rngs(0))
    source = PytreeSource(model, preset("qwen3_moe"), dtype="bfloat16")
    report_and_send(source, args, "nnx module")
    before = dict(source)["model.layers.1.mlp.experts.7.down_proj.weight"]
    # A training step, in place (what nnx.Optimizer.update does): the next pass sees it.
    kernel = model.model.layers[1].mlp.experts.down_proj.kernel
    kernel[...] = kernel[...] + 1.0
    after = dict(source)["model.layers.1.mlp.experts.7.down_proj.weight"]
    assert jnp.array_equal(after, kernel[...][7].T.astype(jnp.bfloat16))
    assert not jnp.array_equal(after, before)
    print(
        "ok: expert 7 of layer 1 is kernel[7].T, and in-place updates are what the next round sends"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
