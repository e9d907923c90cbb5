"""LoRA adapters on the wire: names, the adapter's shape (``LoRASpec``), its PEFT directory.

An adapter round carries only the adapter's tensors, named as a PEFT model's
``state_dict`` names them with the adapter's name inside::

    base_model.model.<module>.lora_A.<adapter>.weight    [rank, in_features]
    base_model.model.<module>.lora_B.<adapter>.weight    [out_features, rank]

``<module>`` is the base model's module path (``model.layers.0.self_attn.q_proj``) and
``<adapter>`` the name the server serves the adapter under (what a completion request
puts in ``model``). A round is either every tensor an adapter round or none: the worker
tells the two apart by these names alone, so the update info and the round driver are
the same as for a dense round.

The directory a server registers the adapter from (once, at the first round) is PEFT's
saved format: ``adapter_config.json`` and ``adapter_model.safetensors`` whose names drop
the adapter segment (``base_model.model.<module>.lora_A.weight``). numpy only.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from weightwire.shared.dtypes import wire_name_of_numpy
from weightwire.shared.errors import ConfigError
from weightwire.shared.meta import ParamMeta

PREFIX = "base_model.model."
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")
"""What an adapter's served name may be: one segment of a tensor name (no dots)."""
_WIRE = re.compile(
    r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight"
)
_SAFETENSORS_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


@dataclass(frozen=True)
class LoRAName:
    """One adapter tensor's parsed wire name."""

    module: str
    """The base model's module path, e.g. ``model.layers.0.self_attn.q_proj``."""
    ab: str
    """``"A"`` (``[rank, in]``) or ``"B"`` (``[out, rank]``)."""
    adapter: str

    @property
    def saved(self) -> str:
        """The name in a saved PEFT adapter (no adapter segment)."""
        return f"{PREFIX}{self.module}.lora_{self.ab}.weight"


def not_registered(adapter: str) -> str:
    """The words a worker's refusal of an adapter round begins with when it serves no adapter
    ``adapter`` (never registered, or unloaded since): ``trainer.lora.AdapterSync`` reads them
    in the round's error (a worker's error reaches the trainer as the server's message)."""
    return f"adapter {adapter!r} is not registered"


def check_adapter_name(name: object) -> str:
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        raise ConfigError(
            f"adapter name must be 1-64 characters of letters, digits, '_' or '-', got {name!r}"
        )
    return name


MAX_LORA_ALPHA = float(1 << 16)
"""The largest ``lora_alpha`` accepted. The served output adds ``alpha / rank * B(Ax)``:
PEFT configs stay far below (alpha is usually 1-4x the rank, vLLM's ranks end at 512),
and far above, a half-precision output overflows and every completion fails."""


