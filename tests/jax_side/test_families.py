"""Each new preset family checked the way a user would: a tiny random HF checkpoint
(``save_pretrained``'s on-disk names, the ones vLLM loads) loaded into the preset's JAX
layout with ``pytree_from_hf``, then sent back through ``PytreeSource``: every name
present, every byte equal.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest
from hf_tiny import HF_FAMILIES, n_experts, tiny_checkpoint

from weightwire.jax_side import PytreeSource, preset
from weightwire.jax_side.checkpoint import CheckpointError, pytree_from_hf, read_safetensors
from weightwire.jax_side.layouts import preset_for_hf
from weightwire.jax_side.layouts import preset_layout as jax_template
from weightwire.jax_side.naming import Naming, NamingError, Stacked, Transpose
from weightwire.jax_side.rules import Rule
from weightwire.shared.groups import layerwise_groups

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, dict]]:
    """family -> (config.json dict, tensors), built once per module."""
    out = {}
    for family in HF_FAMILIES:
        d = tmp_path_factory.mktemp(family)
        out[family] = (tiny_checkpoint(family, d), read_safetensors(d))
    return out


def checkpoint_for(
    naming: Any, template: Any, tensors: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    # A tied checkpoint may carry lm_head.weight; send it only if the preset does.
    names = {e.name for e in naming.resolve(template).entries}
    return {n: t for n, t in tensors.items() if n in names or n != "lm_head.weight"}


CASES = [
    ("llama3", {}),
    ("llama3", {"scan_layers": True}),
    ("phi3", {}),  # separate q/k/v, gate/up in JAX -> HF's fused qkv_proj / gate_up_proj
    ("phi3", {"fused_qkv": True, "fused_gate_up": True, "scan_layers": True}),
    ("gemma2", {}),
    ("gemma2", {"scan_layers": True}),
    ("gemma3", {}),
    ("gemma3", {"scan_layers": True, "fused_qkv": True}),
    ("qwen3_moe", {}),
    ("qwen3_moe", {"scan_layers": True}),
    ("qwen3_moe", {"scan_layers": True, "fused_gate_up": True}),
    ("qwen2_moe", {}),
    ("qwen2_moe", {"scan_layers": True}),
    ("mixtral", {}),
    ("mixtral", {"scan_layers": True, "fused_gate_up": True}),
]


@pytest.mark.parametrize(
    ("family", "layout"), CASES, ids=[f"{f}-{'-'.join(o) or 'plain'}" for f, o in CASES]
)
def test_hf_checkpoint_round_trips_bit_for_bit(
    checkpoints, family: str, layout: dict[str, Any]
) -> None:
    hf, tensors = checkpoints[family]
    template = jax_template(family, hf, **layout)
    naming = preset_for_hf(family, hf, **layout)
    want = checkpoint_for(naming, template, tensors)
    params = pytree_from_hf(naming, template, want)
    sent = {name: np.asarray(a) for name, a in PytreeSource(params, naming)}
    assert sorted(sent) == sorted(want)
    for name, x in want.items():
        assert sent[name].dtype == x.dtype and sent[name].tobytes() == x.tobytes(), name


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_experts_are_sliced_from_the_stacked_kernel(checkpoints, family: str) -> None:
    # The stacked JAX kernel [layers, experts, in, out] holds expert e of layer l at [l, e]:
    # its transpose is HF's per-expert [out, in] weight.
    hf, tensors = checkpoints[family]
    naming = preset_for_hf(family, hf, scan_layers=True)
    params = pytree_from_hf(naming, jax_template(family, hf, scan_layers=True), tensors)
    block, (gate, down) = (
        ("block_sparse_moe", ("w1", "w2"))
        if family == "mixtral"
        else ("mlp", ("gate_proj", "down_proj"))
    )
    experts = params["params"]["model"]["layers"][block]["experts"]
    for layer, expert in ((0, 0), (1, n_experts(hf) - 1)):
        for proj in (gate, down):
            hf_name = f"model.layers.{layer}.{block}.experts.{expert}.{proj}.weight"
            np.testing.assert_array_equal(
                np.asarray(experts[proj]["kernel"][layer, expert]).T, tensors[hf_name]
            )
    router = np.asarray(params["params"]["model"]["layers"][block]["gate"]["kernel"][1])
    np.testing.assert_array_equal(router.T, tensors[f"model.layers.1.{block}.gate.weight"])


def test_moe_metadata_is_layer_contiguous_with_experts_in_numeric_order(checkpoints) -> None:
    hf, _ = checkpoints["qwen3_moe"]
    hf = {**hf, "num_experts": 12}
    naming = preset_for_hf("qwen3_moe", hf, scan_layers=True)
    metas = PytreeSource(jax_template("qwen3_moe", hf, scan_layers=True), naming).metadata()
    groups = layerwise_groups(metas)
    assert [len(g) for g in groups] == [1, 8 + 1 + 3 * 12, 8 + 1 + 3 * 12, 2]
    gates = [m.name for m in groups[1] if m.name.endswith("gate_proj.weight")]
    assert gates == [f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(12)]


def test_wrong_expert_count_is_named_before_loading(checkpoints) -> None:
    hf, tensors = checkpoints["mixtral"]
    template = jax_template("mixtral", {**hf, "num_local_experts": 3})
    with pytest.raises(CheckpointError, match="lacks|does not map"):
        pytree_from_hf(preset("mixtral"), template, tensors)


def test_phi3_fusion_order_is_q_k_v_and_gate_up(checkpoints) -> None:
    hf, tensors = checkpoints["phi3"]
    params = pytree_from_hf(preset("phi3"), jax_template("phi3", hf), tensors)
    attn = params["params"]["model"]["layers_1"]["self_attn"]
    qkv = tensors["model.layers.1.self_attn.qkv_proj.weight"]
    q_rows = hf["num_attention_heads"] * hf["head_dim"]
    np.testing.assert_array_equal(np.asarray(attn["q_proj"]["kernel"]).T, qkv[:q_rows])
    np.testing.assert_array_equal(np.asarray(attn["v_proj"]["kernel"]).T, qkv[-q_rows // 2 :])
    mlp = params["params"]["model"]["layers_1"]["mlp"]
    np.testing.assert_array_equal(
        np.asarray(mlp["up_proj"]["kernel"]).T,
        tensors["model.layers.1.mlp.gate_up_proj.weight"][hf["intermediate_size"] :],
    )


# ----------------------------------------------------------------- multi-axis Stacked
def test_two_stacked_axes_make_one_tensor_per_combination() -> None:
    w = jax.numpy.arange(2 * 3 * 4 * 5, dtype=jax.numpy.float32).reshape(2, 3, 4, 5)
    naming = Naming(
        [
            Rule(
                "l/w",
                "m.{layer}.e.{expert}.w",
                Stacked(0),
                Stacked(1, field="expert", offset=10),
                Transpose(),
            )
        ]
    )
    pairs = dict(PytreeSource({"l": {"w": w}}, naming))
    assert list(pairs)[:4] == ["m.0.e.10.w", "m.0.e.11.w", "m.0.e.12.w", "m.1.e.10.w"]
    np.testing.assert_array_equal(np.asarray(pairs["m.1.e.12.w"]), np.asarray(w[1, 2]).T)


def test_stacked_axis_order_in_the_leaf_is_free() -> None:
    # Experts before layers in the leaf (axis 0 = expert): fields still land right.
    w = jax.numpy.arange(3 * 2 * 4, dtype=jax.numpy.float32).reshape(3, 2, 4)
    naming = Naming([Rule("w", "m.{layer}.e.{expert}.w", Stacked(1), Stacked(0, field="expert"))])
    pairs = dict(PytreeSource({"w": w}, naming))
    np.testing.assert_array_equal(np.asarray(pairs["m.1.e.2.w"]), np.asarray(w[2, 1]))
    assert [len(g) for g in layerwise_groups(PytreeSource({"w": w}, naming).metadata())] == [3, 3]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Rule("w", "a.{layer}", Stacked(0), Stacked(1)), "distinct fields"),
        (
            lambda: Rule("{expert}/w", "a.{expert}", Stacked(0, field="expert")),
            "both a pattern capture",
        ),
        (lambda: Rule("w", "a.{layer}", Transpose(), Stacked(0)), "Stacked must be the first part"),
    ],
)
def test_bad_stacked_rules_are_refused(build, message: str) -> None:
    with pytest.raises(NamingError, match=message):
        build()


def test_stacking_one_axis_twice_is_refused() -> None:
    naming = Naming([Rule("w", "a.{layer}.{expert}", Stacked(0), Stacked(-2, field="expert"))])
    with pytest.raises(NamingError, match="twice along one axis"):
        naming.resolve({"w": jax.ShapeDtypeStruct((2, 3), jax.numpy.float32)})


# ------------------------------------------------------- our JAX forward vs HF torch logits
FORWARD_CASES = [
    ("phi3", {}),
    ("phi3", {"fused_qkv": True, "fused_gate_up": True, "scan_layers": True}),
    ("qwen3_moe", {}),
    ("qwen3_moe", {"scan_layers": True, "norm_topk_prob": True}),
    ("qwen2_moe", {"shared_expert_intermediate_size": 24}),
    ("mixtral", {"scan_layers": True}),
]


@pytest.mark.parametrize(
    ("family", "cfg_options"),
    FORWARD_CASES,
    ids=[f"{f}-{'-'.join(o) or 'plain'}" for f, o in FORWARD_CASES],
)
def test_reference_forward_matches_hf_loaded_from_what_we_send(
    tmp_path, family: str, cfg_options: dict
) -> None:
    # What we send, saved as a checkpoint and loaded by transformers' own from_pretrained
    # (which fuses per-expert tensors into its in-memory layout): no missing or unexpected
    # tensor, and the logits of our JAX forward.
    import torch
    import transformers
    from jaxside_util import perturbed
    from safetensors.numpy import save_file

    from weightwire.tools.models import decoder

    extra = {"moe_intermediate_size": 16} if family != "mixtral" and family != "phi3" else {}
    cfg = decoder.DecoderConfig.for_family(family, head_dim=16, **extra, **cfg_options)
    params = perturbed(decoder.init(jax.random.key(0), cfg))
    sent = {n: np.asarray(a) for n, a in PytreeSource(params, decoder.naming(cfg), dtype="float32")}
    transformers.AutoConfig.for_model(**cfg.to_hf_config()).save_pretrained(tmp_path)
    save_file(sent, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True, dtype=torch.float32
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 9))
    with torch.no_grad():
        ref = model.eval()(torch.from_numpy(tokens)).logits.numpy()
    ours = np.asarray(decoder.apply(params, jax.numpy.asarray(tokens), cfg))
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
