"""vLLM's ``nccl_m2n`` as a trainer-engine backend: ``TrainerInitInfo(backend="nccl_m2n")``,
``trainer_init`` and ``send_weights`` run the engine's own round (pause, start, the update
beside the data plane, finish, resume, versions, metrics, the failure rules) with each trainer
rank's shard resharded on the data-moving fake of ``nccl.m2n`` (``tests.shared.fake_m2n``)
into the emulated workers of ``test_stock_m2n`` (vLLM's own worker code: the interop lane,
``tests/interop/test_vllm_m2n.py``). A JAX mesh of 8 emulated devices runs in a subprocess
(``_m2n_engine_jax.py``: XLA_FLAGS precede jax's import)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.backends.test_stock_m2n import EmulatedWorkers
from tests.ranks import script_report
from tests.shared import fake_m2n
from weightwire.backends.base import StockRefusal
from weightwire.backends.nccl import m2n_data
from weightwire.shared.errors import ConfigError, SourceMismatch, TransferError
from weightwire.shared.timeouts import Timeouts
from weightwire.testing.sources import DictSource
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.engine import EngineBroken

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

TIMEOUTS = Timeouts(http_s=30, connect_s=20, warmup_s=20, transfer_s=20)
SHAPES = {"rows.weight": (8, 4), "cols.weight": (4, 8), "norm.weight": (4,)}
PLACEMENTS: list[tuple[int, int] | None] = [(-1, 0), (-1, 1), None]
"""What the emulated TP=2 workers place: rows split on dim 0, cols on dim 1, the norm whole."""


class Server(EmulatedWorkers):
    """The emulated workers behind a server's round calls, its pause and its shutdown."""

    fail_update: str | None = None

    def version(self) -> str:
        return "0.33.0"

    def get_world_size(self) -> int:
        return self.tp

    def pause(self, mode: str) -> None:
        self.calls.append(f"pause {mode}")

    def resume(self) -> None:
        self.calls.append("resume")

    def update_weights(self, update: dict[str, Any]) -> None:
        if self.fail_update is not None:
            self.calls.append("update")
            raise TransferError(self.fail_update)
        super().update_weights(update)

    def shutdown_weight_transfer_engine(self) -> None:
        self.calls.append("shutdown")


