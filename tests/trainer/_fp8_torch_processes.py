"""Subprocess body of test_fp8_combos' 2-process torch case: one of 2 gloo ranks in a
``TrainerGroup`` (``TorchStoreGroup``) whose linears are bf16 DTensors sharded over both ranks
as the workers split them (rows of q / k / v / gate / up, columns of o / down), quantized to
FP8 under ``fp8_source`` on each rank's own shard and sent as sliced rounds to in-process TCP
workers hosting ``Fp8SlicedTP`` ranks (TP 2) that live in rank 0's process.

``python _fp8_torch_processes.py RANK PORT INTER`` prints one JSON line: this rank's bytes
sent per round, or the error of its first round. No ``full_tensor`` is ever called (it
raises). Rank 0 checks every worker against ``load_weights`` of the whole quantized
checkpoint. INTER 384: each rank's 192 MLP rows cut a 128-row block, so the shards cannot be
quantized apart: every rank refuses the round by the weight's name before any byte.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.getcwd())
from tests.ranks import join_gloo_pair
from tests.trainer._sliced_session import NoCalls
from tests.trainer.test_fp8_combos import NORM, as_torch, assert_serves, fp8_client, held, spec_of
from tests.trainer.test_fp8_combos import weights as round_weights


def main() -> None:
    rank = join_gloo_pair()
    inter = int(sys.argv[3])
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from weightwire.shared.timeouts import Timeouts
    from weightwire.testing.sources import DictSource
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.torch_side.sender.group import TorchStoreGroup
    from weightwire.torch_side.sender.quant import fp8_source
    from weightwire.torch_side.sender.source import describe_tensor
    from weightwire.trainer import TrainerInitInfo

    mesh = init_device_mesh("cpu", (2,))
    tensors: dict[str, Any] = {}

    def fill(step: int) -> Any:
        full = round_weights(step, inter)
        tensors.clear()
        for name, value in full.items():
            t = as_torch(value)
            if name != NORM:
                dim = 1 if ("o_proj" in name or "down_proj" in name) else 0
                t = distribute_tensor(t, mesh, [Shard(dim)])
            tensors[name] = t
        return full

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("full_tensor during a sliced FP8 round: a DTensor was gathered")

    DTensor.full_tensor = refuse  # type: ignore[method-assign]
    fill(0)
    client: Any = fp8_client(inter) if rank == 0 else NoCalls("rank 1")
    info = TrainerInitInfo(
        backend="weightwire_tcp",
        rank=rank,
        pause_mode=None,
        packed_buffer_size_bytes=1 << 14,
        timeouts=Timeouts(http_s=60, connect_s=30, warmup_s=30, transfer_s=30),
    )
    source = fp8_source(DictSource(tensors, describe_tensor), spec_of(inter))
    engine = TorchTrainerEngine.trainer_init(
        info, client=client, source=source, group=TorchStoreGroup()
    )
    sent: list[int] = []
    error = None
    try:
        before = held(client) if rank == 0 else None
        for step in (1, 2):
            full = fill(step)
            try:
                metrics = engine.send_weights()
            except Exception as exc:
                error = {"type": type(exc).__name__, "error": str(exc)[:1000]}
                if rank == 0:  # nothing reached the workers
                    assert client.updates == 0 and held(client) == before
                break
            sent.append(metrics.nbytes)
            if rank == 0:
                assert client.last_update.get("sliced") is True
                assert_serves(client, full)
    finally:
        engine.shutdown()
        if rank == 0:
            client.close()
    print(json.dumps({"rank": rank, "sent": sent, "error": error}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
