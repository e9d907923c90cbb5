"""Tiny random Hugging Face checkpoints of each preset family (transformers, offline), and
``n_experts`` of a config (the layouts themselves: ``weightwire.jax_side.layouts``).

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

TINY = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 4,
}

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
