"""A Llama larger than tiny-llama, built in seconds: tiny-llama's tokenizer and config with the
shapes scaled up and random float32 weights.

The fault suite and the overlap benchmark need a model big enough that a round does not fit
into loopback socket buffers (a receiver that stops reading must stall the sender), yet one
that any CPU host builds without a download. The weights are written with numpy, so building
one imports neither torch nor transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SMALL_LLAMA: dict[str, int] = {
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
"""``config.json`` keys of a ~64 MB float32 Llama (vocab 512): 4 layers, hidden 512."""


def llama_shapes(vocab: int, shape: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """``named_parameters()`` names and shapes of an untied HF ``LlamaForCausalLM``, layer by
    layer (``shape`` holds ``SMALL_LLAMA``'s keys)."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (vocab, h)
    return out


def scaled_llama_dir(out: Path, shape: dict[str, int] = SMALL_LLAMA, seed: int = 0) -> Path:
    """An HF model directory at ``out``: tiny-llama's tokenizer and config, scaled to ``shape``,
    with normal(0.02) float32 weights drawn from ``seed``.

    The server checks on load that every name and shape matches its model class, so a shape
    table that drifted from Llama's fails there, not silently.
    """
    import numpy as np
    from safetensors.numpy import save_file

    from weightwire.tools.server.tiny import tiny_model_dir

    src = Path(tiny_model_dir("tiny-llama"))
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            shutil.copy2(item, out / item.name)
    config = json.loads((src / "config.json").read_text())
    config.update(shape)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)
    weights = {
        name: rng.standard_normal(s, dtype=np.float32) * 0.02
        for name, s in llama_shapes(config["vocab_size"], shape).items()
    }
    save_file(weights, str(out / "model.safetensors"))
    return out
