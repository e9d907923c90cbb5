"""Naming presets for the model families users train: ``preset(family, **options)``.

Leaf paths follow the Flax convention of naming modules after the HF ones (what the
reference models in ``weightwire.tools.models`` do, and what most Flax ports do):
``params/model/layers_3/self_attn/q_proj/kernel`` or, with scanned layers, one stacked
``params/model/layers/...`` subtree. The leading ``params`` component is optional.

Unrolled layers may also be a list (``layers/3``, as NNX and Equinox flatten). MoE
families stack each expert projection (``mlp/experts/gate_proj/kernel [experts, in,
out]``, scanned ``[layers, experts, in, out]``) and send one HF tensor per expert;
``leaf_style="torch"`` takes Equinox-style ``weight [out, in]`` leaves. A new family is
one builder function registered with ``register_family`` (see ``examples/add_a_family.py``).

Rules are listed in HF ``state_dict`` order, which fixes the metadata order: embeddings,
then each layer whole, then the final norm and ``lm_head``. Options not given take the
family's HF defaults; an unknown option is a ``TypeError`` (a typo silently ignored
would produce a mapping that fails much later, on the server).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from weightwire.jax_side.naming import (
    AddScalar,
    MergeAxes,
    Naming,
    NamingError,
    Op,
    Split,
    Stacked,
    Transpose,
)
from weightwire.jax_side.preset_layers import (
    concat_qkv,
    hf_fused_mlp_rules,
    hf_fused_qkv_rules,
    moe_rules,
    need_sizes,
)
from weightwire.jax_side.rules import Rule, drop
from weightwire.shared.errors import ConfigError, WrongType

_DECODER: dict[str, Any] = {
    "tie_word_embeddings": False,
    "attention_bias": False,  # bias on q, k, v and o
    "qkv_bias": False,  # bias on q, k, v only (Qwen2)
    "mlp_bias": False,
    "qk_norm": False,  # per-head RMSNorm on q and k (Qwen3)
    "scan_layers": False,  # one stacked `layers` subtree, leading axis = layer
    "fused_qkv": False,  # one `qkv_proj` Dense -> HF q_proj, k_proj, v_proj
    "fused_gate_up": False,  # one `gate_up_proj` Dense -> HF gate_proj, up_proj
    # DenseGeneral q/k/v kernels [hidden, heads, head_dim], o [heads, head_dim, hidden]
    "head_axes": False,
    "norm_scale_offset": 0.0,  # added to every norm scale (-1.0: JAX stores Gemma's 1 + w)
    "num_attention_heads": None,  # sizes: needed only for fused_qkv / fused_gate_up
    "num_key_value_heads": None,
    "head_dim": None,
    "intermediate_size": None,
    "extra_rules": (),  # rules tried before the preset's own (overrides, drops)
    # -- families beyond the Llama core (rule blocks in ``preset_layers``)
    # "qwen" (mlp.gate, mlp.experts.{e}.*_proj) or "mixtral" (block_sparse_moe.*.w1/w2/w3)
    "moe": None,
    "shared_expert": False,  # Qwen2-MoE: mlp.shared_expert.* and mlp.shared_expert_gate
    "expert_axis": 0,  # expert axis of a per-layer expert kernel [experts, in, out]
    "moe_intermediate_size": None,  # needed only for fused_gate_up with experts
    "sandwich_norms": False,  # Gemma 2/3: pre_/post_feedforward_layernorm besides the usual two
    # Phi-3: HF has qkv_proj and gate_up_proj; JAX q/k/v (gate/up) are fused into them
    "hf_fused": False,
    # "torch": Equinox-style leaves (Linear `weight` [out, in], norms/embeddings `weight`)
    "leaf_style": "flax",
}
_FAMILY: dict[str, dict[str, Any]] = {
    # The one table of what sets the decoder families apart (``family_options``): the
    # layouts (``layouts``) and the reference models (``models.decoder``) read it too.
    "llama": {},
    "llama3": {},  # Llama 3.x: same names; rope scaling and (3.2) tied heads live in config.json
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma": {"tie_word_embeddings": True},
    "gemma2": {"tie_word_embeddings": True, "sandwich_norms": True},
    "gemma3": {"tie_word_embeddings": True, "sandwich_norms": True, "qk_norm": True},
    "phi3": {"hf_fused": True},
    "qwen2_moe": {"qkv_bias": True, "moe": "qwen", "shared_expert": True},
    "qwen3_moe": {"qk_norm": True, "moe": "qwen"},
    "mixtral": {"moe": "mixtral"},
}
DECODER_FAMILIES: tuple[str, ...] = tuple(_FAMILY)
"""The families ``preset`` builds from the Llama-style decoder rules."""
FAMILIES: tuple[str, ...] = (*DECODER_FAMILIES, "gpt2")
"""Every built-in preset family."""
_SANDWICH = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
_GPT2: dict[str, Any] = {
    "tie_word_embeddings": True,
    "scan_layers": False,
    "separate_qkv": False,  # JAX keeps q/k/v apart -> fused into HF's c_attn
    "extra_rules": (),
}


_REGISTERED: dict[str, tuple[Callable[..., Naming], dict[str, Any]]] = {}


def family_options(family: str) -> dict[str, Any]:
    """Every decoder option of ``family``'s preset: the shared defaults with the family's own
    switches applied (``qkv_bias``, ``qk_norm``, ``tie_word_embeddings``, ``moe``, ...).
    ``ConfigError`` (a ``ValueError``) for a family that is not a built-in decoder family."""
    if family not in _FAMILY:
        raise ConfigError(
            f"{family!r} is not a built-in decoder family; known: {', '.join(DECODER_FAMILIES)}"
        )
    return {**_DECODER, **_FAMILY[family]}


def register_family(family: str, build: Callable[..., Naming], defaults: Mapping[str, Any]) -> None:
    """Make ``preset(family, **options)`` return ``build(**{**defaults, **options})``.

    ``defaults`` lists every option ``build`` takes, so a misspelt option is a
    ``TypeError`` here as for the built-in families. Built-in names cannot be replaced
    (a silently swapped Llama mapping would mis-send every user's weights); registering
    the same custom name again replaces it (re-running a notebook cell).
    """
    if family in FAMILIES:
        raise ConfigError(
            f"{family!r} is a built-in preset family; pick another name, or pass extra_rules to it"
        )
    if not callable(build):
        raise WrongType(f"build must be a callable returning a Naming, got {type(build).__name__}")
    _REGISTERED[family] = (build, dict(defaults))


def preset(family: str, **options: Any) -> Naming:
    """The ``Naming`` for ``family`` (see ``FAMILIES``, or ``register_family``) with the given
    layout options."""
    if family in _REGISTERED:
        build, defaults = _REGISTERED[family]
        naming = build(**_options(family, defaults, options))
        if not isinstance(naming, Naming):
            raise WrongType(
                f"the builder registered for {family!r} returned "
                f"{type(naming).__name__}, not a Naming"
            )
        return naming
    if family == "gpt2":
        return _list_indices(_gpt2(**_options(family, _GPT2, options)))
    if family not in _FAMILY:
        raise ConfigError(
            f"unknown preset family {family!r}; known: {', '.join((*FAMILIES, *_REGISTERED))}"
        )
    o = _options(family, family_options(family), options)
    naming = _decoder(**o)
    if o["leaf_style"] == "torch":
        if o["head_axes"]:
            raise NamingError(
                "leaf_style='torch' has no head_axes layout (a torch-style weight is [out, in])"
            )
        naming = torch_style(naming, skip=len(o["extra_rules"]))
    elif o["leaf_style"] != "flax":
        raise NamingError(f"leaf_style must be 'flax' or 'torch', got {o['leaf_style']!r}")
    return _list_indices(naming)


def _options(family: str, defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise WrongType(
            f"preset {family!r} has no option(s) {unknown}; options: {sorted(defaults)}"
        )
    return {**defaults, **given}


def _decoder(**o: Any) -> Naming:
    stack: tuple[Stacked, ...] = (Stacked(),) if o["scan_layers"] else ()
    src = "model/layers" if o["scan_layers"] else "model/layers_{layer:\\d+}"
    dst = "model.layers.{layer}"
    t = Transpose()
    norm_ops: tuple[Op, ...] = (
        (AddScalar(float(o["norm_scale_offset"])),) if o["norm_scale_offset"] else ()
    )
    qkv_bias = o["qkv_bias"] or o["attention_bias"]
    rules: list[Rule] = [
        *o["extra_rules"],
        Rule("model/embed_tokens/embedding", "model.embed_tokens.weight"),
    ]

    def linear(
        jax: str,
        hf: str,
        bias: bool,
        kernel_ops: tuple[Op, ...] = (t,),
        bias_ops: tuple[Op, ...] = (),
    ) -> None:
        rules.append(Rule(f"{src}/{jax}/kernel", f"{dst}.{hf}.weight", *stack, *kernel_ops))
        if bias:
            rules.append(Rule(f"{src}/{jax}/bias", f"{dst}.{hf}.bias", *stack, *bias_ops))

    if o["hf_fused"]:
        rules += hf_fused_qkv_rules(o, src, dst, stack, qkv_bias)
    elif o["fused_qkv"]:
        heads, kv, dim = need_sizes(
            o, "fused_qkv", "num_attention_heads", "num_key_value_heads", "head_dim"
        )
        sizes = (heads * dim, kv * dim, kv * dim)
        names = tuple(f"{dst}.self_attn.{p}_proj" for p in "qkv")
        rules.append(
            Rule(
                f"{src}/self_attn/qkv_proj/kernel",
                tuple(f"{n}.weight" for n in names),
                *stack,
                t,
                Split(0, sizes),
            )
        )
        if qkv_bias:
            rules.append(
                Rule(
                    f"{src}/self_attn/qkv_proj/bias",
                    tuple(f"{n}.bias" for n in names),
                    *stack,
                    Split(0, sizes),
                )
            )
    else:
        # DenseGeneral keeps heads as their own axes; HF Linear has them merged.
        kernel = (MergeAxes(1, 2), t) if o["head_axes"] else (t,)
        bias = (MergeAxes(0, 1),) if o["head_axes"] else ()
        for p in "qkv":
            linear(f"self_attn/{p}_proj", f"self_attn.{p}_proj", qkv_bias, kernel, bias)
    linear(
        "self_attn/o_proj",
        "self_attn.o_proj",
        o["attention_bias"],
        (MergeAxes(0, 1), t) if o["head_axes"] else (t,),
    )
    if o["qk_norm"]:
        for p in "qk":
            rules.append(
                Rule(
                    f"{src}/self_attn/{p}_norm/scale",
                    f"{dst}.self_attn.{p}_norm.weight",
                    *stack,
                    *norm_ops,
                )
            )
    if o["moe"]:
        rules += moe_rules(o, src, dst, stack)
    elif o["hf_fused"]:
        rules += hf_fused_mlp_rules(o, src, dst, stack)
    elif o["fused_gate_up"]:
        (inter,) = need_sizes(o, "fused_gate_up", "intermediate_size")
        names = (f"{dst}.mlp.gate_proj", f"{dst}.mlp.up_proj")
        rules.append(
            Rule(
                f"{src}/mlp/gate_up_proj/kernel",
                tuple(f"{n}.weight" for n in names),
                *stack,
                t,
                Split(0, (inter, inter)),
            )
        )
        if o["mlp_bias"]:
            rules.append(
                Rule(
                    f"{src}/mlp/gate_up_proj/bias",
                    tuple(f"{n}.bias" for n in names),
                    *stack,
                    Split(0, (inter, inter)),
                )
            )
    else:
        linear("mlp/gate_proj", "mlp.gate_proj", o["mlp_bias"])
        linear("mlp/up_proj", "mlp.up_proj", o["mlp_bias"])
    if not (o["moe"] or o["hf_fused"]):
        linear("mlp/down_proj", "mlp.down_proj", o["mlp_bias"])
    for norm in (
        "input_layernorm",
        "post_attention_layernorm",
        *(_SANDWICH if o["sandwich_norms"] else ()),
    ):
        rules.append(Rule(f"{src}/{norm}/scale", f"{dst}.{norm}.weight", *stack, *norm_ops))
    rules.append(Rule("model/norm/scale", "model.norm.weight", *norm_ops))
    if not o["tie_word_embeddings"]:
        # Tied models send no lm_head: the server ties it to the embedding it just received.
        rules.append(Rule("lm_head/kernel", "lm_head.weight", t))
    # Rotary tables some Flax ports keep in the tree: recomputed by the server, never sent.
    rules += [drop("**rotary_emb**"), drop("**inv_freq")]
    return Naming(rules, strip=("params",))


def _gpt2(**o: Any) -> Naming:
    # HF GPT-2 uses Conv1D, whose weight is already [in, out] like a Flax kernel: no transposes.
    stack: tuple[Stacked, ...] = (Stacked(),) if o["scan_layers"] else ()
    src = "transformer/h" if o["scan_layers"] else "transformer/h_{layer:\\d+}"
    dst = "transformer.h.{layer}"
    rules: list[Rule] = [
        *o["extra_rules"],
        Rule("transformer/wte/embedding", "transformer.wte.weight"),
        Rule("transformer/wpe/embedding", "transformer.wpe.weight"),
    ]

    def affine(jax: str, hf: str, weight: str = "kernel") -> None:
        rules.append(Rule(f"{src}/{jax}/{weight}", f"{dst}.{hf}.weight", *stack))
        rules.append(Rule(f"{src}/{jax}/bias", f"{dst}.{hf}.bias", *stack))

    affine("ln_1", "ln_1", "scale")
    if o["separate_qkv"]:
        rules += concat_qkv(f"{src}/attn", f"{dst}.attn.c_attn", stack, (), 1, ())
    else:
        affine("attn/c_attn", "attn.c_attn")
    affine("attn/c_proj", "attn.c_proj")
    affine("ln_2", "ln_2", "scale")
    affine("mlp/c_fc", "mlp.c_fc")
    affine("mlp/c_proj", "mlp.c_proj")
    rules.append(Rule("transformer/ln_f/scale", "transformer.ln_f.weight"))
    rules.append(Rule("transformer/ln_f/bias", "transformer.ln_f.bias"))
    if not o["tie_word_embeddings"]:
        rules.append(Rule("lm_head/kernel", "lm_head.weight", Transpose()))
    return Naming(rules, strip=("params",))


def generic(mapping: Sequence[tuple[str, str | None]], *, transpose_kernels: bool = True) -> Naming:
    """A flat rule set from ``(pattern, target)`` pairs; ``*/kernel`` leaves are transposed
    when ``transpose_kernels`` (Flax Dense -> torch Linear)."""
    rules = []
    for pattern, target in mapping:
        ops = (
            (Transpose(),)
            if transpose_kernels and target is not None and pattern.endswith("kernel")
            else ()
        )
        rules.append(Rule(pattern, target, *ops))
    return Naming(rules)


_INDEXED = re.compile(r"_(\{layer:\\d\+\})")
_FLAX_LEAF = {"kernel": "weight", "scale": "weight", "embedding": "weight"}


def _list_indices(naming: Naming) -> Naming:
    """Unrolled layers as Linen names them (``layers_3``) or as a Python list inside an NNX
    or Equinox module flattens (``layers/3``): both match."""
    rules = [
        r
        if not _INDEXED.search(r.pattern)
        else Rule(
            _INDEXED.sub(r"{_sep:[_/]}\1", r.pattern), r.target, *r.parts, optional=r.optional
        )
        for r in naming.rules
    ]
    return Naming(rules, strip=naming.strip)


def torch_style(naming: Naming, *, skip: int = 0) -> Naming:
    """The same mapping for a tree whose leaves follow torch's conventions, as Equinox's
    ``nn.Linear`` / ``nn.Embedding`` / ``nn.RMSNorm`` do: ``weight`` instead of Flax's
    ``kernel`` / ``embedding`` / ``scale``, and linear weights already ``[out, in]``
    (each kernel rule's leading transpose is dropped; a split or fuse after it then cuts
    the same HF axis). The first ``skip`` rules (a preset's ``extra_rules``, written by
    the user for their own tree) are kept as they are."""
    rules = list(naming.rules[:skip])
    for r in naming.rules[skip:]:
        head, _, leaf = r.pattern.rpartition("/")
        if r.target is None or leaf not in _FLAX_LEAF:
            rules.append(r)
            continue
        parts = list(r.parts)
        if leaf == "kernel":
            first = next((i for i, p in enumerate(parts) if isinstance(p, Op)), None)
            if first is None or parts[first] != Transpose():
                raise NamingError(
                    f"rule {r.pattern!r}: no leading transpose to drop for a torch-style weight"
                )
            del parts[first]
        rules.append(
            Rule(
                f"{head}/{_FLAX_LEAF[leaf]}" if head else _FLAX_LEAF[leaf],
                r.target,
                *parts,
                optional=r.optional,
            )
        )
    return Naming(rules, strip=naming.strip)
