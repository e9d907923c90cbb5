"""Adapter sources: a JAX tree (plain dict, Flax NNX LoRALinear) and a PEFT model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from weightwire.jax_side.lora import lora_source
from weightwire.shared.errors import ConfigError
from weightwire.shared.lora import LoRASpec
from weightwire.torch_side.sender.lora import PeftAdapterSource, peft_alpha

A = "base_model.model.model.layers.{}.{}.lora_A.pol.weight"
B = "base_model.model.model.layers.{}.{}.lora_B.pol.weight"


def test_plain_tree_maps_to_peft_names_transposed() -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 2)).astype(np.float32)
    b = rng.standard_normal((2, 16)).astype(np.float32)
    tree = {"params": {"model": {"layers_1": {"mlp": {"up_proj": {"lora_a": a, "lora_b": b}}}}}}
    got = dict(lora_source(tree, "pol"))
    assert set(got) == {A.format(1, "mlp.up_proj"), B.format(1, "mlp.up_proj")}
    np.testing.assert_array_equal(np.asarray(got[A.format(1, "mlp.up_proj")]), a.T)
    np.testing.assert_array_equal(np.asarray(got[B.format(1, "mlp.up_proj")]), b.T)


def test_nnx_lora_linear_state_and_scanned_layers() -> None:
    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.q_proj = nnx.LoRALinear(8, 8, lora_rank=2, rngs=rngs)
            self.v_proj = nnx.LoRALinear(8, 4, lora_rank=2, rngs=rngs)

    class Layer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.self_attn = Block(rngs)

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = nnx.List([Layer(rngs), Layer(rngs)])

    class Top(nnx.Module):
        def __init__(self) -> None:
            self.model = Model(nnx.Rngs(0))

    top = Top()
    source = lora_source(nnx.state(top, nnx.LoRAParam), "pol")
    spec = LoRASpec.from_metas(source.metadata())
    assert (spec.rank, spec.target_modules, len(spec.modules)) == (2, ("q_proj", "v_proj"), 4)
    got = dict(source)
    lora = top.model.layers[1].self_attn.v_proj.lora
    np.testing.assert_array_equal(
        np.asarray(got[A.format(1, "self_attn.v_proj")]), np.asarray(lora.lora_a[...]).T
    )
    # One stacked `layers` subtree (scan): leading axis = layer.
    stacked = {"model": {"layers": {"self_attn": {"k_proj": {"lora_a": jnp.ones((3, 8, 2))}}}}}
    stacked["model"]["layers"]["self_attn"]["k_proj"]["lora_b"] = jnp.ones((3, 2, 4))
    scanned = lora_source(stacked, "pol", scan_layers=True)
    assert [m.name for m in scanned.metadata()][:2] == [
        A.format(0, "self_attn.k_proj"),
        B.format(0, "self_attn.k_proj"),
    ]
    assert len(scanned.metadata()) == 6
    jax.block_until_ready([t for _, t in scanned])


def test_peft_source_renames_the_adapter_and_reads_alpha() -> None:
    peft = pytest.importorskip("peft")

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.ModuleDict({"proj": torch.nn.Linear(8, 6, bias=False)})

    model = peft.get_peft_model(Tiny(), peft.LoraConfig(r=3, lora_alpha=6, target_modules=["proj"]))
    source = PeftAdapterSource(model, "served", dtype=torch.bfloat16)
    metas = source.metadata()
    assert [(m.name, m.dtype, m.shape) for m in metas] == [
        ("base_model.model.model.proj.lora_A.served.weight", "bfloat16", (3, 8)),
        ("base_model.model.model.proj.lora_B.served.weight", "bfloat16", (6, 3)),
    ]
    pairs = dict(source)
    want = model.base_model.model.model["proj"].lora_A["default"].weight
    assert torch.equal(pairs[metas[0].name], want.detach().to(torch.bfloat16))
    assert peft_alpha(model) == 6.0
    assert source.alpha == 6.0
    with pytest.raises(ConfigError, match="no LoRA matrices of adapter 'nope'"):
        PeftAdapterSource(model, "served", peft_adapter="nope")
    with pytest.raises(ConfigError, match="adapter name"):
        PeftAdapterSource(model, "has.dot")
