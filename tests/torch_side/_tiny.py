"""Tiny Hugging Face Llama models for the torch-side tests (built from a config: no hub)."""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np
import torch


def tiny_llama(
    *, seed: int = 0, dtype: torch.dtype = torch.float32, tied: bool = False
) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM  # slow import, only when used

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    model.eval()
    return model


def perturb(named: list[tuple[str, torch.Tensor]], round_index: int) -> None:
    """Deterministically change every tensor (in place) for round ``round_index``."""
    gen = torch.Generator().manual_seed(1000 + round_index)
    with torch.no_grad():
        for _, t in named:
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            t.add_(noise.to(t.dtype) * 0.01 * (round_index + 1))


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a numpy array of the matching (ml_dtypes) dtype."""
    t = tensor.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def checksums(named: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Independent of HFModelHost: sha256 over the numpy bytes of each tensor."""
    return {n: hashlib.sha256(to_numpy(t).tobytes()).hexdigest() for n, t in named}
