"""``ModelSpec``: what a worker's model accepts, checked before a round receives a byte.

A round whose update info names a tensor the model does not have, gives a wrong
shape or a wrong dtype, or sends only part of a decoder layer is refused while the
model is still untouched: vLLM's loaders would otherwise fail half way (an
``AssertionError`` at chunk 9 of 20), silently cast (a float32 norm sent as bfloat16)
or fill the rest of a half-sent layer from uninitialized memory.

For a vLLM worker the spec comes from the checkpoint the server loaded (safetensors
headers: names and full, unsharded shapes) and the served dtype: a floating-point
tensor must arrive in the dtype vLLM holds it in, others in the checkpoint's dtype.
Tied aliases (``lm_head.weight`` when the head shares the embedding) are accepted
with the canonical tensor's shape and dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open

from weightwire.shared.groups import layer_key
from weightwire.shared.meta import ParamMeta
from weightwire.shared.quant import FP8_DTYPE, QuantizationError, fp8_names, scheme_of_config
from weightwire.shared.served import ServedModel, checkpoint_config

# safetensors header dtype -> wire dtype name (torch attribute names).
_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
_FLOATS = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
_MAX_LISTED = 5


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the served model, as a round must send it."""

    shape: tuple[int, ...]
    """The full (unsharded) shape."""
    dtype: str
    """The wire dtype name the model holds it as."""


@dataclass(frozen=True)
class ModelSpec:
    """``tensors``: name -> its spec. ``aliases``: extra accepted name -> canonical name
    (tied parameters). ``where``: what the spec was read from, for errors."""

    tensors: Mapping[str, TensorSpec]
    aliases: Mapping[str, str] = field(default_factory=dict)
    where: str = "the model"
    quantization_config: Mapping[str, object] | None = None
    """The served model's HF ``quantization_config``: which linears it takes in FP8."""

    def served(self) -> ServedModel | None:
        """The same as the trainer's record (``shared.served``); ``None`` when a tensor is not
        in a wire dtype (a checkpoint the trainer could not send anyway: nothing to tell)."""
        try:
            metas = [ParamMeta(n, t.dtype, t.shape) for n, t in self.tensors.items()]
            config = dict(self.quantization_config) if self.quantization_config else None
            return ServedModel.of(metas, self.aliases, quantization_config=config)
        except ValueError:
            return None

    def lookup(self, name: str) -> TensorSpec | None:
        if name in self.tensors:
            return self.tensors[name]
        canonical = self.aliases.get(name)
        return self.tensors.get(canonical) if canonical is not None else None

    def check(self, metas: Sequence[ParamMeta], *, complete_layers: bool = True) -> None:
        """Raise ``ValueError`` listing what does not fit; returns only if every tensor
        is known with this exact shape and dtype and (``complete_layers``) every layer
        touched is complete. A delta round is checked without the latter: it leaves
        unchanged tensors out, and the worker loads whole layers itself (``delta``)."""
        problems: list[str] = []
        seen: set[str] = set()
        for meta in metas:
            want = self.lookup(meta.name)
            if meta.name in seen:
                problems.append(f"{meta.name!r} is listed twice")
            seen.add(meta.name)
            if want is None:
                problems.append(f"{meta.name!r} is not a tensor of the model")
                continue
            shape, dtype = want.shape, want.dtype
            if tuple(meta.shape) != shape:
                problems.append(
                    f"{meta.name!r} has shape {list(meta.shape)}, the model's is {list(shape)}"
                )
            if meta.dtype != dtype:
                problems.append(
                    f"{meta.name!r} is {meta.dtype}, the model holds it as {dtype} (no silent cast)"
                )
        touched = {layer_key(n) for n in seen} - {None} if complete_layers else set()
        covered = seen | {self.aliases[n] for n in seen if n in self.aliases}
        for key in sorted(k for k in touched if k is not None):
            missing = [n for n in self.tensors if layer_key(n) == key and n not in covered]
            if missing:
                listed = ", ".join(map(repr, missing[:_MAX_LISTED]))
                ellipsis = " ..." if len(missing) > _MAX_LISTED else ""
                problems.append(
                    f"layer {key!r} is incomplete: missing {listed}{ellipsis} (send every tensor "
                    "of a layer in one round)"
                )
        if problems:
            more = f" (+{len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
            raise ValueError(
                f"update info does not match {self.where}: "
                + "; ".join(problems[:_MAX_LISTED])
                + more
                + "; the round was refused before any byte was received and the model is unchanged"
            )

    @classmethod
    def from_checkpoint(
        cls,
        model_dir: str | Path,
        *,
        served_dtype: str | None,
        aliases: Mapping[str, str] | None = None,
        quantization_config: Mapping[str, object] | None = None,
    ) -> ModelSpec | None:
        """The spec of a local HF directory's ``*.safetensors``; ``None`` when there are
        none (a hub id or a .bin checkpoint: the round is then not pre-checked).

        An FP8 checkpoint's ``float8_e4m3fn`` weights and their float32 scales keep their
        checkpoint dtypes (the served model holds them so); ``quantization_config`` defaults
        to the one in the directory's ``config.json``."""
        root = Path(model_dir)
        files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
        if not files:
            return None
        tensors: dict[str, TensorSpec] = {}
        for path in files:
            # Headers only: get_slice reads no tensor data.
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open is not a Mapping)
                    sl = f.get_slice(name)
                    dtype = _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype().lower())
                    if served_dtype is not None and dtype in _FLOATS:
                        dtype = served_dtype
                    tensors[name] = TensorSpec(tuple(int(d) for d in sl.get_shape()), dtype)
        accepted = {a: c for a, c in (aliases or {}).items() if c in tensors and a not in tensors}
        quant = quantization_config
        if quant is None:
            found = checkpoint_config(root).get("quantization_config")
            quant = found if isinstance(found, Mapping) else None
        if quant is not None:
            _keep_fp8_pairs(files, tensors, quant)
        return cls(tensors, accepted, f"the checkpoint at {root}", quant)


def _keep_fp8_pairs(
    files: Sequence[Path],
    tensors: dict[str, TensorSpec],
    quantization_config: Mapping[str, object],
) -> None:
    """The FP8 linears' weights and scales in their checkpoint dtypes (e4m3, float32), not
    the served float dtype: vLLM's FP8 linear method holds them as the checkpoint does."""
    try:
        scheme = scheme_of_config(dict(quantization_config))
    except QuantizationError:
        return  # the served model then tells no FP8 linears; a spec for them is refused
    if scheme is None:
        return
    stored: dict[str, str] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                stored[name] = _ST_DTYPES.get(f.get_slice(name).get_dtype(), "")
    for name, dtype in stored.items():
        if dtype == FP8_DTYPE and name.endswith(".weight"):
            scale = fp8_names(name, scheme).scale
            if scale in stored:
                tensors[name] = TensorSpec(tensors[name].shape, FP8_DTYPE)
                tensors[scale] = TensorSpec(tensors[scale].shape, stored[scale])
