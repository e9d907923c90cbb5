"""Tiny random Hugging Face checkpoints of each preset family (transformers, offline), and
the abstract JAX pytree each preset's documented layout expects for them.

``tiny_checkpoint(family, dir)`` writes what ``save_pretrained`` writes (the on-disk
names vLLM loads: per-expert MoE tensors, Phi-3's fused projections), with every
parameter perturbed so that no two norms or biases are equal by construction (a mapping
that swaps them must show). torch/transformers are imported lazily: the module can be
imported on a torch-free host, only the checkpoint builder needs them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

TINY = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 4}

# preset family -> (HF model_type, config overrides)
HF_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "phi3": ("phi3", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3_text", {}),
    "qwen3_moe": ("qwen3_moe", {**_MOE, "num_experts": 4}),
    "qwen2_moe": ("qwen2_moe", {**_MOE, "num_experts": 4, "shared_expert_intermediate_size": 24}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


def tiny_checkpoint(family: str, out: Path, seed: int = 0, **overrides: Any) -> dict[str, Any]:
    """Write a random tiny checkpoint of ``family`` to ``out``; return its config dict."""
    import torch
    import transformers

    model_type, extra = HF_FAMILIES[family]
    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return json.loads((Path(out) / "config.json").read_text())


def n_experts(hf: dict[str, Any]) -> int:
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def jax_template(family: str, hf: dict[str, Any], *, scan_layers: bool = False, fused_qkv: bool = False,
                 fused_gate_up: bool = False, dtype: Any = jnp.float32) -> dict[str, Any]:
    """Shapes of the preset's JAX layout (``{"params": ...}``) for HF config ``hf``:
    ``[in, out]`` kernels, stacked ``[experts, in, out]`` expert kernels, optional
    scanned ``layers`` subtree (layer axis first)."""
    d, v, n = hf["hidden_size"], hf["vocab_size"], hf["num_hidden_layers"]
    h, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    hd, f = hf.get("head_dim") or d // h, hf["intermediate_size"]
    lead = (n,) if scan_layers else ()

    def s(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((*lead, *shape), dtype)

    def k(i: int, o: int) -> dict[str, Any]:
        return {"kernel": s(i, o)}

    attn: dict[str, Any] = ({"qkv_proj": k(d, (h + 2 * kv) * hd)} if fused_qkv else
                            {"q_proj": k(d, h * hd), "k_proj": k(d, kv * hd), "v_proj": k(d, kv * hd)})
    attn["o_proj"] = k(h * hd, d)
    if family in ("qwen2_moe",):
        for p in ("q_proj", "k_proj", "v_proj"):
            attn[p]["bias"] = s(attn[p]["kernel"].shape[-1])
    if family in ("gemma3", "qwen3_moe"):
        attn["q_norm"], attn["k_norm"] = {"scale": s(hd)}, {"scale": s(hd)}
    layer: dict[str, Any] = {"self_attn": attn, "input_layernorm": {"scale": s(d)},
                             "post_attention_layernorm": {"scale": s(d)}}
    if family.startswith("gemma"):
        layer["pre_feedforward_layernorm"] = {"scale": s(d)}
        layer["post_feedforward_layernorm"] = {"scale": s(d)}
    e = n_experts(hf)
    if e:
        m = hf["moe_intermediate_size"] if family != "mixtral" else f
        names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        experts = ({"gate_up_proj": {"kernel": s(e, d, 2 * m)}} if fused_gate_up else
                   {names[0]: {"kernel": s(e, d, m)}, names[1]: {"kernel": s(e, d, m)}})
        experts[names[2]] = {"kernel": s(e, m, d)}
        block: dict[str, Any] = {"gate": k(d, e), "experts": experts}
        if family == "qwen2_moe":
            sf = hf["shared_expert_intermediate_size"]
            block["shared_expert"] = {"gate_proj": k(d, sf), "up_proj": k(d, sf), "down_proj": k(sf, d)}
            block["shared_expert_gate"] = k(d, 1)
        layer["block_sparse_moe" if family == "mixtral" else "mlp"] = block
    else:
        mlp = {"gate_up_proj": k(d, 2 * f)} if fused_gate_up else {"gate_proj": k(d, f), "up_proj": k(d, f)}
        layer["mlp"] = {**mlp, "down_proj": k(f, d)}
    model: dict[str, Any] = {"embed_tokens": {"embedding": jax.ShapeDtypeStruct((v, d), dtype)},
                             "norm": {"scale": jax.ShapeDtypeStruct((d,), dtype)}}
    if scan_layers:
        model["layers"] = layer
    else:
        model.update({f"layers_{i}": layer for i in range(n)})
    tree: dict[str, Any] = {"model": model}
    if not hf.get("tie_word_embeddings", False):
        tree["lm_head"] = {"kernel": jax.ShapeDtypeStruct((d, v), dtype)}
    return {"params": tree}
