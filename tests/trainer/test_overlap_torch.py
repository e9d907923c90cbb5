"""Overlapped rounds of the torch trainer: its snapshot is a copy into reused buffers, so an
optimizer's in-place step after ``send_weights(wait=False)`` does not reach the round
(``snapshot="none"`` reads the live parameters instead); on a GPU the copy is ordered on the
trainer's stream after the step that wrote the weights."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from tests.trainer.fakes import FAKE, DictSource, FakeServer
from tests.trainer.overlap_helpers import fresh_comm, gate, torch_engine  # noqa: F401
from weightwire.torch_side.sender.source import describe_tensor


def test_torch_copy_snapshot_is_isolated_from_in_place_steps_and_reused() -> None:
    weights = {"w": torch.arange(8, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}
    server = FakeServer()
    engine = torch_engine(server, DictSource(weights, describe_tensor))
    try:
        entered, release = gate(server, "start_weight_update")
        sent = [t.view(torch.uint8).numpy().tobytes() for t in weights.values()]
        handle = engine.send_weights(wait=False)
        for t in weights.values():
            t.add_(5)  # an optimizer step writes the parameters in place
        assert entered.wait(10)
        release.set()
        handle.result()
        assert FAKE.comm.broadcasts == sent
        assert engine._copies is not None
        (buffers,) = engine._copies._free
        kept = {n: b.data_ptr() for n, b in buffers.items()}
        server.hooks.clear()
        engine.send_weights(wait=False).result()
        assert FAKE.comm.broadcasts[2:] == [
            t.view(torch.uint8).numpy().tobytes() for t in weights.values()
        ]
        (again,) = engine._copies._free
        assert {n: b.data_ptr() for n, b in again.items()} == kept  # the same buffers reused
    finally:
        release.set()
        engine.shutdown()


def test_torch_snapshot_none_reads_the_live_parameters() -> None:
    weights = {"w": torch.arange(4, dtype=torch.float32)}
    server = FakeServer()
    engine = torch_engine(server, DictSource(weights, describe_tensor), snapshot="none")
    try:
        engine.send_weights(wait=False).result()
        assert FAKE.comm.broadcasts == [weights["w"].numpy().tobytes()]
        assert engine._copies is None  # nothing copied
    finally:
        engine.shutdown()


@pytest.mark.gpu
def test_torch_copy_snapshot_on_the_gpu_is_ordered_after_the_step_and_before_the_next() -> None:
    """The copy is queued on the trainer's stream after the step that wrote the weights, the
    round waits for it on its own thread, and the next in-place step does not reach it."""
    weights = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(7, device="cuda")}
    server = FakeServer()
    engine = torch_engine(server, DictSource(weights, describe_tensor))
    try:
        entered, release = gate(server, "start_weight_update")
        for t in weights.values():
            t.mul_(3.0)  # the step that produced the round's weights
        sent = [t.cpu().numpy().tobytes() for t in weights.values()]
        handle = engine.send_weights(wait=False)
        for t in weights.values():
            t.add_(1.0)  # the next step, queued on the same stream right behind the copy
        assert entered.wait(10)
        release.set()
        handle.result()
        assert FAKE.comm.broadcasts == sent
    finally:
        release.set()
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("snapshot", ["copy", "cow", "none"])
def test_an_overlapped_round_on_the_gpu_does_not_wait_for_the_next_step(snapshot: str) -> None:
    """#49: the round reads on its own stream, ordered after the snapshot only: it ends while
    the trainer's stream still runs the next step (on the default stream it waited for the
    whole step), and sends the snapshot's bytes."""
    weights = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(7, device="cuda")}
    server = FakeServer()
    engine = torch_engine(server, DictSource(weights, describe_tensor), snapshot=snapshot)
    try:
        _, release = gate(server, "start_weight_update")  # most reads come after the start
        sent = [t.cpu().numpy().tobytes() for t in weights.values()]
        handle = engine.send_weights(wait=False)
        threading.Timer(0.2, release.set).start()  # the step below is queued by then
        if snapshot != "none":  # "none": the caller does not write until the round is done
            engine.before_update()  # cow: copies what the round was not handed; copy: no-op
            for t in weights.values():
                t.add_(1.0)
        torch.cuda._sleep(3_000_000_000)  # the rest of the step: ~1-2 s on the trainer's stream
        handle.result(timeout=30)
        assert not torch.cuda.current_stream().query()  # the step still runs
        assert FAKE.comm.broadcasts == sent
    finally:
        release.set()
        torch.cuda.synchronize()
        engine.shutdown()


@pytest.mark.parametrize("group_bytes", [1, 40, 1 << 30])
def test_the_copy_snapshot_copies_by_groups_into_fitting_buffers(
    monkeypatch: pytest.MonkeyPatch, group_bytes: int
) -> None:
    """#49: ``snapshot="copy"`` copies a group of tensors per foreach call (bounded in bytes,
    so a source that yields new tensors is not held whole); every tensor's bytes are those of
    the call, a buffer is reused while it fits and replaced when the tensor changed shape or
    dtype."""
    from weightwire.torch_side.sender import snapshot as snapshots

    monkeypatch.setattr(snapshots, "GROUP_BYTES", group_bytes)
    weights = {
        "a": torch.arange(6, dtype=torch.float32),
        "b": torch.ones(2, 3, dtype=torch.bfloat16),
        "c": torch.arange(5, dtype=torch.int64),
    }
    pool = snapshots.CopySnapshots(snapshots.RoundStreams(wait_s=5))

    def taken() -> tuple[list[bytes], dict[str, int], Any]:
        snap = pool.take(DictSource(weights, describe_tensor))
        got = [t.view(torch.uint8).numpy().tobytes() for _, t in snap.source]
        ptrs = {n: t.data_ptr() for n, t in snap.source}
        return got, ptrs, snap

    sent = [t.view(torch.uint8).numpy().tobytes() for t in weights.values()]
    got, first, snap = taken()
    for t in weights.values():
        t.add_(1)  # the step after the call
    assert got == sent
    assert [t.view(torch.uint8).numpy().tobytes() for _, t in snap.source] == sent
    snap.release()
    weights["b"] = torch.zeros(3, 2, dtype=torch.bfloat16)  # another shape: a new buffer
    weights["c"] = weights["c"].to(torch.int32)  # another dtype: a new buffer
    sent = [t.view(torch.uint8).numpy().tobytes() for t in weights.values()]
    got, again, snap = taken()
    assert got == sent
    assert again["a"] == first["a"] and again["b"] != first["b"] and again["c"] != first["c"]
    snap.release()
