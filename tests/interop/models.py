"""The interop lane's model matrix: tiny checkpoints, their JAX sources, HF references."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch
from transformers import AutoModelForCausalLM

from weightwire.jax_side.checkpoint import pytree_from_hf, read_hf_config, read_safetensors
from weightwire.jax_side.naming import Naming
from weightwire.jax_side.source import PytreeSource
from weightwire.tools.models import decoder, gpt2
from weightwire.tools.models.loading import load_decoder

# Llama last: the fault cases and the older interop tests run on its server next.
MATRIX = ("tiny-qwen2", "tiny-qwen2-tied", "tiny-gemma", "tiny-qwen3", "tiny-gpt2", "tiny-llama")
FEATURES = {
    "tiny-llama": "untied, GQA 2:1",
    "tiny-qwen2": "untied, qkv bias, GQA 2:1",
    "tiny-qwen2-tied": "tie_word_embeddings, qkv bias, GQA 2:1",
    "tiny-gemma": "tied, (1+w) norms, scaled embedding, gelu-tanh, GQA 2:1",
    "tiny-qwen3": "untied, q/k norm, explicit head_dim, GQA 2:1",
    "tiny-gpt2": "tied, Conv1D fused c_attn, learned positions, LayerNorm with bias",
}

TP_MODEL = "tiny-llama-tied"
"""The tensor-parallel lane's model (``test_vllm_tp.py``), served at ``TP_SIZE``: a Llama whose
one KV head is fewer than TP (vLLM replicates k/v on both workers) and whose head is tied
(vLLM's lm_head shares the embedding's vocab-parallel parameter); float32, 0.43 MB."""
TP_SIZE = 2
FEATURES[TP_MODEL] = f"tied, GQA 2:1, served at TP={TP_SIZE} (1 KV head, replicated)"

# Their vLLM architectures (tiny.py's configs), warmed into vLLM's model-info cache
# before the first server (launcher.py); one missing here only costs its start ~13 s.
ARCHITECTURES = {
    "tiny-llama": "LlamaForCausalLM",
    "tiny-qwen2": "Qwen2ForCausalLM",
    "tiny-qwen2-tied": "Qwen2ForCausalLM",
    "tiny-gemma": "GemmaForCausalLM",
    "tiny-qwen3": "Qwen3ForCausalLM",
    "tiny-gpt2": "GPT2LMHeadModel",
    TP_MODEL: "LlamaForCausalLM",
}


# Perturbation scale per model: tiny random Gemma's scaled, tied embedding dominates its
# logits (greedy repeats the last prompt token) until the weights move by ~0.2.
SCALE = {"tiny-gemma": 0.2}
DEFAULT_SCALE = 0.05


def scale_for(model_dir: str) -> float:
    from pathlib import Path

    return SCALE.get(Path(model_dir).name, DEFAULT_SCALE)


def hf_model(model_dir: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def jax_params(model_dir: str) -> tuple[Any, Naming]:
    """The checkpoint as a JAX pytree plus the preset naming that sends it back."""
    hf = read_hf_config(model_dir)
    if hf.get("model_type") == "gpt2":
        cfg = gpt2.GPT2Config.from_hf_config(hf)
        abstract = jax.eval_shape(lambda: gpt2.init(jax.random.key(0), cfg))
        tensors = read_safetensors(model_dir)
        if cfg.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        return pytree_from_hf(gpt2.naming(cfg), abstract, tensors), gpt2.naming(cfg)
    cfg, params = load_decoder(model_dir)
    return params, decoder.naming(cfg)


def perturbed(params: Any, seed: int, scale: float = 0.05) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [
        x + scale * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, noisy)


def load_into_hf(model: torch.nn.Module, tensors: dict[str, np.ndarray] | PytreeSource) -> None:
    """Give the HF model exactly these tensors; every parameter must be covered except
    tied aliases (HF re-ties them to the tensor sent under the first name)."""
    pairs = tensors.items() if isinstance(tensors, dict) else tensors
    state = {name: torch.from_numpy(np.array(array)) for name, array in pairs}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert not unexpected, f"names HF does not have: {unexpected}"
    assert set(missing) <= tied, f"tensors not sent: {sorted(set(missing) - tied)}"
    if tied:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
