"""``ServedModel``: the checkpoint tensors a worker's model takes, told to the trainer at init.

A round that leaves some of them out, names one the model lacks, or sends one in another
dtype or shape would otherwise be found by the workers after its bytes moved (or, for a
missing tensor, never: the model serves part new, part old weights). The worker describes
its model once per session (names, wire dtypes, full shapes, and which names are tied
aliases of another); the trainer checks every round's metadata against it before the first
byte (``check_round``), so each mismatch is a ``ServedModelMismatch`` that names the tensors
and the fix, and nothing was sent.

On the wire (``docs/wire-format.md``) it is the JSON object ``to_dict`` writes::

    {"tensors": [{"name": ..., "dtype": ..., "shape": [...]}, ...],
     "aliases": {"lm_head.weight": "model.embed_tokens.weight"},
     "checks_dtype": true,
     "fp8": {"scheme": {"kind": "block", "block": [128, 128], "ue8m0": false},
             "weights": ["model.layers.0.mlp.down_proj.weight", ...]}}

``fp8`` (absent for a model served unquantized) names the checkpoint's ``X.weight``s the
model takes in ``float8_e4m3fn`` beside their scale, and the one scheme its
``quantization_config`` declares (``shared.quant``): a trainer's FP8 spec is checked
against it (``check_fp8_spec``), and ``fp8_source(source, "auto")`` quantizes exactly those
names with that scheme.

``checks_dtype`` is ``false`` where the receiver casts on load (stock vLLM's loaders copy
into the parameter whatever the sent dtype), so a dtype difference is not an error there.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightwire.shared.errors import ConfigError
from weightwire.shared.lora import is_adapter_round
from weightwire.shared.meta import ParamMeta
from weightwire.shared.quant import (
    FP8_DTYPE,
    Fp8Scheme,
    QuantizationError,
    describe_scheme,
    fp8_names,
    scheme_from_dict,
    scheme_of_config,
    scheme_to_dict,
)

SHOWN = 8
"""How many names a message lists per problem (the count says how many there are)."""

_KEYS = frozenset({"tensors", "aliases", "checks_dtype", "fp8"})
_SAFETENSORS_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "I8": "int8",
    "U8": "uint8",
    "I32": "int32",
    "I64": "int64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "BOOL": "bool",
}
_MAX_HEADER = 100 << 20  # a safetensors header is JSON; a bigger one is not a checkpoint's
_TIED_HEAD = "lm_head.weight"
_EMBEDDINGS = ("model.embed_tokens.weight", "transformer.wte.weight", "model.embed.weight")


class ServedModelMismatch(ConfigError):
    """A round's tensors do not fit the served model (a tensor missing, unknown, or of
    another dtype or shape); raised by the trainer before any byte of the round."""


@dataclass(frozen=True)
class Fp8Served:
    """The served model's FP8 linears: their ``X.weight`` names and its one scheme."""

    scheme: Fp8Scheme
    weights: frozenset[str]

    def to_dict(self) -> dict[str, Any]:
        return {"scheme": scheme_to_dict(self.scheme), "weights": sorted(self.weights)}

    @classmethod
    def from_dict(cls, data: object, ctx: str) -> Fp8Served:
        if not isinstance(data, dict) or set(data) != {"scheme", "weights"}:
            raise ValueError(f"{ctx} must be an object with 'scheme' and 'weights'")
        weights = data["weights"]
        if not isinstance(weights, list) or not all(isinstance(w, str) for w in weights):
            raise ValueError(f"{ctx}.weights must be a list of names")
        return cls(scheme_from_dict(data["scheme"], f"{ctx}.scheme"), frozenset(weights))


