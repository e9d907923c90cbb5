"""LoRA adapters on the reference server's Hugging Face model (``--enable-lora``).

Each adapter is a PEFT directory at registration (``POST /v1/load_lora_adapter``) and
then whatever its last adapter round sent. A completion naming an adapter runs the
base model with ``W x + scale * B (A x)`` in every adapted linear (``scale = alpha /
rank``, PEFT's LoRA), through forward hooks present only for that completion; the base
weights are never written, so base-model completions are unchanged. The worker holds
its model lock around a completion and around a round's finish, so a swap
(``HFAdapters.swap``: one dict assignment) lands between completions, never inside one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from weightwire.shared.errors import ConfigError
from weightwire.shared.lora import (
    PREFIX,
    LoRASpec,
    check_peft_numbers,
    not_registered,
    wire_name,
)
from weightwire.shared.meta import ParamMeta

_CONFIG, _WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class Adapter:
    """One served adapter: its shape, PEFT scale and matrices (saved PEFT names)."""

    spec: LoRASpec
    scale: float
    tensors: dict[str, torch.Tensor]


class HFAdapters:
    """The adapters of one worker's model; ``AdapterHost`` for its adapter rounds."""

    def __init__(self, model: torch.nn.Module, max_rank: int) -> None:
        self.model, self.max_rank = model, max_rank
        self.linears = {
            name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
        }
        self.served: dict[str, Adapter] = {}
        self._lock = threading.Lock()

    # -- registration -----------------------------------------------------------------------

    def load_dir(self, name: str, path: str) -> dict[str, object]:
        """Register ``name`` from a PEFT directory (``ValueError`` saying what is wrong)."""
        from safetensors.torch import load_file

        root = Path(path)
        if not (root / _CONFIG).is_file() or not (root / _WEIGHTS).is_file():
            raise ValueError(f"{path} holds no {_CONFIG} and {_WEIGHTS}")
        config = json.loads((root / _CONFIG).read_text())
        if not isinstance(config, dict):
            raise ValueError(f"{path}: {_CONFIG} is not a JSON object")
        for flag in ("use_rslora", "use_dora"):
            if config.get(flag):
                raise ValueError(f"{path}: {flag} adapters are not served here")
        saved = load_file(str(root / _WEIGHTS))
        metas, tensors = [], {}
        for key, tensor in saved.items():
            module, _, ab = key.removeprefix(PREFIX).removesuffix(".weight").rpartition(".lora_")
            if not key.startswith(PREFIX) or ab not in ("A", "B"):
                raise ValueError(f"{path}: {key!r} is not a LoRA matrix of PEFT's names")
            metas.append(ParamMeta(wire_name(module, ab, name), "float32", tuple(tensor.shape)))
            tensors[key] = tensor.float()
        spec = LoRASpec.from_metas(metas)
        try:
            scale = check_peft_numbers(config, spec.rank)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        self._check_fits(spec)
        with self._lock:
            self.served[name] = Adapter(spec, scale, self._on_device(tensors))
        return {"rank": spec.rank, "modules": len(spec.modules)}

    def unload(self, name: str) -> None:
        """Stop serving ``name`` (``/v1/unload_lora_adapter``): a completion already running
        with it ends with it; ``ValueError`` when it is not served here."""
        with self._lock:
            if self.served.pop(name, None) is None:
                raise ValueError(f"adapter {name!r} is not registered here")

    def _check_fits(self, spec: LoRASpec) -> None:
        if spec.rank > self.max_rank:
            raise ValueError(
                f"adapter {spec.adapter!r}: LoRA rank {spec.rank} is greater than "
                f"--max-lora-rank {self.max_rank}"
            )
        for m in spec.modules:
            linear = self.linears.get(m.module)
            if linear is None:
                raise ValueError(
                    f"adapter {spec.adapter!r}: {m.module} is not a linear layer of this model"
                )
            if (linear.in_features, linear.out_features) != (m.in_features, m.out_features):
                raise ValueError(
                    f"adapter {spec.adapter!r}: {m.module} is {linear.in_features} -> "
                    f"{linear.out_features}, the adapter's {m.in_features} -> {m.out_features}"
                )

    def _on_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        param = next(self.model.parameters())
        return {k: v.to(param.device, param.dtype) for k, v in tensors.items()}

    # -- AdapterHost ---------------------------------------------------------------------------

    def check(self, spec: LoRASpec) -> None:
        with self._lock:
            known = self.served.get(spec.adapter)
        if known is None:
            raise ValueError(
                f"{not_registered(spec.adapter)} here: register it first "
                "(POST /v1/load_lora_adapter)"
            )
        why = known.spec.same_shape(spec)
        if why is not None:
            raise ValueError(f"adapter {spec.adapter!r}: {why}")

    def swap(self, spec: LoRASpec, tensors: dict[str, torch.Tensor]) -> None:
        self.check(spec)
        with self._lock:
            known = self.served[spec.adapter]
            self.served[spec.adapter] = Adapter(known.spec, known.scale, self._on_device(tensors))

    def checksums(self) -> dict[str, str]:
        """``{wire name: sha256 of the held matrix}`` of every served adapter: the keys an
        adapter round sends (``shared.lora.wire_name``), so ``/weight_checker``'s checksums
        cover adapter rounds as they cover the base model's (``verify=True``)."""
        from weightwire.torch_side.worker.hf_host import tensor_sha256

        with self._lock:
            served = dict(self.served)
        return {
            wire_name(m.module, ab, name): tensor_sha256(
                adapter.tensors[f"{PREFIX}{m.module}.lora_{ab}.weight"]
            )
            for name, adapter in served.items()
            for m in adapter.spec.modules
            for ab in ("A", "B")
        }

    # -- serving -------------------------------------------------------------------------------

    @contextmanager
    def applied(self, name: str | None) -> Iterator[None]:
        """The model computes with adapter ``name`` inside (the base model for None or a
        name that is not an adapter)."""
        with self._lock:
            adapter = self.served.get(name) if name is not None else None
        if adapter is None:
            yield
            return
        handles = []
        for m in adapter.spec.modules:
            a = adapter.tensors[f"{PREFIX}{m.module}.lora_A.weight"]
            b = adapter.tensors[f"{PREFIX}{m.module}.lora_B.weight"]
            handles.append(self.linears[m.module].register_forward_hook(_hook(a, b, adapter.scale)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()


Hook = Callable[[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor]


def _hook(a: torch.Tensor, b: torch.Tensor, scale: float) -> Hook:
    def add_lora(
        _module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor
    ) -> torch.Tensor:
        return out + scale * ((args[0] @ a.T) @ b.T)

    return add_lora
