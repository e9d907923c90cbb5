"""FP8 rounds in combination (issues #51 x #48): a trainer quantizing its bf16 weights into
block-FP8 checkpoint pairs (``fp8_source``, JAX and torch), sending them to in-process TCP
workers that host ``Fp8SlicedTP`` ranks (TP 2: each linear's e4m3 ``weight`` and its
``weight_scale_inv`` narrowed along the same dim). Each worker tells the quantized
checkpoint's tensors as its wants and receives only its slices of both; after each
committed round every worker equals ``load_weights`` of the whole quantized checkpoint (the
numpy reference of vLLM's quantizer) bit for bit, after each failed one its previous
weights. In combination with delta rounds, overlapped rounds, failures and partial rounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from tests.torch_side._sliced_models import FP8_BLOCK, Fp8SlicedTP, fp8_sliced_shapes
from tests.trainer._sliced_session import info
from tests.trainer._sliced_workers import TPClient
from weightwire.shared.quant import Fp8Block, fp8_metas, quantize_block_reference
from weightwire.testing.sources import DictSource
from weightwire.torch_side.worker.spec import ModelSpec, TensorSpec

NORM = "model.norm.weight"
EVEN, UNEVEN = 512, 384  # the MLP width: 256 rows per rank, or 192 (a block cut in two)


def spec_of(inter: int, layers: int = 1) -> dict[str, Fp8Block]:
    """The FP8 spec: every linear's ``X.weight`` (not the norm)."""
    return {n: Fp8Block() for n in fp8_sliced_shapes(inter, layers) if n != NORM}


def weights(step: int, inter: int = EVEN, layers: int = 1) -> dict[str, np.ndarray]:
    """The trainer's round ``step``: bf16 linears, a float32 norm."""
    rng = np.random.default_rng(step)
    out: dict[str, np.ndarray] = {}
    for name, shape in fp8_sliced_shapes(inter, layers).items():
        x = rng.standard_normal(shape).astype(np.float32) * 0.02
        out[name] = x if name == NORM else x.astype(ml_dtypes.bfloat16)
    return out


