"""Subprocess body of test_sliced_tcp's 2-process torch case: one of 2 gloo ranks in a
``TrainerGroup`` (``TorchStoreGroup``) sending 3 sliced rounds to in-process TCP workers
hosting ``SlicedTP`` ranks (TP 2, one KV head, tied head) that live in rank 0's process.

``python _sliced_torch_processes.py RANK PORT`` prints one JSON line: each round's bytes this
rank sent and what the plan gives each rank. The matrices are DTensors sharded over both ranks
(rows or columns, uneven where they do not divide); the rest are plain tensors, each rank a
whole copy of its own (known whole only to itself: the ranks tell each other). No
``full_tensor`` is ever called (it raises). Rank 0 checks every worker's parameters against
``load_weights`` of the full tensors.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.getcwd())
from tests.ranks import join_gloo_pair
from tests.trainer._sliced_workers import TPClient, expected, shapes_of

CONFIG = (2, 4, 1, False, True)  # TP 2, one KV head on two ranks, tied head


class NoCalls:
    """Rank 1's client: only rank 0 makes the control plane's calls."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*_: Any, **__: Any) -> Any:
            raise AssertionError(f"trainer rank 1 called the server ({name})")

        return call


def main() -> None:
    rank = join_gloo_pair()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from weightwire.shared.timeouts import Timeouts
    from weightwire.testing.sources import DictSource
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.torch_side.sender.group import TorchStoreGroup
    from weightwire.torch_side.sender.source import describe_tensor
    from weightwire.trainer import TrainerInitInfo

    mesh = init_device_mesh("cpu", (2,))
    shapes = shapes_of(CONFIG)
    tensors: dict[str, Any] = {}

    def fill(step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(step)
        full = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        tensors.clear()
        for name, value in full.items():
            t = torch.from_numpy(value)
            if t.dim() == 2 and "gate." not in name:  # rows for the odd ones, else columns
                t = distribute_tensor(t, mesh, [Shard(0 if "down" in name else 1)])
            tensors[name] = t
        return full

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("full_tensor during a sliced round: a DTensor was gathered")

    DTensor.full_tensor = refuse  # type: ignore[method-assign]
    fill(0)
    client: Any = TPClient(CONFIG) if rank == 0 else NoCalls()
    info = TrainerInitInfo(
        backend="weightwire_tcp",
        rank=rank,
        pause_mode=None,
        packed_buffer_size_bytes=1 << 10,
        timeouts=Timeouts(http_s=60, connect_s=30, warmup_s=30, transfer_s=30),
    )
    engine = TorchTrainerEngine.trainer_init(
        info,
        client=client,
        source=DictSource(tensors, describe_tensor),
        group=TorchStoreGroup(),
    )
    rounds = []
    failure: dict[str, Any] = {}
    try:
        for step in (1, 2, 3):
            full = fill(step)
            metrics = engine.send_weights()
            plan = engine.session.slicing.plans._plan  # type: ignore[union-attr]
            row: dict[str, Any] = {
                "version": metrics.version,
                "sent": metrics.nbytes,
                "rank_bytes": {str(r): n for r, n in plan.rank_bytes.items()},
                "worker_bytes": {str(w): n for w, n in plan.worker_bytes.items()},
            }
            if rank == 0:
                assert client.last_update.get("sliced") is True
                for worker in range(CONFIG[0]):
                    want, got = expected(CONFIG, full, worker), client.params(worker)
                    for name, tensor in want.items():
                        assert torch.equal(got[name], tensor), f"round {step} {worker} {name}"
                row["received"] = list(client.received)
            rounds.append(row)
        # A 4th round whose start the server refuses: rank 0 fails before its "go", rank 1
        # learns it instead of waiting, nothing reached the workers.
        last = full
        fill(4)
        if rank == 0:

            def refused() -> None:
                raise RuntimeError("the server refused the start")

            client.start_weight_update = refused
        try:
            engine.send_weights()
        except Exception as exc:
            failure = {"type": type(exc).__name__, "error": str(exc)[:300]}
        if rank == 0:
            for worker in range(CONFIG[0]):
                want, got = expected(CONFIG, last, worker), client.params(worker)
                for name, tensor in want.items():
                    assert torch.equal(got[name], tensor), f"refused round: {worker} {name}"
    finally:
        engine.shutdown()
        if rank == 0:
            client.close()
    print(json.dumps({"rank": rank, "rounds": rounds, "failure": failure}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
