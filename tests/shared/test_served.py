"""``ServedModel``: a round's metadata checked against the tensors the served model takes, each
problem named with its fix; the record's strict JSON form."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from weightwire.shared.errors import ConfigError
from weightwire.shared.lora import wire_name, write_safetensors
from weightwire.shared.meta import ParamMeta
from weightwire.shared.served import ServedModel, ServedModelMismatch, from_checkpoint

EMBED = ParamMeta("model.embed_tokens.weight", "bfloat16", (32, 8))
Q = ParamMeta("model.layers.0.self_attn.q_proj.weight", "bfloat16", (8, 8))
Q_BIAS = ParamMeta("model.layers.0.self_attn.q_proj.bias", "bfloat16", (8,))
NORM = ParamMeta("model.norm.weight", "float32", (8,))
TIED = ServedModel.of([EMBED, Q, Q_BIAS, NORM], {"lm_head.weight": EMBED.name})


def refused(metas: list[ParamMeta], **kw: bool) -> str:
    with pytest.raises(ServedModelMismatch) as info:
        TIED.check_round(metas, **kw)
    assert isinstance(info.value, ConfigError)
    assert "nothing was sent" in str(info.value)
    return str(info.value)


def test_a_whole_round_fits_with_or_without_the_tied_alias() -> None:
    TIED.check_round([EMBED, Q, Q_BIAS, NORM])
    lm_head = ParamMeta("lm_head.weight", "bfloat16", (32, 8))
    TIED.check_round([lm_head, Q, Q_BIAS, NORM])  # the alias covers the embedding it shares
    TIED.check_round([EMBED, lm_head, Q, Q_BIAS, NORM])


def test_missing_tensors_are_named_unless_the_round_is_partial() -> None:
    # A tree of another family (no q/k/v biases) or one missing a layer.
    msg = refused([EMBED, Q, NORM])
    assert "1 tensor(s) [model.layers.0.self_attn.q_proj.bias] of the served model missing" in msg
    assert "(3 of 4 sent)" in msg and "TrainerInitInfo(partial=True)" in msg
    TIED.check_round([EMBED, Q, NORM], partial=True)


def test_unknown_names_are_refused_even_when_partial() -> None:
    bogus = ParamMeta("model.layers.99.bogus.weight", "bfloat16", (8, 8))
    msg = refused([EMBED, Q, Q_BIAS, NORM, bogus], partial=True)
    assert "1 tensor(s) [model.layers.99.bogus.weight] unknown to the served model" in msg
    assert "name them as the served checkpoint does" in msg


def test_dtype_and_shape_are_named_with_the_fix() -> None:
    wide = ParamMeta(Q.name, "float32", Q.shape)
    msg = refused([EMBED, wide, Q_BIAS, NORM])
    assert (
        f"dtype differs from the served model's bfloat16 for 1 tensor(s) [{Q.name} (float32)]"
        in msg
    )
    assert "cast the source to bfloat16" in msg
    long = ParamMeta(EMBED.name, "bfloat16", (64, 8))
    msg = refused([long, Q, Q_BIAS, NORM])
    assert f"[{EMBED.name} [64, 8] (served: [32, 8])]" in msg
    # a receiver that casts on load: the dtype is not checked there, the shape still is
    casting = ServedModel.of([EMBED, Q, Q_BIAS, NORM], checks_dtype=False)
    casting.check_round([EMBED, wide, Q_BIAS, NORM])


def test_every_problem_of_a_round_is_in_one_message() -> None:
    bogus = ParamMeta("transformer.h.0.attn.c_attn.weight", "bfloat16", (8, 24))
    wide = ParamMeta(NORM.name, "bfloat16", (9,))
    msg = refused([bogus, wide])
    assert "unknown to the served model" in msg
    assert "shape differs" in msg and "dtype differs" in msg
    assert "3 tensor(s) [model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight" in msg


def test_long_lists_are_cut_with_their_count() -> None:
    many = [ParamMeta(f"model.layers.{i}.mlp.up.weight", "float32", (2,)) for i in range(20)]
    model = ServedModel.of(many)
    with pytest.raises(ServedModelMismatch, match=r"19 tensor\(s\) \[model.layers.1.mlp"):
        model.check_round(many[:1])
    assert str(model.problems(many[:1])[0]).count("model.layers.") == 8


def test_an_adapter_round_is_not_the_base_models() -> None:
    adapter = [
        ParamMeta(wire_name("model.layers.0.self_attn.q_proj", ab, "a1"), "float32", (2, 8))
        for ab in ("A", "B")
    ]
    TIED.check_round(adapter)


def test_the_json_form_round_trips_and_is_strict() -> None:
    assert ServedModel.from_dict(TIED.to_dict()) == TIED
    with pytest.raises(ValueError, match="unknown keys"):
        ServedModel.from_dict({**TIED.to_dict(), "extra": 1})
    with pytest.raises(ValueError, match="alias 'lm_head.weight' names unknown"):
        ServedModel.from_dict({**TIED.to_dict(), "tensors": [Q.to_dict()]})
    with pytest.raises(ValueError, match="non-empty list"):
        ServedModel.from_dict({"tensors": []})
    with pytest.raises(ValueError, match="checks_dtype must be a bool"):
        ServedModel.from_dict({**TIED.to_dict(), "checks_dtype": "yes"})
    with pytest.raises(ValueError, match="names a tensor twice"):
        ServedModel.from_dict({"tensors": [Q.to_dict(), Q.to_dict()]})


def _write_checkpoint(root: Path, tensors: dict[str, np.ndarray], config: dict[str, Any]) -> None:
    root.mkdir()
    write_safetensors(root / "model.safetensors", tensors)
    (root / "config.json").write_text(json.dumps(config))


def test_a_checkpoint_dir_gives_names_and_shapes_the_tied_head_an_alias(tmp_path: Path) -> None:
    tensors = {
        EMBED.name: np.zeros((32, 8), np.float32),
        NORM.name: np.zeros((8,), np.float32),
    }
    _write_checkpoint(tmp_path / "tied", tensors, {"tie_word_embeddings": True})
    served = from_checkpoint(tmp_path / "tied")
    assert set(served.tensors) == {EMBED.name, NORM.name}
    assert served.aliases == {"lm_head.weight": EMBED.name} and not served.checks_dtype
    # stock vLLM casts on load: a bfloat16 embedding fits a float32 checkpoint; shapes count
    served.check_round([EMBED, NORM, ParamMeta("lm_head.weight", "bfloat16", (32, 8))])
    with pytest.raises(ServedModelMismatch, match=r"1 tensor\(s\) \[model.norm.weight\] of"):
        served.check_round([EMBED])
    _write_checkpoint(tmp_path / "untied", tensors, {"tie_word_embeddings": False})
    assert from_checkpoint(tmp_path / "untied").aliases == {}


def test_a_dir_without_a_checkpoint_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"holds no \*.safetensors files: pass the directory"):
        from_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ConfigError, match="cannot read .* as a safetensors checkpoint"):
        from_checkpoint(tmp_path)
