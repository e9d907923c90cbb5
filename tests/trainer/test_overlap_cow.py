"""``snapshot="cow"`` (``torch_side.sender.cow``): an overlapped torch round reads the live
parameters; a torch optimizer's step copies what the round has not read yet first (or waits
while the round may still read what it was handed); any other in-place write fails the round
with ``SnapshotChanged`` naming the tensor. The round sends the weights of ``send_weights``
time or nothing, never a mix; its memory is the copies the steps forced (its own accounting)."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.trainer.fakes import FAKE, DictSource, FakeServer
from tests.trainer.overlap_helpers import fresh_comm, gate, round_routes, torch_engine  # noqa: F401
from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.sender.cow import CowSnapshots
from weightwire.torch_side.sender.source import ModuleSource, describe_tensor
from weightwire.trainer.snapshot import SnapshotChanged


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))


def step(opt: torch.optim.Optimizer, m: torch.nn.Module) -> None:
    """One optimizer step that changes every parameter."""
    opt.zero_grad()
    m(torch.ones(2, 16)).square().sum().backward()
    opt.step()


def bytes_of(tensors: object) -> list[bytes]:
    return [t.detach().contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]  # type: ignore[attr-defined]


def read_all(snap: object) -> list[bytes]:
    return bytes_of(t for _, t in snap.source)  # type: ignore[attr-defined]


def total_bytes(m: torch.nn.Module) -> int:
    return sum(p.nbytes for p in m.parameters())


def test_a_step_before_the_round_reads_copies_first_and_the_round_sends_the_old_bytes() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    cows = CowSnapshots(wait_s=10)
    before = bytes_of(m.parameters())
    snap = cows.take(ModuleSource(m))
    assert cows.stats.held == 0  # nothing copied up front
    step(opt, m)  # the hook copies every tensor the round has not read
    assert bytes_of(m.parameters()) != before
    assert cows.stats.held == cows.stats.peak == total_bytes(m)
    snap.ready()
    assert read_all(snap) == before
    snap.before_commit()
    snap.release()
    assert cows.stats.held == 0 and cows.stats.peak == total_bytes(m)
    assert cows._hook is None  # no round in flight: optimizers run without the hook


def test_a_round_that_read_everything_before_the_step_costs_no_copy() -> None:
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    cows = CowSnapshots(wait_s=10)
    before = bytes_of(m.parameters())
    snap = cows.take(ModuleSource(m))
    assert read_all(snap) == before
    snap.before_commit()
    snap.release()
    step(opt, m)
    assert cows.stats.copied == cows.stats.peak == 0


def test_a_step_while_the_round_reads_copies_the_rest_and_waits_for_the_handed_tensor() -> None:
    """The round was handed the first tensor (it may still read it): the step copies the
    others, then waits until the round's data plane is done before writing anything."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    cows = CowSnapshots(wait_s=10)
    before = bytes_of(m.parameters())
    snap = cows.take(ModuleSource(m))
    pairs = iter(snap.source)
    _, first = next(pairs)  # handed, live
    stepped = threading.Event()

    def trainer() -> None:
        step(opt, m)
        stepped.set()

    t = threading.Thread(target=trainer)
    t.start()
    assert not stepped.wait(0.3)  # the step waits for the round
    assert bytes_of([first]) == before[:1]  # and wrote nothing yet
    rest = bytes_of(t for _, t in pairs)
    assert [bytes_of([first])[0], *rest] == before
    first_bytes = next(iter(m.parameters())).nbytes
    assert cows.stats.peak == total_bytes(m) - first_bytes  # the handed one was not copied
    snap.before_commit()  # the round's data plane read everything: the step may go on
    assert stepped.wait(10)
    t.join(10)
    assert bytes_of(m.parameters()) != before
    snap.release()


def test_an_unwatched_write_before_the_round_reads_raises_naming_the_tensor() -> None:
    m = model()
    cows = CowSnapshots(wait_s=10)
    snap = cows.take(ModuleSource(m))
    with torch.no_grad():
        m[1].bias.add_(1.0)  # not an optimizer step, no before_update()
    with pytest.raises(SnapshotChanged, match="'1.bias' was written in place after send_weights"):
        read_all(snap)
    snap.release()