def fp8_of(tensors: Mapping[str, ParamMeta], quantization_config: object) -> Fp8Served | None:
    """The FP8 linears of a model holding ``tensors`` under ``quantization_config`` (the HF
    config's, a dict): each ``X.weight`` held in ``float8_e4m3fn`` beside the scale its
    scheme names. ``None`` for a model not served in FP8 (no fp8 config, or one whose
    weights were dequantized on load: none is held in e4m3)."""
    scheme = scheme_of_config(quantization_config)
    if scheme is None:
        return None
    weights = frozenset(
        name
        for name, meta in tensors.items()
        if meta.dtype == FP8_DTYPE
        and name.endswith(".weight")
        and fp8_names(name, scheme).scale in tensors
    )
    return Fp8Served(scheme, weights) if weights else None


@dataclass(frozen=True)
class ServedModel:
    """The served model's checkpoint tensors (canonical names) and its tied aliases."""

    tensors: Mapping[str, ParamMeta]
    aliases: Mapping[str, str] = field(default_factory=dict)
    """An alias name -> the canonical name whose tensor it shares (``lm_head.weight`` of a
    tied model): sending it loads that tensor, and it is never missing."""
    checks_dtype: bool = True
    fp8: Fp8Served | None = None
    """The linears the model takes in FP8 and their scheme (``None``: none)."""

    def __post_init__(self) -> None:
        for alias, canonical in self.aliases.items():
            if canonical not in self.tensors:
                raise ValueError(f"served model: alias {alias!r} names unknown {canonical!r}")
            if alias in self.tensors:
                raise ValueError(f"served model: {alias!r} is both a tensor and an alias")

    @classmethod
    def of(
        cls,
        metas: Iterable[ParamMeta],
        aliases: Mapping[str, str] | None = None,
        *,
        checks_dtype: bool = True,
        quantization_config: object = None,
    ) -> ServedModel:
        """``quantization_config``: the HF config's (a dict), which tells the FP8 linears."""
        tensors = {m.name: m for m in metas}
        fp8 = fp8_of(tensors, quantization_config)
        return cls(tensors, dict(aliases or {}), checks_dtype, fp8)

    def canonical(self, name: str) -> str | None:
        """The served tensor ``name`` loads into (itself or what it aliases); None if unknown."""
        if name in self.tensors:
            return name
        return self.aliases.get(name)

    # -- the check ---------------------------------------------------------------------------

    def problems(self, metas: Sequence[ParamMeta], *, partial: bool = False) -> list[str]:
        """Each way ``metas`` (one round's dense metadata) does not fit, as a sentence that
        names the tensors and the fix; empty when the round fits."""
        unknown: list[str] = []
        wrong_shape: list[str] = []
        wrong_dtype: dict[str, list[str]] = {}
        unquantized: list[str] = []
        fp8 = self.fp8.weights if self.fp8 is not None else frozenset()
        covered: set[str] = set()
        for m in metas:
            key = self.canonical(m.name)
            if key is None:
                unknown.append(m.name)
                continue
            covered.add(key)
            want = self.tensors[key]
            if m.shape != want.shape:
                wrong_shape.append(f"{m.name} {list(m.shape)} (served: {list(want.shape)})")
            if key in fp8 and m.dtype != FP8_DTYPE:
                unquantized.append(f"{m.name} ({m.dtype})")
            elif self.checks_dtype and m.dtype != want.dtype:
                wrong_dtype.setdefault(want.dtype, []).append(f"{m.name} ({m.dtype})")
        out: list[str] = []
        if unknown:
            sample = _listed(list(self.tensors)[:3], count=False)
            out.append(
                f"{_listed(unknown)} unknown to the served model (it takes "
                f"{len(self.tensors)} tensors, e.g. {sample}): "
                "name them as the served checkpoint does (the naming preset / rules) or leave "
                "them out; a tree of another model family cannot be sent to this server"
            )
        if wrong_shape:
            out.append(
                f"shape differs from the served model's for {_listed(wrong_shape)}: the source "
                "is not the served model's architecture or config (check the hidden size, vocab "
                "and head counts)"
            )
        for dtype, names in wrong_dtype.items():
            out.append(
                f"dtype differs from the served model's {dtype} for {_listed(names)}: cast the "
                f"source to {dtype} (the served weights keep the trainer's exact bytes, so the "
                "workers do not cast)"
            )
        if unquantized:
            assert self.fp8 is not None
            out.append(
                f"the served model takes {_listed(unquantized)} in FP8 "
                f"({describe_scheme(self.fp8.scheme)}, beside its scale) and the round sends "
                "them unquantized: send the source through fp8_source(source, 'auto') "
                "(jax_side.quant / torch_side.sender.quant), which quantizes what the served "
                "model takes in FP8"
            )
        missing = [n for n in self.tensors if n not in covered]
        if missing and not partial:
            out.append(
                f"{_listed(missing)} of the served model missing from the round "
                f"({len(covered)} of {len(self.tensors)} sent): the model would serve them "
                "unchanged beside the new ones. Send the whole model, or pass "
                "TrainerInitInfo(partial=True) if the rounds leave them out on purpose (frozen "
                "layers)"
            )
        return out

    def check_round(self, metas: Sequence[ParamMeta], *, partial: bool = False) -> None:
        """Raise ``ServedModelMismatch`` naming every problem of the round (``problems``).
        An adapter round (LoRA tensors, ``shared.lora``) is not the base model's: it passes."""
        if is_adapter_round([m.name for m in metas]):
            return
        found = self.problems(metas, partial=partial)
        if found:
            raise ServedModelMismatch(
                "the round does not fit the served model; nothing was sent: " + "; ".join(found)
            )

    def check_fp8_spec(self, spec: Mapping[str, Fp8Scheme]) -> None:
        """Raise ``ServedModelMismatch`` when a trainer's FP8 spec quantizes a tensor the
        served model does not take in FP8, or takes with another scheme (block size, scale
        rounding): before any byte, naming the tensors and the fix."""
        served = self.fp8.weights if self.fp8 is not None else frozenset()
        not_fp8 = sorted(n for n in spec if n not in served)
        other = sorted(n for n in spec if n in served and spec[n] != self.fp8.scheme)  # type: ignore[union-attr]
        out: list[str] = []
        if not_fp8:
            held = ", ".join(
                f"{n} ({self.tensors[k].dtype})"
                for n in not_fp8[:SHOWN]
                if (k := self.canonical(n)) is not None
            )
            out.append(
                f"the FP8 spec quantizes {_listed(not_fp8)}, which the served model does not "
                f"take in FP8{' (it holds ' + held + ')' if held else ''}: leave them out of "
                "the spec, or use fp8_source(source, 'auto'), which quantizes exactly what the "
                "served model takes in FP8"
            )
        if other:
            assert self.fp8 is not None
            schemes = sorted({describe_scheme(spec[n]) for n in other})
            out.append(
                f"the FP8 spec quantizes {_listed(other)} as {' / '.join(schemes)}; the served "
                f"model's checkpoint takes {describe_scheme(self.fp8.scheme)} (its "
                "quantization_config): use that scheme, or fp8_source(source, 'auto')"
            )
        if out:
            raise ServedModelMismatch(
                "the FP8 spec does not fit the served model; nothing was sent: " + "; ".join(out)
            )

    # -- the wire ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tensors": [m.to_dict() for m in self.tensors.values()],
            "aliases": dict(self.aliases),
            "checks_dtype": self.checks_dtype,
        }
        if self.fp8 is not None:  # absent otherwise: an older trainer's strict parse reads it
            out["fp8"] = self.fp8.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: object, ctx: str = "served_model") -> ServedModel:
        """Strict parse: unknown keys, wrong types and bad tensors raise ``ValueError``."""
        if not isinstance(data, dict):
            raise ValueError(f"{ctx} must be a JSON object, got {type(data).__name__}")
        extra = sorted(str(k) for k in data if k not in _KEYS)
        if extra:
            raise ValueError(f"{ctx}: unknown keys {extra}; allowed: {sorted(_KEYS)}")
        tensors = data.get("tensors")
        if not isinstance(tensors, list) or not tensors:
            raise ValueError(f"{ctx}.tensors must be a non-empty list")
        aliases = data.get("aliases", {})
        if not isinstance(aliases, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()
        ):
            raise ValueError(f"{ctx}.aliases must map names to names")
        checks = data.get("checks_dtype", True)
        if type(checks) is not bool:
            raise ValueError(f"{ctx}.checks_dtype must be a bool, got {checks!r}")
        metas = [ParamMeta.from_dict(t) for t in tensors]
        if len({m.name for m in metas}) != len(metas):
            raise ValueError(f"{ctx}.tensors names a tensor twice")
        fp8 = data.get("fp8")
        served = cls.of(metas, aliases, checks_dtype=checks)
        if fp8 is None:
            return served
        told = Fp8Served.from_dict(fp8, f"{ctx}.fp8")
        unknown = sorted(told.weights - set(served.tensors))
        if unknown:
            raise ValueError(f"{ctx}.fp8.weights names {unknown[0]!r}, not one of its tensors")
        return cls(served.tensors, served.aliases, checks, told)


