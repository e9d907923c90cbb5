"""Failure handling: every failure returns promptly with the real cause, never a hang."""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

import numpy as np
import pytest

import weightwire.trainer.transfer as transfer_mod
from tests.trainer.fakes import FAKE, DictSource, FakeComm, FakeServer, numpy_weights
from tests.trainer.pause_defaults import UNPAUSED
from weightwire.backends import register_backend, unregister_backend
from weightwire.backends.base import Backend, Rendezvous, RoundSender, SenderCaps, SenderParts
from weightwire.jax_side.dtypes import describe
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.shared.errors import (
    ControlTimeout,
    PeerLost,
    SourceMismatch,
    TransferError,
    TransferTimeout,
    WeightSyncError,
)
from weightwire.shared.timeouts import Timeouts
from weightwire.trainer import EngineBroken, TrainerInitInfo

FAST = Timeouts(http_s=10, connect_s=5, warmup_s=5, transfer_s=30)


def init(
    server: FakeServer, source: DictSource | None = None, backend: str = "fake_host", **kw: Any
) -> JAXTrainerEngine:
    info = TrainerInitInfo(backend=backend, timeouts=kw.pop("timeouts", FAST), **kw)
    return JAXTrainerEngine.trainer_init(
        info, client=server.client(), source=source or DictSource(numpy_weights(), describe)
    )


def test_rejected_update_surfaces_while_the_broadcast_would_block() -> None:
    FAKE.comm = FakeComm(block=True)  # a broadcast nobody receives: returns only when aborted
    server = FakeServer()
    server.fail["update_weights"] = (400, "update_info.shapes[3] has a negative dim -1")
    engine = init(server)
    start = time.monotonic()
    with pytest.raises(WeightSyncError) as info:
        engine.send_weights()
    assert time.monotonic() - start < 5.0  # not the 30 s transfer timeout
    err = info.value
    assert (err.route, err.status, err.server) == ("update_weights", 400, "http://fake:8000")
    assert "negative dim -1" in err.message and "negative dim -1" in str(err)
    assert any("data plane then failed" in note for note in getattr(err, "__notes__", []))
    assert FAKE.comm.aborted.is_set()
    assert "finish_weight_update" not in server.routes()
    with pytest.raises(EngineBroken, match="WeightSyncError"):
        engine.send_weights()


@pytest.mark.parametrize(
    "error",
    [
        PeerLost("rank 1 (10.0.0.2:5555) closed the connection at byte 0 of 200"),
        TransferTimeout("NCCL work did not finish within 5 s on rank 0 of world size 2"),
    ],
)
def test_transport_failure_is_raised_when_the_server_stays_silent(
    monkeypatch: pytest.MonkeyPatch, error: TransferError
) -> None:
    monkeypatch.setattr(transfer_mod, "_GRACE_S", 0.3)

    class LosingComm(FakeComm):
        def broadcast(self, buffer: Any, **kw: Any) -> None:
            raise error

    FAKE.comm = LosingComm()
    server = FakeServer()
    release = threading.Event()
    server.hooks["update_weights"] = lambda body: release.wait(10)  # the worker never answers
    engine = init(server)
    start = time.monotonic()
    with pytest.raises(type(error)) as info:
        engine.send_weights()
    assert info.value is error  # the data plane's own error, not relabelled
    assert time.monotonic() - start < 3.0
    assert FAKE.comm.aborted.is_set()
    release.set()


class Liar(DictSource):
    """Iteration yields a different shape than metadata declared, while ``lying``."""

    lying = True

    def __iter__(self):
        for name, array in super().__iter__():
            bad = self.lying and name == "model.layers.0.mlp.up_proj.weight"
            yield name, (array[:2] if bad else array)


MISMATCH = r"declared 'model\.layers\.0\.mlp\.up_proj\.weight' float16 \[12, 8\], got .* \[2, 8\]"


def test_source_mismatch_wins_over_the_consequent_server_error() -> None:
    FAKE.comm = FakeComm()
    server = FakeServer()
    # The worker notices only once the trainer gave up (its abort), as a real one would.
    server.hooks["update_weights"] = lambda body: FAKE.comm.aborted.wait(10)
    server.fail["update_weights"] = (500, "PeerLost: trainer vanished")
    # Small chunks: the lie sits in a later chunk, after the first broadcasts went out.
    engine = init(server, Liar(numpy_weights(), describe), packed=True, packed_buffer_size_bytes=64)
    with pytest.raises(SourceMismatch, match=MISMATCH):
        engine.send_weights()
    assert FAKE.comm.aborted.is_set()
    assert FAKE.comm.broadcasts  # the failure really came after bytes went out