def quantized(full: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The served checkpoint of ``full``: vLLM's ``per_block_cast_to_fp8`` bytes (the
    numpy reference) for each linear, the norm as it is."""
    out: dict[str, np.ndarray] = {}
    for name, x in full.items():
        if name == NORM:
            out[name] = x
        else:
            q, scale = quantize_block_reference(name, x, Fp8Block())
            out[name], out[name + "_scale_inv"] = q, scale
    return out


def served_spec(inter: int, layers: int = 1) -> ModelSpec:
    """What the workers serve: the FP8 checkpoint's tensors (their wants name these)."""
    tensors = {NORM: TensorSpec((fp8_sliced_shapes(inter)[NORM][0],), "float32")}
    for name, shape in fp8_sliced_shapes(inter, layers).items():
        if name != NORM:
            for meta in fp8_metas(name, shape, Fp8Block()):
                tensors[meta.name] = TensorSpec(meta.shape, meta.dtype)
    config = {"quant_method": "fp8", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    return ModelSpec(tensors, quantization_config=config)


def as_torch(x: np.ndarray) -> torch.Tensor:
    """A numpy array (bf16 and e4m3 from ml_dtypes too) as a torch tensor of the same bits."""
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
    if x.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(x.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return torch.from_numpy(x.copy())


def fp8_client(inter: int = EVEN, world: int = 2, layers: int = 1) -> TPClient:
    def make(config: Any, rank: int) -> torch.nn.Module:
        torch.manual_seed(rank)
        return Fp8SlicedTP(rank=rank, world=world, inter=inter, layers=layers)

    return TPClient(
        (world, 0, 0, False, False), model=make, model_spec=lambda: served_spec(inter, layers)
    )


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def held(client: TPClient) -> list[dict[str, bytes]]:
    """Every worker's parameters, as bytes."""
    return [{n: bits(p) for n, p in m.named_parameters()} for m in client.models]


def loaded(client: TPClient, checkpoint: dict[str, np.ndarray]) -> list[dict[str, bytes]]:
    """What vLLM-style ``load_weights`` of the whole ``checkpoint`` leaves in each rank."""
    out = []
    for rank, model in enumerate(client.models):
        fresh = Fp8SlicedTP(rank=rank, world=model.world, inter=model.inter, layers=model.layers)
        fresh.load_weights([(n, as_torch(a)) for n, a in checkpoint.items()])
        out.append({n: bits(p) for n, p in fresh.named_parameters()})
    return out


def assert_serves(client: TPClient, full: dict[str, np.ndarray]) -> None:
    want = loaded(client, quantized(full))
    got = held(client)
    for rank, (w, g) in enumerate(zip(want, got, strict=True)):
        for name in w:
            assert g[name] == w[name], f"rank {rank} {name}"


def engine_for(
    framework: str,
    client: TPClient,
    tensors: dict[str, Any],
    inter: int = EVEN,
    layers: int = 1,
    **kw: Any,
) -> Any:
    """A trainer engine whose source sends ``tensors`` (refilled by ``put``) with every
    linear quantized by its framework's quantizer."""
    if framework == "jax":
        from weightwire.jax_side.dtypes import describe
        from weightwire.jax_side.engine import JAXTrainerEngine
        from weightwire.jax_side.quant import fp8_source as jax_fp8

        source = jax_fp8(DictSource(tensors, describe), spec_of(inter, layers))
        return JAXTrainerEngine.trainer_init(info(**kw), client=client, source=source)
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.torch_side.sender.quant import fp8_source as torch_fp8
    from weightwire.torch_side.sender.source import describe_tensor

    source = torch_fp8(DictSource(tensors, describe_tensor), spec_of(inter, layers))
    return TorchTrainerEngine.trainer_init(info(**kw), client=client, source=source)


def putter(framework: str, tensors: dict[str, Any]) -> Callable[[dict[str, np.ndarray]], None]:
    """Puts a round's numpy weights into the trainer's source, as its framework's arrays."""

    def put(full: dict[str, np.ndarray]) -> None:
        if framework == "jax":
            import jax.numpy as jnp

            wrapped = {n: jnp.asarray(a) for n, a in full.items()}
        else:
            wrapped = {n: as_torch(a) for n, a in full.items()}
        tensors.clear()
        tensors.update(wrapped)

    return put


FRAMEWORKS = ["jax", "torch"]


# ------------------------------------------------------------------ 1. FP8 x sliced


@pytest.mark.parametrize("inter", [EVEN, UNEVEN], ids=["blocks-whole", "block-cut"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_worker_gets_its_slices_of_the_fp8_weight_and_its_scale(
    framework: str, inter: int
) -> None:
    """The workers' wants name the quantized checkpoint's tensors; each gets only its rows
    (columns) of each e4m3 weight and the scale blocks its loader reads (where the TP cut
    falls inside a block, the block at the cut goes to both), and equals ``load_weights``
    of the whole quantized checkpoint."""
    client = fp8_client(inter)
    tensors: dict[str, Any] = {}
    put = putter(framework, tensors)
    put(weights(0, inter))
    engine = engine_for(framework, client, tensors, inter)
    try:
        assert client.init_info["sliced"] is True
        # what each worker told it reads: its rows of gate_proj and its scale's blocks
        half = inter // 2
        cut = (0, -(-half // FP8_BLOCK)), (half // FP8_BLOCK, inter // FP8_BLOCK)
        for rank, raw in enumerate(engine.session.slicing.hellos):
            told = json.loads(raw)["tensors"]
            assert told[GATE] == [[[rank * half, (rank + 1) * half], [0, 256]]]
            assert told[GATE + "_scale_inv"] == [[list(cut[rank]), [0, 2]]]
        for step in (1, 2):
            full = weights(step, inter)
            put(full)
            metrics = engine.send_weights()
            assert client.last_update["sliced"] is True
            if step == 1:  # later rounds reuse the metadata (empty names)
                assert client.last_update["names"][-3:] == [
                    "model.layers.0.mlp.down_proj.weight",
                    "model.layers.0.mlp.down_proj.weight_scale_inv",
                    NORM,
                ]
            assert_serves(client, full)
            checkpoint = sum(a.nbytes for a in quantized(full).values())
            norm = full[NORM].nbytes
            for got in client.received:  # about half of the FP8 checkpoint each, not all
                assert got <= (checkpoint - norm) * 0.55 + norm
            assert metrics.nbytes < 1.1 * checkpoint
    finally:
        engine.shutdown()
        client.close()


@pytest.mark.slow  # a JAX process of its own (forced devices): about 5 s each
@pytest.mark.parametrize("inter", [EVEN, UNEVEN], ids=["blocks-whole", "block-cut"])
def test_a_sharded_pytree_source_is_quantized_on_its_shards_never_gathered(inter: int) -> None:
    """A JAX trainer on a TP 2 mesh (each linear sharded as the workers split it), its
    ``PytreeSource`` under ``fp8_source``: blocking and overlapped sliced rounds quantize
    the arrays where they are sharded (the gather entry points raise) and every worker
    serves the whole quantized checkpoint's slices."""
    script = Path(__file__).with_name("_fp8_sliced_jax_mesh.py")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, str(script), str(inter)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    spread = json.loads(proc.stdout.strip().splitlines()[-1])["spread"]
    assert len(spread) == 2
    for weights_read in spread:
        assert len(weights_read) == 3
        if inter == EVEN:  # whole blocks per shard: the e4m3 weights keep their sharding
            assert all(weights_read.values()), weights_read


# ------------------------------------------------------------------ 2. FP8 x delta

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
GATE = "model.layers.0.mlp.gate_proj.weight"


def unmoved_nudge(full: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``full`` with one bf16 element of q_proj moved by one ulp where its e4m3 value (and
    its block's scale) stay as they were."""
    before = quantized(full)
    x = full[Q_PROJ]
    for flat in range(x.size):
        nudged = x.copy()
        cell = nudged.reshape(-1)[flat : flat + 1]
        cell.view(np.uint16)[0] += 1
        after = quantized({**full, Q_PROJ: nudged})
        if all(after[n].tobytes() == before[n].tobytes() for n in before):
            return {**full, Q_PROJ: nudged}
    raise AssertionError("no element moves without moving its e4m3 value")


def changed(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, int]:
    """Per tensor of two quantized checkpoints, the elements whose bytes differ."""
    out = {}
    for name in a:
        itemsize = a[name].dtype.itemsize
        ca = a[name].reshape(-1).view(np.uint8).reshape(-1, itemsize)
        cb = b[name].reshape(-1).view(np.uint8).reshape(-1, itemsize)
        n = int((ca != cb).any(axis=1).sum())
        if n:
            out[name] = n
    return out


@pytest.mark.parametrize("sliced", ["auto", "off"], ids=["sliced", "broadcast"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_delta_round_compares_the_quantized_bytes(framework: str, sliced: str) -> None:
    """``delta="auto"``: a bf16 change that leaves every e4m3 value and scale as it was sends
    no element; a change that moves a block's scale sends that scale and the block's
    elements whose e4m3 value moved, nothing else (sliced: only to the worker whose rows
    hold the block); after each round every worker serves the new quantized checkpoint."""
    client = fp8_client()
    tensors: dict[str, Any] = {}
    put = putter(framework, tensors)
    first = weights(1)
    put(first)
    engine = engine_for(framework, client, tensors, delta="auto", sliced=sliced)
    try:
        engine.send_weights()  # the base
        assert_serves(client, first)
        total = sum(a.size for a in quantized(first).values())
        # 1. one bf16 ulp that no e4m3 value sees: the round sends no element
        same = unmoved_nudge(first)
        put(same)
        metrics = engine.send_weights()
        assert metrics.density == 0.0 and metrics.nbytes < 100  # the base's one-element name
        assert_serves(client, same)
        # 2. a new block maximum in gate_proj's block (2, 0) (rank 1's rows): its scale
        # moves, and with it every e4m3 value of the block (12.5% of the weight: a patch)
        moved = {**same, GATE: same[GATE].copy()}
        moved[GATE][300, 3] = ml_dtypes.bfloat16(float(np.abs(moved[GATE]).max()) * 3)
        diff = changed(quantized(same), quantized(moved))
        assert diff == {GATE: FP8_BLOCK * FP8_BLOCK, GATE + "_scale_inv": 1}
        put(moved)
        metrics = engine.send_weights()
        assert metrics.density is not None
        assert round(metrics.density * total) == sum(diff.values())
        assert_serves(client, moved)
        patches = {p[0]: p[1] for p in client.last_update["patches"]}
        assert patches == {GATE: "float8_e4m3fn", GATE + "_scale_inv": "float32"}
        patch_bytes = FP8_BLOCK * FP8_BLOCK * 5 + 8  # int32 index + e4m3 value; the scale's
        if sliced == "auto":
            assert client.last_update["sliced"] is True
            # the block lies in rank 1's rows: rank 0 is sent none of its elements
            assert client.received[0] < 100 and client.received[1] >= patch_bytes
        else:
            assert client.received == [metrics.nbytes] * 2
            assert patch_bytes <= metrics.nbytes < patch_bytes + 100
    finally:
        engine.shutdown()
        client.close()


def test_an_e4m3_tensor_goes_dense_where_its_patch_would_be_larger() -> None:
    """A patch costs an int32 index beside each value: for e4m3 (1 byte) it outgrows the
    tensor from 1/5 of its elements changed, below the default ``delta_density`` (0.25):
    such a tensor goes dense. bf16 and float32 keep the configured density; a receiver of
    patches only (``sparse_nccl``: density 1, every tensor a patch) is not capped."""
    from weightwire.shared.meta import ParamMeta
    from weightwire.trainer.delta import DeltaTracker

    kernel: Any = None
    capped = DeltaTracker(kernel, density=0.25, anchor_every=0, smaller_only=True)
    assert capped.limit(ParamMeta("w", "float8_e4m3fn", (100, 100))) == 1999
    assert capped.limit(ParamMeta("w", "bfloat16", (100, 100))) == 2499
    assert capped.limit(ParamMeta("w", "float32", (100, 100))) == 2499
    patches_only = DeltaTracker(kernel, density=1.0, anchor_every=0)
    assert patches_only.limit(ParamMeta("w", "float8_e4m3fn", (100, 100))) == 9999


# ------------------------------------------------------------------ 3. FP8 x overlap


@pytest.mark.parametrize(
    ("framework", "snapshot"),
    [("jax", "copy"), ("torch", "copy"), ("torch", "cow"), ("torch", "none")],
)
def test_an_overlapped_fp8_round_quantizes_the_weights_of_its_call(
    framework: str, snapshot: str
) -> None:
    """``send_weights(wait=False)`` on a sliced FP8 session, then the trainer writes its
    weights (torch: in place, as an optimizer step does; JAX: new arrays):
    the round sends the quantization of the weights of the call, the next round the new
    ones. ``snapshot="none"``: the caller keeps the weights until the handle is done."""
    client = fp8_client()
    tensors: dict[str, Any] = {}
    put = putter(framework, tensors)
    first = weights(1)
    put(first)
    kw = {"snapshot": snapshot} if framework == "torch" else {}
    engine = engine_for(framework, client, tensors, **kw)
    try:
        engine.send_weights()
        second, third = weights(2), weights(3)
        if framework == "torch":
            for name, value in second.items():
                tensors[name].copy_(as_torch(value))
        else:
            put(second)
        handle = engine.send_weights(wait=False)
        if snapshot == "none":
            handle.result(timeout=60)
        if framework == "torch":  # the step writes the parameters the round was called on
            if snapshot == "cow":  # a write outside an optimizer's step: told first
                engine.before_update()
            for name, value in third.items():
                tensors[name].copy_(as_torch(value))
        else:
            put(third)
        metrics = handle.result(timeout=60)
        assert client.last_update["sliced"] is True
        assert metrics.fp8 is not None and metrics.fp8.weights == 7
        assert_serves(client, second)
        engine.send_weights()
        assert_serves(client, third)
    finally:
        engine.shutdown()
        client.close()


# ------------------------------------------------------------------ 4. FP8 x failure

DOWN = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.parametrize(
    ("framework", "bad", "how"),
    [
        ("jax", float("nan"), "blocking"),
        ("torch", float("inf"), "blocking"),
        ("torch", float("nan"), "in-place"),
        ("jax", float("inf"), "overlapped"),
        ("torch", float("nan"), "overlapped"),
    ],
)
def test_a_non_finite_weight_fails_the_sliced_round_before_any_byte(
    framework: str, bad: float, how: str
) -> None:
    """NaN or inf in a weight to be quantized (down_proj: the round's last linear): the
    round raises ``QuantizationError`` naming it before its update call (no worker is sent
    a byte), every worker keeps the previous weights, and the fixed next round lands on the
    same engine."""
    from weightwire.shared.quant import QuantizationError

    client = fp8_client()
    tensors: dict[str, Any] = {}
    put = putter(framework, tensors)
    put(weights(1))
    engine = engine_for(
        framework, client, tensors, **({"stage_budget_bytes": 0} if how == "in-place" else {})
    )
    try:
        engine.send_weights()
        before, updates = held(client), client.updates
        poisoned = weights(2)
        poisoned[DOWN] = poisoned[DOWN].copy()
        poisoned[DOWN][200, 300] = bad
        put(poisoned)
        with pytest.raises(QuantizationError, match=f"'{DOWN}' holds NaN or inf"):
            if how == "overlapped":
                engine.send_weights(wait=False).result(timeout=60)
            else:
                engine.send_weights()
        assert client.updates == updates  # no update call: nothing went out
        assert held(client) == before
        fixed = weights(3)
        put(fixed)
        engine.send_weights()
        assert client.last_update["sliced"] is True
        assert_serves(client, fixed)
    finally:
        engine.shutdown()
        client.close()


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("where", ["worker", "trainer"])
def test_a_link_lost_mid_fp8_round_leaves_every_worker_on_the_previous_weights(
    framework: str, where: str
) -> None:
    """Worker 1's link, or the trainer's, dies at the round's 6th piece (mid-transfer of
    the FP8 pairs): the round raises, every worker keeps the previous round's e4m3 weights
    and scales exactly, and after a re-init the next round lands whole."""
    from weightwire.shared.errors import WeightwireError
    from weightwire.trainer.engine import EngineBroken

    client = fp8_client()
    tensors: dict[str, Any] = {}
    put = putter(framework, tensors)
    put(weights(1))
    engine = engine_for(framework, client, tensors)
    try:
        engine.send_weights()
        before = held(client)
        real, reads = engine.read_box, [0]

        def cut(tensor: Any, box: Any) -> Any:
            reads[0] += 1
            if reads[0] == 6:
                if where == "worker":
                    engine.session.link._links[1].sock.shutdown(2)
                else:
                    engine.session.link.abort()
            return real(tensor, box)

        engine.read_box = cut
        put(weights(2))
        with pytest.raises(WeightwireError, match="lost|closed|aborted"):
            engine.send_weights()
        assert reads[0] >= 6
        assert held(client) == before
        with pytest.raises(EngineBroken, match=r"trainer_init\(\) again"):
            engine.send_weights()
        engine.shutdown()
        engine = engine_for(framework, client, tensors)
        full = weights(3)
        put(full)
        engine.send_weights()
        assert_serves(client, full)
    finally:
        engine.shutdown()
        client.close()


# ------------------------------------------------------------------ 5. FP8 x partial


@pytest.mark.parametrize(
    ("framework", "delta"), [("jax", "off"), ("torch", "off"), ("torch", "auto")]
)
def test_a_partial_round_leaves_a_frozen_layers_fp8_weights_and_scales(
    framework: str, delta: str
) -> None:
    """``partial=True``: a round that leaves layer 1 out (frozen) is sliced and lands; on
    every worker layer 1's e4m3 weights and their scales both stay those of the last round
    that sent them, the rest is the new round's."""
    client = fp8_client(layers=2)
    tensors: dict[str, Any] = {}
    put = putter(framework, tensors)
    first = weights(1, layers=2)
    put(first)
    engine = engine_for(framework, client, tensors, layers=2, partial=True, delta=delta)
    try:
        engine.send_weights()
        second = {n: a for n, a in weights(2, layers=2).items() if ".layers.1." not in n}
        put(second)
        engine.send_weights()
        assert client.last_update["sliced"] is True
        frozen = [n for n in quantized(first) if ".layers.1." in n]
        assert len(frozen) == 6  # gate, up, down: each weight and its scale
        for rank, model in enumerate(client.models):
            want = Fp8SlicedTP(rank=rank, world=2, inter=EVEN, layers=2)
            want.load_weights([(n, as_torch(a)) for n, a in quantized(first).items()])
            want.load_weights([(n, as_torch(a)) for n, a in quantized(second).items()])
            got = {n: bits(p) for n, p in model.named_parameters()}
            for name, p in want.named_parameters():
                assert got[name] == bits(p), f"rank {rank} {name}"
        # and the next whole round sends the layer again
        full = weights(3, layers=2)
        put(full)
        engine.send_weights()
        assert_serves(client, full)
    finally:
        engine.shutdown()
        client.close()


@pytest.mark.slow  # two trainer processes: about 15 s each
@pytest.mark.parametrize("inter", [EVEN, UNEVEN], ids=["blocks-whole", "block-cut"])
def test_dtensor_shards_are_quantized_where_they_are_held(inter: int) -> None:
    """Two torch trainer processes (a ``TrainerGroup``) holding each linear as a DTensor
    sharded as the workers split it: each quantizes its own shards (never gathered) and
    sends its pieces; the workers serve the whole quantized checkpoint's slices. Where a
    rank's rows cut a 128-row block (the MLP at 384: 192 rows each), both ranks refuse the
    round naming the weight and the fix, before any byte."""
    from tests import ranks

    script = Path(__file__).with_name("_fp8_torch_processes.py")
    reports = ranks.two_rank_reports(script, str(ranks.free_port()), str(inter), timeout=240)
    if inter == EVEN:
        for report in reports:
            assert report["error"] is None and len(report["sent"]) == 2
            assert all(n > 0 for n in report["sent"])  # each rank sends its own shards' pieces
    else:
        refusal = (
            "'model.layers.0.mlp.gate_proj.weight' is a DTensor (S(0)): rank 1 holds "
            "[192:384, 0:256], which cuts its 128 x 128 FP8 blocks"
        )
        for report in reports:
            # Each rank refuses by its own check, or first hears the other rank's refusal
            # (the same check over the same layout) and raises that, whichever comes first.
            error = report["error"]
            assert report["sent"] == [] and error["type"] in ("QuantizationError", "RoundFailed")
            if error["type"] == "QuantizationError":
                assert error["error"].startswith(refusal), error
            else:
                assert refusal in error["error"], error
