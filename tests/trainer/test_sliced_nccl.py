"""Sliced rounds over ``weightwire_nccl`` on CPU: the trainer engine and ``SlicedTP`` workers
(TP 2, one KV head, tied head) in one process, joined in an in-process NCCL world whose
point-to-point sends and receives really move the bytes (``tests.backends.fake_nccl_p2p``).
The hellos go on the communicator, each worker gets its table and its chunks only; after
each round every worker's parameters equal ``load_weights`` of the full tensors bit for bit,
each worker received about 1/TP of the model plus the replicated tensors, and rank 0 sent
about one model's bytes (plus the tables), not one per worker."""

from __future__ import annotations

from typing import Any

import pytest

from tests.backends.fake_nccl_p2p import in_process_nccl
from tests.trainer._sliced_session import (
    NCCL_TIMEOUTS,
    TP2,
    as_source,
    assert_kept,
    assert_loaded,
    assert_shares,
    assert_trainer_script_rounds,
    committed_round,
    fails_keeping,
    full_tensors,
    opened,
    put,
    run_script,
)
from tests.trainer._sliced_workers import TPClient
from weightwire.shared.errors import WeightwireError
from weightwire.shared.timeouts import Timeouts
from weightwire.torch_side.worker.engines import WeightwireNCCLEngine


