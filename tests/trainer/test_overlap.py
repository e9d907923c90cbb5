"""Overlapped rounds (``send_weights(wait=False)``) against a fake server and a recording
communicator: the snapshot (JAX references, torch copies), rounds in call order with at
most ``max_rounds_in_flight`` in flight, a failure that is never lost and never has a
later round applied on top of it, and ``shutdown``'s drain / abort. (The torch trainer's
snapshot copy: ``test_overlap_torch.py``.)"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.trainer.fakes import FAKE, DictSource, FakeServer
from tests.trainer.overlap_helpers import (  # noqa: F401  (fresh_comm: autouse)
    FAST,
    ROUND,
    fresh_comm,
    gate,
    round_routes,
    slot_waiter,
)
from weightwire.jax_side import PytreeSource
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.naming import Naming
from weightwire.jax_side.rules import Rule
from weightwire.shared.errors import ConfigError, TransferError, WeightSyncError
from weightwire.torch_side.sender.engine import TorchTrainerEngine
from weightwire.torch_side.sender.source import describe_tensor
from weightwire.trainer import RoundHandle, RoundSkipped, RoundWaitTimeout, TrainerInitInfo, overlap
from weightwire.trainer.overlap import RoundRunner
from weightwire.trainer.snapshot import RoundCancelled, Snapshot


class Params:
    """A training loop's live state: each step replaces the arrays (JAX never mutates)."""

    def __init__(self) -> None:
        self.tree = {"a": jnp.arange(6.0), "b": jnp.ones((2, 3), jnp.bfloat16)}

    def step(self) -> None:
        self.tree = {k: v + 1 for k, v in self.tree.items()}

    def wire(self) -> list[bytes]:
        return [np.asarray(v).tobytes() for v in self.tree.values()]


def jax_engine(server: FakeServer, params: Params, **info: Any) -> JAXTrainerEngine:
    source = PytreeSource(lambda: params.tree, Naming([Rule("{x}", "{x}")]))
    kw = {"backend": "fake_host", "timeouts": FAST, "packed": False, **info}
    return JAXTrainerEngine.trainer_init(
        TrainerInitInfo(**kw), client=server.client(), source=source
    )


def test_jax_round_sends_the_arrays_of_the_step_it_was_called_after() -> None:
    server, params = FakeServer(), Params()
    engine = jax_engine(server, params)
    try:
        entered, release = gate(server, "start_weight_update")
        sent = params.wire()
        handle = engine.send_weights(wait=False)
        assert isinstance(handle, RoundHandle)
        assert entered.wait(10) and not handle.done()  # the round is in flight ...
        params.step()  # ... while the trainer computes its next step
        release.set()
        metrics = handle.result()
        assert metrics.version == "1" and handle.version == "1" and handle.done()
        assert FAKE.comm.broadcasts == sent  # the old step's bytes, not the new ones
        assert server.weight_version == "1"
        server.hooks.clear()
        assert engine.send_weights(wait=False).result().version == "2"
        assert FAKE.comm.broadcasts[len(sent) :] == params.wire()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("limit", [1, 2])
def test_rounds_land_in_call_order_with_at_most_limit_in_flight(limit: int) -> None:
    server, params = FakeServer(), Params()
    engine = jax_engine(server, params, max_rounds_in_flight=limit)
    entered, release = gate(server, "update_weights")
    handles: list[RoundHandle] = []
    returned = threading.Event()

    def trainer() -> None:
        for _ in range(3):
            handles.append(engine.send_weights(wait=False))
            params.step()
        returned.set()

    thread = threading.Thread(target=trainer)
    try:
        thread.start()
        assert entered.wait(10)
        # Round 1 is stuck in update_weights: the calls beyond the limit wait for a slot.
        assert not returned.wait(0.3)
        assert len(handles) == limit
        release.set()
        assert returned.wait(10)
        assert [h.result().version for h in handles] == ["1", "2", "3"]
        assert round_routes(server) == ROUND * 3  # one round after the other, never interleaved
        assert [b["weight_version"] for b in server.bodies("finish_weight_update")] == [
            "1",
            "2",
            "3",
        ]
    finally:
        release.set()
        thread.join(10)
        engine.shutdown()


