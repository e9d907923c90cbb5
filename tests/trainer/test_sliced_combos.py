"""Sliced rounds in combination (issue #48): a trainer engine and in-process TCP workers
hosting ``SlicedTP`` ranks (TP 2, one KV head on both, tied head), each round sliced, in
combination with sleep / wake and weight resets between rounds, overlapped rounds, the
stage budget (pause and round guard), a failure in every phase, adapters, and wants that do
not fit the trainer's tensors. After each committed round every worker's parameters equal
``load_weights`` of the full tensors bit for bit; after each failed one, the previous
round's exactly; the round after a failure succeeds."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from tests.trainer._sliced_workers import TPClient, spec_of
from tests.trainer.test_sliced_tcp import TP2, assert_loaded, full_tensors, torch_engine
from weightwire.shared.errors import WeightwireError
from weightwire.tools.server.sleep import ModelSleeper
from weightwire.torch_side.worker.spec import ModelSpec, TensorSpec
from weightwire.vllm_guard.worker import worker_round_state


def load(tensors: dict[str, Any], step: int) -> dict[str, np.ndarray]:
    """The round ``step``'s full tensors, put in the trainer's source (``tensors``)."""
    full = full_tensors(TP2, step)
    tensors.clear()
    tensors.update({n: torch.from_numpy(a) for n, a in full.items()})
    return full


def params(client: TPClient) -> list[dict[str, torch.Tensor]]:
    return [client.params(r) for r in range(client.config[0])]


def assert_kept(client: TPClient, before: list[dict[str, torch.Tensor]]) -> None:
    """Every worker holds exactly ``before`` (the last committed round's weights)."""
    for rank, was in enumerate(before):
        now = client.params(rank)
        for name, tensor in was.items():
            assert torch.equal(now[name], tensor), f"rank {rank} {name} changed"


def state(client: TPClient) -> list[dict[str, Any]]:
    """What the round guard asks each worker (``vllm_guard.worker``): are its weights whole."""
    return [
        worker_round_state(type("Worker", (), {"weight_transfer_engine": e})())
        for e in client.engines
    ]


# ------------------------------------------------------------------ 1. sleep, wake, reset


def sleep_and_wake(client: TPClient, level: int) -> None:
    """The reference server's sleep (``ModelSleeper``) on every worker's model, and what its
    worker tells the engine at level 2 (the weights are gone), then a wake: level 1 keeps
    the weights, level 2 wakes them zeroed in fresh storage."""
    for model, engine in zip(client.models, client.engines, strict=True):
        sleeper = ModelSleeper(model, torch.device("cpu"))
        if level == 2:
            engine.weights_changed("sleep level 2 discards the weights")
        sleeper.sleep(level)
        assert sleeper.wake(None)


def reset(client: TPClient, value: float = 0.0) -> None:
    """A reset of the weights outside a round (``/weight_checker`` reset: zeroed in place;
    NaN: what a level-2 wake that does not zero leaves, vLLM's memory as it comes)."""
    for model, engine in zip(client.models, client.engines, strict=True):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)
        engine.weights_changed("reset the weights")


@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["staged", "in-place"])
@pytest.mark.parametrize("mapped", [True, False], ids=["landing-map", "load_weights"])
def test_sleep_wake_and_reset_between_sliced_rounds(budget: int, mapped: bool) -> None:
    """Level 1, level 2 + wake (zeroed, reallocated), a reset in place, and a level 2 whose
    wake leaves garbage (NaN: every element, the padding's constant fill too, must be
    written again) between rounds: each next round is sliced and lands whole, whether through the landing map (re-recorded
    for the reallocated parameters) or, for a worker without one, through ``load_weights``."""
    client = TPClient(TP2)
    if not mapped:  # worker 1 processes its weights after loading: no map to write through
        client.models[1].qkv_proj.quant_method = object()
    tensors: dict[str, Any] = {}
    engine = torch_engine(client, tensors, stage_budget_bytes=budget)
    try:
        load(tensors, 1)
        engine.send_weights()
        maps = client.engines[1]._core.caches.loader_maps.values()
        assert [m.map is not None for m in maps] == [mapped]
        between = [
            lambda: sleep_and_wake(client, 1),
            lambda: sleep_and_wake(client, 2),
            lambda: reset(client),
            lambda: (sleep_and_wake(client, 2), reset(client, float("nan"))),
        ]
        for step, change in enumerate(between, start=2):
            change()
            if step == 3:  # level 2 woke the weights zeroed, in new storage
                assert all(not p.any() for p in client.params(0).values())
            full = load(tensors, step)
            engine.send_weights()
            assert client.last_update["sliced"] is True
            assert_loaded(client, full)
    finally:
        engine.shutdown()
        client.close()
