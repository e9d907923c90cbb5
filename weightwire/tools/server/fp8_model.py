"""The reference server's FP8 models: a checkpoint in FP8 served as it is stored.

An HF checkpoint whose ``quantization_config`` says ``quant_method: fp8`` holds each
quantized linear as ``X.weight`` (``float8_e4m3fn``) beside its float32 scale
(``X.weight_scale_inv`` per block, ``X.weight_scale`` per tensor). transformers on a CPU
dequantizes such a checkpoint on load (its FP8 matmul is a Triton kernel), so the served
parameters would no longer be the checkpoint's and an FP8 round could not land in them.
Here each such linear is an ``Fp8Linear`` that keeps the two tensors as its parameters,
loaded byte for byte, and dequantizes on the fly in its forward (weights in FP8, activations
in the model's dtype: vLLM's W8A16 path). The weights a round sends in FP8 then land in
those parameters exactly as vLLM's FP8 linear method takes them, and the host tells the
trainer these linears (``HFModelHost.served_model``: the config's ``quantization_config``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from weightwire.shared.quant import (
    FP8_DTYPE,
    Fp8PerTensor,
    Fp8Scheme,
    fp8_names,
    scale_shape,
    scheme_of_config,
)


def fp8_scheme(model_dir: str) -> Fp8Scheme | None:
    """The scheme ``model_dir``'s ``config.json`` declares, ``None`` for a model not in FP8."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return scheme_of_config(config.get("quantization_config")) if isinstance(config, dict) else None


def dequantize(weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme) -> torch.Tensor:
    """float32 ``weight * scale``, each block times its own scale."""
    values = weight.to(torch.float32)
    if isinstance(scheme, Fp8PerTensor):
        return values * scale
    bm, bn = scheme.block
    m, n = weight.shape
    full = scale.repeat_interleave(bm, dim=0).repeat_interleave(bn, dim=1)[:m, :n]
    return values * full


class Fp8Linear(torch.nn.Module):
    """A linear held as its FP8 checkpoint tensors, computed in the input's dtype."""

    def __init__(self, linear: torch.nn.Linear, scheme: Fp8Scheme) -> None:
        super().__init__()
        self.scheme = scheme
        shape = (linear.out_features, linear.in_features)
        weight = torch.zeros(shape, dtype=torch.float8_e4m3fn)
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        scale = torch.nn.Parameter(torch.ones(scale_shape(shape, scheme)), requires_grad=False)
        self.scale_name = fp8_names("x.weight", scheme).scale.removeprefix("x.")
        self.register_parameter(self.scale_name, scale)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = getattr(self, self.scale_name)
        weight = dequantize(self.weight, scale, self.scheme).to(x.dtype)
        return torch.nn.functional.linear(x, weight, self.bias)


def load_fp8_model(model_dir: str, scheme: Fp8Scheme) -> Any:
    """The HF model of ``model_dir`` with every linear its checkpoint stores in FP8 as an
    ``Fp8Linear``, all tensors loaded as stored. ``ValueError`` naming a checkpoint tensor
    the model does not take, or a parameter the checkpoint leaves out (a tied head aside)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    quantization = config.quantization_config
    del config.quantization_config  # built unquantized; the FP8 linears are put in below
    model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    stored: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        stored.update(load_file(str(path)))
    for name, tensor in stored.items():
        if tensor.dtype != torch.float8_e4m3fn or not name.endswith(".weight"):
            continue
        if fp8_names(name, scheme).scale not in stored:
            continue
        module = name.removesuffix(".weight")
        parent, _, child = module.rpartition(".")
        owner = model.get_submodule(parent)
        linear = getattr(owner, child)
        if not isinstance(linear, torch.nn.Linear):
            raise ValueError(f"{model_dir}: {name} is stored in {FP8_DTYPE}, not a linear's")
        setattr(owner, child, Fp8Linear(linear, scheme))
    missing, unexpected = model.load_state_dict(stored, strict=False)
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - dict(
        model.named_parameters()
    ).keys()
    missing = [n for n in missing if n not in tied]
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"holds {unexpected[0]}, unknown to the model"
        raise ValueError(f"{model_dir}: the FP8 checkpoint {what}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.config.quantization_config = quantization  # what HFModelHost tells the trainer
    return model
