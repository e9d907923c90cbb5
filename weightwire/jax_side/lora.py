"""A JAX LoRA adapter as a ``WeightSource``: ``lora_source(params, adapter)``.

The adapter's leaves sit where the base model's linears sit, as Flax names them
(``model/layers_3/self_attn/q_proj``, or ``layers/3`` in an NNX / Equinox list, or one
stacked ``model/layers`` subtree with ``scan_layers=True``), each module holding
``lora_a [in, rank]`` and ``lora_b [rank, out]`` — directly (a plain dict) or under a
``lora`` child, as ``flax.nnx.LoRALinear`` keeps them (pass
``nnx.state(model, nnx.LoRAParam)`` to hand over the adapter alone). They map to PEFT's
names with the served adapter's name inside (``shared.lora``):
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.<adapter>.weight [rank, in]``.
Any linear of the decoder layers can be adapted (attention and MLP projections).
"""

from __future__ import annotations

from typing import Any

import jax

from weightwire.jax_side.naming import Naming, Stacked, Transpose
from weightwire.jax_side.rules import Rule
from weightwire.jax_side.source import PytreeSource
from weightwire.shared.lora import check_adapter_name, wire_name


def lora_naming(adapter: str, *, scan_layers: bool = False) -> Naming:
    """The ``Naming`` of an adapter tree (see the module docstring)."""
    check_adapter_name(adapter)
    stack = (Stacked(),) if scan_layers else ()
    layers = "model/layers" if scan_layers else "model/layers{_sep:[_/]}{layer:\\d+}"
    module = "model.layers.{layer}.{block}.{proj}"
    rules = [
        Rule(
            f"{layers}/{{block:self_attn|mlp}}/{{proj:[A-Za-z0-9_]+}}/{{sub:(?:lora/)?}}lora_{ab}",
            wire_name(module, ab.upper(), adapter),
            *stack,
            Transpose(),  # Flax keeps [in, rank] / [rank, out]; PEFT [rank, in] / [out, rank]
        )
        for ab in "ab"
    ]
    return Naming(rules, strip=("params",))


def lora_source(
    params: Any,
    adapter: str,
    *,
    scan_layers: bool = False,
    dtype: Any = None,
    device: jax.Device | int | None = None,
) -> PytreeSource:
    """A ``PytreeSource`` over an adapter tree (or a callable returning the live one);
    ``dtype`` / ``device`` as for ``PytreeSource``."""
    return PytreeSource(
        params, lora_naming(adapter, scan_layers=scan_layers), dtype=dtype, device=device
    )
