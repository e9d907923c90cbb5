"""The reference decoder's configuration: which family, its shapes and switches.

``DecoderConfig`` is what ``decoder.py``'s modules read; it converts to and from a Hugging Face
``config.json`` and hands the matching preset its options (``preset_kwargs``). A family's traits
that the preset also has come from the presets' table, so they are written once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from weightwire.jax_side.presets import family_options
from weightwire.shared.errors import ConfigError
from weightwire.tools.models.common import rope_inv_freq

FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "phi3",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
)
"""The preset families this reference model computes (phi3: Llama's computation; HF fuses
qkv_proj and gate_up_proj, which the preset fuses on send)."""
_MOE_FAMILIES = tuple(f for f in FAMILIES if family_options(f)["moe"])
# A family's traits the preset also has are read from the presets' table (one source);
# only what the forward pass alone needs is written here.
_PRESET_TRAITS = ("qkv_bias", "qk_norm", "tie_word_embeddings")
_MODEL_TRAITS: dict[str, dict[str, Any]] = {
    "gemma": {"gemma_norm": True, "embed_scale": True, "hidden_act": "gelu_pytorch_tanh"},
    "qwen2_moe": {"num_experts": 4},
    "qwen3_moe": {"num_experts": 4},
    "mixtral": {"num_experts": 4, "norm_topk_prob": True},  # Mixtral always renormalises the top-k
}


def _family_defaults(family: str) -> dict[str, Any]:
    options = family_options(family)
    return {
        **{k: options[k] for k in _PRESET_TRAITS if options[k]},
        **_MODEL_TRAITS.get(family, {}),
    }


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Architecture (HF field names) plus JAX-side layout switches. Frozen, so hashable:
    usable as a ``jax.jit`` static argument."""

    family: str = "llama"
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q, k, v and o (Llama's attention_bias, Qwen3's)
    qkv_bias: bool = False  # q, k, v only (Qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    gemma_norm: bool = False  # RMSNorm computes x * (1 + w)
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size)
    hidden_act: str = "silu"
    scan_layers: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    head_axes: bool = False
    num_experts: int = 0  # > 0: every layer's MLP is a sparse MoE (moe.MoE)
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None  # default: intermediate_size
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"unknown family {self.family!r}; known: {', '.join(FAMILIES)}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "hidden_size must divide by num_attention_heads when head_dim is not given"
            )
        if (self.family in _MOE_FAMILIES) != (self.num_experts > 0):
            raise ConfigError(
                f"family {self.family!r} with num_experts={self.num_experts}: MoE families need "
                "experts, dense ones none"
            )
        if self.num_experts and self.fused_gate_up:
            raise ConfigError(
                "fused_gate_up is not implemented for MoE experts in the reference model"
            )
        if self.fused_qkv and self.head_axes:
            raise ConfigError("fused_qkv and head_axes are alternative layouts; pick one")
        rope_inv_freq(
            self.head_dim_, self.rope_theta, self.rope_scaling_dict
        )  # fail early on a bad rope

    @classmethod
    def for_family(cls, family: str, **overrides: Any) -> DecoderConfig:
        """A config with the family's fixed traits (e.g. Qwen2's qkv bias) filled in."""
        if family not in FAMILIES:
            raise ConfigError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
        return cls(family=family, **{**_family_defaults(family), **overrides})

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], **overrides: Any) -> DecoderConfig:
        """From an HF ``config.json`` dict (``model_type`` picks the family).

        ``overrides`` set JAX-side switches (``scan_layers=True``, ``dtype=...``).
        """
        family = hf.get("model_type", "llama")
        if family not in FAMILIES:
            raise ConfigError(
                f"model_type {family!r} is not a decoder family here; known: {', '.join(FAMILIES)}"
            )
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        kw: dict[str, Any] = {
            "vocab_size": hf["vocab_size"],
            "hidden_size": hf["hidden_size"],
            "intermediate_size": hf["intermediate_size"],
            "num_hidden_layers": hf["num_hidden_layers"],
            "num_attention_heads": hf["num_attention_heads"],
            "num_key_value_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
            "head_dim": hf.get("head_dim"),
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
            "rope_theta": float(theta),
            "rope_scaling": None if rope["rope_type"] == "default" else tuple(sorted(rope.items())),
            "max_position_embeddings": hf.get("max_position_embeddings", 2048),
            "tie_word_embeddings": hf.get(
                "tie_word_embeddings", family_options(family)["tie_word_embeddings"]
            ),
        }
        if family in ("llama", "mistral", "qwen3"):
            kw["attention_bias"] = bool(hf.get("attention_bias", False))
        if family in ("llama", "mistral"):
            kw["mlp_bias"] = bool(hf.get("mlp_bias", False))
        if family in _MOE_FAMILIES:
            kw["num_experts"] = hf.get("num_experts") or hf["num_local_experts"]
            kw["num_experts_per_tok"] = hf["num_experts_per_tok"]
            kw["moe_intermediate_size"] = hf.get("moe_intermediate_size")
            kw["norm_topk_prob"] = family == "mixtral" or bool(hf.get("norm_topk_prob", False))
            kw["shared_expert_intermediate_size"] = hf.get("shared_expert_intermediate_size") or 0
        act = hf.get("hidden_activation") or hf.get("hidden_act")
        if act:
            kw["hidden_act"] = act
        return cls.for_family(family, **{**kw, **overrides})

    def to_hf_config(self) -> dict[str, Any]:
        """The HF ``config.json`` fields of this architecture (layout switches dropped)."""
        out: dict[str, Any] = {
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim_,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, **self.rope_scaling_dict},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
        }
        if self.family in ("llama", "mistral", "qwen3"):
            out["attention_bias"] = self.attention_bias
        if self.family in ("llama", "mistral"):
            out["mlp_bias"] = self.mlp_bias
        if self.family == "gemma":
            out["hidden_activation"] = self.hidden_act
        if self.family == "phi3":
            out["pad_token_id"] = (
                None  # Phi3Config's default (32000) lies outside a tiny vocabulary
            )
        if self.family == "mixtral":
            out.update(
                num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok
            )
        elif self.num_experts:
            out.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size_,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
            if self.family == "qwen2_moe":
                out["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return out

    def preset_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``presets.preset(self.family, ...)`` matching this pytree."""
        return {
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "qkv_bias": self.qkv_bias,
            "mlp_bias": self.mlp_bias,
            "qk_norm": self.qk_norm,
            "scan_layers": self.scan_layers,
            "fused_qkv": self.fused_qkv,
            "fused_gate_up": self.fused_gate_up,
            "head_axes": self.head_axes,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim_,
            "intermediate_size": self.intermediate_size,
        }

    def replace(self, **changes: Any) -> DecoderConfig:
        return dataclasses.replace(self, **changes)

    @property
    def moe_intermediate_size_(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def head_dim_(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or {"rope_type": "default"})

    @property
    def jdtype(self) -> Any:
        return jnp.dtype(self.dtype)

    @property
    def jparam_dtype(self) -> Any:
        return jnp.dtype(self.param_dtype)