@pytest.fixture
def fake_nccl(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name, module in fake_m2n.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(m2n_data, "array_module", lambda: fake_m2n.FakeXP())
    fake_m2n.reset()
    yield
    fake_m2n.reset()


def describe(t: Any) -> tuple[str, tuple[int, ...]]:
    from weightwire.torch_side.dtypes import wire_name

    return wire_name(t.dtype), tuple(t.shape)


def info(**kw: Any) -> TrainerInitInfo:
    base: dict[str, Any] = {
        "backend": "nccl_m2n",
        "inference_tensor_parallel_size": 2,
        "reset_prefix_cache": False,
        "timeouts": TIMEOUTS,
    }
    return TrainerInitInfo(**{**base, **kw})


def weights(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def check_workers(server: Server, full: dict[str, Any]) -> None:
    for w in range(server.tp):
        got = server.bufs[w]
        np.testing.assert_array_equal(got["rows.weight"], full["rows.weight"][w * 4 : w * 4 + 4])
        np.testing.assert_array_equal(got["cols.weight"], full["cols.weight"][:, w * 4 : w * 4 + 4])
        np.testing.assert_array_equal(got["norm.weight"], full["norm.weight"])


def test_a_torch_engine_sends_three_rounds_through_the_engine_round(fake_nccl: None) -> None:
    from weightwire.torch_side.sender.engine import TorchTrainerEngine

    server = Server(PLACEMENTS, tp=2)
    source = DictSource(weights(0), describe)
    engine = TorchTrainerEngine.trainer_init(info(), client=server, source=source)
    try:
        init = server.info
        assert init["rank_offset"] == 1 and init["world_size"] == 3
        assert init["dst_mesh_dims"] == [1, 2]  # (world / tp, tp): vLLM places the TP slices
        assert [p["src_placements"] for p in init["params"]] == [None] * 3  # one rank, whole
        # refused before any call: a draft round, a tensor the init did not declare
        with pytest.raises(ConfigError, match="'nccl_m2n' sends no draft rounds"):
            engine.send_weights(draft=True)
        source.tensors = {**weights(1), "extra.weight": torch.zeros(2)}
        with pytest.raises(SourceMismatch, match="'extra.weight' was not declared at the nccl"):
            engine.send_weights()
        assert server.calls == ["init"]
        for version in (1, 2, 3):
            full = weights(version)
            source.tensors = full
            if version == 3:  # an overlapped round: the same round on the engine's thread
                metrics = engine.send_weights(wait=False).result(timeout=30)
            else:
                metrics = engine.send_weights()
            assert metrics.version == str(version) and metrics.tensors == 3
            # what the workers receive: half of rows and cols each, the norm whole to both
            assert metrics.nbytes == 2 * (16 * 4 + 16 * 4 + 4 * 4)
            check_workers(server, {n: t.numpy() for n, t in full.items()})
            assert server.calls[-5:] == [
                "pause keep",
                "start",
                "update",
                f"finish {version}",
                "resume",
            ]
    finally:
        engine.shutdown()
    assert server.calls[-1] == "shutdown"


def test_a_failed_round_raises_on_that_round_and_breaks_the_engine(fake_nccl: None) -> None:
    from weightwire.torch_side.sender.engine import TorchTrainerEngine

    server = Server(PLACEMENTS, tp=2)
    source = DictSource(weights(0), describe)
    engine = TorchTrainerEngine.trainer_init(info(), client=server, source=source)
    try:
        engine.send_weights()
        server.fail_update = "HTTP 500: worker 1 refused the round"
        with pytest.raises(TransferError, match="worker 1 refused the round"):
            engine.send_weights()
        assert "finish 2" not in server.calls  # never committed
        with pytest.raises(EngineBroken, match="worker 1 refused the round"):
            engine.send_weights()
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"verify": True}, "'nccl_m2n' cannot verify rounds"),
        ({"delta": "auto"}, r"a stock vLLM worker \('nccl_m2n'\) cannot apply them"),
        ({"inference_tensor_parallel_size": 0}, "inference_tensor_parallel_size must be"),
        ({"sliced": "off"}, r"'nccl_m2n' cannot broadcast \(sliced='off'\)"),
    ],
)
def test_what_nccl_m2n_cannot_do_is_refused_at_the_config(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        info(**kw)


def test_a_source_or_server_it_cannot_serve_is_refused_before_the_init(fake_nccl: None) -> None:
    from weightwire.torch_side.sender.engine import TorchTrainerEngine

    server = Server(PLACEMENTS, tp=2)
    four = DictSource({"w": torch.zeros(1, 2, 2, 2)}, describe)
    with pytest.raises(StockRefusal, match="'w': it has 4 dims"):
        TorchTrainerEngine.trainer_init(info(), client=server, source=four)
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 does not divide the 2"):
        TorchTrainerEngine.trainer_init(
            info(inference_tensor_parallel_size=4), client=server, source=DictSource({}, describe)
        )
    with pytest.raises(ConfigError, match="'0.0.0.0' is not an address the workers can dial"):
        TorchTrainerEngine.trainer_init(
            info(tcp_bind_host="0.0.0.0"), client=server, source=DictSource({}, describe)
        )
    with pytest.raises(ValueError, match=r"lacks nccl_m2n \(needs >= 0\.33"):
        TorchTrainerEngine.trainer_init(
            info(server_version="0.32.0"), client=_Old(server), source=DictSource({}, describe)
        )
    assert server.calls == []


class _Unconfigured(Server):
    """A server whose vLLM runs another backend: its init call fails at once."""

    def init_weight_transfer_engine(self, info: dict[str, Any]) -> None:
        self.calls.append("init")
        raise TransferError("HTTP 400: weight transfer backend is 'nccl', not 'nccl_m2n'")


def test_an_init_the_server_refuses_fails_trainer_init_at_once(fake_nccl: None) -> None:
    import time

    from weightwire.torch_side.sender.engine import TorchTrainerEngine

    server = _Unconfigured(PLACEMENTS, tp=2)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="backend is 'nccl', not 'nccl_m2n'"):
        TorchTrainerEngine.trainer_init(
            info(), client=server, source=DictSource(weights(0), describe)
        )
    assert time.monotonic() - t0 < 10  # the POST's error, not the 20 s connect timeout
    assert server.calls == ["init"]