def test_a_failed_round_fails_the_queued_ones_and_its_error_is_raised() -> None:
    server, params = FakeServer(), Params()
    engine = jax_engine(server, params, max_rounds_in_flight=2)
    entered, release = gate(server, "start_weight_update")
    server.fail["start_weight_update"] = (500, "worker 0 died")
    try:
        first = engine.send_weights("v1", wait=False)
        params.step()
        second = engine.send_weights("v2", wait=False)
        assert entered.wait(10)
        release.set()
        with pytest.raises(WeightSyncError, match="start_weight_update failed.*worker 0 died"):
            first.result()
        with pytest.raises(RoundSkipped, match=r"round 'v2' .* was not sent: round 'v1'") as info:
            second.result()
        assert isinstance(info.value.__cause__, WeightSyncError)
        assert server.bodies("start_weight_update") == [None]  # v2 never started
        assert "update_weights" not in server.routes()
        # Seen at result(): the engine carries on (nothing went on the wire, it is not broken).
        del server.fail["start_weight_update"]
        server.hooks.clear()
        assert engine.send_weights("v3", wait=False).result().version == "v3"
        assert server.weight_version == "v3"
    finally:
        release.set()
        engine.shutdown()


def test_a_failure_nobody_asked_for_is_raised_by_the_next_send_weights() -> None:
    server, params = FakeServer(), Params()
    engine = jax_engine(server, params)
    server.fail["start_weight_update"] = (500, "worker 0 died")
    try:
        handle = engine.send_weights("v1", wait=False)
        while not handle.done():
            handle._future.exception(timeout=10)
        with pytest.raises(WeightSyncError, match="worker 0 died") as info:
            engine.send_weights("v2", wait=False)
        assert info.value is handle._future.exception()  # the round's own error
        assert "round 'v1' (overlapped round #1) failed in flight" in str(info.value.__notes__)
        assert server.bodies("start_weight_update") == [None]  # v2 sent nothing
        del server.fail["start_weight_update"]
        assert engine.send_weights("v2").version == "v2"  # raised once: the engine goes on
    finally:
        engine.shutdown()


def test_a_failure_while_the_next_call_waits_for_its_slot_is_raised_by_that_call() -> None:
    """#46 (4): with one slot, round v1 fails while ``send_weights("v2")`` waits for the slot
    it frees: that call raises v1's error (its note true) and v2 is never sent."""
    server, params = FakeServer(), Params()
    engine = jax_engine(server, params)  # max_rounds_in_flight=1
    entered, release = gate(server, "start_weight_update")
    server.fail["start_weight_update"] = (500, "worker 0 died")
    outcome: list[object] = []

    def second() -> None:
        try:
            outcome.append(engine.send_weights("v2", wait=False))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=second)
    try:
        first = engine.send_weights("v1", wait=False)
        assert entered.wait(10)  # v1 holds the only slot
        waiting = slot_waiter(engine)
        thread.start()
        assert waiting.wait(10)  # v2's call waits for the slot ...
        release.set()  # ... and v1 fails now
        thread.join(10)
        assert not thread.is_alive()
        (raised,) = outcome
        assert isinstance(raised, WeightSyncError), raised
        assert raised is first._future.exception()  # v1's own error, not a later round's
        assert "round 'v1' (overlapped round #1) failed in flight; no round after it was sent" in (
            raised.__notes__
        )
        assert server.bodies("start_weight_update") == [None]  # v2 never started
        assert "update_weights" not in server.routes()
        del server.fail["start_weight_update"]
        server.hooks.clear()
        assert engine.send_weights("v3").version == "v3"  # raised once: the engine goes on
    finally:
        release.set()
        thread.join(10)
        engine.shutdown()


