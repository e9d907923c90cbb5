"""A delta round's patch application on the worker, against one dense device copy.

    python benchmarks/bench_patch_apply.py                       # GPU: Llama-3-8B shapes, bf16
    python benchmarks/bench_patch_apply.py --device cpu --shape small   # CPU smoke run

Parameters laid out like vLLM's Llama (``tests/torch_side/fake_llama.py``: fused ``qkv_proj``
and ``gate_up_proj``), their landing map recorded from the model's own loader; every tensor
gets a patch of ``--density`` (2 % by default, what lr 1e-6 changes: bench_delta.py) random
strictly increasing ``int32`` indices and random values, on the device, as the worker holds
them after receipt. Timed until the device finished, median of ``--repeats`` after one
warm-up, side by side:

- ``one by one``: ``LoaderMap.patch`` per tensor (the path before the fused one);
- ``fused``: ``LoaderMap.patch_all(concat=True)`` (one scatter per parameter storage over
  the concatenated patches, ``fused_patch``);
- ``fused, per patch``: ``patch_all`` with a scatter per patch at ``index + offset`` (the
  default: the concatenation's two extra passes cost more than the launches it saves);
- ``dense copy``: one ``copy_`` of every destination parameter into a buffer of its size
  (the floor the issue compares with: the payload's destination tensors copied once).

Before the application, on receipt (``update_weights``), the same rows time what the worker
does with the patches there, each until its host sync:

- ``index check``: ``delta.check_indices`` over the round's patches, concatenated (the
  GPU's path, taken here on any device): one order check, each patch's first and last
  index against its bounds, one sync;
- ``index check, per-index bound (before)``: the formulation it replaced, each index
  compared with its tensor's size expanded by ``repeat_interleave`` (int64), which CUDA
  runs one warp per patch;
- ``copy every wire tensor (before)``: one ``clone`` per ``@index`` / ``@values`` tensor,
  what the worker's ``PatchSplitter`` did to every received patch (it now holds a chunk of
  patches only as it landed);
- ``unpack``: the patches packed as the wire lays them out (``T@index`` then ``T@values``,
  back to back, one chunk), unpacked by the worker's ``UnpackPlan`` (views; the ``@index``
  tensors an odd-sized ``@values`` left misaligned copied out in one ``cat``);
- ``unpack, a clone per misaligned tensor (before)``: the same chunk, each misaligned
  tensor cloned on its own.

``exact``: a twin model patched one by one holds the fused model's bits (``--no-check``
skips the twin, which doubles the memory).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.torch_side.fake_llama import SHAPES, FakeLlama, hf_shapes  # noqa: E402
from weightwire.shared.delta import Patch  # noqa: E402
from weightwire.shared.framing import plan as plan_chunks  # noqa: E402
from weightwire.shared.meta import ParamMeta  # noqa: E402
from weightwire.torch_side.worker.delta import StagedPatch, check_indices  # noqa: E402
from weightwire.torch_side.worker.landing import LoaderMap, record_loader_map  # noqa: E402
from weightwire.torch_side.worker.receive import UnpackPlan  # noqa: E402

Patches = list[tuple[str, torch.Tensor, torch.Tensor]]


def make_patches(
    shapes: dict[str, tuple[int, ...]], density: float, device: torch.device, seed: int
) -> Patches:
    g = torch.Generator(device=device).manual_seed(seed)
    out: Patches = []
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        mask = torch.rand(n, generator=g, device=device) < density
        idx = torch.nonzero(mask).reshape(-1).to(torch.int32)
        del mask
        vals = torch.randn(idx.numel(), generator=g, device=device).to(torch.bfloat16)
        out.append((name, idx, vals))
    return out


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def model_and_map(shape: str, device: torch.device) -> tuple[FakeLlama, LoaderMap]:
    model = FakeLlama(shape, torch.bfloat16, device)
    metas = [ParamMeta(n, "bfloat16", s) for n, s in hf_shapes(shape).items()]
    return model, record_loader_map(model, metas)


def bound_check_before(patches: list[StagedPatch], device: torch.device) -> bool:
    """The receipt check as it was: every index against its tensor's size, expanded per
    index (``repeat_interleave``, int64), then the order check; one host sync."""
    counts = [p.index.numel() for p in patches]
    total = sum(counts)
    idx = torch.cat([p.index for p in patches]).to(torch.int64)
    starts = [sum(counts[: i + 1]) for i in range(len(counts) - 1)]
    host = torch.tensor([p.patch.numel for p in patches] + counts + [s - 1 for s in starts])
    dev = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    n = len(patches)
    bound = torch.repeat_interleave(dev[:n], dev[n : 2 * n], output_size=total)
    bad = ((idx < 0) | (idx >= bound)).any()
    rising = idx[1:] > idx[:-1]
    rising.index_fill_(0, dev[2 * n :], True)
    return bool(bad | ~rising.all())


def wire_chunk(patches: Patches, device: torch.device) -> tuple[torch.Tensor, UnpackPlan]:
    """The patches as one packed chunk in wire order (each ``@index`` then its ``@values``)
    and the worker's plan for it."""
    metas: list[ParamMeta] = []
    parts: list[torch.Tensor] = []
    for name, idx, vals in patches:
        if not idx.numel():
            continue
        metas += [
            ParamMeta(name + "@index", "int32", (idx.numel(),)),
            ParamMeta(name + "@values", "bfloat16", (vals.numel(),)),
        ]
        parts += [idx.view(torch.uint8), vals.view(torch.uint8)]
    (chunk,) = plan_chunks(metas, packed=True, buffer_size_bytes=1 << 36)
    return torch.cat(parts), UnpackPlan(metas, chunk)


