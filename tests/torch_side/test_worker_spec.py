"""``ModelSpec``: a round's update info is checked against the served checkpoint."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.worker.spec import ModelSpec, TensorSpec


@pytest.fixture
def spec(tmp_path) -> ModelSpec:
    save_file(
        {
            "model.embed_tokens.weight": torch.zeros(16, 8),
            "model.layers.0.self_attn.k_proj.weight": torch.zeros(4, 8),
            "model.layers.0.mlp.up_proj.weight": torch.zeros(12, 8),
            "model.norm.weight": torch.zeros(8),
            "model.step": torch.zeros(1, dtype=torch.int64),
        },
        str(tmp_path / "model.safetensors"),
    )
    got = ModelSpec.from_checkpoint(
        tmp_path, served_dtype="bfloat16", aliases={"lm_head.weight": "model.embed_tokens.weight"}
    )
    assert got is not None
    return got


def _metas(spec: ModelSpec, **changes: tuple[str, tuple[int, ...]]) -> list[ParamMeta]:
    out = []
    for name, want in spec.tensors.items():
        dtype, shape = changes.get(name, (want.dtype, want.shape))
        out.append(ParamMeta(name, dtype, shape))
    return out


def test_served_dtype_applies_to_floats_only(spec: ModelSpec) -> None:
    assert spec.tensors["model.norm.weight"] == TensorSpec((8,), "bfloat16")
    assert spec.tensors["model.step"] == TensorSpec((1,), "int64")
    spec.check(_metas(spec))  # the full model, as served: accepted
    spec.check([ParamMeta("model.norm.weight", "bfloat16", (8,))])  # a non-layer tensor alone
    spec.check([ParamMeta("lm_head.weight", "bfloat16", (16, 8))])  # a tied alias


@pytest.mark.parametrize(
    ("metas", "message"),
    [
        (
            [
                ParamMeta("model.layers.0.self_attn.k_proj.weight", "bfloat16", (8, 4)),
                ParamMeta("model.layers.0.mlp.up_proj.weight", "bfloat16", (12, 8)),
            ],
            "'model.layers.0.self_attn.k_proj.weight' has shape [8, 4], the model's is [4, 8]",
        ),
        (
            [ParamMeta("model.norm.weight", "float32", (8,))],
            "'model.norm.weight' is float32, the model holds it as bfloat16 (no silent cast)",
        ),
        (
            [ParamMeta("model.extra", "bfloat16", (8,))],
            "'model.extra' is not a tensor of the model",
        ),
        (
            [ParamMeta("model.layers.0.self_attn.k_proj.weight", "bfloat16", (4, 8))],
            "layer 'model.layers.0' is incomplete: missing 'model.layers.0.mlp.up_proj.weight'",
        ),
        (
            [ParamMeta("model.norm.weight", "bfloat16", (8,))] * 2,
            "'model.norm.weight' is listed twice",
        ),
    ],
)
def test_mismatches_are_refused_naming_the_problem(
    spec: ModelSpec, metas: list[ParamMeta], message: str
) -> None:
    with pytest.raises(ValueError, match="refused before any byte was received") as err:
        spec.check(metas)
    assert message in str(err.value)


def test_no_safetensors_means_no_spec(tmp_path) -> None:
    assert ModelSpec.from_checkpoint(tmp_path, served_dtype="float32") is None
    assert ModelSpec.from_checkpoint(tmp_path / "hub-id-not-a-dir", served_dtype="float32") is None


def test_the_spec_tells_the_trainer_the_same_model() -> None:
    """What a plugin worker tells (``/collective_rpc``): the names, dtypes, shapes and tied
    aliases it checks rounds against; nothing when a tensor is in no wire dtype."""
    from weightwire.shared.served import ServedModel

    spec = ModelSpec(
        {"model.embed_tokens.weight": TensorSpec((16, 8), "bfloat16")},
        {"lm_head.weight": "model.embed_tokens.weight"},
    )
    assert spec.served() == ServedModel.of(
        [ParamMeta("model.embed_tokens.weight", "bfloat16", (16, 8))],
        {"lm_head.weight": "model.embed_tokens.weight"},
    )
    assert ModelSpec({"model.step": TensorSpec((1,), "int16")}).served() is None
