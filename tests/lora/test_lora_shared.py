"""Adapter names, shapes and the PEFT directory (``weightwire.shared.lora``)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from weightwire.shared.errors import ConfigError
from weightwire.shared.lora import (
    MAX_LORA_ALPHA,
    LoRASpec,
    check_lora_alpha,
    check_peft_numbers,
    is_adapter_round,
    parse_name,
    wire_name,
    write_adapter_dir,
)
from weightwire.shared.meta import ParamMeta

Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.1.mlp.down_proj"


def _metas(rank: int = 4, adapter: str = "pol", dtype: str = "float32") -> list[ParamMeta]:
    return [
        ParamMeta(wire_name(Q, "A", adapter), dtype, (rank, 64)),
        ParamMeta(wire_name(Q, "B", adapter), dtype, (64, rank)),
        ParamMeta(wire_name(DOWN, "A", adapter), dtype, (rank, 128)),
        ParamMeta(wire_name(DOWN, "B", adapter), dtype, (64, rank)),
    ]


def test_names_round_trip_and_saved_form() -> None:
    name = wire_name(Q, "B", "pol")
    assert name == "base_model.model.model.layers.0.self_attn.q_proj.lora_B.pol.weight"
    parsed = parse_name(name)
    assert parsed is not None and (parsed.module, parsed.ab, parsed.adapter) == (Q, "B", "pol")
    assert parsed.saved == "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert parse_name("model.layers.0.self_attn.q_proj.weight") is None


def test_spec_reads_modules_and_rank() -> None:
    spec = LoRASpec.from_metas(_metas())
    assert (spec.adapter, spec.rank, spec.dtype) == ("pol", 4, "float32")
    assert spec.target_modules == ("down_proj", "q_proj")
    assert {(m.module, m.in_features, m.out_features) for m in spec.modules} == {
        (Q, 64, 64),
        (DOWN, 128, 64),
    }
    config = spec.peft_config(alpha=8.0)
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")


@pytest.mark.parametrize(
    ("metas", "match"),
    [
        (_metas()[:3], "lora_B is missing"),
        ([*_metas()[:2], *_metas(rank=8)[2:]], "one rank"),
        ([*_metas()[:2], *_metas(adapter="other")[2:]], "one adapter"),
        ([*_metas()[:2], *_metas(dtype="bfloat16")[2:]], "one dtype"),
        (
            [ParamMeta(wire_name(Q, "A", "p"), "float32", (4, 64)), *_metas(adapter="p")[1:]][:1]
            + [ParamMeta(wire_name(Q, "B", "p"), "float32", (64, 2))],
            "disagree on the rank",
        ),
        ([ParamMeta(wire_name(Q, "A", "p.q"), "float32", (4, 64))], "not an adapter tensor"),
        ([], "at least one"),
    ],
)
def test_spec_refuses_what_is_not_one_adapter(metas: list[ParamMeta], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LoRASpec.from_metas(metas)


def test_a_round_is_an_adapter_or_base_weights_never_both() -> None:
    assert is_adapter_round([m.name for m in _metas()])
    assert not is_adapter_round(["model.embed_tokens.weight", "lm_head.weight"])
    with pytest.raises(ConfigError, match="mixes adapter tensors with base weights"):
        is_adapter_round([_metas()[0].name, "lm_head.weight"])


def test_same_shape_names_what_changed() -> None:
    spec = LoRASpec.from_metas(_metas())
    assert spec.same_shape(LoRASpec.from_metas(_metas())) is None
    assert "rank 8 differs" in str(spec.same_shape(LoRASpec.from_metas(_metas(rank=8))))
    fewer = LoRASpec.from_metas(_metas()[:2])
    assert "modules differ" in str(spec.same_shape(fewer))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_adapter_dir_is_peft_saved_format(tmp_path: Path, dtype: type) -> None:
    spec = LoRASpec.from_metas(_metas(dtype="float32" if dtype is np.float32 else "bfloat16"))
    rng = np.random.default_rng(0)
    tensors = {
        m.name: rng.standard_normal(m.shape).astype(np.float32).astype(dtype)
        for m in _metas(dtype="float32")
    }
    out = write_adapter_dir(tmp_path / "a", spec, tensors, alpha=16.0, base_model="tiny")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16.0
    assert config["target_modules"] == ["down_proj", "q_proj"]
    if dtype is np.float32:
        back = load_file(str(out / "adapter_model.safetensors"))
        for name, array in tensors.items():
            parsed = parse_name(name)
            assert parsed is not None
            np.testing.assert_array_equal(back[parsed.saved], array)
    else:  # numpy's safetensors reader has no bfloat16: read it through torch
        torch = pytest.importorskip("torch")
        from safetensors.torch import load_file as load_torch

        back_t = load_torch(str(out / "adapter_model.safetensors"))
        for name, array in tensors.items():
            parsed = parse_name(name)
            assert parsed is not None
            got = back_t[parsed.saved]
            assert got.dtype == torch.bfloat16
            want = torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
            assert torch.equal(got, want)
    assert not list(out.glob("*.partial"))


def test_adapter_dir_refuses_another_adapters_tensor(tmp_path: Path) -> None:
    spec = LoRASpec.from_metas(_metas())
    with pytest.raises(ConfigError, match="not a tensor of adapter 'pol'"):
        write_adapter_dir(
            tmp_path, spec, {wire_name(Q, "A", "x"): np.zeros((4, 64), np.float32)}, alpha=1
        )


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), 1e308, -1.0, 0.0, True, "8"])
def test_an_alpha_no_served_adapter_can_use_is_refused(tmp_path: Path, alpha: object) -> None:
    spec = LoRASpec.from_metas(_metas())
    with pytest.raises(ConfigError, match="alpha must be a (finite )?number"):
        write_adapter_dir(tmp_path, spec, {}, alpha=alpha)  # type: ignore[arg-type]
    assert not (tmp_path / "adapter_config.json").exists()
    with pytest.raises(ConfigError, match="adapter_config.json: lora_alpha must be"):
        check_peft_numbers({"r": 4, "lora_alpha": alpha}, 4)


def test_peft_numbers_give_the_scale_or_name_the_bad_field() -> None:
    assert check_peft_numbers({"r": 4, "lora_alpha": 8.0, "lora_dropout": 0.1}, 4) == 2.0
    assert check_peft_numbers({}, 4) == 1.0  # PEFT's defaults: alpha = r
    assert check_lora_alpha(MAX_LORA_ALPHA) == MAX_LORA_ALPHA
    for config, field in [
        ({"r": 4.0}, "r is 4.0 but the matrices have rank 4"),
        ({"r": "4"}, "r is '4'"),
        ({"r": 8}, "r is 8 but"),
        ({"lora_dropout": float("nan")}, "lora_dropout must be a number in \\[0, 1\\)"),
        ({"lora_dropout": 1.0}, "lora_dropout"),
        (
            {"lora_alpha": MAX_LORA_ALPHA * 2},
            "lora_alpha must be a finite number in \\(0, 65536\\]",
        ),
    ]:
        with pytest.raises(ConfigError, match=field):
            check_peft_numbers(config, 4)


def test_adapter_sync_refuses_a_delta_engine_and_a_bad_alpha(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from weightwire.trainer.config import TrainerInitInfo
    from weightwire.trainer.lora import AdapterSync

    delta = SimpleNamespace(info=TrainerInitInfo(backend="weightwire_tcp", delta="auto"))
    with pytest.raises(ConfigError, match="its engine has delta='auto'.*delta='off'"):
        AdapterSync(delta, "pol", alpha=8.0, adapter_dir=tmp_path, base_urls=["http://x"])  # type: ignore[arg-type]
    dense = SimpleNamespace(info=TrainerInitInfo(backend="weightwire_tcp"))
    for alpha in (float("inf"), 1e308, float("nan")):
        with pytest.raises(ConfigError, match="alpha must be a finite number"):
            AdapterSync(dense, "pol", alpha=alpha, adapter_dir=tmp_path, base_urls=["http://x"])  # type: ignore[arg-type]
    sync = AdapterSync(dense, "pol", alpha=8, adapter_dir=tmp_path, base_urls=["http://x"])  # type: ignore[arg-type]
    assert sync.alpha == 8.0


def test_adapter_sync_without_an_engine_is_a_config_error(tmp_path: Path) -> None:
    """``AdapterSync(None, ...)`` names its engine argument (was: ``AttributeError``)."""
    from weightwire.trainer.lora import AdapterSync

    for engine in (None, "http://x"):
        with pytest.raises(ConfigError, match="AdapterSync's engine must be a trainer engine.*"):
            AdapterSync(engine, "pol", alpha=8.0, adapter_dir=tmp_path)  # type: ignore[arg-type]
