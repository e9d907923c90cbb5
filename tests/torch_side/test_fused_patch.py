"""Fused patch application (``torch_side.worker.fused_patch``, ``LoaderMap.patch_all``,
``HFModelHost``'s commit): bit-identical to applying each patch in turn through today's
per-tensor paths, for random patches over vLLM-shaped models (fused q/k/v and gate/up, a tied
head, tensor-parallel slices, MoE experts) and the edge cases (empty patch, every element,
a NaN payload, storage indices past int32's range); one scatter per destination storage."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.torch_side._landing_models import TinyTP, tiny_tp_shapes
from tests.torch_side.fake_llama import FakeLlama, hf_shapes
from weightwire.shared.delta import Patch
from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.dtypes import wire_name
from weightwire.torch_side.worker.delta import StagedPatch, check_indices, patch_tensor
from weightwire.torch_side.worker.fused_patch import (
    WORD,
    FusedPatch,
    PatchTarget,
    _offsets,
    apply_fused,
)
from weightwire.torch_side.worker.landing import record_loader_map

Patches = list[tuple[str, torch.Tensor, torch.Tensor]]


def random_patches(
    shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, seed: int, device: str = "cpu"
) -> Patches:
    """Per tensor one of: nothing sent, an empty patch, every element, the first and last
    element, a random strictly increasing subset (int32 indices, as on the wire); values are
    random bit patterns (NaN payloads and signed zeros included)."""
    g = torch.Generator().manual_seed(seed)
    word = WORD[torch.empty((), dtype=dtype).element_size()]
    out: Patches = []
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        kind = int(torch.randint(0, 5, (), generator=g))
        if kind == 0:
            continue
        if kind == 1:
            idx = torch.empty(0, dtype=torch.int64)
        elif kind == 2:
            idx = torch.arange(n)
        elif kind == 3:
            idx = torch.tensor(sorted({0, n - 1}))
        else:
            density = float(torch.rand((), generator=g)) * 0.3
            idx = torch.nonzero(torch.rand(n, generator=g) < density).reshape(-1)
        info = torch.iinfo(word)
        bits = torch.randint(info.min, info.max, (idx.numel(),), generator=g, dtype=torch.int64)
        values = bits.to(word).view(dtype)
        out.append((name, idx.to(torch.int32).to(device), values.to(device)))
    return out


def bits_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach().reshape(-1).view(WORD[p.element_size()]).cpu().clone()
    return out


def assert_bit_identical(a: torch.nn.Module, b: torch.nn.Module) -> None:
    ba, bb = bits_of(a), bits_of(b)
    assert ba.keys() == bb.keys()
    for name in ba:
        assert torch.equal(ba[name], bb[name]), name


def _fused_vs_one_by_one(
    make: Callable[[], torch.nn.Module],
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    seed: int,
    device: str = "cpu",
    concat: bool | None = True,
) -> tuple[int, int, Patches]:
    """Patch two identical models, one with ``patch_all``, one with ``patch`` per tensor
    (today's path); returns (scatters launched, fused-eligible storages patched, patches)."""
    torch.manual_seed(seed)
    a = make()
    b = make()
    b.load_state_dict(a.state_dict())
    metas = [ParamMeta(n, wire_name(dtype), s) for n, s in shapes.items()]
    ma, mb = record_loader_map(a, metas), record_loader_map(b, metas)
    patches = random_patches(shapes, dtype, seed, device)
    tied = {"lm_head.weight", "model.embed_tokens.weight"}
    if tied <= {n for n, _, _ in patches} and getattr(a, "tied", False):
        # tied names carry the same patch (the worker refuses two different ones on receipt)
        emb = next(p for p in patches if p[0] == "model.embed_tokens.weight")
        patches = [p if p[0] != "lm_head.weight" else ("lm_head.weight", *emb[1:]) for p in patches]
    launched = ma.patch_all(patches, concat=concat)
    for name, idx, vals in patches:
        mb.patch(name, idx, vals)
    assert_bit_identical(a, b)
    storages = {
        t.storage for n, idx, _ in patches if idx.numel() and (t := ma.plain_target(n)) is not None
    }
    return launched, len(storages), patches


@pytest.mark.parametrize("seed", range(6))
def test_fake_llama_fused_equals_one_by_one(seed: int) -> None:
    """Concatenated (the GPU's way, forced here): one scatter per parameter storage."""
    dtype = torch.bfloat16 if seed % 2 else torch.float32
    tied = seed % 3 == 0
    shapes = hf_shapes("tiny")
    if tied:
        del shapes["lm_head.weight"]
        shapes["lm_head.weight"] = hf_shapes("tiny")["lm_head.weight"]  # patched by name too
    launched, storages, patches = _fused_vs_one_by_one(
        lambda: FakeLlama("tiny", dtype, torch.device("cpu"), tied=tied), shapes, dtype, seed
    )
    # one scatter per parameter storage: q/k/v share the fused qkv_proj, gate/up gate_up_proj
    assert launched == storages
    assert sum(1 for _, i, _ in patches if i.numel()) >= storages


@pytest.mark.parametrize("concat", [True, None])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("rank", "world", "tied"), [(0, 1, True), (0, 1, False), (1, 2, False)])
def test_tp_moe_tied_fused_equals_one_by_one(
    seed: int, rank: int, world: int, tied: bool, concat: bool | None
) -> None:
    """Expert slices of stacked w13/w2 and tensor-parallel slices have no plain target: they
    keep the per-tensor translation, beside the fused rest, with the same result; on a CPU
    by default (``concat=False``) each plain patch is its own scatter."""
    shapes = tiny_tp_shapes()
    _fused_vs_one_by_one(
        lambda: TinyTP(rank=rank, world=world, tied=tied),
        shapes,
        torch.float32,
        seed,
        concat=concat,
    )