class _Group:
    """A ``TrainerGroup`` of two processes (never exchanged over: refused first)."""

    rank, size = 0, 2

    def publish(self, key: str, value: str) -> None:
        raise AssertionError("nothing is exchanged")

    def read(self, key: str, timeout: float) -> str:
        raise AssertionError("nothing is exchanged")


def test_a_trainer_group_and_an_adapter_sync_are_refused(fake_nccl: None) -> None:
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.trainer.lora import AdapterSync

    server = Server(PLACEMENTS, tp=2)
    source = DictSource(weights(0), describe)
    with pytest.raises(ConfigError, match="a TrainerGroup's processes cannot share its session"):
        TorchTrainerEngine.trainer_init(info(), client=server, source=source, group=_Group())
    assert server.calls == []
    engine = TorchTrainerEngine.trainer_init(info(), client=server, source=source)
    try:
        with pytest.raises(ConfigError, match="'nccl_m2n' is vLLM's own receiver, which loads"):
            AdapterSync(engine, "a", alpha=16.0, adapter_dir="/nonexistent")
    finally:
        engine.shutdown()


class _Old:
    """A 0.32 server: no nccl_m2n receiver."""

    def __init__(self, server: Server) -> None:
        self._server = server

    def __getattr__(self, name: str) -> Any:
        if name == "version":
            return lambda: "0.32.0"
        return getattr(self._server, name)


def test_a_jax_mesh_engine_sends_each_rank_its_own_shard() -> None:
    """8 emulated devices (FSDP 4 x TP 2) as 8 trainer ranks of ``JAXTrainerEngine``: three
    rounds through ``trainer_init`` / ``send_weights``, each worker's slices bit-exact, and no
    rank ever handed more than its own shard."""
    report = script_report(Path(__file__).with_name("_m2n_engine_jax.py"))
    assert report["layouts"] == {
        "rows.weight": [[4, 2], [0, -1]],
        "cols.weight": [[4, 2], [-1, 1]],
        "flat.bias": [[8, 1], [0, -1]],
        "norm.weight": [[8, 1], None],
    }
    assert report["rounds"] == ["1", "2", "3"]
    assert report["whole_handed"] == []
    assert report["parts_per_reshard"] == [8]


def test_the_init_info_is_refused_as_vllm_would_before_the_post() -> None:
    from weightwire.backends.nccl.info import M2NInitInfo

    good = {
        "schema_version": 2,
        "master_address": "127.0.0.1",
        "master_port": 1234,
        "rank_offset": 1,
        "world_size": 3,
        "dst_mesh_dims": [1, 2],
        "source_digest": "d",
        "params": [{"name": "w"}],
    }
    M2NInitInfo.from_dict(good)
    with pytest.raises(ConfigError, match=r"dst_mesh_dims \[1, 3\] must be two positive dims"):
        M2NInitInfo.from_dict({**good, "dst_mesh_dims": [1, 3]})
    with pytest.raises(ConfigError, match="must leave at least one trainer rank"):
        M2NInitInfo.from_dict({**good, "rank_offset": 3})
    with pytest.raises(ConfigError, match="unknown keys"):
        M2NInitInfo.from_dict({**good, "packed": True})


DTENSOR = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from weightwire.shared.errors import ConfigError
from weightwire.torch_side.sender.holdings import TorchLocalShards
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
dt = distribute_tensor(torch.zeros(4, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
try:
    TorchLocalShards.of({"w": dt}, None)
except ConfigError as exc:
    print(exc)
dist.destroy_process_group()
"""


def test_a_dtensor_is_refused_by_name() -> None:
    """A DTensor's other shards live in other processes (a subprocess: the process group)."""
    done = subprocess.run(
        [sys.executable, "-c", DTENSOR],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'w' is a DTensor: its shards are held by other trainer processes" in done.stdout
