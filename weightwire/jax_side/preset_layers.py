"""Per-layer rule blocks for the families beyond the Llama core: mixture-of-experts MLPs
(Qwen2/Qwen3-MoE, Mixtral) and Hugging Face's fused projections (Phi-3).

``presets._decoder`` calls these in place of its dense blocks. Each takes the layer's
JAX path prefix ``src`` (``model/layers_{layer}`` or scanned ``model/layers``), its HF
prefix ``dst`` and the layer ``stack`` parts, and returns rules in HF ``state_dict``
order.

Expert layout on the JAX side: one stacked kernel per projection, ``[experts, in, out]``
(``[layers, experts, in, out]`` when scanned), the layout ``jax.vmap``/``einsum`` MoE
code trains; HF (and vLLM's ``load_weights``, which fuses them itself) name every expert,
so each stacked kernel becomes ``num_experts`` HF tensors, ``{expert}`` in the target.
"""

from __future__ import annotations

from typing import Any

from weightwire.jax_side.rules import Rule
from weightwire.jax_side.transforms import (
    Concat,
    MergeAxes,
    NamingError,
    Op,
    Split,
    Stacked,
    Transpose,
)

MOE_STYLES = {
    # style: (JAX/HF block name, router, experts, (gate, up, down) HF projection names)
    "qwen": ("mlp", "gate", "experts", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", "gate", "experts", ("w1", "w3", "w2")),
}
_T = Transpose()


def need_sizes(o: dict[str, Any], why: str, *keys: str) -> list[int]:
    """The size options ``keys`` of ``o`` as ints; ``NamingError`` naming the missing ones
    (a fused layout cannot be cut without them)."""
    missing = [k for k in keys if not o.get(k)]
    if missing:
        raise NamingError(f"{why} needs the size option(s) {missing}")
    return [int(o[k]) for k in keys]


def moe_rules(o: dict[str, Any], src: str, dst: str, stack: tuple[Stacked, ...]) -> list[Rule]:
    """Router, stacked experts (-> one HF tensor per expert) and, with ``shared_expert``,
    Qwen2-MoE's always-on shared expert and its sigmoid gate."""
    style = o["moe"]
    if style not in MOE_STYLES:
        raise NamingError(f"moe={style!r}: known MoE layouts are {sorted(MOE_STYLES)}")
    block, router, experts, (gate, up, down) = MOE_STYLES[style]
    # The expert axis counts in the per-layer kernel; a scanned leaf has the layer axis first.
    axis = int(o["expert_axis"]) + (1 if stack else 0)
    per_expert = (*stack, Stacked(axis, field="expert"))
    hf = f"{dst}.{block}.{experts}.{{expert}}"
    jx = f"{src}/{block}/{experts}"
    rules = [Rule(f"{src}/{block}/{router}/kernel", f"{dst}.{block}.{router}.weight", *stack, _T)]
    if o["fused_gate_up"]:
        (inter,) = need_sizes(o, "fused_gate_up with experts", "moe_intermediate_size")
        rules.append(
            Rule(
                f"{jx}/gate_up_proj/kernel",
                (f"{hf}.{gate}.weight", f"{hf}.{up}.weight"),
                *per_expert,
                _T,
                Split(0, (inter, inter)),
            )
        )
    else:
        rules.append(Rule(f"{jx}/{gate}/kernel", f"{hf}.{gate}.weight", *per_expert, _T))
        rules.append(Rule(f"{jx}/{up}/kernel", f"{hf}.{up}.weight", *per_expert, _T))
    rules.append(Rule(f"{jx}/{down}/kernel", f"{hf}.{down}.weight", *per_expert, _T))
    if o["shared_expert"]:
        for p in ("gate_proj", "up_proj", "down_proj"):
            rules.append(
                Rule(
                    f"{src}/{block}/shared_expert/{p}/kernel",
                    f"{dst}.{block}.shared_expert.{p}.weight",
                    *stack,
                    _T,
                )
            )
        rules.append(
            Rule(
                f"{src}/{block}/shared_expert_gate/kernel",
                f"{dst}.{block}.shared_expert_gate.weight",
                *stack,
                _T,
            )
        )
    if not stack:
        # Dense layers inside a MoE model (Qwen-MoE's mlp_only_layers / decoder_sparse_step).
        for p in ("gate_proj", "up_proj", "down_proj"):
            rules.append(Rule(f"{src}/mlp/{p}/kernel", f"{dst}.mlp.{p}.weight", _T, optional=True))
    return rules


def hf_fused_qkv_rules(
    o: dict[str, Any], src: str, dst: str, stack: tuple[Stacked, ...], bias: bool
) -> list[Rule]:
    """Phi-3: HF holds one ``self_attn.qkv_proj`` ([q; k; v] rows). A fused JAX kernel maps
    as is; separate (or head-axes) q/k/v kernels are concatenated into it on device."""
    name = f"{dst}.self_attn.qkv_proj"
    if o["fused_qkv"]:
        rules = [Rule(f"{src}/self_attn/qkv_proj/kernel", f"{name}.weight", *stack, _T)]
        if bias:
            rules.append(Rule(f"{src}/self_attn/qkv_proj/bias", f"{name}.bias", *stack))
        return rules
    kernel: tuple[Op, ...] = (MergeAxes(1, 2), _T) if o["head_axes"] else (_T,)
    bias_ops: tuple[Op, ...] = (MergeAxes(0, 1),) if o["head_axes"] else ()
    return concat_qkv(f"{src}/self_attn", name, stack, kernel, 0, bias_ops if bias else None)


def concat_qkv(
    src: str,
    dst: str,
    stack: tuple[Stacked, ...],
    kernel: tuple[Op, ...],
    axis: int,
    bias: tuple[Op, ...] | None,
) -> list[Rule]:
    """Separate ``{src}/{q,k,v}_proj`` kernels (each through ``kernel``) concatenated along
    ``axis`` into the fused HF ``{dst}.weight``, and, unless ``bias`` is None, their biases
    (each through ``bias``) along 0 into ``{dst}.bias``: a fused checkpoint tensor whose
    parts a JAX model holds apart."""
    rules = []
    for i, p in enumerate("qkv"):
        rules.append(
            Rule(f"{src}/{p}_proj/kernel", f"{dst}.weight", *stack, *kernel, Concat(axis, i, 3))
        )
        if bias is not None:
            rules.append(
                Rule(f"{src}/{p}_proj/bias", f"{dst}.bias", *stack, *bias, Concat(0, i, 3))
            )
    return rules


def hf_fused_mlp_rules(
    o: dict[str, Any], src: str, dst: str, stack: tuple[Stacked, ...]
) -> list[Rule]:
    """Phi-3: HF holds one ``mlp.gate_up_proj`` ([gate; up] rows) and ``mlp.down_proj``."""
    name = f"{dst}.mlp.gate_up_proj"
    if o["fused_gate_up"]:
        rules = [Rule(f"{src}/mlp/gate_up_proj/kernel", f"{name}.weight", *stack, _T)]
    else:
        rules = [
            Rule(f"{src}/mlp/{p}/kernel", f"{name}.weight", *stack, _T, Concat(0, i, 2))
            for i, p in enumerate(("gate_proj", "up_proj"))
        ]
    rules.append(Rule(f"{src}/mlp/down_proj/kernel", f"{dst}.mlp.down_proj.weight", *stack, _T))
    if o["mlp_bias"]:
        raise NamingError("phi3 has no MLP biases (mlp_bias=True given)")
    return rules
