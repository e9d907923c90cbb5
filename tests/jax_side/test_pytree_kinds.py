"""``PytreeSource`` straight from what JAX trainers hold: a Flax NNX module and its
``nnx.State``, a Linen variables dict, an Equinox module, a MaxText-style scanned tree.

Each is checked as a user would: a tiny random HF Llama checkpoint is loaded into the
trainer's own object with ``pytree_from_hf``, the source sends it back bit for bit, and
one projection computed by the framework's own layer equals HF's ``x @ W.T`` (so the
layout, not just the names, is right).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import TINY

from weightwire.jax_side import PytreeSource, preset
from weightwire.jax_side.checkpoint import pytree_from_hf, read_safetensors
from weightwire.jax_side.layouts import preset_layout
from weightwire.jax_side.trees import kind_of, params_tree
from weightwire.tools.models import llama

pytest.importorskip("transformers")
pytest.importorskip("torch")

HF = {**TINY, "model_type": "llama", "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
X = np.random.default_rng(3).standard_normal((3, TINY["hidden_size"])).astype(np.float32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> dict[str, np.ndarray]:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("llama")
    model.save_pretrained(d)
    return read_safetensors(d)


def sent_equals(source: PytreeSource, tensors: dict[str, np.ndarray]) -> None:
    sent = {n: np.asarray(a) for n, a in source}
    assert sorted(sent) == sorted(tensors)
    for name, x in tensors.items():
        assert sent[name].tobytes() == x.tobytes(), name


def q_ref(tensors: dict[str, np.ndarray], layer: int) -> np.ndarray:
    return X @ tensors[f"model.layers.{layer}.self_attn.q_proj.weight"].T


# --------------------------------------------------------------------------- Flax NNX
def nnx_llama():
    from flax import nnx

    d, f, v = TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"]
    h, kv, hd = TINY["num_attention_heads"], TINY["num_key_value_heads"], TINY["head_dim"]

    class Attention(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.q_proj = nnx.Linear(d, h * hd, use_bias=False, rngs=rngs)
            self.k_proj = nnx.Linear(d, kv * hd, use_bias=False, rngs=rngs)
            self.v_proj = nnx.Linear(d, kv * hd, use_bias=False, rngs=rngs)
            self.o_proj = nnx.Linear(h * hd, d, use_bias=False, rngs=rngs)

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.gate_proj = nnx.Linear(d, f, use_bias=False, rngs=rngs)
            self.up_proj = nnx.Linear(d, f, use_bias=False, rngs=rngs)
            self.down_proj = nnx.Linear(f, d, use_bias=False, rngs=rngs)

    class Layer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.self_attn, self.mlp = Attention(rngs), MLP(rngs)
            self.input_layernorm = nnx.RMSNorm(d, rngs=rngs)
            self.post_attention_layernorm = nnx.RMSNorm(d, rngs=rngs)
            self.dropout = nnx.Dropout(0.1, rngs=rngs)  # carries RNG state: not a weight

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed_tokens = nnx.Embed(v, d, rngs=rngs)
            self.layers = nnx.List([Layer(rngs) for _ in range(TINY["num_hidden_layers"])])
            self.norm = nnx.RMSNorm(d, rngs=rngs)

    class CausalLM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.model = Model(rngs)
            self.lm_head = nnx.Linear(d, v, use_bias=False, rngs=rngs)

    return nnx, CausalLM(nnx.Rngs(0))


def test_nnx_module_and_state_are_sources(checkpoint) -> None:
    nnx, model = nnx_llama()
    naming = preset("llama")
    assert kind_of(model) == "nnx-module"
    loaded = pytree_from_hf(naming, nnx.state(model, nnx.Param), checkpoint)
    nnx.update(model, loaded)
    sent_equals(PytreeSource(model, naming), checkpoint)  # the module itself (rng state skipped)
    sent_equals(PytreeSource(nnx.state(model), naming), checkpoint)  # full state, filtered to Param
    np.testing.assert_allclose(
        np.asarray(model.model.layers[1].self_attn.q_proj(jnp.asarray(X))),
        q_ref(checkpoint, 1),
        rtol=1e-5,
        atol=1e-5,
    )
    # live: an in-place update of the module is what the next pass sends
    source = PytreeSource(model, naming)
    model.model.norm.scale[...] = model.model.norm.scale[...] + 1.0
    np.testing.assert_array_equal(
        np.asarray(dict(source)["model.norm.weight"]), checkpoint["model.norm.weight"] + 1.0
    )


# --------------------------------------------------------------------------- Linen
def test_linen_variables_dict_is_a_source(checkpoint) -> None:
    cfg = llama.config(**{k: TINY[k] for k in TINY})
    template = jax.eval_shape(lambda: llama.init(jax.random.key(0), cfg))
    assert kind_of(template) == "pytree"
    params = pytree_from_hf(llama.naming(cfg), template, checkpoint)
    sent_equals(PytreeSource(params, llama.naming(cfg)), checkpoint)
    sent_equals(
        PytreeSource(params["params"], llama.naming(cfg)), checkpoint
    )  # with or without "params"
    q = params["params"]["model"]["layers_0"]["self_attn"]["q_proj"]["kernel"]
    np.testing.assert_allclose(X @ np.asarray(q), q_ref(checkpoint, 0), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- Equinox
def eqx_llama():
    eqx = pytest.importorskip("equinox")
    d, f, v = TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"]
    h, kv, hd = TINY["num_attention_heads"], TINY["num_key_value_heads"], TINY["head_dim"]

    def lin(i: int, o: int, key: jax.Array) -> eqx.nn.Linear:
        return eqx.nn.Linear(i, o, use_bias=False, key=key)

    class Attention(eqx.Module):
        q_proj: eqx.nn.Linear
        k_proj: eqx.nn.Linear
        v_proj: eqx.nn.Linear
        o_proj: eqx.nn.Linear

        def __init__(self, key: jax.Array) -> None:
            k = jax.random.split(key, 4)
            self.q_proj, self.k_proj = lin(d, h * hd, k[0]), lin(d, kv * hd, k[1])
            self.v_proj, self.o_proj = lin(d, kv * hd, k[2]), lin(h * hd, d, k[3])

    class MLP(eqx.Module):
        gate_proj: eqx.nn.Linear
        up_proj: eqx.nn.Linear
        down_proj: eqx.nn.Linear

        def __init__(self, key: jax.Array) -> None:
            k = jax.random.split(key, 3)
            self.gate_proj, self.up_proj, self.down_proj = (
                lin(d, f, k[0]),
                lin(d, f, k[1]),
                lin(f, d, k[2]),
            )

    class Layer(eqx.Module):
        self_attn: Attention
        mlp: MLP
        input_layernorm: eqx.nn.RMSNorm
        post_attention_layernorm: eqx.nn.RMSNorm
        dropout: eqx.nn.Dropout

        def __init__(self, key: jax.Array) -> None:
            k = jax.random.split(key)
            self.self_attn, self.mlp = Attention(k[0]), MLP(k[1])
            self.input_layernorm = eqx.nn.RMSNorm(d, use_bias=False)
            self.post_attention_layernorm = eqx.nn.RMSNorm(d, use_bias=False)
            self.dropout = eqx.nn.Dropout(0.1)  # a float field: not an array, not sent

    class Model(eqx.Module):
        embed_tokens: eqx.nn.Embedding
        layers: list
        norm: eqx.nn.RMSNorm

        def __init__(self, key: jax.Array) -> None:
            k = jax.random.split(key, 1 + TINY["num_hidden_layers"])
            self.embed_tokens = eqx.nn.Embedding(v, d, key=k[0])
            self.layers = [Layer(x) for x in k[1:]]
            self.norm = eqx.nn.RMSNorm(d, use_bias=False)

    class CausalLM(eqx.Module):
        model: Model
        lm_head: eqx.nn.Linear

        def __init__(self, key: jax.Array) -> None:
            k = jax.random.split(key)
            self.model, self.lm_head = Model(k[0]), lin(d, v, k[1])

    return eqx, CausalLM(jax.random.key(0))


def test_equinox_module_is_a_source_with_torch_style_leaves(checkpoint) -> None:
    eqx, model = eqx_llama()
    naming = preset("llama", leaf_style="torch")
    assert kind_of(model) == "equinox"
    loaded = pytree_from_hf(naming, params_tree(model), checkpoint)
    model = eqx.combine(loaded, model)  # arrays from the checkpoint, static fields from the module
    sent_equals(PytreeSource(model, naming), checkpoint)
    state = {"model": model}
    sent_equals(PytreeSource(lambda: state["model"], naming), checkpoint)  # a live getter
    np.testing.assert_allclose(
        np.asarray(jax.vmap(model.model.layers[1].self_attn.q_proj)(jnp.asarray(X))),
        q_ref(checkpoint, 1),
        rtol=1e-5,
        atol=1e-5,
    )


def test_flax_preset_on_an_equinox_tree_names_the_unclaimed_leaves() -> None:
    from weightwire.jax_side.naming import NamingError

    _, model = eqx_llama()
    with pytest.raises(
        NamingError, match=r"no naming rule claims these pytree leaves: 'model/embed_tokens/weight'"
    ):
        PytreeSource(model, preset("llama"))


# --------------------------------------------------------------------------- MaxText-style
def test_maxtext_style_scanned_tree_with_stacked_experts(tmp_path) -> None:
    # A scanned MoE tree whose layer axis is 1 (MaxText's param_scan_axis) and whose
    # experts lead: kernels [experts, layers, in, out], router [in, layers, experts].
    from hf_tiny import tiny_checkpoint

    from weightwire.jax_side.naming import Naming, Stacked, Transpose
    from weightwire.jax_side.rules import Rule

    hf = tiny_checkpoint("mixtral", tmp_path)
    tensors = read_safetensors(tmp_path)
    L, E, T = "decoder/layers", "model.layers.{layer}", Transpose()
    scan, expert = Stacked(axis=1), Stacked(axis=0, field="expert")
    moe = "block_sparse_moe"
    naming = Naming(
        [
            Rule("token_embedder/embedding", "model.embed_tokens.weight"),
            Rule(
                f"{L}/self_attention/{{p:query|key|value|out}}/kernel",
                f"{E}.self_attn.{{p}}.weight",
                scan,
                T,
            ),
            Rule(f"{L}/moe/gate/kernel", f"{E}.{moe}.gate.weight", scan, T),
            Rule(f"{L}/moe/wi_0", f"{E}.{moe}.experts.{{expert}}.w1.weight", expert, scan, T),
            Rule(f"{L}/moe/wi_1", f"{E}.{moe}.experts.{{expert}}.w3.weight", expert, scan, T),
            Rule(f"{L}/moe/wo", f"{E}.{moe}.experts.{{expert}}.w2.weight", expert, scan, T),
            Rule(
                f"{L}/{{n:input_layernorm|post_attention_layernorm}}/scale",
                f"{E}.{{n}}.weight",
                scan,
            ),
            Rule("decoder/decoder_norm/scale", "model.norm.weight"),
            Rule("decoder/logits_dense/kernel", "lm_head.weight", T),
        ],
        strip=("params",),
    )
    renamed = {
        k.replace("self_attn.q_proj", "self_attn.query")
        .replace("self_attn.k_proj", "self_attn.key")
        .replace("self_attn.v_proj", "self_attn.value")
        .replace("self_attn.o_proj", "self_attn.out"): t
        for k, t in tensors.items()
    }
    d, n, v, f, e = (
        hf["hidden_size"],
        hf["num_hidden_layers"],
        hf["vocab_size"],
        hf["intermediate_size"],
        4,
    )
    q, kv = hf["num_attention_heads"] * hf["head_dim"], hf["num_key_value_heads"] * hf["head_dim"]

    def s(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    layers = {
        "self_attention": {
            "query": {"kernel": s(d, n, q)},
            "key": {"kernel": s(d, n, kv)},
            "value": {"kernel": s(d, n, kv)},
            "out": {"kernel": s(q, n, d)},
        },
        "moe": {
            "gate": {"kernel": s(d, n, e)},
            "wi_0": s(e, n, d, f),
            "wi_1": s(e, n, d, f),
            "wo": s(e, n, f, d),
        },
        "input_layernorm": {"scale": s(d, n)},
        "post_attention_layernorm": {"scale": s(d, n)},
    }
    template = {
        "params": {
            "token_embedder": {"embedding": s(v, d)},
            "decoder": {
                "layers": layers,
                "decoder_norm": {"scale": s(d)},
                "logits_dense": {"kernel": s(d, v)},
            },
        }
    }
    params = pytree_from_hf(naming, template, renamed)
    wo = params["params"]["decoder"]["layers"]["moe"]["wo"]
    np.testing.assert_array_equal(
        np.asarray(wo[3, 1]).T, tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    )
    sent_equals(PytreeSource(params, naming), renamed)


def test_preset_layout_is_the_unrolled_linen_layout_of_the_reference_model() -> None:
    cfg = llama.config(**{k: TINY[k] for k in TINY})
    ours = jax.eval_shape(lambda: llama.init(jax.random.key(0), cfg))
    assert jax.tree_util.tree_structure(preset_layout("llama", HF)) == jax.tree_util.tree_structure(
        ours
    )
    assert [x.shape for x in jax.tree_util.tree_leaves(preset_layout("llama", HF))] == [
        x.shape for x in jax.tree_util.tree_leaves(ours)
    ]