def _listed(names: Sequence[str], *, count: bool = True) -> str:
    shown = ", ".join(names[:SHOWN]) + (", ..." if len(names) > SHOWN else "")
    return f"{len(names)} tensor(s) [{shown}]" if count else shown


def from_checkpoint(model_dir: str | os.PathLike[str]) -> ServedModel:
    """What a server that cannot tell serves, read from its checkpoint directory (the
    ``*.safetensors`` headers and ``config.json``): names and full shapes, the tied head an
    alias of the embedding where the checkpoint leaves it out. Dtypes are not checked
    (``checks_dtype=False``): stock vLLM casts every tensor into its parameter on load.
    ``ConfigError`` naming the directory when it holds no readable safetensors checkpoint."""
    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"served_checkpoint {str(root)!r} holds no *.safetensors files: pass the directory "
            "the server loaded its model from (a local copy of it), or None"
        )
    metas: dict[str, ParamMeta] = {}
    for path in files:
        for name, meta in _safetensors_header(path).items():
            metas.setdefault(name, meta)
    aliases: dict[str, str] = {}
    config = checkpoint_config(root)
    if _TIED_HEAD not in metas and config.get("tie_word_embeddings", True) is not False:
        embedding = next((e for e in _EMBEDDINGS if e in metas), None)
        if embedding is not None:
            aliases[_TIED_HEAD] = embedding
    try:
        fp8 = fp8_of(metas, config.get("quantization_config"))
    except QuantizationError as exc:
        raise ConfigError(f"served_checkpoint {str(root)!r}: {exc}") from None
    return ServedModel(metas, aliases, checks_dtype=False, fp8=fp8)


