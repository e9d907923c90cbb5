"""A small layered model and a check that a delta kernel's rounds through ``DeltaTracker``
are the reference kernel's, byte for byte, whatever the launches' batching (``group_bytes``)
and depth (``ahead``): shared by the CPU tests (the fused kernel emulated) and the GPU ones."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np

from weightwire.shared.meta import ParamMeta
from weightwire.trainer.delta import DeltaKernel, DeltaTracker

DTYPES = {"bfloat16": 2, "float32": 4, "bool": 1}
DENSITY = 0.3


def layered(
    rng: np.random.Generator, layers: int = 5
) -> list[tuple[str, str, np.ndarray, np.ndarray]]:
    """``(name, dtype, old bits, new bits)`` per tensor, in stream order: an embedding, some
    decoder layers (a tensor changed a little, one not at all, one everywhere: dense, a
    float32 norm, a bool mask) and an un-indexed tail."""
    out = []

    def add(name: str, dtype: str, n: int, fraction: float) -> None:
        width = DTYPES[dtype]
        if dtype == "bool":
            old = rng.integers(0, 2, n, dtype=np.uint8)
        else:
            old = rng.integers(0, 1 << (8 * width), n, dtype=f"u{width}")
            # Finite floats (the top exponent bit clear): XLA on CPU may quiet a NaN's
            # payload in the reference kernel's copies.
            old &= np.array(~(1 << (8 * width - 2)) & ((1 << (8 * width)) - 1), old.dtype)
        new = old.copy()
        picked = rng.random(n) < fraction
        new[picked] ^= 1
        out.append((name, dtype, old, new))

    add("model.embed_tokens.weight", "bfloat16", 5000, 0.01)
    for i in range(layers):
        p = f"model.layers.{i}."
        add(p + "self_attn.q_proj.weight", "bfloat16", 3000 + 17 * i, 0.02)
        add(p + "self_attn.k_proj.weight", "bfloat16", 1000, 0.0 if i % 2 else 0.001)
        add(p + "mlp.up_proj.weight", "bfloat16", 4099, 1.0 if i == 1 else 0.05)
        add(p + "input_layernorm.weight", "float32", 64, 0.1)
        add(p + "attn_mask", "bool", 77, 0.2)
    add("model.norm.weight", "float32", 64, 0.0)
    add("lm_head.weight", "bfloat16", 5000, 0.01)
    return out


def metas_of(model: list[tuple[str, str, np.ndarray, np.ndarray]]) -> list[ParamMeta]:
    return [ParamMeta(name, dtype, (old.size,)) for name, dtype, old, _ in model]


def one_round(
    kernel: DeltaKernel,
    model: list[tuple[str, str, np.ndarray, np.ndarray]],
    to_device: Callable[[str, np.ndarray], Any],
    host: Callable[[Any], np.ndarray],
    group_bytes: int = 0,
    ahead: int = 1,
) -> tuple[list[tuple[str, bytes]], list[ParamMeta], dict[str, bytes]]:
    """A round through a tracker whose base is ``old``: the wire pairs' bytes, their metas,
    and every base's bytes after."""
    tracker = DeltaTracker(
        kernel, density=DENSITY, anchor_every=0, group_bytes=group_bytes, ahead=ahead
    )
    metas = metas_of(model)
    tracker.bases = {name: kernel.snapshot(to_device(dtype, old)) for name, dtype, old, _ in model}
    pairs = [(name, to_device(dtype, new)) for name, dtype, _, new in model]
    built = tracker.build(pairs, metas)
    assert built is not None
    wire = [(name, host(t).tobytes()) for name, t in built.pairs]
    return wire, built.metas, {n: host(b).tobytes() for n, b in tracker.bases.items()}


def assert_same_rounds(
    fused: DeltaKernel,
    reference: DeltaKernel,
    model: list[tuple[str, str, np.ndarray, np.ndarray]],
    to_device: Callable[[str, np.ndarray], Any],
    host: Callable[[Any], np.ndarray],
    configs: list[tuple[int, int]],
) -> None:
    want = one_round(reference, model, to_device, host)
    assert want[2] == {name: new.tobytes() for name, _, _, new in model}
    names = [n for n, _ in want[0]]
    assert any(n.endswith("@index") for n in names) and any("@" not in n for n in names)
    for group_bytes, ahead in configs:
        got = one_round(fused, model, to_device, host, group_bytes, ahead)
        assert [n for n, _ in got[0]] == names, (group_bytes, ahead)
        assert got[0] == want[0], (group_bytes, ahead)
        assert got[1] == want[1]
        assert got[2] == want[2]


def batch_sizes(
    model: list[tuple[str, str, np.ndarray, np.ndarray]], group_bytes: int
) -> list[int]:
    """Tensors per launch that ``group_bytes`` makes of ``model``."""
    from weightwire.shared.groups import batch_by_layer
    from weightwire.trainer.delta import batch_by_bytes

    metas = {m.name: m for m in metas_of(model)}
    pairs = [(name, None) for name, _, _, _ in model]
    return [len(b) for b in batch_by_bytes(batch_by_layer(pairs), metas, group_bytes)]


def assert_steady_rounds(
    fused: DeltaKernel,
    reference: DeltaKernel,
    model: list[tuple[str, str, np.ndarray, np.ndarray]],
    to_device: Callable[[str, np.ndarray], Any],
    host: Callable[[Any], np.ndarray],
    allocations: Callable[[], int],
    around: Callable[[int], Any] | None = None,
) -> None:
    """Rounds of one session (``w1``, ``w0``, ``w1``, half of the changes, ...): each
    ``fused`` round's wire bytes are ``reference``'s, and after the first none of them
    allocates (``allocations()``: a running count of device allocations). ``around(i)``: a
    context round ``i`` is built in (a stream of its own, say)."""
    metas = metas_of(model)
    w0 = [(n, d, old) for n, d, old, _ in model]
    w1 = [(n, d, new) for n, d, _, new in model]
    half = [(n, d, np.where(np.arange(old.size) % 2 == 0, new, old)) for n, d, old, new in model]
    kernels = {"fused": fused, "reference": reference}
    trackers = {
        k: DeltaTracker(kernel, density=DENSITY, anchor_every=0, group_bytes=40_000)
        for k, kernel in kernels.items()
    }
    for k, tracker in trackers.items():
        tracker.bases = {n: kernels[k].snapshot(to_device(d, b)) for n, d, b in w0}
    for i, weights in enumerate([w1, w0, w1, half, w1, w0]):
        want = trackers["reference"].build([(n, to_device(d, b)) for n, d, b in weights], metas)
        pairs = [(n, to_device(d, b)) for n, d, b in weights]
        with around(i) if around is not None else contextlib.nullcontext():
            before = allocations()
            got = trackers["fused"].build(pairs, metas)
            made = allocations() - before
        assert got is not None and want is not None and got.patches
        wire = [(n, host(t).tobytes()) for n, t in got.pairs]  # read before the next round
        assert wire == [(n, host(t).tobytes()) for n, t in want.pairs], i
        assert got.metas == want.metas
        if i:  # the first delta round sizes the workspace
            assert made == 0, (i, made)