def test_plain_targets_are_whole_single_landings_and_cached() -> None:
    m = record_loader_map(
        TinyTP(rank=1, world=2),
        [ParamMeta(n, "float32", s) for n, s in tiny_tp_shapes().items()],
    )
    assert m.plain_target("model.norm.weight") == PatchTarget("model.norm.weight", 0)
    assert m.plain_target("model.layers.0.self_attn.q_proj.weight") is None  # a TP slice
    assert m.plain_target("model.embed_tokens.weight") is None  # a padded vocab slice
    assert "model.norm.weight" in m._plain  # worked out once
    fm = record_loader_map(
        FakeLlama("tiny", torch.float32, torch.device("cpu")),
        [ParamMeta(n, "float32", s) for n, s in hf_shapes("tiny").items()],
    )
    v = fm.plain_target("model.layers.1.self_attn.v_proj.weight")
    assert v == PatchTarget("layers.7.weight", (64 + 32) * 64)  # after q's and k's rows


def test_mixed_dtypes_group_by_width_and_match_patch_tensor() -> None:
    """``apply_fused`` over separate tensors of several dtypes (``HFModelHost``'s case) equals
    ``patch_tensor`` per tensor, bit for bit; one scatter per tensor patched."""
    g = torch.Generator().manual_seed(7)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64, torch.bool]
    a = {f"t{i}": torch.randn(37, 5, generator=g).to(d) for i, d in enumerate(dtypes)}
    b = {n: t.clone() for n, t in a.items()}
    shapes = {n: tuple(t.shape) for n, t in a.items()}
    fused: list[FusedPatch] = []
    for name, idx, _ in random_patches(shapes, torch.int16, 3):
        vals = torch.randn(idx.numel(), generator=g).to(a[name].dtype)
        fused.append(FusedPatch(PatchTarget(name, 0), idx, vals, name))
        patch_tensor(b[name], idx, vals)
    launched = apply_fused({n: t.view(-1) for n, t in a.items()}, fused, concat=True)
    assert launched == sum(1 for p in fused if p.index.numel())
    for name in a:
        assert torch.equal(
            a[name].view(-1).view(WORD[a[name].element_size()]),
            b[name].view(-1).view(WORD[b[name].element_size()]),
        ), name


