"""Session rules and failure handling of the worker engines (sender in a thread)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from weightwire.backends.tcp.comm import TCPCommunicator
from weightwire.backends.tcp.info import TCPInitInfo
from weightwire.backends.tcp.rendezvous import TCPRendezvous
from weightwire.shared.errors import TransferError
from weightwire.shared.framing import pack_host, plan
from weightwire.shared.info import encode_secret
from weightwire.shared.update_info import UpdateInfo
from weightwire.torch_side.sender.source import ModuleSource
from weightwire.torch_side.worker.core import WeightReceiveError
from weightwire.torch_side.worker.engines import WeightwireNCCLEngine, WeightwireTCPEngine
from weightwire.torch_side.worker.hf_host import HFModelHost

pytestmark = pytest.mark.timeout(60)


class Tiny(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])
        self.norm = torch.nn.LayerNorm(8)


class ThreadSender:
    """Rank 0 in a thread: accept, warm up, then run ``script(comm)``; records its error."""

    def __init__(self, script: Callable[[TCPCommunicator], None]) -> None:
        self.rdv = TCPRendezvous(world_size=2)
        self.error: BaseException | None = None
        self.error_after_s: float | None = None
        self._script = script
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        comm = None
        try:
            comm = self.rdv.accept(timeout=20)
            comm.warmup(timeout=20)
            self._t0 = time.monotonic()
            self._script(comm)
        except BaseException as exc:  # recorded for the test to assert on
            self.error = exc
            self.error_after_s = time.monotonic() - getattr(self, "_t0", time.monotonic())
        finally:
            if comm is not None:
                comm.close()
            self.rdv.close()

    def info(self, **over) -> TCPInitInfo:
        fields = {
            **self.rdv.init_fields(),
            "rank_offset": 1,
            "world_size": 2,
            "packed": True,
            "packed_buffer_size_bytes": 256,
            "packed_num_buffers": 2,
            "timeout_s": 20.0,
            **over,
        }
        return TCPInitInfo(**fields)

    def join(self) -> None:
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "sender thread hung"


def send_module(
    module: torch.nn.Module, *, rounds: int = 1, buffer_size: int = 256
) -> Callable[[TCPCommunicator], None]:
    """Send ``rounds`` packed rounds of ``module``; ``rounds=0``: keep sending (bounded)
    until the receiver's abort surfaces, as a trainer's next round would."""
    named = [(n, t.detach().numpy().copy()) for n, t in ModuleSource(module)]
    metas = ModuleSource(module).metadata()

    def script(comm: TCPCommunicator) -> None:
        deadline = time.monotonic() + 15
        sent = 0
        while (sent < rounds or rounds == 0) and time.monotonic() < deadline:
            for chunk in plan(metas, packed=True, buffer_size_bytes=buffer_size):
                comm.broadcast(
                    pack_host([a for _, a in named[chunk.start : chunk.stop]], chunk), timeout=20
                )
            sent += 1

    return script


def make_engine(**kw) -> tuple[WeightwireTCPEngine, HFModelHost]:
    host = HFModelHost(Tiny(seed=5))
    return WeightwireTCPEngine.standalone(model=host, device="cpu", **kw), host


def test_round_trip_and_group_batching():
    trainer = Tiny(seed=1)
    sender = ThreadSender(send_module(trainer))
    engine, host = make_engine(load_batching="group")
    batches: list[list[str]] = []
    real = host.load_weights
    host.load_weights = lambda pairs: (batches.append([n for n, _ in pairs]), real(pairs))[1]  # type: ignore[method-assign]
    engine.init_transfer_engine(sender.info().to_dict())
    engine.start_weight_update()
    engine.update_weights(UpdateInfo.from_metas(ModuleSource(trainer).metadata()).to_dict())
    engine.finish_weight_update()
    sender.join()
    assert sender.error is None
    for name, p in trainer.named_parameters():
        assert torch.equal(host.model.get_parameter(name), p), name
    # one load_weights call per layer group, even though 256-byte chunks cut across layers
    assert batches == [
        ["embed.weight"],
        *[[f"layers.{i}.weight", f"layers.{i}.bias"] for i in range(3)],
        ["norm.weight", "norm.bias"],
    ]
    engine.shutdown()


def test_reuse_without_previous_round_refuses_and_frees_the_sender():
    trainer = Tiny(seed=1)
    sender = ThreadSender(send_module(trainer, rounds=0))
    engine, host = make_engine()
    before = host.state_checksums()
    engine.init_transfer_engine(sender.info())
    engine.start_weight_update()
    with pytest.raises(ValueError, match="received no round since init"):
        engine.update_weights({"names": [], "dtype_names": [], "shapes": []})
    sender.join()
    assert isinstance(sender.error, TransferError)
    assert sender.error_after_s is not None and sender.error_after_s < 10, (
        "sender should fail fast, not time out"
    )
    assert host.state_checksums() == before and not host.in_round


def test_unknown_name_aborts_round_and_communicator():
    trainer = Tiny(seed=1)
    sender = ThreadSender(send_module(trainer, rounds=0))
    engine, host = make_engine()
    before = host.state_checksums()
    metas = ModuleSource(trainer).metadata()
    update = UpdateInfo.from_metas(metas).to_dict()
    update["names"][3] = "layers.9.weight"  # same bytes, a name the model lacks
    engine.init_transfer_engine(sender.info())
    engine.start_weight_update()
    with pytest.raises(WeightReceiveError, match=r"unknown weight name 'layers.9.weight'"):
        engine.update_weights(update)
    sender.join()
    assert isinstance(sender.error, TransferError)
    assert host.state_checksums() == before and not host.in_round


def test_silent_sender_times_out_instead_of_hanging():
    trainer = Tiny(seed=1)
    sender = ThreadSender(lambda comm: time.sleep(4))
    engine, host = make_engine()
    engine.init_transfer_engine(sender.info(timeout_s=1.0))
    engine.start_weight_update()
    t0 = time.monotonic()
    with pytest.raises(WeightReceiveError, match="TransferTimeout"):
        engine.update_weights(UpdateInfo.from_metas(ModuleSource(trainer).metadata()).to_dict())
    assert time.monotonic() - t0 < 8
    sender.join()


def test_session_rules():
    engine, host = make_engine()
    with pytest.raises(RuntimeError, match="not initialized"):
        engine.start_weight_update()
    with pytest.raises(RuntimeError, match="not initialized"):
        engine.update_weights({"names": [], "dtype_names": [], "shapes": []})
    with pytest.raises(RuntimeError, match="without start_weight_update"):
        engine.finish_weight_update()
    release = threading.Event()
    sender = ThreadSender(lambda comm: release.wait(20))  # keeps its link open: a live session
    engine.init_transfer_engine(sender.info())
    with pytest.raises(RuntimeError, match="without start_weight_update"):
        engine.update_weights({"names": [], "dtype_names": [], "shapes": []})
    engine.start_weight_update()
    with pytest.raises(RuntimeError, match="called twice"):
        engine.start_weight_update()
    other = ThreadSender(lambda comm: None)
    with pytest.raises(
        RuntimeError, match=r"refused: a weight update of session \w+ is in progress"
    ):
        engine.init_transfer_engine(other.info())  # a second trainer mid-round of a live one
    engine.finish_weight_update()
    assert not engine._core.active  # an empty staged round commits nothing, and ends
    release.set()
    engine.shutdown()
    engine.shutdown()  # idempotent
    sender.join()
    other.rdv.close()


def test_a_stale_round_is_dropped_by_the_next_init():
    engine, host = make_engine()
    first = ThreadSender(
        lambda comm: None
    )  # closes its link right after warm-up: the trainer is gone
    engine.init_transfer_engine(first.info())
    engine.start_weight_update()
    first.join()
    second = ThreadSender(lambda comm: None)
    engine.init_transfer_engine(second.info())  # not refused: the open round is stale
    assert not engine._core.active and host.rounds_committed == 0
    engine.shutdown()
    second.join()


def test_parsers_are_strict_and_rank_is_checked():
    engine, _ = make_engine(worker_rank=1)
    good = {
        "host": "127.0.0.1",
        "port": 9,
        "secret_b64": encode_secret(bytes(128)),
        "rank_offset": 1,
        "world_size": 2,
    }
    with pytest.raises(ValueError, match=r"unknown keys \W*bogus"):
        engine.parse_init_info({**good, "bogus": 1})
    with pytest.raises(ValueError, match="dtype_names has 0 entries but names has 1"):
        engine.parse_update_info({"names": ["a"], "dtype_names": [], "shapes": []})
    with pytest.raises(ValueError, match=r"rank 2 .* outside world_size 2"):
        engine.init_transfer_engine(good)
    with pytest.raises(TypeError, match="must be TCPInitInfo"):
        WeightwireTCPEngine.standalone(model=HFModelHost(Tiny(0)))._core.init(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="load_batching must be one of"):
        make_engine(load_batching="layer")
    with pytest.raises(TypeError, match="load_weights"):
        WeightwireTCPEngine.standalone(model=object())


def test_nccl_engine_refuses_a_cpu_device():
    engine = WeightwireNCCLEngine.standalone(model=HFModelHost(Tiny(0)), device="cpu")
    info = {"nccl_unique_id_b64": encode_secret(bytes(128)), "rank_offset": 1, "world_size": 2}
    with pytest.raises(ValueError, match="needs a CUDA worker device"):
        engine.init_transfer_engine(info)
    assert not engine._core.initialized
