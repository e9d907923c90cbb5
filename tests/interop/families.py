"""The preset families of the real-vLLM lane: each one's tiny random HF checkpoint.

``FAMILIES`` names, per preset family, the HF model type and architecture, the config
values that make it differ from Llama, and what its row exercises;
``build_family`` writes the checkpoint (``save_pretrained``'s names, the ones vLLM
loads) with the tiny models' offline tokenizer. The lane's fixtures read the
architectures from here to warm vLLM's model-info cache before the first server.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

# vLLM's CPU attention needs head_dim >= 32: 2 query heads of 32 share 1 KV head (GQA).
# Vocab 512: the tiny tokenizer's (the prompts use ids up to 405).
_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 1,
    "rms_norm_eps": 1e-6,
}
# 4 experts, top 2; the CPU MoE kernel wants hidden and expert width divisible by 32.
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}

# preset family -> (HF model_type, architecture, config overrides, what the row exercises)
FAMILIES: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "phi3": (
        "phi3",
        "Phi3ForCausalLM",
        {"tie_word_embeddings": False},
        "HF-fused qkv_proj / gate_up_proj built from separate JAX q/k/v and gate/up kernels",
    ),
    "gemma2": (
        "gemma2",
        "Gemma2ForCausalLM",
        {
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 2.0,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "hidden_activation": "gelu_pytorch_tanh",
        },
        "tied, sandwich norms, (1+w) norms, attention and final soft caps, sliding window",
    ),
    "gemma3": (
        "gemma3_text",
        "Gemma3ForCausalLM",
        {
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "hidden_activation": "gelu_pytorch_tanh",
        },
        "tied, sandwich norms, q/k norm, local + global layers",
    ),
    "qwen3_moe": (
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        {**_MOE, "num_experts": 4, "norm_topk_prob": True},
        "stacked experts -> per-expert mlp.experts.{e}, router, q/k norm",
    ),
    "mixtral": (
        "mixtral",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
        "stacked experts -> block_sparse_moe.experts.{e}.w1/w2/w3",
    ),
    "qwen2_moe": (
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        {
            **_MOE,
            "num_experts": 4,
            "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        "stacked experts, shared expert + its gate, qkv bias",
    ),
    "llama3": (
        "llama",
        "LlamaForCausalLM",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
        "tied head (3.2), llama3 rope scaling",
    ),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_family(family: str, out: Path, tokenizer_dir: Path) -> Path:
    """A tiny random checkpoint of ``family`` with the tiny models' offline tokenizer."""
    model_type, arch, extra, _ = FAMILIES[family]
    config = AutoConfig.for_model(model_type, **{**_SHAPE, **extra})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out / name)
    path = out / "config.json"
    data = json.loads(path.read_text())
    # vLLM 0.32's config parsing reads torch_dtype; transformers 5 writes dtype.
    data.update({"torch_dtype": "float32", "dtype": "float32", "architectures": [arch]})
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return out
