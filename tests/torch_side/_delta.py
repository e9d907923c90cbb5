"""Test kit for delta rounds on the worker: a numpy trainer, a TCP sender thread and workers.

``Trainer`` holds numpy weights (float32 and bfloat16), steps them, and encodes each round
as the trainer engine does (``shared.delta``): dense, or per changed tensor a patch below the
density threshold and the tensor itself above it, unchanged tensors left out. ``Session`` is
one trainer session over TCP (one link, many rounds). The workers: ``HFModelHost`` (patches
in its own round), a plain model with a loader map (``IdentityMap``, the ``landing`` shape)
and a plain model without one (the host-copy fallback), optionally under ``WholeLayers``
(a framework that, like vLLM's layerwise reload, needs every tensor of a layer it loads);
``landing``: the plain model with the real ``record_loader_map``; ``store``: the loopback
receiver's ``TensorStoreHost``.
"""

from __future__ import annotations

import math
import queue
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import torch

from tests.torch_side.test_engine_rules import ThreadSender
from weightwire.backends.tcp.comm import TCPCommunicator
from weightwire.backends.tcp.info import TCPInitInfo
from weightwire.backends.tcp.spec import TCP
from weightwire.shared.delta import FLAT_I32, extract_host
from weightwire.shared.framing import pack_host, plan
from weightwire.shared.groups import layer_key
from weightwire.shared.meta import ParamMeta
from weightwire.shared.update_info import UpdateInfo
from weightwire.testing.loopback import TensorStoreHost
from weightwire.torch_side.worker.connect import connect
from weightwire.torch_side.worker.core import _ReceiverCore
from weightwire.torch_side.worker.engines import EngineFacade
from weightwire.torch_side.worker.hf_host import HFModelHost
from weightwire.torch_side.worker.landing import record_loader_map

LAYOUT: list[tuple[str, tuple[int, ...], str]] = [
    ("model.embed_tokens.weight", (16, 8), "bfloat16"),
    ("model.layers.0.mlp.experts.w13", (4, 8, 8), "bfloat16"),
    ("model.layers.0.proj.weight", (8, 8), "float32"),
    ("model.layers.0.proj.bias", (8,), "float32"),
    ("model.layers.1.proj.weight", (8, 8), "float32"),
    ("model.layers.1.proj.bias", (8,), "float32"),
    ("model.norm.weight", (8,), "bfloat16"),
]
TIED = {"lm_head.weight": "model.embed_tokens.weight"}
NP = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def host_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def to_torch(a: np.ndarray, dtype: str) -> torch.Tensor:
    if dtype == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


class Net(torch.nn.Module):
    """Parameters named as ``LAYOUT`` (checkpoint names), ``lm_head`` tied to the embedding;
    ``load_weights`` copies by name (a vLLM-like model without ``patch_weights``)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for name, shape, dtype in LAYOUT:
            owner: torch.nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            value = torch.randn(shape, generator=gen).to(TORCH[dtype])
            owner.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=False))
        self.lm_head = torch.nn.Module()
        self.lm_head.weight = self.get_parameter("model.embed_tokens.weight")
        self.loaded: list[str] = []
        self.reloading = False

    def load_weights(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in pairs:
                self.loaded.append(name)
                self.get_parameter(TIED.get(name, name)).copy_(tensor)


class WholeLayers:
    """``FrameworkHooks`` that, like vLLM's layerwise reload, needs every tensor of a layer
    it loads in one round: a partly loaded layer is recorded in ``violations``."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self.reloads = 0

    def begin(self, model: Any) -> None:
        model.loaded, model.reloading = [], True
        self.reloads += 1

    def commit(self, model: Any, model_config: Any) -> None:
        model.reloading = False
        loaded = set(model.loaded)
        for key in {layer_key(n) for n in loaded} - {None}:
            missing = [n for n, _, _ in LAYOUT if layer_key(n) == key and n not in loaded]
            if missing:
                self.violations.append(f"layer {key} loaded without {missing}")

    def abort(self, model: Any, model_config: Any) -> None:
        model.reloading = False

    def receive_context(self) -> Any:
        return nullcontext()

    def prepare(self, model: Any, pairs: list[tuple[str, torch.Tensor]]) -> Any:
        return pairs

    def round_dropped(self) -> None:
        pass


