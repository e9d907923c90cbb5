"""The worker core with a link that writes through (CPU, no CUDA): a turn the link takes as
write-through opens no load and no framework round, a round that fails mid-write leaves
the model incomplete (refused by name) until a complete round commits, and a link that
declines gets the usual staged round with the landing map's refusal in hand."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.torch_side._local_core import local_core, local_init
from weightwire.backends.worker_base import (
    LandingRecord,
    ReceiveLink,
    ReceiveProgress,
    ReceiveTurn,
    WorkerPairs,
)
from weightwire.shared.errors import PeerLost
from weightwire.shared.meta import ParamMeta
from weightwire.shared.update_info import UpdateInfo
from weightwire.torch_side.worker.core import WeightReceiveError, _ReceiverCore

METAS = [ParamMeta("w", "float32", (2, 2)), ParamMeta("b", "float32", (2,))]


class ThroughLink(ReceiveLink):
    """``lands`` answers ``through``; a written-through turn yields nothing, or dies."""

    def __init__(self, through: bool) -> None:
        super().__init__(device=torch.device("cpu"), timeout_s=5.0, depth=2)
        self.through, self.die = through, False
        self.records: list[LandingRecord] = []
        self.early: frozenset[str] | None = None  # a table that holds since the last round
        self.went: list[bool] = []

    def early_landing(self) -> frozenset[str] | None:
        return self.early

    def go_early(self) -> None:
        self.went.append(True)

    def lands(self, turn: ReceiveTurn, record: Callable[[], LandingRecord]) -> bool:
        self.records.append(record())
        return self.through

    def receive(self, turn: ReceiveTurn, progress: ReceiveProgress) -> Iterator[WorkerPairs]:
        progress.chunk = 0
        if self.die:
            raise PeerLost("the IPC trainer closed the IPC control channel")
        if not self.through:
            yield [(m.name, torch.ones(m.shape)) for m in turn.metas]

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


class Model:
    def __init__(self) -> None:
        self.loads = 0
        self.hooks: list[str] = []

    def load_weights(self, weights: Any) -> None:
        self.loads += 1

    def begin_round(self) -> None:
        self.hooks.append("begin")


def _core(through: bool) -> tuple[_ReceiverCore, Model, list[ThroughLink]]:
    model, links = Model(), []

    def connect(info: Any, *, rank: int, device: torch.device) -> ReceiveLink:
        links.append(ThroughLink(through))
        return links[-1]

    core = local_core(model, connect)
    core.init(local_init())
    return core, model, links


def _round(core: _ReceiverCore) -> None:
    core.start()
    core.receive_dict(UpdateInfo.from_metas(METAS).to_dict())
    assert core.strategy in ("write_through", "staged")
    core.finish()


def test_a_written_through_round_loads_nothing_and_commits() -> None:
    core, model, (link,) = _core(True)
    core.start()
    core.receive_dict(UpdateInfo.from_metas(METAS).to_dict())
    assert core.strategy == "write_through"
    core.finish()
    assert model.loads == 0 and model.hooks == [] and core.incomplete_round is None


def test_a_trainer_lost_mid_write_leaves_the_model_incomplete_until_a_complete_round() -> None:
    core, model, (link,) = _core(True)
    link.die = True
    core.start()
    with pytest.raises(WeightReceiveError, match="PeerLost"):
        core.receive_dict(UpdateInfo.from_metas(METAS).to_dict())
    incomplete = core.incomplete_round
    assert incomplete is not None and incomplete.names == {"w", "b"}
    assert "incomplete weight round" in incomplete.describe()
    with pytest.raises(RuntimeError, match="aborted after a failed round"):
        core.start()
    core.init(core._info)  # type: ignore[arg-type]  # the next trainer
    _round(core)
    assert core.incomplete_round is None


def test_a_declining_link_gets_a_staged_round_and_the_landing_maps_answer() -> None:
    core, model, (link,) = _core(False)
    _round(core)
    assert model.loads == 1 and core.incomplete_round is None
    (got,) = link.records
    assert got.map is None and got.refused  # this model has no vLLM loader to record


def test_a_round_the_trainer_may_write_from_its_start_is_in_place_from_its_start() -> None:
    core, model, (link,) = _core(True)
    link.early = frozenset({"w", "b"})
    core.start()
    assert core.strategy == "write_through" and link.went == [True]
    core.shutdown()  # the trainer vanished before its update: the model may be part new
    incomplete = core.incomplete_round
    assert incomplete is not None and incomplete.names == {"w", "b"}


def test_a_start_that_fails_after_the_go_leaves_the_model_incomplete_until_a_whole_round() -> None:
    """The server's start failed after this worker's go (another replica's reply lost, the
    answer lost): its failure tears the engine down (the reference server's ``abort``: the
    replica's teardown), and the trainer may have written at the go, so generation stays
    refused (the model is incomplete) until a whole round commits, after the next init."""
    core, model, (link,) = _core(True)
    link.early = frozenset({"w", "b"})
    core.start()
    assert link.went == [True]  # the go: the last step of the worker's start
    info = core._info
    core.shutdown()  # the replica's teardown on the failed start
    incomplete = core.incomplete_round
    assert incomplete is not None and incomplete.names == {"w", "b"}
    core.init(info)  # type: ignore[arg-type]  # the trainer's new init
    assert core.incomplete_round is not None  # a new session alone repairs nothing
    _round(core)
    assert core.incomplete_round is None


def test_an_early_round_whose_update_is_not_written_through_goes_on_in_place() -> None:
    core, model, (link,) = _core(False)
    link.early = frozenset({"w", "b"})
    core.start()
    core.receive_dict(UpdateInfo.from_metas(METAS).to_dict())
    assert core.strategy == "streaming" and model.loads == 1  # loaded, in place
    core.finish()
    assert core.incomplete_round is None


def test_the_round_guard_counts_an_open_written_through_round_as_not_whole() -> None:
    from types import SimpleNamespace

    from weightwire.vllm_guard.worker import worker_round_state

    core, model, (link,) = _core(True)
    engine = SimpleNamespace(incomplete_round=None, round_strategy=None)
    worker = SimpleNamespace(weight_transfer_engine=engine)
    assert worker_round_state(worker)["whole"] is True
    core.start()
    core.receive_dict(UpdateInfo.from_metas(METAS).to_dict())
    engine.round_strategy = core.strategy  # what the engine reports while the round is open
    state = worker_round_state(worker)
    assert state["whole"] is False and "applied in place is open" in state["reason"]
