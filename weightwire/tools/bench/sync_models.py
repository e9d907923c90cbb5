"""The parameter sets ``weightwire bench --sync`` sends: real models' HF names and shapes
(from their ``config.json``), synthetic bf16 values on the sender's GPU, and the plain
``WeightSource`` the sender hands the engine."""

from __future__ import annotations

from typing import Any

MODELS: dict[str, dict[str, Any]] = {  # from the models' HF config.json
    "qwen2-0.5b": dict(
        hidden=896,
        inter=4864,
        layers=24,
        heads=14,
        kv=2,
        head_dim=64,
        vocab=151936,
        tied=True,
        bias=True,
    ),
    "qwen2-1.5b": dict(
        hidden=1536,
        inter=8960,
        layers=28,
        heads=12,
        kv=2,
        head_dim=128,
        vocab=151936,
        tied=True,
        bias=True,
    ),
    "llama3-8b": dict(
        hidden=4096,
        inter=14336,
        layers=32,
        heads=32,
        kv=8,
        head_dim=128,
        vocab=128256,
        tied=False,
        bias=False,
    ),
}


def hf_shapes(c: dict[str, Any]) -> list[tuple[str, list[int]]]:
    """HF checkpoint names and shapes, in state-dict order (one layer's names contiguous)."""
    h, q, kv = c["hidden"], c["heads"] * c["head_dim"], c["kv"] * c["head_dim"]
    out = [("model.embed_tokens.weight", [c["vocab"], h])]
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        for proj, rows in (("q", q), ("k", kv), ("v", kv)):
            out.append((f"{p}self_attn.{proj}_proj.weight", [rows, h]))
            if c["bias"]:
                out.append((f"{p}self_attn.{proj}_proj.bias", [rows]))
        out += [
            (f"{p}self_attn.o_proj.weight", [h, q]),
            (f"{p}mlp.gate_proj.weight", [c["inter"], h]),
            (f"{p}mlp.up_proj.weight", [c["inter"], h]),
            (f"{p}mlp.down_proj.weight", [h, c["inter"]]),
            (f"{p}input_layernorm.weight", [h]),
            (f"{p}post_attention_layernorm.weight", [h]),
        ]
    out.append(("model.norm.weight", [h]))
    if not c["tied"]:
        out.append(("lm_head.weight", [c["vocab"], h]))
    return out


def make_source(params: dict[str, Any]) -> Any:
    from weightwire.shared.meta import ParamMeta
    from weightwire.shared.source import WeightSource

    class DictSource(WeightSource):
        def __init__(self) -> None:
            self._metas = [
                ParamMeta(n, "bfloat16", tuple(int(d) for d in a.shape)) for n, a in params.items()
            ]

        def metadata(self) -> list[ParamMeta]:
            return self._metas

        def __iter__(self) -> Any:
            return iter(params.items())

    return DictSource()


def build_params(model: str, engine: str) -> dict[str, Any]:
    """Synthetic bf16 weights with the model's HF names and shapes, on the sender's GPU."""
    if engine == "torch":
        import torch

        gen, out = torch.Generator(device="cuda").manual_seed(0), {}
        for name, shape in hf_shapes(MODELS[model]):
            if len(shape) == 1:
                out[name] = torch.ones(shape, dtype=torch.bfloat16, device="cuda")
            else:
                out[name] = (torch.randn(shape, generator=gen, device="cuda") * 0.02).to(
                    torch.bfloat16
                )
        torch.cuda.synchronize()
        return out
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    jout: dict[str, Any] = {}
    for i, (name, shape) in enumerate(hf_shapes(MODELS[model])):
        if len(shape) == 1:
            jout[name] = jnp.ones(shape, jnp.bfloat16)
        else:
            jout[name] = (
                jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * 0.02
            ).astype(jnp.bfloat16)
    jax.block_until_ready(list(jout.values()))
    return jout