@dataclass(frozen=True)
class Landing:
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorLandings:
    name: str
    shape: tuple[int, ...]
    dtype: str
    landings: tuple[Landing, ...]
    complete: bool = True


class IdentityMap:
    """The ``LoaderMap`` shape for a model whose parameters carry the checkpoint names."""

    def __init__(self, model: Net, metas: list[ParamMeta]) -> None:
        self.model = model
        self.params = {n: p.data for n, p in model.named_parameters()}
        self.tensors = {  # a tied alias is not a landing of its own: the sink resolves it
            m.name: TensorLandings(m.name, m.shape, m.dtype, (Landing(m.shape),))
            for m in metas
            if m.name in self.params
        }
        self.patched: list[str] = []

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.params[name].copy_(tensor)

    def patch(
        self, name: str, flat_index: torch.Tensor, values: torch.Tensor, *, in_range: bool = False
    ) -> None:
        assert not self.model.reloading, "patched while the parameters are reloading"
        self.patched.append(name)
        flat = self.params[name].view(-1)
        word = {2: torch.int16, 4: torch.int32}[flat.element_size()]
        flat.view(word)[flat_index.long()] = values.view(word)

    def patch_all(self, patches: list[tuple[str, torch.Tensor, torch.Tensor]]) -> int:
        for name, flat_index, values in patches:
            self.patch(name, flat_index, values, in_range=True)
        return 0

    def read(self, name: str) -> torch.Tensor:
        assert not self.model.reloading, "read while the parameters are reloading"
        return self.params[name].clone()

    def is_live(self, model: Any) -> bool:
        return True

    def nbytes(self) -> int:
        return 0


def identity_map(model: Any, metas: Any) -> IdentityMap:
    return IdentityMap(model, list(metas))


class Engine(EngineFacade):
    """A worker engine over any target, with the core's framework and loader map exposed."""

    backend = TCP.name
    init_info_cls = TCPInitInfo

    def __init__(self, model: Any, *, framework: Any = None, map_recorder: Any = None) -> None:
        self.model = model
        self.device = torch.device("cpu")
        self._core = _ReceiverCore(
            backend=TCP.name,
            device=self.device,
            target=lambda: (self.model, None),
            connect=connect,
            info_type=TCPInitInfo,
            framework=framework,
            map_recorder=map_recorder,
        )


WORKERS = ("hf_host", "map", "copy", "map_whole", "copy_whole", "landing", "store")


@dataclass
class Worker:
    engine: Engine
    params: dict[str, torch.Tensor]
    framework: WholeLayers | None
    net: Net


def make_worker(kind: str, seed: int = 99) -> Worker:
    net = Net(seed)
    framework = WholeLayers() if kind.endswith("_whole") else None
    if kind == "hf_host":
        engine = Engine(HFModelHost(net))
    elif kind == "store":  # the loopback receiver's model stand-in
        store = TensorStoreHost()
        return Worker(Engine(store), store.tensors, None, net)
    else:
        recorders = {"map": identity_map, "landing": record_loader_map}
        engine = Engine(net, framework=framework, map_recorder=recorders.get(kind.split("_")[0]))
    return Worker(engine, dict(net.named_parameters()), framework, net)


@dataclass
class Wire:
    arrays: list[np.ndarray]
    info: UpdateInfo

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