def test_a_failure_after_the_slot_wait_queues_nothing() -> None:
    """#46 (4), the runner alone (a fake round): a round that fails between a caller's slot
    wait and its submit fails that submit, which releases the snapshot it was handed."""
    failing, release = threading.Event(), threading.Event()

    def run(source: Any, version: str, draft: bool, dense: bool, *commit_gate: Any) -> Any:
        if version == "r1":
            failing.set()
            assert release.wait(10)
            raise TransferError("r1 lost its receiver")
        raise AssertionError(f"{version} was run after r1 failed")

    runner = RoundRunner(run, lambda v: v or "?", limit=2, wait_s=10, abort_link=lambda: None)
    released: list[str] = []

    def snapshot(name: str) -> Snapshot:
        return Snapshot(DictSource({}, describe_tensor), release=lambda: released.append(name))

    try:
        first = runner.submit(snapshot("r1"), "r1", False)
        assert failing.wait(10)
        runner.wait_slot()  # a second slot is free: the caller goes on to take its snapshot ...
        release.set()  # ... while r1 fails
        while not first.done():
            first._future.exception(timeout=10)
        with pytest.raises(TransferError, match="r1 lost its receiver") as info:
            runner.submit(snapshot("r2"), "r2", False)
        assert "round 'r1' (overlapped round #1) failed in flight" in str(info.value.__notes__)
        assert released == ["r1", "r2"] and runner.in_flight() == 0
    finally:
        release.set()
        runner.close()


@pytest.mark.parametrize("fails", [False, True])
def test_a_round_reads_its_snapshot_inside_the_snapshot_context_on_the_round_thread(
    fails: bool,
) -> None:
    """#49: ``Snapshot.context`` (torch: the round's own CUDA streams) is entered on the
    round thread before ``ready`` and left after the round, before ``release``, whether the
    round committed or failed."""
    events: list[tuple[str, bool]] = []
    trainer = threading.current_thread()

    def on_round() -> bool:
        return threading.current_thread() is not trainer

    class Context:
        def __enter__(self) -> None:
            events.append(("enter", on_round()))

        def __exit__(self, *exc: object) -> None:
            events.append(("exit", on_round()))

    def run(source: Any, version: str, draft: bool, dense: bool, before_commit: Any) -> Any:
        events.append(("run", on_round()))
        if fails:
            raise TransferError("the receiver went away")
        before_commit()
        return SimpleNamespace(version=version)

    runner = RoundRunner(run, lambda v: v or "?", limit=1, wait_s=10, abort_link=lambda: None)
    snap = Snapshot(
        DictSource({}, describe_tensor),
        ready=lambda: events.append(("ready", on_round())),
        release=lambda: events.append(("release", on_round())),
        before_commit=lambda: events.append(("before_commit", on_round())),
        context=Context,
    )
    try:
        handle = runner.submit(snap, "c1", False)
        if fails:
            with pytest.raises(TransferError, match="the receiver went away"):
                handle.result()
        else:
            assert handle.result().version == "c1"
        steps = ["enter", "ready", "run", *([] if fails else ["before_commit"]), "exit"]
        assert events == [(e, True) for e in [*steps, "release"]]
    finally:
        runner.close()


def test_a_drain_that_runs_out_stops_the_round_before_its_commit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """#46 (11): ``shutdown(timeout=...)`` runs out while the round waits for its update
    reply: the round can no longer commit (no finish is ever sent, even once the reply
    comes), the servers are told to shut the session down, and the error says so."""
    monkeypatch.setattr(overlap, "_ABORT_WAIT_S", 0.2)  # the round stays stuck past the abort
    server, params = FakeServer(), Params()
    engine = jax_engine(server, params)
    entered, release = gate(server, "update_weights")
    try:
        handle = engine.send_weights("d1", wait=False)
        assert entered.wait(10)
        with pytest.raises(RoundWaitTimeout) as info:
            engine.shutdown(timeout=0.2)
        told = f"{info.value} {getattr(info.value, '__notes__', [])}"
        assert "round 'd1' (overlapped round #1) is still in flight after 0.2 s" in told, told
        assert "stopped before its commit (no finish sent)" in told, told
        assert "shut this trainer's weight-transfer session down" in told, told
        assert "shutdown_weight_transfer_engine" in server.routes()
        release.set()  # the update reply comes after shutdown returned
        with pytest.raises(RoundCancelled, match="before its commit: its finish was never sent"):
            handle.result(timeout=10)
        assert "finish_weight_update" not in server.routes()
        assert server.weight_version == "default"
    finally:
        release.set()


