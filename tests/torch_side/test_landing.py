"""The landing map (``torch_side.worker.landing``): recorded from the model's own loader,
``write`` / ``patch`` / ``read`` equal to what ``load_weights`` does, bit for bit, and a
refusal with its reason for every loader that is not a plain view copy."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.torch_side._landing_models import HIDDEN, LOADERS, Refusing, TinyTP, tiny_tp_shapes
from tests.torch_side._local_core import local_core
from tests.torch_side.fake_llama import FakeLlama, hf_shapes
from weightwire.shared.delta import Patch
from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.worker.core import _ReceiverCore
from weightwire.torch_side.worker.delta import StagedPatch, check_indices
from weightwire.torch_side.worker.landing import (
    LoaderMap,
    LoaderMapRefused,
    _whole,
    post_load_refusal,
    record_loader_map,
)

CPU = torch.device("cpu")


def metas_of(shapes: dict[str, tuple[int, ...]], dtype: str = "bfloat16") -> list[ParamMeta]:
    return [ParamMeta(n, dtype, s) for n, s in shapes.items()]


def checkpoint(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def twins(make: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two instances with the same starting values (the map's and load_weights')."""
    torch.manual_seed(1)
    a = make()  # type: ignore[operator]
    torch.manual_seed(1)
    b = make()  # type: ignore[operator]
    return a, b


def write_all(m: LoaderMap, ck: dict[str, torch.Tensor]) -> None:
    for name, t in ck.items():
        m.write(name, t)