class Trainer:
    """Numpy weights and the trainer engine's encoding of a round (``shared.delta``)."""

    def __init__(self, seed: int, session: str = "t") -> None:
        self.rng = np.random.default_rng(seed)
        self.weights = {n: self.rng.standard_normal(shape).astype(NP[d]) for n, shape, d in LAYOUT}
        self.session = session
        self.round = 0
        self.base: dict[str, np.ndarray] | None = None
        self.base_token: str | None = None

    def step(self, densities: dict[str, float]) -> None:
        """Change about ``density`` of each tensor's elements (signed zeros included)."""
        for name, density in densities.items():
            flat = self.weights[name].reshape(-1)
            count = math.ceil(density * flat.size) if density > 0 else 0
            idx = self.rng.choice(flat.size, size=count, replace=False)
            new = self.rng.standard_normal(count).astype(flat.dtype)
            new[: count // 7] = -0.0 if self.rng.random() < 0.5 else 0.0
            flat[idx] = new

    def encode(self, *, dense: bool, threshold: float = 0.3) -> Wire:
        self.round += 1
        token = f"{self.session}:{self.round}"
        names: list[str] = []
        arrays: list[np.ndarray] = []
        patches: list[list[Any]] = []
        base = None if dense else self.base
        for name, _, dtype in LAYOUT:
            new = self.weights[name]
            if base is None:
                names.append(name)
                arrays.append(new.copy())
                continue
            index, values = extract_host(base[name], new)
            if index.size == 0:
                continue
            if index.size / new.size > threshold:
                names.append(name)
                arrays.append(new.copy())
                continue
            names += [f"{name}@index", f"{name}@values"]
            arrays += [index, values]
            patches.append([name, dtype, list(new.shape), int(index.size), FLAT_I32])
        if not names:  # nothing changed: a dense round (an empty one would mean "reuse")
            return self.encode(dense=True)
        info = UpdateInfo(
            names=names,
            dtype_names=[str(a.dtype) for a in arrays],
            shapes=[list(a.shape) for a in arrays],
            round_token=token,
            delta_base=self.base_token if patches else None,
            patches=patches or None,
        )
        return Wire(arrays, info)

    def committed(self, wire: Wire) -> None:
        self.base = {n: a.copy() for n, a in self.weights.items()}
        self.base_token = wire.info.round_token

    def failed(self) -> None:
        self.base = self.base_token = None


class Session:
    """One trainer session: a TCP link to the worker, rounds fed to the sender thread."""

    def __init__(self, engine: Engine, **info: Any) -> None:
        self._queue: queue.Queue[Wire | None] = queue.Queue()
        self.sender = ThreadSender(self._script)
        self.engine = engine
        engine.init_transfer_engine(self.sender.info(**info))

    def _script(self, comm: TCPCommunicator) -> None:
        while (wire := self._queue.get(timeout=60)) is not None:
            chunks = plan(wire.info.metas(), packed=True, buffer_size_bytes=256)
            for chunk in chunks:
                comm.broadcast(pack_host(wire.arrays[chunk.start : chunk.stop], chunk), timeout=20)

    def send(self, wire: Wire) -> None:
        """One round: start, the update (the sender puts its bytes on the wire), finish."""
        self._queue.put(wire)
        self.engine.start_weight_update()
        self.engine.update_weights(wire.info.to_dict())
        self.engine.finish_weight_update()

    def anchor(self, trainer: Trainer) -> Wire:
        """The session's first round: dense, committed on both sides."""
        first = trainer.encode(dense=True)
        self.send(first)
        trainer.committed(first)
        return first

    def close(self) -> None:
        self._queue.put(None)
        self.sender.join()
        self.engine.shutdown()


def assert_holds(worker: Worker, weights: dict[str, np.ndarray]) -> None:
    """The worker's parameters hold exactly the trainer's bytes (and the tie holds)."""
    for name, array in weights.items():
        assert host_bytes(worker.params[name]) == array.tobytes(), name
    if isinstance(worker.engine.model, (Net, HFModelHost)):
        assert worker.net.lm_head.weight is worker.net.get_parameter("model.embed_tokens.weight")
