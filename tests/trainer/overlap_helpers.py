"""What the overlapped-round tests share (``test_overlap.py``, ``test_overlap_torch.py``,
``test_overlap_cow.py``): short timeouts, a fresh recording communicator per test, a gate
that holds a route inside the fake server until the test releases it, and the torch engine
those tests send from.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.trainer.fakes import FAKE, FakeComm, FakeServer
from weightwire.shared.source import WeightSource
from weightwire.shared.timeouts import Timeouts

FAST = Timeouts(http_s=10, connect_s=5, warmup_s=5, transfer_s=5, round_s=10)
ROUND = ["start_weight_update", "update_weights", "finish_weight_update"]


@pytest.fixture(autouse=True)
def fresh_comm() -> FakeComm:
    """Every test starts with an empty communicator and no open link (imported: autouse)."""
    FAKE.comm = FakeComm()
    FAKE.opened.clear()
    return FAKE.comm


def gate(server: FakeServer, route: str) -> tuple[threading.Event, threading.Event]:
    """``route`` blocks inside the server until released; ``entered`` says it was reached."""
    entered, release = threading.Event(), threading.Event()

    def hook(body: Any) -> None:
        entered.set()
        assert release.wait(10)

    server.hooks[route] = hook
    return entered, release


def torch_engine(server: FakeServer, source: WeightSource, *, snapshot: str = "copy") -> Any:
    """A ``TorchTrainerEngine`` sending ``source`` unpacked to ``server`` over the fake host
    backend, its overlapped rounds fixed by ``snapshot``."""
    from weightwire.torch_side.sender.engine import TorchTrainerEngine  # torch tests only
    from weightwire.trainer import TrainerInitInfo

    return TorchTrainerEngine.trainer_init(
        TrainerInitInfo(backend="fake_host", timeouts=FAST, packed=False, snapshot=snapshot),
        client=server.client(),
        source=source,
    )


def round_routes(server: FakeServer) -> list[str]:
    """The round's own routes the server saw, in order."""
    return [r for r in server.routes() if r in ROUND]


def slot_waiter(engine: Any) -> threading.Event:
    """Set once a thread other than the round thread waits on the engine's round runner: a
    ``send_weights(wait=False)`` waiting for a free slot. (Lets a test fail a round exactly
    while that call waits, without sleeping.)"""
    runner = engine._overlapped._runner
    assert runner is not None, "no overlapped round was sent yet"
    cond, real = runner._cond, runner._cond.wait
    waiting = threading.Event()

    def wait(timeout: float | None = None) -> bool:
        if not runner.on_round_thread():
            waiting.set()
        return real(timeout)

    cond.wait = wait
    return waiting