def unpack_before(buffer: torch.Tensor, layout: UnpackPlan) -> list[torch.Tensor]:
    """``UnpackPlan.unpack`` as it was: the same views, each misaligned tensor cloned on
    its own."""
    views = {}
    for dtype, end in layout._typed:
        view = buffer[:end].view(dtype)
        views[dtype] = (view.as_strided, view.storage_offset())
    out = []
    for _, kind, dtype, shape, strides, element, offset, nbytes, _ in layout._entries:
        if kind == "view":
            strided, base = views[dtype]
            out.append(strided(shape, strides, base + element))
        elif kind == "clone":
            out.append(buffer[offset : offset + nbytes].clone().view(dtype).view(shape))
    return out


def same_bits(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pb = dict(b.named_parameters())
    return all(
        torch.equal(p.view(torch.int16), pb[n].view(torch.int16)) for n, p in a.named_parameters()
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--density", type=float, default=0.0195)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-check", action="store_true", help="skip the twin model's check")
    args = ap.parse_args()
    device = torch.device(args.device)
    shape = args.shape or ("llama3-8b" if device.type == "cuda" else "small")

    model, m = model_and_map(shape, device)
    patches = make_patches(hf_shapes(shape), args.density, device, seed=0)
    changed = sum(i.numel() for _, i, _ in patches)
    payload_mb = changed * 6 / 1e6
    dests = [p.data for p in model.parameters()]
    scratch = [torch.empty_like(d) for d in dests]
    dense_mb = sum(d.nbytes for d in dests) / 1e6

    def one_by_one() -> None:
        for name, idx, vals in patches:
            m.patch(name, idx, vals, in_range=True)

    launched: dict[str, int] = {}

    def fused() -> None:
        launched["fused"] = m.patch_all(patches, concat=True)

    def each() -> None:
        launched["fused, per patch"] = m.patch_all(patches, concat=False)

    def dense() -> None:
        for s, d in zip(scratch, dests, strict=True):
            s.copy_(d)

    shapes = hf_shapes(shape)
    staged = [
        StagedPatch(Patch(name, "bfloat16", shapes[name], idx.numel()), idx, vals)
        for name, idx, vals in patches
        if idx.numel()
    ]

    def check() -> None:
        check_indices(staged, concat=True)  # the GPU's path, on any device here

    def check_before() -> None:
        assert not bound_check_before(staged, device)

    def copies_before() -> None:
        for _, idx, vals in patches:
            idx.clone()
            vals.clone()

    buffer, layout = wire_chunk(patches, device)

    def unpack() -> None:
        layout.unpack(buffer)

    rows = {
        "unpack": timed(unpack, device, args.repeats),
        "unpack, a clone per misaligned tensor (before)": timed(
            lambda: unpack_before(buffer, layout), device, args.repeats
        ),
        "index check": timed(check, device, args.repeats),
        "index check, per-index bound (before)": timed(check_before, device, args.repeats),
        "copy every wire tensor (before)": timed(copies_before, device, args.repeats),
        "one by one": timed(one_by_one, device, args.repeats),
        "fused": timed(fused, device, args.repeats),
        "fused, per patch": timed(each, device, args.repeats),
        "dense copy": timed(dense, device, args.repeats),
    }
    scratch.clear()  # its memory back before the twin
    exact = "not checked"
    if not args.no_check:
        twin, tm = model_and_map(shape, device)
        with torch.no_grad():
            for p, q in zip(twin.parameters(), model.parameters(), strict=True):
                p.copy_(q)
        m.patch_all(patches)
        for name, idx, vals in patches:
            tm.patch(name, idx, vals)
        exact = "yes" if same_bits(model, twin) else "NO"

    med = {k: statistics.median(v) for k, v in rows.items()}
    print(
        f"# patch application, {shape} ({len(patches)} tensors, {dense_mb:.1f} MB dense), "
        f"{device}, density {changed / (dense_mb * 1e6 / 2):.3%}, payload {payload_mb:.1f} MB, "
        f"median of {args.repeats}"
    )
    print("| path | ms | x dense copy | scatters |")
    print("|---|---:|---:|---:|")
    counts = {"one by one": "per landing", "dense copy": "-"}
    counts.update((k, "-") for k in rows if k.startswith(("index check", "copy every", "unpack")))
    counts.update((k, str(v)) for k, v in launched.items())
    for k, v in med.items():
        print(f"| {k} | {v:.2f} | {v / med['dense copy']:.2f}x | {counts[k]} |")
    print(f"exact (fused == one by one, bit for bit): {exact}")


if __name__ == "__main__":
    main()
