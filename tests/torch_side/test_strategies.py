"""Both receive strategies on one fault matrix (worker engine in process, sender in a thread).

``staged``: the stage budget holds the round (received whole, applied at finish);
``streaming``: budget 0, every chunk applied in place as it lands. For each fault, staged
leaves the previous weights exactly and the model whole; streaming leaves the model
recorded as incomplete (``incomplete_round``), and a fresh trainer's complete round makes
it whole again with exactly the new bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.torch_side.test_engine_rules import ThreadSender, Tiny, send_module
from weightwire.backends.tcp.comm import TCPCommunicator
from weightwire.shared.framing import pack_host, plan
from weightwire.shared.staging import round_bytes, round_streams
from weightwire.shared.update_info import UpdateInfo
from weightwire.torch_side.sender.source import ModuleSource
from weightwire.torch_side.worker.core import WeightReceiveError
from weightwire.torch_side.worker.engines import WeightwireTCPEngine
from weightwire.torch_side.worker.hf_host import HFModelHost

pytestmark = pytest.mark.timeout(60)

BUDGETS = {"staged": 1 << 30, "streaming": 0}
STRATEGIES = pytest.mark.parametrize("strategy", list(BUDGETS))


def engine_and_host() -> tuple[WeightwireTCPEngine, HFModelHost]:
    host = HFModelHost(Tiny(seed=5))
    return WeightwireTCPEngine.standalone(model=host, device="cpu"), host


def params(host: HFModelHost) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in host.model.named_parameters()}


def first_chunks(
    module: torch.nn.Module, count: int, then: Callable[[], None] = lambda: None
) -> Callable[[TCPCommunicator], None]:
    """Send the first ``count`` chunks of a round of ``module``, then ``then()`` (and the
    thread's exit closes the link: a trainer that died mid-round)."""
    named = [(n, t.detach().numpy().copy()) for n, t in ModuleSource(module)]
    metas = ModuleSource(module).metadata()

    def script(comm: TCPCommunicator) -> None:
        for chunk in plan(metas, packed=True, buffer_size_bytes=256)[:count]:
            comm.broadcast(
                pack_host([a for _, a in named[chunk.start : chunk.stop]], chunk), timeout=20
            )
        then()

    return script


def update_of(module: torch.nn.Module) -> dict:
    return UpdateInfo.from_metas(ModuleSource(module).metadata()).to_dict()


def fresh_round(engine: WeightwireTCPEngine, host: HFModelHost, budget: int, seed: int) -> None:
    """A new trainer's complete round: every parameter holds its bytes afterwards."""
    trainer = Tiny(seed=seed)
    sender = ThreadSender(send_module(trainer))
    engine.init_transfer_engine(sender.info(stage_budget_bytes=budget))
    engine.start_weight_update()
    engine.update_weights(update_of(trainer))
    engine.finish_weight_update()
    sender.join()
    assert sender.error is None
    for name, p in trainer.named_parameters():
        assert torch.equal(host.model.get_parameter(name), p), name
    assert engine.incomplete_round is None and not host.in_round


def check_outcome(
    strategy: str, engine: WeightwireTCPEngine, host: HFModelHost, before: dict[str, torch.Tensor]
) -> None:
    after = params(host)
    if strategy == "staged":
        assert all(torch.equal(after[n], before[n]) for n in before), (
            "a staged round changed the model"
        )
        assert engine.incomplete_round is None
    else:
        assert any(not torch.equal(after[n], before[n]) for n in before), (
            "nothing was written in place"
        )
        incomplete = engine.incomplete_round
        assert incomplete is not None and "embed.weight" in incomplete.names
        assert "incomplete weight round" in incomplete.describe()
    assert not host.in_round


def test_the_shared_rule() -> None:
    metas = ModuleSource(Tiny(0)).metadata()
    nbytes = round_bytes(metas)
    assert nbytes == sum(p.numel() * 4 for p in Tiny(0).parameters())
    assert (
        not round_streams(nbytes, nbytes)
        and round_streams(nbytes, nbytes - 1)
        and round_streams(1, 0)
    )
    assert not round_streams(0, 0)


@STRATEGIES
def test_a_good_round_lands_exactly(strategy: str) -> None:
    engine, host = engine_and_host()
    fresh_round(engine, host, BUDGETS[strategy], seed=1)
    engine.shutdown()


@STRATEGIES
def test_the_strategy_follows_the_budget(strategy: str) -> None:
    trainer = Tiny(seed=1)
    sender = ThreadSender(send_module(trainer))
    engine, host = engine_and_host()
    engine.init_transfer_engine(sender.info(stage_budget_bytes=BUDGETS[strategy]))
    engine.start_weight_update()
    engine.update_weights(update_of(trainer))
    assert engine._core.strategy == strategy
    # Staged: nothing touched the model before finish; streaming: the round is already in it.
    assert torch.equal(host.model.get_parameter("embed.weight"), trainer.embed.weight) == (
        strategy == "streaming"
    )
    engine.finish_weight_update()
    sender.join()
    engine.shutdown()


def fails_then_recovers(
    strategy: str,
    sender: ThreadSender,
    update: dict[str, Any],
    match: str,
    *,
    seed: int,
    **info: Any,
) -> None:
    """A round from ``sender`` that the worker fails with ``match`` (``info``: more init
    fields); the model is what ``strategy`` promises after a failed round; a fresh trainer's
    round (``seed``) then lands whole."""
    engine, host = engine_and_host()
    before = params(host)
    engine.init_transfer_engine(sender.info(stage_budget_bytes=BUDGETS[strategy], **info))
    engine.start_weight_update()
    with pytest.raises(WeightReceiveError, match=match):
        engine.update_weights(update)
    sender.join()
    check_outcome(strategy, engine, host, before)
    fresh_round(engine, host, BUDGETS[strategy], seed=seed)
    engine.shutdown()


@STRATEGIES
def test_trainer_dies_after_the_first_chunks(strategy: str) -> None:
    fails_then_recovers(
        strategy,
        ThreadSender(first_chunks(Tiny(seed=1), 3)),
        update_of(Tiny(seed=1)),
        r"round failed at chunk 4/\d+ .*PeerLost",
        seed=2,
    )


@STRATEGIES
def test_worker_side_failure_mid_round(strategy: str) -> None:
    trainer = Tiny(seed=1)
    update = update_of(trainer)
    update["names"][3] = (
        "layers.9.weight"  # same bytes; the model has no such tensor (chunk 2 or later)
    )
    fails_then_recovers(
        strategy,
        ThreadSender(send_module(trainer, rounds=0)),
        update,
        "unknown weight name 'layers.9.weight'",
        seed=3,
    )


@STRATEGIES
def test_bad_chunk_length_mid_round(strategy: str) -> None:
    trainer = Tiny(seed=1)
    named = [(n, t.detach().numpy().copy()) for n, t in ModuleSource(trainer)]
    chunks = plan(ModuleSource(trainer).metadata(), packed=True, buffer_size_bytes=256)

    def script(comm: TCPCommunicator) -> None:
        for i, chunk in enumerate(chunks[:3]):
            data = pack_host([a for _, a in named[chunk.start : chunk.stop]], chunk)
            comm.broadcast(data[:-4] if i == 2 else data, timeout=20)  # the third chunk comes short

    fails_then_recovers(
        strategy, ThreadSender(script), update_of(trainer), "round failed at chunk 3/", seed=4
    )


@STRATEGIES
def test_silent_trainer_after_the_first_chunks_times_out(strategy: str) -> None:
    fails_then_recovers(
        strategy,
        ThreadSender(first_chunks(Tiny(seed=1), 2, then=lambda: time.sleep(3))),
        update_of(Tiny(seed=1)),
        "TransferTimeout",
        seed=5,
        timeout_s=1.0,
    )


def test_a_partial_round_does_not_clear_an_incomplete_model() -> None:
    """Only a round that rewrites every tensor the broken round may have touched makes the
    model whole; a smaller one commits but the model stays recorded as incomplete."""
    engine, host = engine_and_host()
    sender = ThreadSender(first_chunks(Tiny(seed=1), 3))
    engine.init_transfer_engine(sender.info(stage_budget_bytes=0))
    engine.start_weight_update()
    with pytest.raises(WeightReceiveError):
        engine.update_weights(update_of(Tiny(seed=1)))
    sender.join()
    assert engine.incomplete_round is not None
    partial = torch.nn.Module()
    partial.norm = torch.nn.LayerNorm(8)  # norm.* only
    sender = ThreadSender(send_module(partial))
    engine.init_transfer_engine(sender.info())
    engine.start_weight_update()
    engine.update_weights(update_of(partial))
    engine.finish_weight_update()
    sender.join()
    assert engine.incomplete_round is not None and "embed.weight" in engine.incomplete_round.names
    fresh_round(engine, host, 0, seed=6)
    engine.shutdown()


def test_a_staged_start_that_outgrows_the_budget_applies_what_it_held() -> None:
    """Two updates in one round (several broadcasters): the first fits the budget and is held,
    the second takes the round over it, so the held tensors go in place first."""
    trainer = Tiny(seed=1)
    metas = ModuleSource(trainer).metadata()
    first, second = metas[:3], metas[3:]
    engine, host = engine_and_host()

    def script(comm: TCPCommunicator) -> None:
        named = dict((n, t.detach().numpy().copy()) for n, t in ModuleSource(trainer))
        for part in (first, second):
            for chunk in plan(part, packed=True, buffer_size_bytes=256):
                comm.broadcast(
                    pack_host([named[m.name] for m in part[chunk.start : chunk.stop]], chunk),
                    timeout=20,
                )

    sender = ThreadSender(script)
    engine.init_transfer_engine(sender.info(stage_budget_bytes=round_bytes(first)))
    engine.start_weight_update()
    engine.update_weights(UpdateInfo.from_metas(first).to_dict())
    assert engine._core.strategy == "staged"
    engine.update_weights(UpdateInfo.from_metas(second).to_dict())
    assert engine._core.strategy == "streaming"
    engine.finish_weight_update()
    sender.join()
    for name, p in trainer.named_parameters():
        assert torch.equal(host.model.get_parameter(name), p), name
    engine.shutdown()
