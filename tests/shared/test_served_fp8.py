"""The served model's FP8 linears: read from its ``quantization_config`` and held dtypes,
told in its JSON, and the trainer's FP8 spec checked against them before any byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weightwire.shared.errors import ConfigError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.quant import Fp8Block, Fp8PerTensor, scheme_from_dict, scheme_of_config
from weightwire.shared.served import ServedModel, ServedModelMismatch, from_checkpoint

DOWN = "model.layers.0.mlp.down_proj.weight"
UP = "model.layers.0.mlp.up_proj.weight"
NORM = "model.norm.weight"
BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
METAS = [
    ParamMeta(DOWN, "float8_e4m3fn", (64, 256)),
    ParamMeta(DOWN + "_scale_inv", "float32", (1, 2)),
    ParamMeta(UP, "bfloat16", (256, 64)),  # left unquantized (modules_to_not_convert)
    ParamMeta(NORM, "bfloat16", (64,)),
]


def test_the_scheme_is_read_from_the_quantization_config() -> None:
    assert scheme_of_config(BLOCK) == Fp8Block((128, 128))
    assert scheme_of_config({**BLOCK, "scale_fmt": "ue8m0"}) == Fp8Block((128, 128), True)
    assert scheme_of_config({**BLOCK, "weight_block_size": [64, 32]}) == Fp8Block((64, 32))
    assert scheme_of_config({"quant_method": "fp8"}) == Fp8PerTensor()
    assert scheme_of_config({"quant_method": "awq"}) is None and scheme_of_config(None) is None
    with pytest.raises(ConfigError, match="scale_fmt 'e8m0x'.*send this model's weights"):
        scheme_of_config({**BLOCK, "scale_fmt": "e8m0x"})


def test_the_fp8_linears_are_the_e4m3_weights_beside_their_scale() -> None:
    served = ServedModel.of(METAS, quantization_config=BLOCK)
    assert served.fp8 is not None and served.fp8.weights == {DOWN}
    assert served.fp8.scheme == Fp8Block((128, 128))
    # a model whose weights were dequantized on load (transformers on CPU) takes none in FP8
    plain = [ParamMeta(DOWN, "bfloat16", (64, 256)), ParamMeta(NORM, "bfloat16", (64,))]
    assert ServedModel.of(plain, quantization_config=BLOCK).fp8 is None
    assert ServedModel.of(METAS).fp8 is None  # no config: no scheme, never guessed


def test_the_json_tells_the_fp8_linears_and_is_strict() -> None:
    served = ServedModel.of(METAS, quantization_config={**BLOCK, "scale_fmt": "ue8m0"})
    data = json.loads(json.dumps(served.to_dict()))
    assert data["fp8"] == {
        "scheme": {"kind": "block", "block": [128, 128], "ue8m0": True},
        "weights": [DOWN],
    }
    assert ServedModel.from_dict(data) == served
    assert "fp8" not in ServedModel.of(METAS).to_dict()  # an older trainer still parses it
    with pytest.raises(ValueError, match=r"fp8.weights names 'x.weight', not one of"):
        ServedModel.from_dict({**data, "fp8": {**data["fp8"], "weights": ["x.weight"]}})
    with pytest.raises(ValueError, match=r"scheme: unknown keys \['group'\]"):
        scheme_from_dict({"kind": "block", "block": [128, 128], "group": 1}, "scheme")
    with pytest.raises(ValueError, match="kind must be 'block' or 'tensor'"):
        scheme_from_dict({"kind": "mx"}, "scheme")


def test_a_spec_that_does_not_fit_the_served_fp8_linears_is_refused_by_name() -> None:
    served = ServedModel.of(METAS, quantization_config=BLOCK)
    served.check_fp8_spec({DOWN: Fp8Block()})
    with pytest.raises(
        ServedModelMismatch,
        match=rf"quantizes 1 tensor\(s\) \[{UP}\], which the "
        r"served model does not take in FP8 \(it holds .*bfloat16\)",
    ):
        served.check_fp8_spec({DOWN: Fp8Block(), UP: Fp8Block()})
    with pytest.raises(
        ServedModelMismatch,
        match=r"as block \[128, 64\] e4m3; the served model's "
        r"checkpoint takes block \[128, 128\] e4m3",
    ):
        served.check_fp8_spec({DOWN: Fp8Block((128, 64))})
    with pytest.raises(ServedModelMismatch, match=r"as block \[128, 128\] e4m3 ue8m0;"):
        served.check_fp8_spec({DOWN: Fp8Block(ue8m0=True)})
    with pytest.raises(ServedModelMismatch, match="as per-tensor e4m3"):
        served.check_fp8_spec({DOWN: Fp8PerTensor()})
    with pytest.raises(ServedModelMismatch, match="does not take in FP8"):
        ServedModel.of(METAS).check_fp8_spec({DOWN: Fp8Block()})


@pytest.mark.parametrize("checks_dtype", [True, False])
def test_a_round_that_sends_an_fp8_linear_unquantized_is_refused(checks_dtype: bool) -> None:
    served = ServedModel.of(METAS, quantization_config=BLOCK, checks_dtype=checks_dtype)
    served.check_round(METAS)
    bf16 = [ParamMeta(DOWN, "bfloat16", (64, 256)), *METAS[2:]]
    with pytest.raises(ServedModelMismatch) as refused:
        served.check_round(bf16)
    assert (
        f"takes 1 tensor(s) [{DOWN} (bfloat16)] in FP8 (block [128, 128] e4m3, beside its "
        "scale) and the round sends them unquantized: send the source through "
        "fp8_source(source, 'auto')" in str(refused.value)
    )
    assert "cast the source" not in str(refused.value)


def test_a_checkpoint_dir_tells_its_fp8_linears(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file(
        {
            DOWN: torch.zeros(64, 256).to(torch.float8_e4m3fn),
            DOWN + "_scale_inv": torch.ones(1, 2),
            NORM: torch.zeros(64, dtype=torch.bfloat16),
        },
        str(tmp_path / "model.safetensors"),
    )
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": BLOCK}))
    served = from_checkpoint(tmp_path)
    assert served.fp8 is not None and served.fp8.weights == {DOWN}
    assert served.tensors[DOWN].dtype == "float8_e4m3fn"
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {**BLOCK, "scale_fmt": "e8m0x"}})
    )
    with pytest.raises(ConfigError, match=r"served_checkpoint .*scale_fmt 'e8m0x'"):
        from_checkpoint(tmp_path)


def test_a_vllm_workers_spec_keeps_the_fp8_pairs_and_tells_them(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from weightwire.torch_side.worker.spec import ModelSpec

    save_file(
        {
            DOWN: torch.zeros(64, 256).to(torch.float8_e4m3fn),
            DOWN + "_scale_inv": torch.ones(1, 2),
            UP: torch.zeros(256, 64, dtype=torch.bfloat16),
        },
        str(tmp_path / "model.safetensors"),
    )
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": BLOCK}))
    spec = ModelSpec.from_checkpoint(tmp_path, served_dtype="bfloat16")
    assert spec is not None
    # the served float dtype is bfloat16; the FP8 pair stays as vLLM's FP8 linear holds it
    assert {n: t.dtype for n, t in spec.tensors.items()} == {
        DOWN: "float8_e4m3fn",
        DOWN + "_scale_inv": "float32",
        UP: "bfloat16",
    }
    served = spec.served()
    assert served is not None and served.fp8 is not None and served.fp8.weights == {DOWN}
    no_config = ModelSpec.from_checkpoint(tmp_path, served_dtype="bfloat16", quantization_config={})
    assert no_config is not None and no_config.tensors[DOWN].dtype == "bfloat16"


def test_the_reference_servers_host_tells_the_fp8_linears_it_holds() -> None:
    import types

    import torch

    from weightwire.torch_side.worker.hf_host import HFModelHost

    class Linear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            weight = torch.zeros(64, 256).to(torch.float8_e4m3fn)
            self.weight = torch.nn.Parameter(weight, requires_grad=False)
            self.weight_scale_inv = torch.nn.Parameter(torch.ones(1, 2))

    model = torch.nn.Module()
    model.down_proj = Linear()
    model.config = types.SimpleNamespace(quantization_config=BLOCK)
    served = HFModelHost(model).served_model()
    assert served.fp8 is not None and served.fp8.weights == {"down_proj.weight"}
    assert ServedModel.from_dict(served.to_dict()) == served
    model.config = types.SimpleNamespace()
    assert HFModelHost(model).served_model().fp8 is None
