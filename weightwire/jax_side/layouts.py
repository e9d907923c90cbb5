"""The abstract pytree of each preset's documented JAX layout, from an HF ``config.json``.

``preset_layout(family, hf_config, scan_layers=...)`` returns ``jax.ShapeDtypeStruct``
leaves shaped as ``preset(family, ...)`` expects them: Flax ``[in, out]`` kernels named
after the HF modules, stacked ``[experts, in, out]`` expert kernels, an optional scanned
``layers`` subtree (layer axis first). Use it as the template of
``checkpoint.pytree_from_hf`` to load a checkpoint into that layout when no Flax model
of the family is at hand (``jax.eval_shape`` of your own model's init is the usual
template otherwise), and to size metadata without allocating anything.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from weightwire.jax_side.naming import Naming
from weightwire.jax_side.preset_layers import MOE_STYLES
from weightwire.jax_side.presets import DECODER_FAMILIES, family_options, preset
from weightwire.shared.errors import ConfigError

# What sets the families apart is read from the presets' table (``presets.family_options``),
# so a layout cannot disagree with the preset that maps it.
LAYOUT_FAMILIES = DECODER_FAMILIES


def n_experts(hf: dict[str, Any]) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def preset_layout(
    family: str,
    hf: dict[str, Any],
    *,
    scan_layers: bool = False,
    fused_qkv: bool = False,
    fused_gate_up: bool = False,
    dtype: Any = jnp.float32,
) -> dict[str, Any]:
    """``{"params": ...}`` of ShapeDtypeStructs in the layout ``preset_for_hf(family, hf,
    **layout)`` maps; the layout switches are the preset options of the same names."""
    if family not in LAYOUT_FAMILIES:
        raise ConfigError(f"no layout for family {family!r}; known: {', '.join(LAYOUT_FAMILIES)}")
    opts = family_options(family)
    d, v, n = hf["hidden_size"], hf["vocab_size"], hf["num_hidden_layers"]
    h, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    hd, f = hf.get("head_dim") or d // h, hf["intermediate_size"]
    lead = (n,) if scan_layers else ()

    def s(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((*lead, *shape), dtype)

    def k(i: int, o: int) -> dict[str, Any]:
        return {"kernel": s(i, o)}

    attn: dict[str, Any] = (
        {"qkv_proj": k(d, (h + 2 * kv) * hd)}
        if fused_qkv
        else {"q_proj": k(d, h * hd), "k_proj": k(d, kv * hd), "v_proj": k(d, kv * hd)}
    )
    attn["o_proj"] = k(h * hd, d)
    if opts["qkv_bias"]:
        for p in ("q_proj", "k_proj", "v_proj"):
            attn[p]["bias"] = s(attn[p]["kernel"].shape[-1])
    if opts["qk_norm"]:
        attn["q_norm"], attn["k_norm"] = {"scale": s(hd)}, {"scale": s(hd)}
    layer: dict[str, Any] = {
        "self_attn": attn,
        "input_layernorm": {"scale": s(d)},
        "post_attention_layernorm": {"scale": s(d)},
    }
    if opts["sandwich_norms"]:
        layer["pre_feedforward_layernorm"] = {"scale": s(d)}
        layer["post_feedforward_layernorm"] = {"scale": s(d)}
    e = n_experts(hf)
    if e:
        block_name, router, experts_name, names = MOE_STYLES[opts["moe"]]
        m = (
            f if opts["moe"] == "mixtral" else hf["moe_intermediate_size"]
        )  # Mixtral's are intermediate_size wide
        experts = (
            {"gate_up_proj": {"kernel": s(e, d, 2 * m)}}
            if fused_gate_up
            else {names[0]: {"kernel": s(e, d, m)}, names[1]: {"kernel": s(e, d, m)}}
        )
        experts[names[2]] = {"kernel": s(e, m, d)}
        block: dict[str, Any] = {router: k(d, e), experts_name: experts}
        if opts["shared_expert"]:
            sf = hf["shared_expert_intermediate_size"]
            block["shared_expert"] = {
                "gate_proj": k(d, sf),
                "up_proj": k(d, sf),
                "down_proj": k(sf, d),
            }
            block["shared_expert_gate"] = k(d, 1)
        layer[block_name] = block
    else:
        mlp = (
            {"gate_up_proj": k(d, 2 * f)}
            if fused_gate_up
            else {"gate_proj": k(d, f), "up_proj": k(d, f)}
        )
        layer["mlp"] = {**mlp, "down_proj": k(f, d)}
    model: dict[str, Any] = {
        "embed_tokens": {"embedding": jax.ShapeDtypeStruct((v, d), dtype)},
        "norm": {"scale": jax.ShapeDtypeStruct((d,), dtype)},
    }
    if scan_layers:
        model["layers"] = layer
    else:
        model.update({f"layers_{i}": layer for i in range(n)})
    tree: dict[str, Any] = {"model": model}
    if not hf.get("tie_word_embeddings", False):
        tree["lm_head"] = {"kernel": jax.ShapeDtypeStruct((d, v), dtype)}
    return {"params": tree}


def preset_for_hf(family: str, hf: dict[str, Any], **layout: Any) -> Naming:
    """``preset(family, ...)`` with the options an HF config fixes (tied head, the sizes
    fused layouts need) filled in from ``hf``; ``layout``: the JAX-side switches
    (``scan_layers``, ``fused_qkv``, ``fused_gate_up``, ...)."""
    # HF's default when config.json omits tie_word_embeddings is the family's own.
    tied = hf.get("tie_word_embeddings", family_options(family)["tie_word_embeddings"])
    o: dict[str, Any] = {"tie_word_embeddings": bool(tied), **layout}
    heads = hf["num_attention_heads"]
    if not family_options(family)[
        "hf_fused"
    ]:  # Phi-3's HF tensors are fused already: nothing to cut
        if layout.get("fused_qkv"):
            o.setdefault("num_attention_heads", heads)
            o.setdefault("num_key_value_heads", hf.get("num_key_value_heads") or heads)
            o.setdefault("head_dim", hf.get("head_dim") or hf["hidden_size"] // heads)
        if layout.get("fused_gate_up"):
            o.setdefault("intermediate_size", hf["intermediate_size"])
            if n_experts(hf):
                o.setdefault(
                    "moe_intermediate_size",
                    hf.get("moe_intermediate_size") or hf["intermediate_size"],
                )
    return preset(family, **o)
