"""The harness of ``test_vllm_sparse.py``: vLLM's own ``sparse_nccl`` receiver (loaded from a
vLLM tree, its NCCL group a shim over our TCP transport, its device calls CPU no-ops) behind a
client our trainer engines drive, and the trainer's side of that wire (the ``sparse_nccl`` plan
and stock init payload over our TCP data plane). See the test module for what is checked."""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from tests.interop.trees import vllm_tree_root, vllm_trees
from tests.torch_side.fake_llama import FakeLlama, hf_shapes
from tests.torch_side.vllm_stub import VLLM_SPARSE_FILES, install_vllm_sources
from tests.trainer.fakes import DictSource
from weightwire.backends import register_backend
from weightwire.backends.base import PatchPlan, SenderCaps, WirePlan
from weightwire.backends.nccl.sparse import sparse_nccl_round
from weightwire.backends.nccl.trainer import SparseNCCLBackend, UnpackedSettings
from weightwire.backends.tcp.comm import TCPCommunicator
from weightwire.backends.tcp.info import TCPInitInfo
from weightwire.backends.tcp.trainer import TCPBackend
from weightwire.shared.patches import SparsePatch
from weightwire.shared.timeouts import Timeouts
from weightwire.trainer import TrainerInitInfo

T = 30.0
TIMEOUTS = Timeouts(http_s=60, connect_s=T, warmup_s=T, transfer_s=T)
BACKEND = "interop_sparse_tcp"
SPARSE_ENGINE = os.path.join("distributed", "weight_transfer", "sparse_nccl_engine.py")
"""vLLM's sparse receiver, inside the ``vllm`` package."""


@pytest.fixture(scope="module", params=vllm_trees())
def vllm_sparse(request: pytest.FixtureRequest) -> Iterator[types.ModuleType]:
    """vLLM's sparse engine module of one tree; its ``vllm.*`` modules leave with it."""
    before = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for k in before:
        del sys.modules[k]
    try:
        ns = install_vllm_sources(vllm_tree_root(request.param, SPARSE_ENGINE), VLLM_SPARSE_FILES)
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


def initial(dtype: str, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {n: rng.standard_normal(s).astype(_np_dtype(dtype)) for n, s in hf_shapes("tiny").items()}
    next(iter(out.values())).reshape(-1)[0] = 0.0
    return out


def step(
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


def patches_np(
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


def trainer(fw: Any, weights: dict[str, np.ndarray], client: VLLMSparseClient) -> Any:
    info = TrainerInitInfo(backend=BACKEND, timeouts=TIMEOUTS, reset_prefix_cache=False)
    source = DictSource({n: fw.array(a) for n, a in weights.items()}, fw.describe)
    return fw.engine.trainer_init(info, client=client, source=source)


def patches_of(fw: Any, old: dict, new: dict, dtype: str) -> list[SparsePatch]:
    return [
        SparsePatch(n, dtype, new[n].shape, fw.array(i), fw.array(v))
        for n, i, v in patches_np(old, new)
    ]


def holds(model: FakeLlama, want: dict[str, np.ndarray]) -> list[str]:
    """The names whose bytes in the model differ from ``want`` (read through the fused layout)."""
    bad = []
    for n, a in want.items():
        got = model.hf_view(n).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        if got != np.ascontiguousarray(a).tobytes():
            bad.append(n)
    return bad
