"""Add a model family in ~30 lines: OLMo-2 with the rule language, registered as a preset.

OLMo-2 differs from Llama in its norms (no ``input_layernorm``; ``post_feedforward_layernorm``;
q/k norms over the whole projection), so no built-in preset fits. The family is one
function from layout options to a ``Naming``: one ``Rule`` per HF tensor kind, pattern
on the JAX leaf path, target the HF name, transforms between (``Transpose`` for Flax
kernels, ``Stacked`` for scanned layers). ``register_family`` makes it a preset, with
option checking, for ``preset("olmo2", scan_layers=True)``.

    python examples/add_a_family.py            # checks it against a tiny HF OLMo-2 checkpoint

Every mistake a rule set can make is found from shapes when the source is built: a leaf
no rule claims, a rule that matches nothing, two leaves on one HF name, a transform that
does not fit. The check below is the one to run for a new family: load a real checkpoint
into your layout with ``pytree_from_hf`` (it fails naming any tensor the rules miss or
invent) and send it back bit for bit.
"""

from __future__ import annotations

import tempfile

import numpy as np

from weightwire import (
    Naming,
    PytreeSource,
    Rule,
    Stacked,
    Transpose,
    drop,
    preset,
    pytree_from_hf,
    read_safetensors,
    register_family,
)


# ---------------------------------------------------------------- the family: 30 lines
def olmo2(*, scan_layers: bool, tie_word_embeddings: bool) -> Naming:
    stack = (Stacked(),) if scan_layers else ()
    src = (
        "model/layers" if scan_layers else "model/layers{_sep:[_/]}{layer:\\d+}"
    )  # Linen or NNX/list
    dst = "model.layers.{layer}"
    t = Transpose()
    rules = [Rule("model/embed_tokens/embedding", "model.embed_tokens.weight")]
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        rules.append(Rule(f"{src}/self_attn/{p}/kernel", f"{dst}.self_attn.{p}.weight", *stack, t))
    for p in ("q_norm", "k_norm"):
        rules.append(Rule(f"{src}/self_attn/{p}/scale", f"{dst}.self_attn.{p}.weight", *stack))
    for p in ("gate_proj", "up_proj", "down_proj"):
        rules.append(Rule(f"{src}/mlp/{p}/kernel", f"{dst}.mlp.{p}.weight", *stack, t))
    for p in ("post_attention_layernorm", "post_feedforward_layernorm"):
        rules.append(Rule(f"{src}/{p}/scale", f"{dst}.{p}.weight", *stack))
    rules.append(Rule("model/norm/scale", "model.norm.weight"))
    if not tie_word_embeddings:
        rules.append(Rule("lm_head/kernel", "lm_head.weight", t))
    rules.append(drop("**rotary_emb**"))
    return Naming(rules, strip=("params",))


register_family("olmo2", olmo2, {"scan_layers": False, "tie_word_embeddings": False})
# -------------------------------------------------------------------------------------


def olmo2_layout(hf: dict, *, scan_layers: bool) -> dict:
    """The Flax layout the rules describe (what ``jax.eval_shape(model.init)`` gives)."""
    import jax
    import jax.numpy as jnp

    d, n, v, f = (
        hf["hidden_size"],
        hf["num_hidden_layers"],
        hf["vocab_size"],
        hf["intermediate_size"],
    )
    q = hf["num_attention_heads"] * (hf.get("head_dim") or d // hf["num_attention_heads"])
    kv = q // hf["num_attention_heads"] * hf["num_key_value_heads"]
    lead = (n,) if scan_layers else ()

    def s(*shape: int) -> dict:
        return jax.ShapeDtypeStruct((*lead, *shape), jnp.float32)

    layer = {
        "self_attn": {
            "q_proj": {"kernel": s(d, q)},
            "k_proj": {"kernel": s(d, kv)},
            "v_proj": {"kernel": s(d, kv)},
            "o_proj": {"kernel": s(q, d)},
            "q_norm": {"scale": s(q)},
            "k_norm": {"scale": s(kv)},
        },
        "mlp": {
            "gate_proj": {"kernel": s(d, f)},
            "up_proj": {"kernel": s(d, f)},
            "down_proj": {"kernel": s(f, d)},
        },
        "post_attention_layernorm": {"scale": s(d)},
        "post_feedforward_layernorm": {"scale": s(d)},
    }
    model = {
        "embed_tokens": {"embedding": jax.ShapeDtypeStruct((v, d), jnp.float32)},
        "norm": {"scale": jax.ShapeDtypeStruct((d,), jnp.float32)},
    }
    model.update({"layers": layer} if scan_layers else {f"layers_{i}": layer for i in range(n)})
    return {
        "params": {"model": model, "lm_head": {"kernel": jax.ShapeDtypeStruct((d, v), jnp.float32)}}
    }


def main() -> int:
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "olmo2",
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=1,
    )
    with tempfile.TemporaryDirectory() as d:
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
        tensors = read_safetensors(d)
    for scan in (False, True):
        naming = preset("olmo2", scan_layers=scan)
        params = pytree_from_hf(naming, olmo2_layout(cfg.to_dict(), scan_layers=scan), tensors)
        sent = {n: np.asarray(a) for n, a in PytreeSource(params, naming)}
        bad = sorted(
            n for n in tensors if n not in sent or sent[n].tobytes() != tensors[n].tobytes()
        )
        if bad or len(sent) != len(tensors):
            raise SystemExit(f"olmo2 mapping wrong for {bad[:4]}")
        print(f"olmo2 (scan_layers={scan}): {len(sent)} HF tensors round-trip bit for bit")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