def _safetensors_header(path: Path) -> dict[str, ParamMeta]:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            (size,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 0 < size <= _MAX_HEADER:
                raise ValueError(f"header length {size}")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        out: dict[str, ParamMeta] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"{name!r} has dtype {entry['dtype']!r}, not a wire dtype")
            out[name] = ParamMeta(name, dtype, tuple(entry["shape"]))
        return out
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"served_checkpoint: cannot read {str(path)!r} as a safetensors checkpoint ({exc}); "
            "pass the served model's directory, or None to skip the check"
        ) from None


def checkpoint_config(root: Path) -> dict[str, Any]:
    """The checkpoint directory ``root``'s ``config.json``; ``{}`` where it is missing or not
    a JSON object (the caller then falls back to its defaults)."""
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def from_worker_answers(results: object, ctx: str) -> ServedModel | None:
    """The served model every worker told (``/collective_rpc``'s ``results``); ``None`` when
    one told nothing (vLLM's own engine, no local checkpoint). ``ValueError`` for a malformed
    answer or workers that disagree."""
    if not isinstance(results, list) or not results:
        return None
    if any(r is None for r in results):
        return None
    models = [ServedModel.from_dict(r, f"{ctx} worker {i}") for i, r in enumerate(results)]
    if any(m != models[0] for m in models[1:]):
        raise ValueError(f"{ctx}: the workers tell different models")
    return models[0]
