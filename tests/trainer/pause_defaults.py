"""What the round-driver default tests share: the fake backend reset to stand in for a
stock worker, an engine on it, and the round's route names as the fake server saw them."""

from __future__ import annotations

from typing import Any

import pytest

from tests.trainer.commit_order import canonical
from tests.trainer.fakes import FAKE, FAST, FakeComm, FakeServer
from weightwire.backends.base import SenderCaps
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.trainer import TrainerInitInfo

RESET = ["reset_prefix_cache", "reset_encoder_cache"]
ROUND = ["pause", "start_weight_update", "update_weights", "finish_weight_update", *RESET, "resume"]
PROBE = "weightwire/round_guard"
UNPAUSED = ["start_weight_update", "update_weights", "finish_weight_update", *RESET]


def stock_fake_comm(monkeypatch: pytest.MonkeyPatch) -> FakeComm:
    """A fresh fake communicator; the fake backend stands in for a stock worker (auto pauses
    only those; a test makes it a plugin worker with ``stock_receiver=False``)."""
    FAKE.comm = FakeComm()
    FAKE.opened.clear()
    monkeypatch.setattr(type(FAKE), "caps", SenderCaps(on_device=False, stock_receiver=True))
    return FAKE.comm


def engine_for(client: Any, source: Any, **info: Any) -> JAXTrainerEngine:
    return JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend="fake_host", timeouts=FAST, **info), client=client, source=source
    )


def round_routes(server: FakeServer) -> list[str]:
    """The round calls (a paused round's finish and resets in their in-line order:
    ``commit_order``)."""
    return canonical(
        [
            r
            for r in server.routes()
            if r not in ("version", "get_world_size", "init_weight_transfer_engine")
        ]
    )