def test_mismatch_in_the_first_chunk_sends_nothing_and_keeps_the_engine() -> None:
    FAKE.comm = FakeComm()
    server = FakeServer()
    source = Liar(numpy_weights(), describe)
    engine = init(server, source)  # one chunk: the lie is found before the control plane runs
    with pytest.raises(SourceMismatch, match=MISMATCH):
        engine.send_weights()
    assert not FAKE.comm.aborted.is_set() and not FAKE.comm.broadcasts
    assert "start_weight_update" not in server.routes()
    source.lying = False
    metrics = engine.send_weights()  # nothing went out, so nothing is broken
    assert metrics.version == "1" and server.routes()[-5:] == UNPAUSED


def test_update_that_never_returns_times_out() -> None:
    FAKE.comm = FakeComm()
    server = FakeServer()
    release = threading.Event()
    server.hooks["update_weights"] = lambda body: release.wait(10)
    engine = init(server, timeouts=Timeouts(http_s=0.5, connect_s=5, warmup_s=5, transfer_s=5))
    start = time.monotonic()
    with pytest.raises(
        ControlTimeout,
        match=r"update_weights \(after the last broadcast\) did not return within 0.5 s",
    ):
        engine.send_weights()
    assert time.monotonic() - start < 3.0
    release.set()


class StuckJoin(Backend):
    """A rendezvous whose workers never arrive: join blocks until cancelled or timed out."""

    name: ClassVar[str] = "stuck_join"
    caps: ClassVar[SenderCaps] = SenderCaps(on_device=False)

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def open(self, info: Any, *, world_size: int) -> Rendezvous:
        backend = self

        class _Rdv(Rendezvous):
            def join(self, *, timeout: float) -> Any:
                if backend.cancelled.wait(timeout):
                    raise TransferError("rendezvous closed while waiting")
                raise TransferTimeout(f"nobody joined within {timeout} s")

            def cancel(self) -> None:
                backend.cancelled.set()

        return _Rdv({"secret_b64": "never-logged"})

    def sender(self, link: Any, settings: Any, parts: SenderParts) -> RoundSender:
        raise AssertionError("nobody ever joins this backend")


@pytest.fixture
def stuck() -> StuckJoin:
    backend = StuckJoin()
    register_backend(backend, replace=True)
    yield backend
    unregister_backend(backend.name)


def test_rejected_init_returns_at_once_and_cancels_the_rendezvous(stuck: StuckJoin) -> None:
    server = FakeServer()
    server.fail["init_weight_transfer_engine"] = (400, "TCPInitInfo: unknown keys 'bogus'")
    start = time.monotonic()
    with pytest.raises(
        WeightSyncError,
        match=(
            r"init_weight_transfer_engine failed on http://fake:8000 \(status 400\): "
            r"TCPInitInfo: unknown keys"
        ),
    ):
        init(server, backend="stuck_join")
    assert time.monotonic() - start < 2.0
    assert stuck.cancelled.wait(2.0)


def test_rendezvous_that_nobody_joins_times_out(
    stuck: StuckJoin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transfer_mod, "_GRACE_S", 0.3)
    server = FakeServer()
    release = threading.Event()
    server.hooks["init_weight_transfer_engine"] = lambda body: release.wait(
        10
    )  # workers still joining
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match="nobody joined within 0.5 s"):
        init(
            server,
            backend="stuck_join",
            timeouts=Timeouts(http_s=10, connect_s=0.5, warmup_s=1, transfer_s=1),
        )
    assert time.monotonic() - start < 3.0
    release.set()


def test_secrets_stay_out_of_reprs_and_errors(stuck: StuckJoin) -> None:
    server = FakeServer()
    server.fail["init_weight_transfer_engine"] = (500, "boom")
    with pytest.raises(WeightSyncError) as info:
        init(server, backend="stuck_join")
    assert "never-logged" not in str(info.value)
    assert "never-logged" not in repr(stuck.open(TrainerInitInfo(), world_size=2))


def test_values_changing_between_rounds_arrive() -> None:
    FAKE.comm = FakeComm()
    weights = {"w": np.zeros(4, np.float32)}
    engine = init(FakeServer(), DictSource(weights, describe))
    for step in range(3):
        weights["w"] = np.full(4, step, np.float32)
        engine.send_weights()
    assert FAKE.comm.broadcasts == [np.full(4, s, np.float32).tobytes() for s in range(3)]
