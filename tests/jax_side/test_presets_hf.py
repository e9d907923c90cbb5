"""The proof that names and layouts are right: map each family's Flax model with its
preset, load the tensors into the matching ``transformers`` torch model with
``strict=True``, and compare logits on the same tokens.

torch is imported inside the tests only; ``weightwire.jax_side`` itself never imports it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import LLAMA3_ROPE
from jaxside_util import perturbed

from weightwire.jax_side import PytreeSource, preset
from weightwire.jax_side.rules import Rule
from weightwire.tools.models import decoder, gpt2

pytest.importorskip("torch")
pytest.importorskip("transformers")

TOKENS = np.random.default_rng(0).integers(0, 128, size=(2, 9))


def _to_torch(array: jax.Array) -> Any:
    import torch

    host = np.asarray(array)
    if host.dtype == jnp.bfloat16:
        return torch.from_numpy(host.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(host.copy())


def _hf_logits(
    cfg: Any, source: PytreeSource, *, bf16: bool = False
) -> tuple[np.ndarray, list[str]]:
    import torch
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_config())
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_cfg, attn_implementation="eager"
    ).eval()
    if bf16:
        model = model.to(torch.bfloat16)
    state = {name: _to_torch(array) for name, array in source}
    sent = list(state)
    if hf_cfg.tie_word_embeddings:
        # Tied: the sender omits lm_head, the server ties it; resolve it here for strict loading.
        assert "lm_head.weight" not in state
        embed = (
            "transformer.wte.weight"
            if cfg.to_hf_config()["model_type"] == "gpt2"
            else "model.embed_tokens.weight"
        )
        state["lm_head.weight"] = state[embed]
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model(torch.from_numpy(TOKENS)).logits.float().numpy()
    return logits, sent


def _hf_order(cfg: Any) -> list[str]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**cfg.to_hf_config())
    )
    names = list(model.state_dict())
    return [n for n in names if not (cfg.tie_word_embeddings and n == "lm_head.weight")]


DECODER_CASES = [
    ("llama", {}),
    ("llama", {"fused_qkv": True, "fused_gate_up": True, "attention_bias": True, "mlp_bias": True}),
    ("llama", {"head_axes": True, "attention_bias": True, "tie_word_embeddings": True}),
    (
        "llama",
        {
            "rope_scaling": (
                ("factor", 8.0),
                ("high_freq_factor", 4.0),
                ("low_freq_factor", 1.0),
                ("original_max_position_embeddings", 8),
                ("rope_type", "llama3"),
            )
        },
    ),
    ("qwen2", {}),
    ("qwen2", {"tie_word_embeddings": True, "fused_qkv": True, "scan_layers": True}),
    ("qwen3", {}),
    ("qwen3", {"scan_layers": True, "attention_bias": True}),
    ("gemma", {}),
]


@pytest.mark.parametrize(
    ("family", "options"),
    DECODER_CASES,
    ids=[f"{f}-{'-'.join(o) or 'plain'}" for f, o in DECODER_CASES],
)
def test_decoder_family_logits_match_hf_fp32(family: str, options: dict[str, Any]) -> None:
    cfg = decoder.DecoderConfig.for_family(family, head_dim=16, **options)
    params = perturbed(decoder.init(jax.random.key(0), cfg))
    source = PytreeSource(params, decoder.naming(cfg), dtype="float32")
    ref, sent = _hf_logits(cfg, source)
    ours = np.asarray(decoder.apply(params, jnp.asarray(TOKENS), cfg))
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    hf_order = _hf_order(cfg)
    assert sorted(sent) == sorted(hf_order)
    if not (cfg.fused_qkv or cfg.fused_gate_up):
        assert sent == hf_order  # metadata order is HF's own state_dict order


def test_gemma_full_scale_convention_with_offset_rule() -> None:
    # A JAX Gemma that stores the full multiplier (1 + w) maps with norm_scale_offset=-1.
    cfg = decoder.DecoderConfig.for_family("gemma", head_dim=16)
    params = perturbed(decoder.init(jax.random.key(0), cfg))
    full = jax.tree_util.tree_map_with_path(
        lambda kp, x: x + 1.0 if "norm" in jax.tree_util.keystr(kp) else x, params
    )
    source = PytreeSource(full, preset("gemma", norm_scale_offset=-1.0), dtype="float32")
    ref, _ = _hf_logits(cfg, source)
    np.testing.assert_allclose(
        np.asarray(decoder.apply(params, jnp.asarray(TOKENS), cfg)), ref, rtol=1e-4, atol=1e-4
    )


GPT2_CASES = [{}, {"separate_qkv": True}, {"tie_word_embeddings": False}]


@pytest.mark.parametrize("options", GPT2_CASES, ids=["plain", "separate_qkv", "untied"])
def test_gpt2_logits_match_hf_fp32(options: dict[str, Any]) -> None:
    cfg = gpt2.config(**options)
    params = perturbed(gpt2.init(jax.random.key(0), cfg))
    source = PytreeSource(params, gpt2.naming(cfg), dtype="float32")
    ref, sent = _hf_logits(cfg, source)
    np.testing.assert_allclose(
        np.asarray(gpt2.apply(params, jnp.asarray(TOKENS), cfg)), ref, rtol=1e-4, atol=1e-4
    )
    assert sent == _hf_order(cfg)


def test_gpt2_transposed_conv1d_would_be_caught() -> None:
    # The square c_proj loads fine transposed; only the logits reveal it. This is the
    # check the fp32 tests rely on, so prove it can fail.
    from weightwire.jax_side.naming import Transpose

    cfg = gpt2.config()
    params = perturbed(gpt2.init(jax.random.key(0), cfg))
    wrong = Rule(
        "transformer/h_{layer:\\d+}/attn/c_proj/kernel",
        "transformer.h.{layer}.attn.c_proj.weight",
        Transpose(),
    )
    source = PytreeSource(params, preset("gpt2", extra_rules=(wrong,)))
    ref, _ = _hf_logits(cfg, source)
    ours = np.asarray(gpt2.apply(params, jnp.asarray(TOKENS), cfg))
    assert np.abs(ours - ref).max() > 1e-2


BF16_CASES = [("llama", {}), ("qwen3", {"scan_layers": True}), ("gemma", {}), ("gpt2", {})]


@pytest.mark.parametrize(("family", "options"), BF16_CASES, ids=[f for f, _ in BF16_CASES])
def test_bf16_cast_logits_close_to_fp32(family: str, options: dict[str, Any]) -> None:
    module = gpt2 if family == "gpt2" else decoder
    cfg = (
        gpt2.config(**options)
        if family == "gpt2"
        else decoder.DecoderConfig.for_family(family, head_dim=16, **options)
    )
    params = perturbed(module.init(jax.random.key(0), cfg))
    source = PytreeSource(params, module.naming(cfg), dtype="bfloat16")
    assert {m.dtype for m in source.metadata()} == {"bfloat16"}
    ref, _ = _hf_logits(cfg, source, bf16=True)
    ours = np.asarray(module.apply(params, jnp.asarray(TOKENS), cfg))
    scale = np.abs(ours).max()
    err = np.abs(ours - ref).max()
    assert err < 0.05 * scale, (err, scale)
    assert err > 0  # really went through bf16


HF_SMALL = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_from_hf_config_of_a_real_hf_config_maps_onto_its_state_dict(family: str) -> None:
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(family, **HF_SMALL)
    cfg = decoder.DecoderConfig.from_hf_config(hf_cfg.to_dict())
    assert cfg.family == family and cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    want = {
        n: tuple(t.shape)
        for n, t in model.state_dict().items()
        if not (hf_cfg.tie_word_embeddings and n == "lm_head.weight")
    }
    metas = PytreeSource(decoder.init(jax.random.key(0), cfg), decoder.naming(cfg)).metadata()
    assert {m.name: m.shape for m in metas} == want


def test_llama_from_hf_config_dict_with_llama3_rope_matches_logits() -> None:
    import transformers

    from weightwire.tools.models import llama

    hf_dict = transformers.LlamaConfig(
        **HF_SMALL, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True
    ).to_dict()
    cfg = llama.LlamaConfig.from_hf_config(hf_dict)
    params = perturbed(llama.init(jax.random.key(0), cfg))
    ref, _ = _hf_logits(cfg, PytreeSource(params, llama.naming(cfg)))
    np.testing.assert_allclose(
        np.asarray(llama.apply(params, jnp.asarray(TOKENS), cfg)), ref, rtol=1e-4, atol=1e-4
    )


def test_llama_left_padding_mask_and_positions_match_hf() -> None:
    import torch
    import transformers

    from weightwire.tools.models import llama

    cfg = llama.config(head_dim=16)
    params = perturbed(llama.init(jax.random.key(0), cfg))
    mask = np.ones_like(TOKENS)
    mask[0, :3] = 0  # row 0 left-padded by 3
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**cfg.to_hf_config()), attn_implementation="eager"
    ).eval()
    model.load_state_dict(
        {n: _to_torch(a) for n, a in PytreeSource(params, llama.naming(cfg))}, strict=True
    )
    with torch.no_grad():
        ref = model(
            torch.from_numpy(TOKENS),
            attention_mask=torch.from_numpy(mask),
            position_ids=torch.from_numpy(positions),
        ).logits.numpy()
    ours = np.asarray(
        llama.apply(
            params,
            jnp.asarray(TOKENS),
            cfg,
            attention_mask=jnp.asarray(mask),
            positions=jnp.asarray(positions),
        )
    )
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], rtol=1e-4, atol=1e-4)
