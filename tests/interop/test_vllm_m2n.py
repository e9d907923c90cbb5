"""Our torch-free ``nccl_m2n`` trainer against vLLM 0.33's OWN ``nccl_m2n`` receiver.

vLLM's files run unchanged, loaded from the tree ``WEIGHTWIRE_VLLM_SRC`` names (0.33; the
interop venv's 0.32 has no ``nccl_m2n``, so without it the module skips):
``m2n_engine.py`` (``M2NWeightTransferEngine``: the init info's parse, the four agreement
phases, the destination plan, the placements broadcast, ``receive_weights``),
``m2n_common.py``, ``m2n_layout.py`` (which tensors go straight into the live parameter),
``nccl_common.py``, and vLLM's ``StatelessProcessGroup`` (the class, from
``vllm/distributed/utils.py``) whose store is a real torch ``TCPStore`` client of our
torch-free ``MetadataStore``. Replaced: NCCL4Py / ``nccl.m2n`` by ``tests.shared.fake_m2n``
(it moves the bytes between the ranks' threads), vLLM's linear layers by classes carrying
the loader methods ``m2n_layout`` recognizes, the layerwise reload by a recorder, device
calls by CPU no-ops. Our side is the real ``StockM2NSession`` and ``NcclM2NDataPlane``, driven
directly and, in one case, through the trainer engines (``TrainerInitInfo(backend="nccl_m2n")``,
``trainer_init``, ``send_weights``).

The workers serve a TP=2 toy decoder layer: ``o_proj`` (row-parallel) and ``up_proj``
(column-parallel) are written straight into the live parameters, each worker only its half;
q/k/v (fused into ``qkv_proj`` by the model's ``load_weights``) and the norm go whole to
each worker and through ``load_weights``, as vLLM plans them.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import os
import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tests.shared import fake_m2n
from tests.torch_side.vllm_stub import install_vllm_sources
from weightwire.backends.nccl.m2n_data import NcclM2NDataPlane
from weightwire.backends.nccl.stock_m2n import (
    M2NLayout,
    M2NParam,
    StockM2NSession,
    layout_of,
    plan_bytes,
)
from weightwire.shared.errors import TransferError, WeightwireError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box

SRC = os.environ.get("WEIGHTWIRE_VLLM_SRC", "")
M2N_FILES = ("base", "packed_tensor", "nccl_common", "m2n_common", "m2n_layout", "m2n_engine")
pytestmark = [
    pytest.mark.interop,
    pytest.mark.skipif(
        not os.path.exists(os.path.join(SRC, "vllm/distributed/weight_transfer/m2n_engine.py")),
        reason="WEIGHTWIRE_VLLM_SRC names no vLLM 0.33 tree (nccl_m2n is new in 0.33)",
    ),
]

H, TP = 8, 2
KV = 4  # rows of k and v (fewer than q's H)


# -- the vLLM pieces m2n imports, beside its own files --------------------------------------------


class _Linear:
    """vLLM's linear layers as ``m2n_layout`` sees them: a ``tp_size`` and, per class, its
    own loader functions (``m2n_layout`` tells the classes apart by them)."""

    def __init__(self, tp_size: int, tp_rank: int) -> None:
        self.tp_size, self.tp_rank = tp_size, tp_rank

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, dim: int) -> None:
        n = param.shape[dim]
        param.data.copy_(loaded.narrow(dim, self.tp_rank * n, n))


class ColumnParallelLinear(_Linear):
    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        self._load(param, loaded, param.output_dim)  # type: ignore[attr-defined]

    def weight_loader_v2(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        self._load(param, loaded, param.output_dim)  # type: ignore[attr-defined]


class RowParallelLinear(_Linear):
    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        self._load(param, loaded, param.input_dim)  # type: ignore[attr-defined]

    def weight_loader_v2(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        self._load(param, loaded, param.input_dim)  # type: ignore[attr-defined]


class ReplicatedLinear(_Linear):
    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


def _stateless_group_module(src: str) -> types.ModuleType:
    """vLLM's ``StatelessProcessGroup`` and ``create_tcp_store``, their source unchanged,
    executed in a module holding only what they use (the rest of ``utils.py`` pulls in
    vLLM's whole runtime)."""
    path = os.path.join(src, "vllm", "distributed", "utils.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    keep = [
        n
        for n in tree.body
        if isinstance(n, ast.ClassDef | ast.FunctionDef)
        and n.name in ("StatelessProcessGroup", "create_tcp_store")
    ]
    assert len(keep) == 2, path
    mod = types.ModuleType("vllm.distributed.utils")
    import collections
    import dataclasses
    import pickle
    import socket
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    mod.__dict__.update(
        dataclasses=dataclasses,
        pickle=pickle,
        socket=socket,
        time=time,
        deque=collections.deque,
        timedelta=timedelta,
        Any=Any,
        torch=torch,
        TCPStore=TCPStore,
        Sequence=list,
    )
    sys.modules[mod.__name__] = mod  # dataclasses look their module up while building
    exec(compile(ast.Module(body=keep, type_ignores=[]), path, "exec"), mod.__dict__)
    return mod


class _TorchOnCPU:
    """``torch`` for vLLM's modules: the device index is 0, syncs and streams are no-ops."""

    accelerator = types.SimpleNamespace(current_device_index=lambda: 0, synchronize=lambda *a: None)
    cuda = types.SimpleNamespace(
        current_stream=lambda device=None: types.SimpleNamespace(synchronize=lambda: None)
    )

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


RELOADS: list[str] = []


@pytest.fixture(scope="module")
def vllm_m2n() -> Iterator[types.SimpleNamespace]:
    before = {
        k: v for k, v in sys.modules.items() if k.split(".")[0] in ("vllm", "nccl", "pybase64")
    }
    for k in before:
        del sys.modules[k]

    def module(name: str, **attrs: Any) -> types.ModuleType:
        mod = sys.modules.get(name) or types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return mod

    try:
        module("vllm", __path__=[])
        module("vllm.distributed", __path__=[])
        module("vllm.logger", init_logger=logging.getLogger)
        _stateless_group_module(SRC)
        module("vllm.model_executor", __path__=[])
        module("vllm.model_executor.layers", __path__=[])
        module(
            "vllm.model_executor.layers.linear",
            ColumnParallelLinear=ColumnParallelLinear,
            RowParallelLinear=RowParallelLinear,
            ReplicatedLinear=ReplicatedLinear,
        )
        module("vllm.model_executor.model_loader", __path__=[])
        module(
            "vllm.model_executor.model_loader.weight_utils",
            default_weight_loader=default_weight_loader,
        )
        fake_m2n.install()
        ns = install_vllm_sources(SRC, M2N_FILES)
        module(
            "vllm.model_executor.model_loader.reload",
            initialize_layerwise_reload=lambda model: RELOADS.append("start"),
            finalize_layerwise_reload=lambda model, cfg: RELOADS.append("finish"),
        )
        for name in ("base", "m2n_common", "m2n_engine"):
            getattr(ns, name).torch = _TorchOnCPU()
        yield ns
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] in ("vllm", "nccl", "pybase64")]:
            del sys.modules[k]
        sys.modules.update(before)