def check_lora_alpha(alpha: object, where: str = "alpha") -> float:
    """``alpha`` as a float when it is a finite number in (0, ``MAX_LORA_ALPHA``]."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ConfigError(f"{where} must be a number, got {alpha!r:.40}")
    if not math.isfinite(alpha) or not 0 < alpha <= MAX_LORA_ALPHA:
        raise ConfigError(
            f"{where} must be a finite number in (0, {MAX_LORA_ALPHA:g}], got {alpha!r}: "
            "the adapter's scale is alpha / rank"
        )
    return float(alpha)


def check_peft_numbers(config: Mapping[str, Any], rank: int) -> float:
    """The scale (``lora_alpha / r``) of an ``adapter_config.json`` for matrices of ``rank``;
    ``ConfigError`` naming the field that is not a number a served adapter can use."""
    r = config.get("r", rank)
    if isinstance(r, bool) or not isinstance(r, int) or r != rank:
        raise ConfigError(f"adapter_config.json: r is {r!r:.40} but the matrices have rank {rank}")
    alpha = check_lora_alpha(config.get("lora_alpha", rank), "adapter_config.json: lora_alpha")
    dropout = config.get("lora_dropout", 0.0)
    if (
        isinstance(dropout, bool)
        or not isinstance(dropout, (int, float))
        or not 0 <= dropout < 1  # NaN fails this too
    ):
        raise ConfigError(
            f"adapter_config.json: lora_dropout must be a number in [0, 1), got {dropout!r:.40}"
        )
    return alpha / rank


def wire_name(module: str, ab: str, adapter: str) -> str:
    """``base_model.model.<module>.lora_<ab>.<adapter>.weight``."""
    return f"{PREFIX}{module}.lora_{ab}.{adapter}.weight"


def parse_name(name: str) -> LoRAName | None:
    """The parsed adapter tensor name, or None when ``name`` is not one."""
    m = _WIRE.fullmatch(name)
    return None if m is None else LoRAName(m["module"], m["ab"], m["adapter"])


def is_adapter_round(names: Sequence[str]) -> bool:
    """Whether a round's names are an adapter's; ``ConfigError`` for a mix of both kinds."""
    if not any(n.startswith(PREFIX) for n in names):  # a dense round: no regex per name
        return False
    kinds = {parse_name(n) is not None for n in names}
    if len(kinds) > 1:
        first = next(n for n in names if parse_name(n) is None)
        raise ConfigError(
            f"a round mixes adapter tensors with base weights ({first!r}): send an adapter "
            "and the base model in separate rounds"
        )
    return kinds == {True}


@dataclass(frozen=True)
class LoRAModule:
    """One adapted linear: its path and its input / output sizes."""

    module: str
    in_features: int
    out_features: int


@dataclass(frozen=True)
class LoRASpec:
    """What an adapter is, read off its tensors: which base modules, which rank."""

    adapter: str
    rank: int
    modules: tuple[LoRAModule, ...]
    dtype: str

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The modules' last path segments (PEFT's ``target_modules``), sorted."""
        return tuple(sorted({m.module.rsplit(".", 1)[-1] for m in self.modules}))

    @classmethod
    def from_metas(cls, metas: Sequence[ParamMeta]) -> LoRASpec:
        """The adapter described by a round's metadata; ``ConfigError`` naming the first
        problem (another tensor kind, two adapters, an A without its B, ranks that differ,
        shapes that do not pair up)."""
        if not metas:
            raise ConfigError("an adapter round needs at least one lora_A / lora_B pair")
        parsed: dict[tuple[str, str], ParamMeta] = {}
        adapters, dtypes = set(), set()
        for meta in metas:
            p = parse_name(meta.name)
            if p is None:
                raise ConfigError(
                    f"{meta.name!r} is not an adapter tensor name "
                    "(base_model.model.<module>.lora_A|lora_B.<adapter>.weight)"
                )
            if len(meta.shape) != 2:
                raise ConfigError(f"{meta.name}: an adapter matrix is 2-D, got {list(meta.shape)}")
            parsed[(p.module, p.ab)] = meta
            adapters.add(p.adapter)
            dtypes.add(meta.dtype)
        if len(adapters) != 1:
            raise ConfigError(f"one round carries one adapter, got {sorted(adapters)}")
        if len(dtypes) != 1:
            raise ConfigError(f"an adapter's tensors share one dtype, got {sorted(dtypes)}")
        (adapter,) = adapters
        check_adapter_name(adapter)
        modules, ranks = [], set()
        for module in dict.fromkeys(m for m, _ in parsed):
            a, b = parsed.get((module, "A")), parsed.get((module, "B"))
            if a is None or b is None:
                raise ConfigError(f"{module}: lora_{'A' if a is None else 'B'} is missing")
            if a.shape[0] != b.shape[1]:
                raise ConfigError(
                    f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} disagree on "
                    "the rank (A is [rank, in], B is [out, rank])"
                )
            ranks.add(a.shape[0])
            modules.append(LoRAModule(module, a.shape[1], b.shape[0]))
        if len(ranks) != 1:
            raise ConfigError(f"every module of an adapter has one rank, got {sorted(ranks)}")
        return cls(adapter, ranks.pop(), tuple(modules), dtypes.pop())

    def same_shape(self, other: LoRASpec) -> str | None:
        """Why ``other`` cannot replace this adapter in place (None when it can)."""
        if other.rank != self.rank:
            return f"rank {other.rank} differs from the registered rank {self.rank}"
        mine, theirs = set(self.modules), set(other.modules)
        if mine != theirs:
            extra = sorted(m.module for m in theirs - mine)
            missing = sorted(m.module for m in mine - theirs)
            return f"the adapted modules differ (new: {extra[:3]}, missing: {missing[:3]})"
        return None

    def peft_config(self, *, alpha: float, base_model: str = "") -> dict[str, Any]:
        """The ``adapter_config.json`` that describes this adapter to PEFT and vLLM."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": check_lora_alpha(alpha),
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": list(self.target_modules),
            "fan_in_fan_out": False,
            "inference_mode": True,
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
        }


def write_adapter_dir(
    directory: str | os.PathLike[str],
    spec: LoRASpec,
    tensors: Mapping[str, np.ndarray],
    *,
    alpha: float,
    base_model: str = "",
) -> Path:
    """Write ``tensors`` (wire names -> host arrays) as a PEFT adapter directory.

    The weights file is written beside and renamed into place, so a server reading the
    directory never sees half of it."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    saved: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        p = parse_name(name)
        if p is None or p.adapter != spec.adapter:
            raise ConfigError(f"{name!r} is not a tensor of adapter {spec.adapter!r}")
        saved[p.saved] = np.ascontiguousarray(array)
    config = json.dumps(spec.peft_config(alpha=alpha, base_model=base_model), indent=1)
    (out / "adapter_config.json").write_text(config)
    tmp = out / "adapter_model.safetensors.partial"
    write_safetensors(tmp, saved)
    tmp.replace(out / "adapter_model.safetensors")
    return out


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, np.ndarray]) -> None:
    """A safetensors file of ``tensors`` (float32 / float16 / bfloat16 / float64)."""
    header: dict[str, Any] = {}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        dtype = _SAFETENSORS_DTYPE.get(wire_name_of_numpy(a.dtype))
        if dtype is None:
            raise ConfigError(f"{name}: dtype {a.dtype} cannot be written as an adapter weight")
        header[name] = {
            "dtype": dtype,
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        arrays.append(a)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
