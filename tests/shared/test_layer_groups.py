"""Layer grouping: ``layer_key`` (the outermost layer index of a name), ``layerwise_groups``
(a checkpoint's metadata cut into its layers' runs) and a source's ``groups`` / ``iter_groups``."""

from __future__ import annotations

import pytest

from weightwire.shared import ParamMeta, WeightSource
from weightwire.shared.groups import layer_key, layerwise_groups


def m(name: str, dtype: str = "float32", shape: tuple[int, ...] = (2,)) -> ParamMeta:
    return ParamMeta(name, dtype, shape)


def names(groups: list[list[ParamMeta]]) -> list[list[str]]:
    return [[x.name for x in g] for g in groups]


def test_layer_key_is_outermost_index() -> None:
    assert layer_key("model.layers.3.mlp.experts.7.w1.weight") == "model.layers.3"
    assert layer_key("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert layer_key("transformer.h.0.attn.c_attn.weight") == "transformer.h.0"
    assert layer_key("model.embed_tokens.weight") is None
    assert layer_key("lm_head.weight") is None
    assert layer_key("model.layers.².weight") is None  # Unicode digit is not an index


def test_groups_follow_seed_semantics() -> None:
    seq = [
        "model.embed_tokens.weight",
        "model.rotary.inv_freq",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        # A MoE layer: expert indices are inner, so the whole layer is one group.
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.mlp.experts.0.w1.weight",
        "model.layers.1.mlp.experts.1.w1.weight",
        "model.layers.1.mlp.gate.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert names(layerwise_groups([m(n) for n in seq])) == [
        ["model.embed_tokens.weight", "model.rotary.inv_freq"],
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight"],
        [
            "model.layers.1.self_attn.q_proj.weight",
            "model.layers.1.mlp.experts.0.w1.weight",
            "model.layers.1.mlp.experts.1.w1.weight",
            "model.layers.1.mlp.gate.weight",
        ],
        ["model.norm.weight", "lm_head.weight"],
    ]


def test_unindexed_runs_split_by_layers_are_separate_groups() -> None:
    seq = ["a.weight", "model.layers.0.w", "b.weight", "model.layers.1.w", "c.weight", "d.weight"]
    assert names(layerwise_groups([m(n) for n in seq])) == [
        ["a.weight"],
        ["model.layers.0.w"],
        ["b.weight"],
        ["model.layers.1.w"],
        ["c.weight", "d.weight"],
    ]


def test_empty_metadata_has_no_groups() -> None:
    assert layerwise_groups([]) == []


def test_non_contiguous_layer_raises_naming_the_name() -> None:
    seq = ["model.layers.0.a", "model.layers.1.a", "model.layers.0.b"]
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.b' belongs to 'model\.layers\.0'"):
        layerwise_groups([m(n) for n in seq])
    # An un-indexed name in between also closes the layer.
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.b'"):
        layerwise_groups([m(n) for n in ["model.layers.0.a", "norm", "model.layers.0.b"]])


def test_source_groups_and_iter_groups() -> None:
    class Src(WeightSource):
        def __init__(self, held: set[str] | None) -> None:
            self.held = held

        def metadata(self) -> list[ParamMeta]:
            return [m("emb"), m("l.0.a"), m("l.0.b"), m("l.1.a"), m("norm")]

        def __iter__(self):
            return iter([(x.name, x.name) for x in self.metadata()])

        def held_names(self) -> set[str] | None:
            return self.held

    assert names(Src(None).groups()) == [["emb"], ["l.0.a", "l.0.b"], ["l.1.a"], ["norm"]]
    assert names(Src({"l.1.a"}).groups()) == [["l.1.a"]]
    batches = [[n for n, _ in b] for b in Src(None).iter_groups()]
    assert batches == [["emb"], ["l.0.a", "l.0.b"], ["l.1.a"], ["norm"]]