@pytest.mark.parametrize("concat", [True, False])
def test_storage_indices_past_int32(concat: bool) -> None:
    """int32 wire indices plus an offset beyond 2**31 land where int64 arithmetic puts them
    (the storage is reserved, not touched: only the patched pages are written)."""
    big = torch.empty(2**31 + 64, dtype=torch.uint8)
    far = 2**31 - 2
    idx = torch.tensor([0, 1, 5], dtype=torch.int32)
    int32_max = torch.tensor([2**31 - 1], dtype=torch.int32)  # the largest wire index
    for at in (far - 1, far, far + 1, far + 5, far + 6, 2**31 + 39):
        big[at] = 0
    apply_fused(
        {"big": big, "small": torch.zeros(4, dtype=torch.uint8)},
        [
            FusedPatch(PatchTarget("big", far), idx, torch.tensor([1, 2, 3], dtype=torch.uint8)),
            FusedPatch(PatchTarget("big", 40), int32_max, torch.tensor([9], dtype=torch.uint8)),
        ],
        concat=concat,
    )
    assert [int(big[at]) for at in (far - 1, far, far + 1, far + 5, far + 6)] == [0, 1, 2, 3, 0]
    assert int(big[2**31 + 39]) == 9


@pytest.mark.parametrize("seed", range(20))
def test_the_offsets_scan_repeats_each_patchs_offset_once_per_index(seed: int) -> None:
    """The concatenated path's per-index storage offsets (a step per patch, summed) are each
    patch's offset repeated over its indices, empty patches and offsets past int32 included."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 9, (), generator=g))
    counts = torch.randint(0, 4, (n,), generator=g).tolist()
    offsets = (torch.randint(0, 2**33, (n,), generator=g) * (seed % 2)).tolist()
    got = _offsets(offsets, counts, sum(counts), torch.device("cpu"))
    want = torch.repeat_interleave(torch.tensor(offsets), torch.tensor(counts))
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()


def _staged(name: str, numel: int, index: list[int]) -> StagedPatch:
    idx = torch.tensor(index, dtype=torch.int32)
    return StagedPatch(Patch(name, "float32", (numel,), len(index)), idx, torch.ones(len(index)))


def _outcome(patches: list[StagedPatch], concat: bool | None) -> str:
    try:
        check_indices(patches, concat=concat)
    except ValueError as exc:
        return str(exc)
    return "ok"


def _random_case(seed: int) -> list[StagedPatch]:
    """A round's patches on the host, maybe one of them bad: out of range at either end or
    over a rising run's half, repeated or falling within a patch."""
    g = torch.Generator().manual_seed(seed)
    patches = []
    for i in range(int(torch.randint(1, 6, (), generator=g))):
        numel = int(torch.randint(1, 50, (), generator=g))
        idx = sorted(
            set(
                torch.randint(
                    0, numel, (int(torch.randint(0, 8, (), generator=g)),), generator=g
                ).tolist()
            )
        )
        fault = int(torch.randint(0, 7, (), generator=g))
        if idx and fault == 1:
            idx[-1] = numel  # one past the end
        elif idx and fault == 2:
            idx[0] = -1
        elif len(idx) > 1 and fault == 3:
            idx[1] = idx[0]  # repeated
        elif len(idx) > 2 and fault == 4:
            idx[1], idx[2] = idx[2], idx[1]  # falling
        elif idx and fault == 5:
            idx = [
                i + numel - idx[len(idx) // 2] for i in idx
            ]  # rising, its upper half past the end
        elif len(idx) > 1 and fault == 6:
            idx = [i - idx[-1] for i in idx]  # rising, all but the last below 0
        patches.append(_staged(f"p{i}", numel, idx))
    return patches


@pytest.mark.parametrize("seed", range(60))
def test_concatenated_index_check_agrees_with_the_per_patch_one(seed: int) -> None:
    """The receipt check over a round's indices concatenated (a GPU's way) refuses exactly
    what the per-patch check refuses, naming the same patch: out of range at either end or
    over a rising run's half, repeated or falling within a patch; a patch starting below the
    previous one's last index (a different tensor) and empty patches pass."""
    patches = _random_case(seed)
    assert _outcome(patches, concat=True) == _outcome(patches, concat=False)


@pytest.mark.gpu
def test_the_index_check_on_cuda_agrees_with_the_per_patch_one_on_the_host() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for seed in range(60):
        patches = _random_case(seed)
        on_gpu = [StagedPatch(p.patch, p.index.cuda(), p.values.cuda()) for p in patches]
        assert _outcome(on_gpu, concat=None) == _outcome(patches, concat=False), seed


@pytest.mark.parametrize("concat", [True, False])
def test_the_index_check_spans_int32s_whole_range(concat: bool) -> None:
    """The check runs in the wire's int32: a tensor of MAX_PATCH_NUMEL elements takes its
    last index and refuses the one past it (only the patch's declared shape is read)."""
    top = 2**31 - 1
    check_indices([_staged("big", top, [0, top - 1])], concat=concat)  # nothing raised
    with pytest.raises(ValueError, match="'big': an index is outside its 2147483647"):
        check_indices([_staged("big", top, [0, top])], concat=concat)
    with pytest.raises(ValueError, match="'big': an index is outside"):
        check_indices([_staged("a", 4, [1]), _staged("big", top, [-1, 5])], concat=concat)


def test_an_offset_patch_leaves_the_held_index_as_received() -> None:
    """A patch landing at an offset of its storage adds the offset to a copy of its indices:
    an int64 index (held as received, maybe a view of the chunk) is not written."""
    flat = torch.zeros(16)
    for dtype in (torch.int32, torch.int64):
        idx = torch.tensor([0, 2], dtype=dtype)
        apply_fused({"s": flat}, [FusedPatch(PatchTarget("s", 8), idx, torch.ones(2))])
        assert idx.tolist() == [0, 2] and idx.dtype == dtype
    assert flat.nonzero().view(-1).tolist() == [8, 10]


def test_a_patch_may_start_below_the_previous_ones_last_index() -> None:
    patches = [_staged("a", 10, [3, 9]), _staged("b", 4, []), _staged("c", 10, [0, 1])]
    check_indices(patches, concat=True)  # nothing raised
    with pytest.raises(ValueError, match="index 1 at position 2 follows 1"):
        check_indices([*patches, _staged("d", 5, [0, 1, 1])], concat=True)


def test_a_bad_patch_is_named() -> None:
    flat = torch.zeros(8)
    with pytest.raises(
        ValueError, match="patch of 'w': \\[3\\] values for indices of shape \\[2\\]"
    ):
        apply_fused(
            {"w": flat},
            [FusedPatch(PatchTarget("w", 0), torch.tensor([0, 1]), torch.zeros(3), "w")],
        )


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_fused_equals_one_by_one_on_cuda_without_a_sync(seed: int) -> None:
    """The same on a GPU, the fused application under torch's sync debug mode set to raise
    on any synchronizing call (the one-by-one reference runs outside it)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device("cuda")
    shapes = hf_shapes("tiny")
    torch.manual_seed(seed)
    a = FakeLlama("tiny", torch.bfloat16, dev)
    b = FakeLlama("tiny", torch.bfloat16, dev)
    b.load_state_dict(a.state_dict())
    metas = [ParamMeta(n, "bfloat16", s) for n, s in shapes.items()]
    ma, mb = record_loader_map(a, metas), record_loader_map(b, metas)
    patches = random_patches(shapes, torch.bfloat16, seed, "cuda")
    for n, _, _ in patches:
        ma.plain_target(n)  # the per-tensor layout work is done once, ahead
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ma.patch_all(patches)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name, idx, vals in patches:
        mb.patch(name, idx, vals)
    assert_bit_identical(a, b)


@pytest.mark.gpu
def test_concatenated_index_check_on_cuda_names_the_bad_patch() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    good = [_staged("a", 10, [3, 9]), _staged("b", 4, []), _staged("c", 10, [0, 1])]
    on_gpu = [StagedPatch(p.patch, p.index.cuda(), p.values.cuda()) for p in good]
    check_indices(on_gpu)  # concatenated by default on a GPU: nothing raised
    bad = _staged("d", 5, [0, 5])
    with pytest.raises(ValueError, match="patch of 'd': an index is outside its 5 elements"):
        check_indices([*on_gpu, StagedPatch(bad.patch, bad.index.cuda(), bad.values.cuda())])