def test_an_unwatched_write_after_the_round_read_fails_it_before_its_commit() -> None:
    m = model()
    cows = CowSnapshots(wait_s=10)
    snap = cows.take(ModuleSource(m))
    read_all(snap)  # handed out live, perhaps still being read
    with torch.no_grad():
        m[0].weight.mul_(2.0)
    with pytest.raises(SnapshotChanged, match="'0.weight' was written in place"):
        snap.before_commit()
    snap.release()


def test_engine_cow_round_overlapped_with_an_optimizer_step_sends_the_pre_step_bytes() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    server = FakeServer()
    engine = torch_engine(server, ModuleSource(m), snapshot="cow")
    try:
        entered, release = gate(server, "start_weight_update")
        before = bytes_of(m.parameters())
        handle = engine.send_weights(wait=False)
        assert entered.wait(10)
        # the round may or may not have been handed tensors yet: the step either copies them
        # or waits for the round (released meanwhile), and the round sends the old bytes
        threading.Timer(0.2, release.set).start()
        step(opt, m)
        handle.result()
        assert FAKE.comm.broadcasts == before
        assert bytes_of(m.parameters()) != before
        assert engine.snapshot_bytes == 0  # the copies went with the round
        assert round_routes(server)[-1] == "finish_weight_update"
    finally:
        release.set()
        engine.shutdown()


def test_engine_cow_round_with_an_unwatched_write_is_not_committed() -> None:
    m = model()
    server = FakeServer()
    engine = torch_engine(server, ModuleSource(m), snapshot="cow")
    try:
        entered, release = gate(server, "start_weight_update")
        handle = engine.send_weights(wait=False)
        assert entered.wait(10)
        with torch.no_grad():
            m[0].bias.zero_()
        release.set()
        with pytest.raises(SnapshotChanged, match="'0.bias' was written in place"):
            handle.result()
        assert "finish_weight_update" not in round_routes(server)
    finally:
        release.set()
        engine.shutdown()  # the failure was seen by result(): not raised again


def test_before_update_copies_for_a_write_outside_an_optimizer() -> None:
    weights = {"w": torch.arange(8, dtype=torch.float32), "b": torch.ones(3)}
    server = FakeServer()
    engine = torch_engine(server, DictSource(weights, describe_tensor), snapshot="cow")
    try:
        entered, release = gate(server, "start_weight_update")
        before = bytes_of(weights.values())
        handle = engine.send_weights(wait=False)
        assert entered.wait(10)
        threading.Timer(0.2, release.set).start()
        engine.before_update()
        for t in weights.values():
            t.add_(5)
        handle.result()
        assert FAKE.comm.broadcasts == before
    finally:
        release.set()
        engine.shutdown()


@pytest.mark.gpu
def test_engine_cow_round_on_the_gpu_sends_the_pre_step_bytes() -> None:
    """On a GPU the copies a step forces are queued on the trainer's stream ahead of the
    step's kernels, and the round's stream waits for them."""
    m = model().cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, foreach=True)
    server = FakeServer()
    engine = torch_engine(server, ModuleSource(m), snapshot="cow")
    try:
        entered, release = gate(server, "start_weight_update")
        before = [p.detach().cpu().view(torch.uint8).numpy().tobytes() for p in m.parameters()]
        handle = engine.send_weights(wait=False)
        assert entered.wait(10)
        threading.Timer(0.2, release.set).start()
        opt.zero_grad()
        m(torch.ones(2, 16, device="cuda")).square().sum().backward()
        opt.step()
        handle.result()
        assert FAKE.comm.broadcasts == before
    finally:
        release.set()
        engine.shutdown()


class CountedSource(DictSource):
    """A ``DictSource`` that counts its ``metadata()`` calls (a module's walks)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors, describe_tensor)
        self.declared = 0

    def metadata(self) -> list[ParamMeta]:
        self.declared += 1
        return super().metadata()


@pytest.mark.parametrize("snapshot", ["cow", "copy"])
def test_send_weights_without_waiting_reads_the_metadata_once(snapshot: str) -> None:
    """#49: the trainer's thread declares the source once per overlapped round (the served
    model's check and the snapshot share it); the round thread reads the snapshot's."""
    weights = {"w": torch.arange(8, dtype=torch.float32), "b": torch.ones(3)}
    source = CountedSource(weights)
    server = FakeServer()
    engine = torch_engine(server, source, snapshot=snapshot)
    try:
        source.declared = 0
        handle = engine.send_weights(wait=False)
        assert source.declared == 1
        handle.result()
        assert source.declared == 1
        assert FAKE.comm.broadcasts == bytes_of(weights.values())
    finally:
        engine.shutdown()