# -- the served model ----------------------------------------------------------------------------


FULL = {
    "model.layers.0.self_attn.q_proj.weight": (H, H),
    "model.layers.0.self_attn.k_proj.weight": (KV, H),
    "model.layers.0.self_attn.v_proj.weight": (KV, H),
    "model.layers.0.self_attn.o_proj.weight": (H, H),
    "model.layers.0.mlp.up_proj.weight": (2 * H, H),
    "model.norm.weight": (H,),
}


class ToyLayer(torch.nn.Module):
    """One TP rank's parameters of a Llama layer, with vLLM's names and loaders."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        p = {
            "model.layers.0.self_attn.qkv_proj.weight": (H // TP + 2 * KV // TP, H),
            "model.layers.0.self_attn.o_proj.weight": (H, H // TP),
            "model.layers.0.mlp.up_proj.weight": (2 * H // TP, H),
            "model.norm.weight": (H,),
        }
        self.params = {
            k: torch.nn.Parameter(torch.zeros(v), requires_grad=False) for k, v in p.items()
        }
        for i, v in enumerate(self.params.values()):
            self.register_parameter(f"p{i}", v)
        o, up = (
            self.params["model.layers.0.self_attn.o_proj.weight"],
            self.params["model.layers.0.mlp.up_proj.weight"],
        )
        o.input_dim = 1  # type: ignore[attr-defined]
        o.weight_loader = RowParallelLinear(TP, rank).weight_loader  # type: ignore[attr-defined]
        up.output_dim = 0  # type: ignore[attr-defined]
        up.weight_loader = ColumnParallelLinear(TP, rank).weight_loader  # type: ignore[attr-defined]
        self.loaded: list[str] = []

    def named_parameters(self, *a: Any, **k: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:  # type: ignore[override]
        yield from self.params.items()

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        qkv = self.params["model.layers.0.self_attn.qkv_proj.weight"]
        q, kv = H // TP, KV // TP
        for name, t in weights:
            self.loaded.append(name)
            if name.endswith("q_proj.weight"):
                qkv.data[:q] = t[self.rank * q : (self.rank + 1) * q]
            elif name.endswith("k_proj.weight"):
                qkv.data[q : q + kv] = t[self.rank * kv : (self.rank + 1) * kv]
            elif name.endswith("v_proj.weight"):
                qkv.data[q + kv :] = t[self.rank * kv : (self.rank + 1) * kv]
            else:
                self.params[name].data.copy_(t)

    def expected(self, full: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What vLLM's loaders make of the full tensors on this rank."""
        r, q, kv = self.rank, H // TP, KV // TP
        pre = "model.layers.0.self_attn."
        return {
            pre + "qkv_proj.weight": np.concatenate(
                [
                    full[pre + "q_proj.weight"][r * q : (r + 1) * q],
                    full[pre + "k_proj.weight"][r * kv : (r + 1) * kv],
                    full[pre + "v_proj.weight"][r * kv : (r + 1) * kv],
                ]
            ),
            pre + "o_proj.weight": full[pre + "o_proj.weight"][
                :, r * (H // TP) : (r + 1) * (H // TP)
            ],
            "model.layers.0.mlp.up_proj.weight": full["model.layers.0.mlp.up_proj.weight"][
                r * 2 * H // TP : (r + 1) * 2 * H // TP
            ],
            "model.norm.weight": full["model.norm.weight"],
        }


class VllmServer:
    """The server's weight-sync routes over TP workers of vLLM's own engine (one thread each
    per call, as vLLM's ``collective_rpc`` fans out; a call returns once every worker did)."""

    def __init__(
        self, ns: types.SimpleNamespace, tamper: Any = None, tamper_update: Any = None
    ) -> None:
        self.models = [ToyLayer(r) for r in range(TP)]
        cfg = [
            types.SimpleNamespace(
                parallel_config=types.SimpleNamespace(
                    data_parallel_index=0, world_size=TP, rank=r, pipeline_parallel_size=1
                ),
                model_config=types.SimpleNamespace(quantization=None),
            )
            for r in range(TP)
        ]
        cls = ns.m2n_engine.M2NWeightTransferEngine
        self.engines = [cls(None, cfg[r], torch.device("cpu"), self.models[r]) for r in range(TP)]
        self.tamper, self.tamper_update = tamper, tamper_update

    def _all(self, call: Any) -> None:
        errors: list[BaseException] = []

        def run(r: int) -> None:
            try:
                call(self.engines[r])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(TP)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise RuntimeError(f"HTTP 500: {errors[0]}") from errors[0]

    def init_weight_transfer_engine(self, info: dict[str, Any]) -> None:
        if self.tamper is not None:
            info = self.tamper(info)
        self._all(lambda e: e.init_transfer_engine(e.parse_init_info(info)))

    def start_weight_update(self) -> None:
        self._all(lambda e: e.start_weight_update())

    def update_weights(self, update: dict[str, Any]) -> None:
        if self.tamper_update is not None:
            update = self.tamper_update(update)
        self._all(lambda e: e.update_weights(update))

    def finish_weight_update(self, version: str) -> None:
        self._all(lambda e: e.finish_weight_update())


def _params(trainer_ranks: int) -> list[M2NParam]:
    """The plan: o_proj held as rows split over the trainer ranks, the rest whole on each."""
    out = []
    for name, shape in FULL.items():
        meta = ParamMeta(name, "float32", shape)
        if name.endswith("o_proj.weight") and trainer_ranks > 1:
            boxes = [
                Box(((r * H // trainer_ranks, (r + 1) * H // trainer_ranks), (0, H)))
                for r in range(trainer_ranks)
            ]
        else:
            boxes = [Box.whole(shape)] * trainer_ranks
        out.append(M2NParam(meta, layout_of(name, shape, boxes)))
    return out


def _shards(
    params: list[M2NParam], full: dict[str, np.ndarray], ranks: int
) -> list[list[np.ndarray]]:
    """Each trainer rank's own part (a copy: no rank is handed a whole sharded tensor)."""
    return [
        [full[p.meta.name][p.layout.box(p.meta.shape, r).slices()].copy() for r in range(ranks)]
        for p in params
    ]


@contextlib.contextmanager
def session(
    ns: types.SimpleNamespace, ranks: int, **server_kw: Any
) -> Iterator[tuple[StockM2NSession, VllmServer, list[M2NParam]]]:
    fake_m2n.reset()
    server = VllmServer(ns, **server_kw)
    params = _params(ranks)
    s = StockM2NSession(
        server,
        params,
        NcclM2NDataPlane(list(range(ranks)), xp=fake_m2n.FakeXP()),
        workers=TP,
        host="127.0.0.1",
        unique_id=os.urandom(128),
        dst_mesh_dims=(1, TP),
        timeout_s=20,
    )
    try:
        yield s, server, params
    finally:
        s.close()
        fake_m2n.reset()


@pytest.mark.parametrize("ranks", [1, 2])
def test_three_rounds_land_as_vllms_loaders_would_each_worker_only_its_slices(
    vllm_m2n: types.SimpleNamespace, ranks: int
) -> None:
    rng = np.random.default_rng(ranks)
    with session(vllm_m2n, ranks) as (s, server, params):
        s.open()
        names = [p.meta.name for p in params]
        place = dict(zip(names, s.placements, strict=True))
        # vLLM's destination plan, as its first worker broadcast it: the two plain TP
        # layers straight into the parameters (split over the TP axis), the rest whole.
        assert place["model.layers.0.self_attn.o_proj.weight"] == (-1, 1)
        assert place["model.layers.0.mlp.up_proj.weight"] == (-1, 0)
        assert [n for n, p in place.items() if p is None] == [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
            "model.norm.weight",
        ]
        world = next(iter(fake_m2n.World.worlds.values()))
        for version in range(3):
            full = {n: rng.standard_normal(shape).astype(np.float32) for n, shape in FULL.items()}
            before = dict(world.received)
            RELOADS.clear()
            s.send(_shards(params, full, ranks), str(version))
            for m in server.models:
                got = {k: v.detach().numpy() for k, v in m.params.items()}
                for k, want in m.expected(full).items():
                    np.testing.assert_array_equal(got[k], want, err_msg=f"{k} round {version}")
                # only the fallback tensors went through load_weights
                assert m.loaded[-4:] == [n for n, p in place.items() if p is None]
            assert RELOADS == ["start"] * TP + ["finish"] * TP  # vLLM's reload, on each worker
            got_bytes = [world.received[ranks + w] - before[ranks + w] for w in range(TP)]
            assert got_bytes == plan_bytes(params, s.placements, (1, TP))
            whole = sum(int(np.prod(v)) * 4 for v in FULL.values())
            direct = (H * H + 2 * H * H) * 4
            assert got_bytes == [whole - direct // 2] * TP  # each worker: half of the direct bytes


class _FakeCupy:
    """``m2n_data.array_module``'s stand-in: the fake's CuPy surface."""

    def __call__(self) -> Any:
        return fake_m2n.FakeXP()


@pytest.mark.parametrize("kind", ["torch", "jax"])
def test_the_engine_api_drives_vllms_receiver_three_rounds_bit_exact(
    vllm_m2n: types.SimpleNamespace, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TrainerInitInfo(backend="nccl_m2n")`` + ``trainer_init`` + ``send_weights`` against
    vLLM's own worker engines: the engine's round (start, the update beside the reshards,
    finish) lands every tensor as vLLM's loaders would, each worker only its slices of the
    tensors vLLM places directly."""
    from weightwire.backends.nccl import m2n_data
    from weightwire.shared.timeouts import Timeouts
    from weightwire.testing.sources import DictSource
    from weightwire.trainer.config import TrainerInitInfo

    monkeypatch.setattr(m2n_data, "array_module", _FakeCupy())
    if kind == "jax":
        import jax.numpy as jnp

        from weightwire.jax_side.dtypes import describe
        from weightwire.jax_side.engine import JAXTrainerEngine as Engine

        def array(a: np.ndarray) -> Any:
            return jnp.asarray(a)
    else:
        from weightwire.torch_side.dtypes import wire_name
        from weightwire.torch_side.sender.engine import TorchTrainerEngine as Engine

        def describe(t: Any) -> tuple[str, tuple[int, ...]]:
            return wire_name(t.dtype), tuple(t.shape)

        def array(a: np.ndarray) -> Any:
            return torch.from_numpy(a.copy())

    fake_m2n.reset()
    server = VllmServer(vllm_m2n)
    rng = np.random.default_rng(3)

    def weights() -> dict[str, np.ndarray]:
        return {n: rng.standard_normal(shape).astype(np.float32) for n, shape in FULL.items()}

    full = weights()
    source = DictSource({n: array(a) for n, a in full.items()}, describe)
    info = TrainerInitInfo(
        backend="nccl_m2n",
        server_version="0.33.0",
        inference_world_size=TP,
        inference_tensor_parallel_size=TP,
        pause_mode=None,
        reset_prefix_cache=False,
        timeouts=Timeouts(http_s=30, connect_s=20, warmup_s=20, transfer_s=20),
    )
    engine = Engine.trainer_init(info, client=server, source=source)
    try:
        world = next(iter(fake_m2n.World.worlds.values()))
        direct = (H * H + 2 * H * H) * 4  # o_proj and up_proj: vLLM writes them in place
        whole = sum(int(np.prod(v)) * 4 for v in FULL.values())
        for version in ("1", "2", "3"):
            full = weights()
            source.tensors = {n: array(a) for n, a in full.items()}
            before = dict(world.received)
            RELOADS.clear()
            metrics = engine.send_weights(version)
            assert metrics.version == version
            for m in server.models:
                got = {k: v.detach().numpy() for k, v in m.params.items()}
                for k, want in m.expected(full).items():
                    np.testing.assert_array_equal(got[k], want, err_msg=f"{k} round {version}")
            assert RELOADS == ["start"] * TP + ["finish"] * TP
            got_bytes = [world.received[1 + w] - before[1 + w] for w in range(TP)]
            assert got_bytes == [whole - direct // 2] * TP  # each worker: half of the direct
            assert metrics.nbytes == sum(got_bytes)
    finally:
        engine.shutdown()
        fake_m2n.reset()


def test_a_worker_that_refuses_the_plan_fails_the_init_on_every_rank(
    vllm_m2n: types.SimpleNamespace,
) -> None:
    def skew(info: dict[str, Any]) -> dict[str, Any]:  # a trainer / server version skew
        out = dict(info, params=[dict(p) for p in info["params"]])
        out["params"][0]["shape"] = [H, H + 1]
        return out

    with (
        session(vllm_m2n, 1, tamper=skew) as (s, _server, _params),
        pytest.raises(WeightwireError, match="source digest does not match") as raised,
    ):
        s.open()
    # vLLM's workers said why, through their envelopes; nothing was resharded
    assert "worker rank 1: ValueError" in str(raised.value)


def test_a_round_the_workers_refuse_fails_at_once_and_spends_the_session(
    vllm_m2n: types.SimpleNamespace,
) -> None:
    def unknown(update: dict[str, Any]) -> dict[str, Any]:
        return {"names": ["model.unknown.weight", *update["names"]]}

    with session(vllm_m2n, 1, tamper_update=unknown) as (s, _server, params):
        s.open()
        full = {n: np.ones(shape, np.float32) for n, shape in FULL.items()}
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="'model.unknown.weight' was not declared at init"):
            s.send(_shards(params, full, 1), "1")
        assert time.monotonic() - t0 < 10  # the update's failure, not the 20 s timeout
        with pytest.raises(TransferError, match="broken by a failed round.*not declared"):
            s.send(_shards(params, full, 1), "2")


def test_our_plan_checks_and_digests_equal_vllms_over_random_layouts(
    vllm_m2n: types.SimpleNamespace,
) -> None:
    """Random trainer meshes, placements, shapes and worker meshes: our digests are vLLM's
    (``source_plan_digest``, ``complete_plan_digest``) and ``check_destinations`` refuses
    exactly what vLLM's ``validate_transfer_plan`` refuses (uneven splits, fan-in / fan-out
    over M2N's bounds)."""
    from weightwire.backends.nccl.stock_m2n import (
        check_destinations,
        complete_digest,
        source_digest,
    )

    common = vllm_m2n.m2n_common
    rng = np.random.default_rng(48)
    refused = accepted = 0
    for _ in range(300):
        t = int(rng.choice([1, 2, 3, 4, 6, 8, 16, 32]))
        dims = [(t // d, d) for d in range(1, t + 1) if t % d == 0]
        src_dims = dims[int(rng.integers(len(dims)))]
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 32, 64])) for _ in range(ndim))
        if rng.random() < 0.3:
            src = M2NLayout(src_dims, None)
        else:
            axis = int(rng.integers(2))
            codes = [-1, -1]
            codes[axis] = int(rng.integers(ndim))
            src = M2NLayout(src_dims, (codes[0], codes[1]))
            if shape[codes[axis]] % src_dims[axis]:
                continue  # layout_of never yields an uneven source
        workers = int(rng.choice([1, 2, 4, 8, 64, 128]))
        tp = int(rng.choice([d for d in (1, 2, 4, 8, 64, 128) if workers % d == 0]))
        dst_dims = (workers // tp, tp)
        place = None if rng.random() < 0.3 else (-1, int(rng.integers(ndim)))
        p = M2NParam(ParamMeta("w", "float32", shape), src)
        wire = common.M2NWireParam.from_dict(p.wire())
        assert source_digest([p]) == common.source_plan_digest([wire])
        meta = common.M2NParamMeta(
            "w",
            torch.float32,
            shape,
            common.M2NLayout(common.M2NMesh(src.dims, 0), src.placements),
        )
        dst_mesh = common.M2NMesh(dst_dims, t)
        assert complete_digest("d", dst_dims, t, [place]) == common.complete_plan_digest(
            "d", dst_mesh, [place]
        )
        try:
            common.validate_transfer_plan([meta], dst_mesh, [place])
            theirs = None
        except ValueError as exc:
            theirs = str(exc)
        try:
            check_destinations([p], dst_dims, [place])
            ours = None
        except ValueError as exc:
            ours = str(exc)
        assert (ours is None) == (theirs is None), (shape, src, dst_dims, place, ours, theirs)
        refused += theirs is not None
        accepted += theirs is None
    assert refused > 10 and accepted > 10