@pytest.mark.parametrize("kind", ["torch", "jax"])
def test_sliced_rounds_over_nccl_send_each_worker_its_slices(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    with in_process_nccl(monkeypatch, 3) as world:
        client = TPClient(TP2, engine=WeightwireNCCLEngine)
        tensors: dict[str, Any] = {}
        with opened(client, tensors, kind, "nccl") as engine:
            assert client.init_info["sliced"] is True
            dense = sum(a.nbytes for a in full_tensors(TP2, 0).values())
            for step in (1, 2, 3):
                full = full_tensors(TP2, step)
                put(tensors, full, kind)
                before = world.sent_bytes[0]
                metrics = engine.send_weights()
                assert client.last_update["sliced"] is True
                assert_loaded(client, full)
                assert_shares(client.received, TP2, dense)
                assert sum(client.received) == metrics.nbytes <= 1.3 * dense
                # on the wire: the pieces, their padding and the two tables, nothing else
                wire = world.sent_bytes[0] - before
                assert metrics.nbytes <= wire <= metrics.nbytes + 8 << 10
            assert engine.session.slicing.plans.builds == 1
            # every worker's own sends: its hello only (the join), nothing in the rounds
            assert all(world.sent_bytes[r] < 64 << 10 for r in (1, 2))
            # rank 0's chunk buffers: depth x workers, each at most the buffer size
            sender = engine.session.slicing.sender
            assert 0 < sender.held_bytes() <= 2 * 2 * (1 << 10)
        assert sender.held_bytes() == 0  # freed with the session


def test_sliced_off_over_nccl_broadcasts_every_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sliced="off"``: no wants asked, no hello on the communicator, every worker gets
    every byte by broadcast (the same in-process world)."""
    with in_process_nccl(monkeypatch, 3) as world:
        client = TPClient(TP2, engine=WeightwireNCCLEngine)
        full = full_tensors(TP2, 1)
        tensors = as_source("torch", full)
        with opened(client, tensors, "torch", "nccl", sliced="off") as engine:
            assert "sliced" not in client.init_info
            metrics = engine.send_weights()
            assert "sliced" not in client.last_update
            dense = sum(a.nbytes for a in full.values())
            assert metrics.nbytes >= dense and client.received == [metrics.nbytes] * 2
            assert world.sent_bytes[1:] == [0, 0]  # no hellos
            assert_loaded(client, full)


def test_a_sliced_nccl_round_that_loses_the_trainer_applies_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer fails between two waves (its source raises after some chunks left):
    every worker's receive fails within its timeout (2 s here) and keeps round 1's weights
    exactly."""
    with in_process_nccl(monkeypatch, 3):
        client = TPClient(TP2, engine=WeightwireNCCLEngine)
        tensors: dict[str, Any] = {}
        quick = Timeouts(http_s=60, connect_s=30, warmup_s=30, transfer_s=2)
        with opened(client, tensors, "torch", "nccl", timeouts=quick) as engine:
            _, before = committed_round(engine, client, tensors)
            cut, reads = engine.cut_box, [0]

            def failing(tensor: Any, box: Any) -> Any:
                reads[0] += 1
                if reads[0] == 12:
                    raise RuntimeError("the trainer lost a shard")
                return cut(tensor, box)

            engine.cut_box = failing
            put(tensors, full_tensors(TP2, 2))
            fails_keeping(engine, client, before, error=(RuntimeError, WeightwireError))


def test_verify_over_nccl_keeps_the_broadcast_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``verify=True``: the slices' digests are of host bytes, which the NCCL sender (pieces
    cut and packed on the device) never has; its rounds go as verified broadcasts."""
    with in_process_nccl(monkeypatch, 3):
        client = TPClient(TP2, engine=WeightwireNCCLEngine)
        tensors: dict[str, Any] = {}
        with opened(client, tensors, "torch", "nccl", verify=True) as engine:
            with caplog.at_level("INFO", logger="weightwire.trainer.sliced"):
                for step in (1, 2):
                    full = full_tensors(TP2, step)
                    put(tensors, full)
                    report = engine.send_weights().verify
                    assert "sliced" not in client.last_update and report is not None
            said = [r for r in caplog.records if "verify=True on an on-device backend" in r.message]
            assert len(said) == 1
            assert_loaded(client, full)


def test_jax_rounds_from_an_fsdp_tp_mesh_over_nccl_never_gather_nor_touch_the_host() -> None:
    """A JAX trainer on 8 forced host devices (FSDP 4 x TP 2), in a subprocess (XLA_FLAGS
    precede jax's import), over the in-process NCCL: 3 sliced rounds from a ``PytreeSource``
    (a jitted transpose on the shards), every worker bit-identical to ``load_weights`` of the
    full tensors (checked there), every gather entry point raising throughout, each piece
    cut on its one shard's device and no host copy at all, each worker its share."""
    report = run_script("_sliced_jax_trainer.py", "2", "4", "1", "1", "pytree", "nccl")
    assert report["copies"] == 0
    assert_trainer_script_rounds(report, TP2)


def test_a_worker_that_fails_mid_round_fails_it_everywhere_nothing_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Worker 1's receive fails after a few pieces: its update fails, so rank 0 stops the
    round and aborts the communicator (its sends to worker 1 do not wait out the timeout);
    the trainer raises and both workers keep round 1's weights exactly."""
    import time

    from weightwire.shared.errors import TransferError

    with in_process_nccl(monkeypatch, 3):
        client = TPClient(TP2, engine=WeightwireNCCLEngine)
        tensors: dict[str, Any] = {}
        with opened(client, tensors, "torch", "nccl") as engine:
            _, before = committed_round(engine, client, tensors)
            link = client.engines[1]._core._link
            real = link.receive_sliced

            def failing(metas: Any, progress: Any) -> Any:
                for i, item in enumerate(real(metas, progress)):
                    if i == 3:
                        raise TransferError("worker 1 lost its receive buffer")
                    yield item

            link.receive_sliced = failing
            put(tensors, full_tensors(TP2, 2))
            started = time.monotonic()
            with pytest.raises(WeightwireError, match="worker 1 lost its receive buffer"):
                engine.send_weights()
            assert time.monotonic() - started < NCCL_TIMEOUTS.transfer_s
            assert_kept(client, before)


def test_a_source_failing_on_its_first_piece_sends_nothing_and_the_next_round_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first piece is read before the control plane: a source that fails there lets no
    start, no update and no byte out, and the session stays usable."""
    with in_process_nccl(monkeypatch, 3) as world:
        client = TPClient(TP2, engine=WeightwireNCCLEngine)
        tensors: dict[str, Any] = dict(as_source("torch", full_tensors(TP2, 1)))
        with opened(client, tensors, "torch", "nccl") as engine:
            cut = engine.cut_box

            def broken(tensor: Any, box: Any) -> Any:
                raise RuntimeError("the source's first shard is gone")

            engine.cut_box = broken
            sent = world.sent_bytes[0]
            with pytest.raises(RuntimeError, match="first shard is gone"):
                engine.send_weights()
            assert client.updates == 0 and world.sent_bytes[0] == sent
            engine.cut_box = cut
            engine.send_weights()
            assert_loaded(client, full_tensors(TP2, 1))