def test_a_drain_that_runs_out_after_the_finish_went_out_says_it_may_commit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A finish already sent cannot be withdrawn: the error says the servers may still commit
    the round, and they do."""
    monkeypatch.setattr(overlap, "_ABORT_WAIT_S", 0.2)
    server, params = FakeServer(), Params()
    engine = jax_engine(server, params)
    entered, release = gate(server, "finish_weight_update")
    try:
        handle = engine.send_weights("f1", wait=False)
        assert entered.wait(10)
        with pytest.raises(RoundWaitTimeout) as info:
            engine.shutdown(timeout=0.2)
        assert (
            "round 'f1' (overlapped round #1) had already sent its finish and had not returned: "
            "the servers may still commit it"
        ) in str(info.value)
        release.set()
        assert handle.result(timeout=10).version == "f1"
        assert server.weight_version == "f1"
    finally:
        release.set()


def test_result_timeout_leaves_the_round_running() -> None:
    server, params = FakeServer(), Params()
    engine = jax_engine(server, params)
    entered, release = gate(server, "update_weights")
    try:
        handle = engine.send_weights(wait=False)
        assert entered.wait(10)
        with pytest.raises(RoundWaitTimeout, match=r"round '1' .* still in flight after 0.05 s"):
            handle.result(timeout=0.05)
        release.set()
        assert handle.result().version == "1" and server.weight_version == "1"
    finally:
        release.set()
        engine.shutdown()


def test_a_blocking_call_first_waits_for_the_rounds_in_flight() -> None:
    server, params = FakeServer(), Params()
    engine = jax_engine(server, params, max_rounds_in_flight=2)
    try:
        first = engine.send_weights(wait=False)
        params.step()
        assert engine.send_weights().version == "2"
        assert first.done() and first.result().version == "1"
        assert round_routes(server) == ROUND * 2
    finally:
        engine.shutdown()


def test_shutdown_drain_lands_every_queued_round() -> None:
    server, params = FakeServer(), Params()
    engine = jax_engine(server, params, max_rounds_in_flight=3)
    handles = []
    for _ in range(3):
        handles.append(engine.send_weights(wait=False))
        params.step()
    engine.shutdown(in_flight="drain")
    assert [h.result(timeout=0).version for h in handles] == ["1", "2", "3"]
    assert server.weight_version == "3"
    assert "shutdown_weight_transfer_engine" in server.routes()


def test_shutdown_abort_stops_the_running_round_and_skips_the_queued() -> None:
    server, params = FakeServer(), Params()
    engine = jax_engine(server, params, max_rounds_in_flight=2)
    FAKE.comm.block = True  # the first broadcast never lands: only an abort ends it
    entered = threading.Event()
    server.hooks["update_weights"] = lambda body: entered.set()
    running = engine.send_weights("a1", wait=False)
    queued = engine.send_weights("a2", wait=False)
    assert entered.wait(10)  # a1 is on the wire
    engine.shutdown(in_flight="abort", timeout=10)
    assert running.done() and queued.done()  # shutdown returned after both ended
    with pytest.raises(RoundSkipped, match=r"round 'a2' .* never sent: shutdown"):
        queued.result(timeout=0)
    with pytest.raises(TransferError, match="abort"):  # aborted in or before the broadcast
        running.result(timeout=0)
    assert server.bodies("start_weight_update") == [None]  # a2 never started
    assert "finish_weight_update" not in server.routes()  # nothing committed
    assert server.weight_version == "default"


def test_shutdown_abort_stops_a_round_at_its_next_tensor() -> None:
    server, params = FakeServer(), Params()
    engine = jax_engine(server, params)
    entered, release = gate(server, "start_weight_update")
    running = engine.send_weights("c1", wait=False)
    assert entered.wait(10)  # the first tensor is prepared; the rest wait for start
    threading.Timer(0.2, release.set).start()
    engine.shutdown(in_flight="abort", timeout=10)
    with pytest.raises((RoundCancelled, TransferError)):
        running.result(timeout=0)
    assert "finish_weight_update" not in server.routes()
    assert server.weight_version == "default"


def test_other_ranks_iterate_on_their_own_thread_and_get_a_finished_handle() -> None:
    params = Params()
    source = PytreeSource(lambda: params.tree, Naming([Rule("{x}", "{x}")]))
    engine = JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend="fake_host", timeouts=FAST, rank=1),
        client=FakeServer().client(),
        source=source,
    )
    handle = engine.send_weights(wait=False)
    assert handle.done() and handle.result().sender is False
    engine.shutdown()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_rounds_in_flight", 0, r"max_rounds_in_flight must be an int in 1\.\.8, got 0"),
        ("max_rounds_in_flight", True, "max_rounds_in_flight must be an int"),
        ("snapshot", "deep", r"snapshot must be one of \('copy', 'none', 'cow'\), got 'deep'"),
    ],
)
def test_bad_overlap_settings_are_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainerInitInfo(backend="weightwire_tcp", **{field: value})  # type: ignore[arg-type]


def test_shutdown_refuses_an_unknown_in_flight_mode() -> None:
    server, params = FakeServer(), Params()
    engine = jax_engine(server, params)
    with pytest.raises(ConfigError, match="in_flight must be one of"):
        engine.shutdown(in_flight="later")
    engine.shutdown()


def test_a_donated_leaf_is_refused_before_anything_is_sent() -> None:
    server, params = FakeServer(), Params()
    engine = jax_engine(server, params)
    try:
        params.tree["a"].delete()  # what a step with donate_argnums does to its input
        with pytest.raises(ConfigError, match="deleted .*donated"):
            engine.send_weights(wait=False)
        assert "start_weight_update" not in server.routes()
    finally:
        engine.shutdown()


def test_leaving_the_context_on_an_error_abandons_the_rounds_in_flight() -> None:
    server, params = FakeServer(), Params()
    engine = jax_engine(server, params)
    FAKE.comm.block = True  # the round would otherwise wait out its transfer timeout
    entered = threading.Event()
    server.hooks["update_weights"] = lambda body: entered.set()
    with pytest.raises(KeyError), engine:
        handle = engine.send_weights(wait=False)
        assert entered.wait(10)
        raise KeyError("the training step failed")
    assert handle.done()  # abandoned (aborted), not drained over its 5 s transfer timeout
    with pytest.raises(TransferError, match="abort"):
        handle.result(timeout=0)
    assert server.weight_version == "default"


def test_snapshot_none_is_refused_with_several_trainer_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = FakeServer()
    engine = TorchTrainerEngine.trainer_init(
        TrainerInitInfo(backend="fake_host", timeouts=FAST, snapshot="none"),
        client=server.client(),
        source=DictSource({"w": torch.zeros(2)}, describe_tensor),
    )
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    try:
        with pytest.raises(ConfigError, match='snapshot="none" reads the source on the round'):
            engine.send_weights(wait=False)
        assert "start_weight_update" not in server.routes()
    finally:
        engine.shutdown()


def test_jax_numpy_leaves_are_copied_into_the_snapshot() -> None:
    leaf = np.arange(4.0, dtype=np.float32)
    source = PytreeSource({"a": leaf}, Naming([Rule("{x}", "{x}")]))
    frozen = source.frozen()
    leaf += 10  # numpy arrays are mutable: the snapshot must not see this
    ((name, array),) = list(frozen)
    assert name == "a" and np.asarray(array).tolist() == [0.0, 1.0, 2.0, 3.0]
