"""Send a MaxText-style scanned MoE tree: layer axis 1, experts leading.

MaxText stores every decoder layer in one stacked tensor per parameter with the layer
axis at position 1 (``param_scan_axis=1``), and a MoE block's expert kernels as
``wi_0 / wi_1 / wo [experts, layers, in, out]`` with the router
``gate/kernel [embed, layers, experts]``. Two ``Stacked`` parts on one rule name both
axes (``field="expert"`` fills ``{expert}`` in the target); the layer axis stays
``{layer}``. One rule per tensor kind then gives Mixtral's per-expert HF names:
``model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight``.

    python examples/maxtext_moe_scanned.py [--server URL]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _send import parser, report_and_send

from weightwire import MergeAxes, Naming, PytreeSource, Rule, Stacked, Transpose

L, HF, MOE = "decoder/layers", "model.layers.{layer}", "model.layers.{layer}.block_sparse_moe"
SCAN, EXPERT, T = Stacked(axis=1), Stacked(axis=0, field="expert"), Transpose()

MAXTEXT_MIXTRAL = Naming(
    [
        Rule("token_embedder/embedding", "model.embed_tokens.weight"),
        Rule(f"{L}/pre_self_attention_layer_norm/scale", f"{HF}.input_layernorm.weight", SCAN),
        Rule(
            f"{L}/self_attention/query/kernel",
            f"{HF}.self_attn.q_proj.weight",
            SCAN,
            MergeAxes(1, 2),
            T,
        ),
        Rule(
            f"{L}/self_attention/key/kernel",
            f"{HF}.self_attn.k_proj.weight",
            SCAN,
            MergeAxes(1, 2),
            T,
        ),
        Rule(
            f"{L}/self_attention/value/kernel",
            f"{HF}.self_attn.v_proj.weight",
            SCAN,
            MergeAxes(1, 2),
            T,
        ),
        Rule(
            f"{L}/self_attention/out/kernel",
            f"{HF}.self_attn.o_proj.weight",
            SCAN,
            MergeAxes(0, 1),
            T,
        ),
        Rule(
            f"{L}/post_self_attention_layer_norm/scale",
            f"{HF}.post_attention_layernorm.weight",
            SCAN,
        ),
        Rule(f"{L}/MoeBlock_0/gate/kernel", f"{MOE}.gate.weight", SCAN, T),
        Rule(f"{L}/MoeBlock_0/wi_0", f"{MOE}.experts.{{expert}}.w1.weight", EXPERT, SCAN, T),
        Rule(f"{L}/MoeBlock_0/wi_1", f"{MOE}.experts.{{expert}}.w3.weight", EXPERT, SCAN, T),
        Rule(f"{L}/MoeBlock_0/wo", f"{MOE}.experts.{{expert}}.w2.weight", EXPERT, SCAN, T),
        Rule("decoder/decoder_norm/scale", "model.norm.weight"),
        Rule("decoder/logits_dense/kernel", "lm_head.weight", T),
    ],
    strip=("params",),
)


def maxtext_tree(
    key: jax.Array,
    *,
    embed: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv: int = 2,
    head_dim: int = 16,
    mlp: int = 32,
    experts: int = 8,
    vocab: int = 256,
) -> dict:
    shapes = {
        "token_embedder": {"embedding": (vocab, embed)},
        "decoder": {
            "layers": {
                "pre_self_attention_layer_norm": {"scale": (embed, layers)},
                "self_attention": {
                    "query": {"kernel": (embed, layers, heads, head_dim)},
                    "key": {"kernel": (embed, layers, kv, head_dim)},
                    "value": {"kernel": (embed, layers, kv, head_dim)},
                    "out": {"kernel": (heads, layers, head_dim, embed)},
                },
                "post_self_attention_layer_norm": {"scale": (embed, layers)},
                "MoeBlock_0": {
                    "gate": {"kernel": (embed, layers, experts)},
                    "wi_0": (experts, layers, embed, mlp),
                    "wi_1": (experts, layers, embed, mlp),
                    "wo": (experts, layers, mlp, embed),
                },
            },
            "decoder_norm": {"scale": (embed,)},
            "logits_dense": {"kernel": (embed, vocab)},
        },
    }
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    return {
        "params": jax.tree_util.tree_unflatten(
            treedef,
            [
                0.02 * jax.random.normal(k, s, jnp.float32)
                for k, s in zip(keys, leaves, strict=True)
            ],
        )
    }


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    params = maxtext_tree(jax.random.key(0))
    source = PytreeSource(params, MAXTEXT_MIXTRAL)
    report_and_send(source, args, "maxtext moe")
    wo = params["params"]["decoder"]["layers"]["MoeBlock_0"]["wo"]
    sent = np.asarray(dict(source)["model.layers.1.block_sparse_moe.experts.5.w2.weight"])
    assert np.array_equal(sent, np.asarray(wo[5, 1]).T)
    print(
        f"ok: wo {list(wo.shape)} [experts, layers, mlp, embed] -> expert 5 of layer 1 as HF w2 "
        f"{list(sent.shape)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
