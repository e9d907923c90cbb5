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
from tests.trainer._sliced_session import (
    TP2,
    NoCalls,
    assert_loaded,
    full_tensors,
    rounds_then_failure,
    torch_engine,
)
from tests.trainer._sliced_workers import TPClient


def main() -> None:
    rank = join_gloo_pair()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from weightwire.torch_side.sender.group import TorchStoreGroup

    mesh = init_device_mesh("cpu", (2,))
    tensors: dict[str, Any] = {}

    def fill(step: int) -> dict[str, np.ndarray]:
        full = full_tensors(TP2, step)
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
    client: Any = TPClient(TP2) if rank == 0 else NoCalls("rank 1")
    engine = torch_engine(client, tensors, rank=rank, group=TorchStoreGroup())

    # A 4th round whose start the server refuses: rank 0 fails before its "go", rank 1
    # learns it instead of waiting, nothing reached the workers.
    def refused() -> None:
        raise RuntimeError("the server refused the start")

    def refuse_the_start() -> None:
        if rank == 0:
            client.start_weight_update = refused
            # one server: its refused start opened no round anywhere, so rank 0 keeps its
            # engine (a client naming none counts as several: trainer.round.may_have_opened)
            client.base_url = "http://in-process-workers"

    try:
        rounds, failure = rounds_then_failure(engine, client, rank == 0, fill, refuse_the_start)
        # A 5th round, the start answered again: every process kept its engine (no byte of
        # the 4th went out), so it commits on both.
        if rank == 0:
            del client.start_weight_update
        full = fill(5)
        try:
            after: Any = engine.send_weights().version
            if rank == 0:
                assert_loaded(client, full, "round 5 ")
        except Exception as exc:
            after = {"type": type(exc).__name__, "error": str(exc)[:400]}
    finally:
        engine.shutdown()
        if rank == 0:
            client.close()
    report = {"rank": rank, "rounds": rounds, "failure": failure, "after": after}
    print(json.dumps(report), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
