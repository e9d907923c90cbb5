"""A PEFT model's LoRA adapter as a ``WeightSource``: ``PeftAdapterSource(model, adapter)``.

A PEFT model names an adapter's matrices ``base_model.model.<module>.lora_A.<peft
name>.weight``; the source sends them under the name the server serves the adapter as
(``shared.lora``): ``...lora_A.<adapter>.weight``. Only the LoRA matrices travel (no
base weight, no bias); PEFT's ``lora_alpha`` and ``r`` are read from its config.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from weightwire.shared.errors import ConfigError
from weightwire.shared.lora import check_adapter_name, wire_name
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource
from weightwire.torch_side.dtypes import wire_name as dtype_name

_PEFT = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<peft>[^.]+)\.weight")


class PeftAdapterSource(WeightSource):
    """The LoRA matrices of ``model`` (a ``peft.PeftModel``, or any module named the same
    way) for its adapter ``peft_adapter`` (default: the active one), sent as ``adapter``.
    ``dtype`` casts them on the wire (``None`` keeps theirs)."""

    def __init__(
        self,
        model: torch.nn.Module,
        adapter: str,
        *,
        peft_adapter: str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.adapter = check_adapter_name(adapter)
        self.peft_adapter = peft_adapter or str(getattr(model, "active_adapter", "default"))
        self.dtype = dtype
        self._model = model
        self._params: list[tuple[str, torch.nn.Parameter]] = []
        for name, param in model.named_parameters():
            m = _PEFT.fullmatch(name)
            if m is not None and m["peft"] == self.peft_adapter:
                self._params.append((wire_name(m["module"], m["ab"], adapter), param))
        if not self._params:
            raise ConfigError(
                f"{type(model).__name__} has no LoRA matrices of adapter {self.peft_adapter!r} "
                "(names base_model.model.<module>.lora_A.<adapter>.weight)"
            )

    @property
    def alpha(self) -> float:
        """The adapter's ``lora_alpha`` from the PEFT config, for ``AdapterSync(alpha=...)``
        (``ConfigError`` when the model has none, or uses rslora / per-module alphas)."""
        return peft_alpha(self._model, self.peft_adapter)

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(name, dtype_name(self.dtype or p.dtype), tuple(p.shape))
            for name, p in self._params
        ]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for name, p in self._params:
            t = p.detach()
            yield name, t if self.dtype is None else t.to(self.dtype)


def peft_alpha(model: Any, peft_adapter: str | None = None) -> float:
    """``lora_alpha`` of a PEFT model's adapter (``ConfigError`` when it has no config)."""
    name = peft_adapter or str(getattr(model, "active_adapter", "default"))
    config = getattr(model, "peft_config", {}).get(name)
    if config is None:
        raise ConfigError(f"the model has no PEFT config for adapter {name!r}")
    if (
        getattr(config, "use_rslora", False)
        or getattr(config, "rank_pattern", None)
        or getattr(config, "alpha_pattern", None)
    ):
        raise ConfigError(
            f"adapter {name!r} uses rslora or per-module ranks/alphas; weightwire sends one "
            "rank and one alpha per adapter"
        )
    return float(config.lora_alpha)
