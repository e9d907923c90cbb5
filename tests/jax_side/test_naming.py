"""Naming rules: matching, transforms, ordering, and the construction-time errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from weightwire.jax_side import preset
from weightwire.jax_side.naming import (
    AddScalar,
    Cast,
    Concat,
    MergeAxes,
    Naming,
    NamingError,
    Reshape,
    Split,
    Stacked,
    Transpose,
    path_str,
)
from weightwire.jax_side.rules import Rule, drop
from weightwire.jax_side.source import PytreeSource
from weightwire.shared.errors import ConfigError


def arange(*shape: int, dtype=jnp.float32) -> jax.Array:
    return jnp.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)


def tensors(tree, naming: Naming, **kw) -> dict[str, np.ndarray]:
    return {name: np.asarray(a) for name, a in PytreeSource(tree, naming, **kw)}


def test_transpose_and_named_captures() -> None:
    tree = {"params": {"blk_3": {"proj": {"kernel": arange(2, 3)}}}}
    naming = Naming(
        [Rule("blk_{i:\\d+}/{m}/kernel", "layers.{i}.{m}.weight", Transpose())], strip=("params",)
    )
    out = tensors(tree, naming)
    assert list(out) == ["layers.3.proj.weight"]
    np.testing.assert_array_equal(out["layers.3.proj.weight"], np.arange(6.0).reshape(2, 3).T)


def test_unclaimed_leaf_is_an_error_naming_the_paths() -> None:
    tree = {"a": {"kernel": arange(2, 2)}, "rotary": {"cos": arange(4)}, "other": arange(1)}
    with pytest.raises(
        NamingError, match=r"no naming rule claims these pytree leaves: 'other', 'rotary/cos'"
    ):
        Naming([Rule("a/kernel", "a.weight")]).resolve(tree)


def test_drop_rule_removes_rotary_cache() -> None:
    tree = {"a": {"kernel": arange(2, 2)}, "rotary": {"cos": arange(4)}}
    plan = Naming([Rule("a/kernel", "a.weight"), drop("rotary/**")]).resolve(tree)
    assert [e.name for e in plan.entries] == ["a.weight"]
    assert plan.dropped == ("rotary/cos",)


def test_two_leaves_to_one_name_is_an_error_naming_both() -> None:
    tree = {"x": {"w": arange(2)}, "y": {"w": arange(2)}}
    with pytest.raises(NamingError, match=r"'x/w', 'y/w' all map to HF name 'same.weight'"):
        Naming([Rule("{m}/w", "same.weight")]).resolve(tree)


def test_rule_matching_nothing_is_an_error_unless_optional_or_shadowed() -> None:
    tree = {"a": arange(2)}
    with pytest.raises(NamingError, match=r"matched no pytree leaf: 'b'"):
        Naming([Rule("a", "a.weight"), Rule("b", "b.weight")]).resolve(tree)
    Naming([Rule("a", "a.weight"), Rule("b", "b.weight", optional=True)]).resolve(tree)
    # an override placed first shadows the default rule: not an error
    Naming([Rule("a", "a.first"), Rule("a", "a.weight")]).resolve(tree)


@pytest.mark.parametrize(
    ("rule", "match"),
    [
        (lambda: Rule("x/{i}", "y.{j}"), r"uses \['j'\], not captured"),
        (lambda: Rule("x", ("a", "b")), "several targets need a Split"),
        (lambda: Rule("x", ("a", "b"), Split(0, (1,))), "one per target"),
        (lambda: Rule("x", "a", Transpose(), Stacked()), "Stacked must be the first part"),
        (lambda: Rule("x", "a", Concat(0, 0, 2), Transpose()), "Concat must be the last"),
        (lambda: Rule("x", "a", Concat(0, 3, 2)), "Concat index 3 outside 0..1"),
        (lambda: Rule("x", None, Transpose()), "drop rule"),
        (lambda: Rule("x", "a", "transpose"), "not a transform"),
    ],
)
def test_bad_rules_fail_at_construction(rule, match: str) -> None:
    with pytest.raises(NamingError, match=match):
        rule()


def test_transform_that_does_not_fit_names_the_leaf() -> None:
    tree = {"w": arange(2, 3)}
    with pytest.raises(NamingError, match=r"does not fit pytree leaf 'w' of shape \[\[2, 3\]\]"):
        Naming([Rule("w", "w", Transpose((0, 1, 2)))]).resolve(tree)


def test_split_unfuses_and_must_cover_the_axis() -> None:
    fused = arange(4, 6)  # Flax [in=4, out=q(2)+k(2)+v(2)]
    naming = Naming(
        [Rule("qkv", ("q.weight", "k.weight", "v.weight"), Transpose(), Split(0, (2, 2, 2)))]
    )
    out = tensors({"qkv": fused}, naming)
    assert list(out) == ["q.weight", "k.weight", "v.weight"]
    t = np.asarray(fused).T
    np.testing.assert_array_equal(out["k.weight"], t[2:4])
    bad = Naming([Rule("qkv", ("q", "k"), Transpose(), Split(0, (2, 2)))])
    with pytest.raises(
        NamingError, match=r"add up to 4, but axis 0 has 6; a remainder would be silently dropped"
    ):
        bad.resolve({"qkv": fused})


def test_concat_fuses_parts_in_index_order() -> None:
    tree = {"q": arange(3, 2), "k": arange(3, 2) + 100, "v": arange(3, 2) + 200}
    rules = [Rule(p, "c_attn.weight", Concat(1, i, 3)) for i, p in reversed(list(enumerate("qkv")))]
    out = tensors(tree, Naming(rules))
    np.testing.assert_array_equal(
        out["c_attn.weight"], np.concatenate([np.asarray(tree[p]) for p in "qkv"], 1)
    )
    with pytest.raises(
        NamingError, match=r"fuses 3 parts along axis 1, but got part indices \[0, 2\]"
    ):
        Naming([r for r in rules if r.pattern != "k"]).resolve({"q": tree["q"], "v": tree["v"]})


def test_stacked_leaf_becomes_one_tensor_per_layer_with_offset() -> None:
    stack = arange(3, 2, 4)
    naming = Naming([Rule("layers/w", "model.layers.{layer}.w", Stacked(offset=10), Transpose())])
    out = tensors({"layers": {"w": stack}}, naming)
    assert list(out) == [f"model.layers.{i}.w" for i in (10, 11, 12)]
    for i in range(3):
        np.testing.assert_array_equal(out[f"model.layers.{10 + i}.w"], np.asarray(stack)[i].T)


def test_merge_reshape_add_and_cast() -> None:
    tree = {
        "q": arange(4, 2, 3),
        "b": arange(2, 3),
        "n": arange(4),
        "i": jnp.arange(3, dtype=jnp.int32),
    }
    naming = Naming(
        [
            Rule("q", "q.weight", MergeAxes(1, 2), Transpose()),
            Rule("b", "q.bias", Reshape((-1,))),
            Rule("n", "norm.weight", AddScalar(-1.0), Cast("float32")),
            Rule("i", "ids"),
        ]
    )
    out = tensors(tree, naming, dtype="bfloat16")
    np.testing.assert_array_equal(
        out["q.weight"].astype(np.float32), np.asarray(tree["q"]).reshape(4, 6).T
    )
    assert out["q.weight"].dtype == jnp.bfloat16
    assert out["q.bias"].shape == (6,)
    assert out["norm.weight"].dtype == np.float32  # Cast pins it despite the source-wide bfloat16
    np.testing.assert_array_equal(out["norm.weight"], np.arange(4.0) - 1)
    assert out["ids"].dtype == np.int32  # the source-wide cast applies to float leaves only


def test_order_is_embed_layers_contiguous_then_tail() -> None:
    # Rule order is HF order; leaves flatten alphabetically, which must not leak into the order.
    tree = {
        "z_embed": arange(2),
        "layers_1": {"b": arange(1), "a": arange(1)},
        "layers_0": {"b": arange(1), "a": arange(1)},
        "a_norm": arange(2),
        "layers_10": {"b": arange(1), "a": arange(1)},
    }
    naming = Naming(
        [
            Rule("z_embed", "embed"),
            Rule("layers_{i:\\d+}/b", "layers.{i}.b"),
            Rule("layers_{i:\\d+}/a", "layers.{i}.a"),
            Rule("a_norm", "norm"),
        ]
    )
    names = [e.name for e in naming.resolve(tree).entries]
    assert names == [
        "embed",
        "layers.0.b",
        "layers.0.a",
        "layers.1.b",
        "layers.1.a",
        "layers.10.b",
        "layers.10.a",
        "norm",
    ]


def test_pattern_wildcards() -> None:
    tree = {"enc": {"block_1": {"w": arange(1)}}, "head": {"deep": {"er": arange(1)}}}
    plan = Naming([Rule("enc/block_*/w", "enc.w"), Rule("head/**", "head")]).resolve(tree)
    assert [e.name for e in plan.entries] == ["enc.w", "head"]


def test_nnx_state_paths_drop_value() -> None:
    from flax import nnx

    class Tiny(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.proj = nnx.Linear(3, 2, use_bias=False, rngs=rngs)

    state = nnx.state(Tiny(nnx.Rngs(0)), nnx.Param)
    paths = [path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    assert paths == ["proj/kernel"]
    out = tensors(state, Naming([Rule("proj/kernel", "proj.weight", Transpose())]))
    assert out["proj.weight"].shape == (2, 3)


def test_preset_rejects_unknown_family_and_option() -> None:
    with pytest.raises(ConfigError, match="unknown preset family 'bert'"):  # a ValueError
        preset("bert")
    with pytest.raises(TypeError, match=r"preset 'llama' has no option\(s\) \['tie_embeddings'\]"):
        preset("llama", tie_embeddings=True)
    with pytest.raises(NamingError, match=r"fused_qkv needs the size option\(s\)"):
        preset("llama", fused_qkv=True)


def test_preset_model_mismatch_is_reported_at_construction() -> None:
    from weightwire.tools.models import llama

    def shapes(cfg):  # abstract params: resolution needs shapes only
        return jax.eval_shape(lambda: llama.init(jax.random.key(0), cfg))

    cfg = llama.config(tie_word_embeddings=True)
    with pytest.raises(NamingError, match=r"matched no pytree leaf: 'lm_head/kernel'"):
        PytreeSource(shapes(cfg), preset("llama"))  # preset expects an untied lm_head
    with pytest.raises(NamingError, match=r"no naming rule claims.*q_norm"):
        PytreeSource(shapes(cfg.replace(qk_norm=True)), preset("llama", tie_word_embeddings=True))
    assert len(PytreeSource(shapes(cfg), llama.naming(cfg)).metadata()) == 1 + 2 * 9 + 1


def test_stacked_rule_on_a_scalar_leaf_names_it() -> None:
    with pytest.raises(
        NamingError, match=r"pytree leaf 'layers/w' has shape \[\]: no layer axis 0"
    ):
        Naming([Rule("layers/w", "l.{layer}.w", Stacked(), Split(0, (1,)))]).resolve(
            {"layers": {"w": jnp.float32(1)}}
        )


def test_leaf_that_is_not_an_array_is_named() -> None:
    with pytest.raises(NamingError, match=r"pytree leaf 'step' is a str, not an array"):
        Naming([Rule("**", "x")]).resolve({"step": "3"})