def patched(ck: dict[str, torch.Tensor], seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A few random flat indices and new values per tensor."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in ck.items():
        k = max(1, t.numel() // 7)
        idx = torch.randperm(t.numel(), generator=g)[:k]
        out[name] = (idx, torch.randn(k, generator=g).to(t.dtype))
    return out


def apply_dense(
    ck: dict[str, torch.Tensor], patches: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in ck.items():
        idx, vals = patches[name]
        flat = t.clone().reshape(-1)
        flat[idx] = vals
        out[name] = flat.reshape(t.shape)
    return out


# ------------------------------------------------------------------- FakeLlama
def test_fake_llama_write_patch_read_equal_load_weights() -> None:
    shapes = hf_shapes("tiny")
    a, b = twins(lambda: FakeLlama("tiny", torch.float32, CPU))
    m = record_loader_map(a, metas_of(shapes))
    qkv = m.tensors["model.layers.1.self_attn.v_proj.weight"].landings
    assert [ld.param for ld in qkv] == ["layers.7.weight"]  # the fused qkv_proj of layer 1
    assert qkv[0].dst_offset == (64 + 32) * 64  # after q and k rows
    ck = checkpoint(shapes, 0)
    write_all(m, ck)
    b.load_weights(ck.items())
    assert_same_params(a, b)
    for name, t in ck.items():
        assert torch.equal(m.read(name), t), name
    patches = patched(ck, 1)
    for name, (idx, vals) in patches.items():
        m.patch(name, idx, vals)
    b.load_weights(apply_dense(ck, patches).items())
    assert_same_params(a, b)
    assert 0 < m.nbytes() < 64 << 10


def test_patch_in_range_takes_whole_landings_directly_and_equals_the_translation() -> None:
    """``in_range=True``: q/k/v (rows of the fused qkv_proj), gate/up, plain tensors write
    at ``index + offset``; the result equals the general translation's, bit for bit."""
    shapes = hf_shapes("tiny")
    a, b = twins(lambda: FakeLlama("tiny", torch.float32, CPU))
    ma, mb = record_loader_map(a, metas_of(shapes)), record_loader_map(b, metas_of(shapes))
    whole = [n for n, tl in ma.tensors.items() if all(_whole(ld, tl.shape) for ld in tl.landings)]
    assert "model.layers.1.self_attn.v_proj.weight" in whole and len(whole) == len(shapes)
    ck = checkpoint(shapes, 4)
    write_all(ma, ck)
    write_all(mb, ck)
    for name, (idx, vals) in patched(ck, 5).items():
        ma.patch(name, idx, vals, in_range=True)
        mb.patch(name, idx, vals)
    assert_same_params(a, b)


def test_tensor_parallel_slices_are_not_whole_landings() -> None:
    m = record_loader_map(TinyTP(rank=1, world=2), metas_of(tiny_tp_shapes()))
    tl = m.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert tl.landings and not any(_whole(ld, tl.shape) for ld in tl.landings)


def test_received_indices_are_checked_together_and_the_bad_patch_named() -> None:
    def staged(name: str, numel: int, index: list[int]) -> StagedPatch:
        idx = torch.tensor(index, dtype=torch.int32)
        return StagedPatch(
            Patch(name, "float32", (numel,), len(index)), idx, torch.ones(len(index))
        )

    good = [staged("a", 10, [0, 9]), staged("b", 5, []), staged("c", 3, [2])]
    check_indices(good)  # nothing raised
    for bad in ([10], [-1], [3, 100]):
        with pytest.raises(ValueError, match="patch of 'd': an index is outside its 10 elements"):
            check_indices([*good, staged("d", 10, bad)])


def test_recording_writes_no_parameter() -> None:
    a, b = twins(lambda: FakeLlama("tiny", torch.float32, CPU))
    record_loader_map(a, metas_of(hf_shapes("tiny")))
    assert_same_params(a, b)


# ------------------------------------------------------- TP rank 1 of 2, MoE, tied, vocab pad
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("tied", [False, True])
def test_tp_moe_vocab_tied_write_and_patch_equal_load_weights(rank: int, tied: bool) -> None:
    shapes = tiny_tp_shapes()
    if tied:
        del shapes["lm_head.weight"]  # not in a tied checkpoint; the map answers for it anyway
    a, b = twins(lambda: TinyTP(rank=rank, world=2, tied=tied))
    m = record_loader_map(a, metas_of(shapes))
    ck = checkpoint(shapes, 2)
    write_all(m, ck)
    b.load_weights(ck.items())
    assert_same_params(a, b)
    # padded vocab rows: the loader zero-fills them, the map never touches them
    assert not m.tensors["model.embed_tokens.weight"].complete
    with pytest.raises(ValueError, match="only part of it lives on this rank"):
        m.read("model.embed_tokens.weight")
    assert torch.equal(m.read("model.norm.weight"), ck["model.norm.weight"])
    patches = patched(ck, 3)  # indices on both ranks: the other rank's are ignored
    for i, (name, (idx, vals)) in enumerate(patches.items()):
        # in range of the tensor: sliced landings still take the translation
        m.patch(name, idx.to(torch.int32), vals, in_range=i % 2 == 0)
    b.load_weights(apply_dense(ck, patches).items())
    assert_same_params(a, b)


def test_patch_of_another_ranks_slice_changes_nothing() -> None:
    a, b = twins(lambda: TinyTP(rank=1, world=2))
    m = record_loader_map(a, metas_of(tiny_tp_shapes()))
    # rank 0's rows of q_proj, and of expert 1's gate_proj: rank 1 holds none of them
    m.patch("model.layers.0.self_attn.q_proj.weight", torch.arange(4 * HIDDEN), torch.ones(64))
    m.patch("model.mlp.experts.1.gate_proj.weight", torch.arange(4 * HIDDEN), torch.ones(64))
    assert_same_params(a, b)


def test_tied_head_lands_on_the_embedding_under_either_name() -> None:
    shapes = tiny_tp_shapes()
    a, b = twins(lambda: TinyTP(tied=True))
    m = record_loader_map(a, metas_of(shapes))  # the loader skips lm_head.weight
    assert m.tensors["lm_head.weight"].landings == m.tensors["model.embed_tokens.weight"].landings
    head = checkpoint({"lm_head.weight": shapes["lm_head.weight"]}, 4)["lm_head.weight"]
    m.write("lm_head.weight", head)
    b.load_weights([("model.embed_tokens.weight", head)])
    assert_same_params(a, b)
    assert torch.equal(m.read("model.embed_tokens.weight"), head)
    idx, vals = torch.tensor([0, 17, 159]), torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    m.patch("lm_head.weight", idx, vals)
    assert a.lm_head.weight.reshape(-1)[idx].tolist() == [1.0, 2.0, 3.0]


def test_expert_landing_is_one_slice_of_the_stacked_parameter() -> None:
    m = record_loader_map(TinyTP(rank=1, world=2), metas_of(tiny_tp_shapes()))
    (ld,) = m.tensors["model.mlp.experts.2.up_proj.weight"].landings
    assert ld.param == "model.experts.w13_weight"
    assert (ld.shape, ld.src_offset, ld.dst_offset) == ((4, 16), 4 * 16, 2 * 8 * 16 + 4 * 16)


# ------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("computes", r"w\.weight: the loader computes on it \(aten\.mul"),
        ("setitem", r"w\.weight: the loader writes it by __setitem__"),
        ("transposes", r"w\.weight: the loader copies it into a new tensor \(\.clone\(\) or "),
        ("item", r"w\.weight: the loader reads a value of it \(\.item\(\)\)"),
        ("twice", r"parameter w\.weight: the loader writes some elements twice"),
        ("partly", r"parameter w\.weight: the loader writes 8 of its 16 elements"),
        ("temporary", r"w\.weight: the loader copies it into a tensor that is not a parameter"),
        ("concatenates", r"w\.weight: the loader computes on it \(aten\.cat"),
        ("casts", r"w\.weight: the loader casts it to torch\.float16 before copying it"),
        ("rebinds", r"parameter w\.weight: the loader rebinds or replaces it \(param\.data = "),
        ("swallows", r"w\.weight: the loader computes on it \(aten\.add"),
    ],
)
def test_loaders_that_are_not_plain_copies_refuse(kind: str, message: str) -> None:
    assert set(LOADERS) >= {kind}
    model = Refusing(kind)
    before = model.w.weight.clone()
    param = model.w.weight
    with pytest.raises(LoaderMapRefused, match=message):
        record_loader_map(model, [ParamMeta("w.weight", "bfloat16", (4, 4))])
    assert model.w.weight is param and torch.equal(model.w.weight, before)


class UnquantizedLinearMethod:
    pass


class Fp8LinearMethod:
    pass


def test_post_load_processing_refuses_cpu_prepack_and_quantized_methods() -> None:
    model = FakeLlama("tiny", torch.float32, CPU)
    assert post_load_refusal(model) is None
    model.layers[1].quant_method = UnquantizedLinearMethod()  # type: ignore[assignment]
    with pytest.raises(
        LoaderMapRefused,
        match=r"layers\.1: UnquantizedLinearMethod repacks the "
        r"weights for the CPU kernels after loading \(CPU prepack\)",
    ):
        record_loader_map(model, metas_of(hf_shapes("tiny")))
    # a fresh instance nobody post-processed may skip the check
    record_loader_map(model, metas_of(hf_shapes("tiny")), check_post_load=False)
    model.layers[1].quant_method = Fp8LinearMethod()  # type: ignore[assignment]
    assert post_load_refusal(model) == (
        "layers.1: Fp8LinearMethod processes the weights after loading (not a plain copy)"
    )


def test_write_and_patch_check_their_input() -> None:
    m = record_loader_map(TinyTP(), metas_of(tiny_tp_shapes()))
    with pytest.raises(ValueError, match=r"model\.norm\.weight: shape \[3\], the map has \[16\]"):
        m.write("model.norm.weight", torch.zeros(3))
    with pytest.raises(KeyError, match="not a checkpoint tensor of this landing map"):
        m.write("nope", torch.zeros(3))
    with pytest.raises(ValueError, match="flat_index must be a 1-D int32/int64 tensor"):
        m.patch("model.norm.weight", torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="2 values for 3 indices"):
        m.patch("model.norm.weight", torch.arange(3), torch.zeros(2))


# ------------------------------------------------------------------- the worker's cache
def core_for(model: torch.nn.Module) -> _ReceiverCore:
    def connect(*_: object, **__: object) -> None:
        raise AssertionError("loader_map opens no link")

    return local_core(model, connect)


def test_worker_records_the_map_once_per_model_and_metadata() -> None:
    model = FakeLlama("tiny", torch.float32, CPU)
    core = core_for(model)
    metas = metas_of(hf_shapes("tiny"))
    first = core.caches.loader_map(metas)
    assert first is not None and core.caches.loader_map(list(metas)) is first
    assert core.caches.loader_map(metas[:3]) is not first  # other metadata, its own map
    model.layers[0].weight.data = torch.zeros_like(model.layers[0].weight)  # reallocated
    again = core.caches.loader_map(metas)
    assert again is not None and again is not first
    again.write(
        "model.embed_tokens.weight", torch.ones(hf_shapes("tiny")["model.embed_tokens.weight"])
    )
    assert bool((model.layers[0].weight == 1).all())


def test_worker_refusal_is_none_and_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    core = core_for(Refusing("computes"))
    metas = [ParamMeta("w.weight", "bfloat16", (4, 4))]
    with caplog.at_level(logging.WARNING, logger="weightwire.torch_side.worker.target_caches"):
        assert core.caches.loader_map(metas) is None
        assert core.caches.loader_map(metas) is None
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "test: no landing map, loading through load_weights: w.weight: the loader computes on "
        "it (aten.mul.Tensor), not a plain copy"
    )
