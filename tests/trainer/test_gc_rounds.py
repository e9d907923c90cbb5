"""Steady-state rounds feed Python's garbage collector nothing (issue #49): a round's objects
are freed by reference counting when it ends, on both sides, so no round leaves a reference
cycle (which only a collection frees: the full one walks every object of a process that
imported torch and JAX, ~100 ms) and none adds to the long-lived heap.

A torch or JAX trainer (``delta="auto"``) sends dense rounds, then delta rounds alternating
two weight sets one step apart, to vLLM's plugin engine class over ``weightwire_tcp`` (the
stub worker, its own process: ``tests/torch_side/vllm_stub.py``, whose ``gc`` op probes its
collector). After warm-up rounds the collector is off in both processes and after every
round a collection must find nothing; the tracked objects must stay where they were.
``benchmarks/bench_gc_rounds.py`` measures the same per round, and the collections per 100.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.torch_side._procs import spawn_stub
from tests.torch_side.fake_llama import trainer_tensors
from weightwire.testing.loopback import LoopbackClient
from weightwire.testing.sources import DictSource
from weightwire.trainer import TrainerInitInfo

pytestmark = pytest.mark.timeout(300)

SHAPE = "tiny"
WARMUP = 4
"""Rounds before the check: the first is dense; the worker keeps the plans of the two last
delta rounds' metadata, so two delta rounds of each weight set pass before it is steady."""
ROUNDS = 4
DRIFT = 0
"""Tracked objects steady rounds may add: none (each side's count is exact, taken after a
collection while the stub's request threads wait; fewer is fine: a cache of the warm-up's
may drop an entry)."""


@pytest.fixture(scope="module")
def worker() -> Iterator[LoopbackClient]:
    proc, client = spawn_stub("weightwire_tcp", "cpu", SHAPE, timeout=120)
    yield client
    try:
        client.exit()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


def weight_sets() -> list[dict[str, torch.Tensor]]:
    """``w0`` and ``w1``: every 37th element of each tensor doubled (an exact bf16 change)."""
    w0 = dict(trainer_tensors(SHAPE, torch.device("cpu"), seed=0))
    w1 = {}
    for name, t in w0.items():
        t = t.clone()
        t.view(-1)[::37] *= 2
        w1[name] = t
    return [w0, w1]


def engine_for(kind: str) -> tuple[Any, Callable[[torch.Tensor], Any], Callable[[Any], Any]]:
    """The trainer engine class, how it holds a set's tensor, and its ``describe``."""
    if kind == "jax":
        import jax.numpy as jnp
        import ml_dtypes

        from weightwire.jax_side.dtypes import describe
        from weightwire.jax_side.engine import JAXTrainerEngine

        def to_jax(t: torch.Tensor) -> Any:
            return jnp.asarray(t.view(torch.int16).numpy().view(ml_dtypes.bfloat16))

        return JAXTrainerEngine, to_jax, describe
    from weightwire.torch_side.sender.engine import TorchTrainerEngine

    def describe_torch(t: Any) -> tuple[str, tuple[int, ...]]:
        return TorchTrainerEngine.describe(None, t)  # type: ignore[arg-type]

    return TorchTrainerEngine, lambda t: t, describe_torch


def steady_rounds(send: Callable[[int], None], worker: LoopbackClient) -> dict[str, list[int]]:
    """``WARMUP`` rounds, then ``ROUNDS`` with the collector off on both sides: per round,
    the objects a collection found only cycles holding, and the tracked objects after it."""
    for i in range(WARMUP):
        send(i)
    out: dict[str, list[int]] = {k: [] for k in ("cycles", "objects", "w.cycles", "w.objects")}
    gc.disable()
    try:
        gc.collect()
        worker.call("gc", {"enabled": False})
        for i in range(WARMUP, WARMUP + ROUNDS):
            send(i)
            out["cycles"].append(gc.collect())
            out["objects"].append(len(gc.get_objects()))
            probe = worker.call("gc", {})
            out["w.cycles"].append(probe["unreachable"])
            out["w.objects"].append(probe["objects"])
    finally:
        gc.enable()
        worker.call("gc", {"enabled": True})
    return out


@pytest.mark.parametrize("kind", ["torch", "jax"])
def test_steady_rounds_leave_no_cycles_and_no_survivors(kind: str, worker: LoopbackClient) -> None:
    cls, hold, describe = engine_for(kind)
    sets = [{n: hold(t) for n, t in w.items()} for w in weight_sets()]
    source = DictSource(dict(sets[0]), describe)
    trainer = cls.trainer_init(
        TrainerInitInfo(backend="weightwire_tcp", delta="auto"), client=worker, source=source
    )
    try:
        for round_kind in ("dense", "delta"):
            cycle = [0] if round_kind == "dense" else [1, 0]

            def send(i: int, cycle: list[int] = cycle, dense: bool = round_kind == "dense") -> None:
                source.tensors.update(sets[cycle[i % len(cycle)]])
                metrics = trainer.send_weights(dense=dense)
                # the delta rounds must be delta rounds (patches), not dense resends
                assert (metrics.density is None) == dense or i == 0, metrics.summary()

            got = steady_rounds(send, worker)
            what = f"{kind} {round_kind} rounds: {got}"
            assert got["cycles"] == [0] * ROUNDS, f"the trainer's rounds left cycles, {what}"
            assert got["w.cycles"] == [0] * ROUNDS, f"the worker's rounds left cycles, {what}"
            for side in ("objects", "w.objects"):
                growth = max(got[side]) - got[side][0]
                assert growth <= DRIFT, f"{side}: the tracked objects grew by {growth}, {what}"
    finally:
        trainer.shutdown()


def test_a_broadcast_sessions_delta_rounds_add_nothing_to_the_wants_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each delta round asks ``Slicing.slices`` of a new list (its changed tensors, varying
    round to round): once every worker wants the model's tensors whole, the answer comes
    without parsing the hellos again nor caching their wants per round (a long-lived cache
    that grew each round fed full collections); a tensor some worker slices still slices."""
    import json

    from weightwire.shared.meta import ParamMeta
    from weightwire.shared.slices import Box, Wants
    from weightwire.trainer import sliced

    model = [ParamMeta(f"w{i}", "bfloat16", (4, 2)) for i in range(6)]
    shapes = {m.name: m.shape for m in model}
    whole = json.dumps(Wants.whole(shapes, "TP=1").to_json()).encode()
    parsed: list[int] = []
    parse = sliced.parse_wants
    monkeypatch.setattr(
        sliced,
        "parse_wants",
        lambda *a: parsed.append(1) or parse(*a),  # type: ignore[func-returns-value]
    )
    slicing = sliced.Slicing([whole, whole], sender=None)  # type: ignore[arg-type]
    assert slicing.slices(model) is False
    first = len(parsed)
    for k in range(1, 6):  # a round's changed tensors, a new list (and set) each round
        assert slicing.slices([ParamMeta(m.name, m.dtype, m.shape) for m in model[:k]]) is False
    assert len(parsed) == first and len(slicing._wants) == 1

    halves = Wants({**Wants.whole(shapes, "-").regions, "w5": (Box.of((0, 2), (0, 2)),)})
    slicing = sliced.Slicing([whole, json.dumps(halves.to_json()).encode()], sender=None)  # type: ignore[arg-type]
    assert slicing.slices(model[:5]) is False  # every worker wants these whole
    assert slicing.slices(model[3:]) is True  # w5: worker 1 wants half of it
