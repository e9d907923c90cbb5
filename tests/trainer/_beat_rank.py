"""Subprocess body of test_multi_source_cpu's liveness cases: one rank of a 2-process
``TrainerGroup`` (rank 0 sends tiny-llama's checkpoint alone, rank 1 passes over its copy).

``python _beat_rank.py MODE RANK PORT URL OUT``; MODE is ``torch`` (gloo ranks,
``TorchStoreGroup``) or ``jax`` (``jax.distributed`` on CPU, ``JaxProcessGroup``). Round 1
commits; rank 1 then computes for longer than a stopped beat's bound before round 2 (it must
commit: a slow rank is alive); after round 2 rank 1 SIGKILLs itself, and rank 0's round 3 must
fail within seconds naming it (its bound, ``http_s``, is 60 s). Rank 0 writes every round's
outcome and seconds to OUT; rank 1 prints its outcomes before it dies.
"""

from __future__ import annotations

import os
import sys

MODE, RANK, PORT, URL, OUT = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    sys.argv[4],
    sys.argv[5],
)
if MODE == "jax":
    os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from weightwire.control import HTTPWeightSyncClient  # noqa: E402
from weightwire.shared.errors import WeightwireError  # noqa: E402
from weightwire.shared.timeouts import Timeouts  # noqa: E402
from weightwire.testing.sources import DictSource  # noqa: E402
from weightwire.trainer import TrainerInitInfo  # noqa: E402
from weightwire.trainer.group import BEAT_S, STOPPED_AFTER_S  # noqa: E402

HTTP_S = 60.0
SLOW_S = STOPPED_AFTER_S + 3 * BEAT_S  # rank 1's step between rounds 1 and 2


def checkpoint() -> dict[str, Any]:
    from safetensors.numpy import load_file

    from weightwire.tools.server.tiny import resolve_model

    tensors: dict[str, Any] = {}
    for f in sorted(Path(resolve_model("tiny-llama")).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def engine_and_source() -> tuple[Any, DictSource, Any]:
    """This rank's engine class, its source (the checkpoint in its framework) and group."""
    if MODE == "jax":
        import jax
        import jax.numpy as jnp

        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{PORT}", num_processes=2, process_id=RANK
        )
        from weightwire.jax_side.dtypes import describe
        from weightwire.jax_side.engine import JAXTrainerEngine
        from weightwire.jax_side.multiprocess import JaxProcessGroup

        arrays = {k: jnp.asarray(v) for k, v in checkpoint().items()}
        return JAXTrainerEngine, DictSource(arrays, describe), JaxProcessGroup()
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=RANK, world_size=2)
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.torch_side.sender.group import TorchStoreGroup
    from weightwire.torch_side.sender.source import describe_tensor

    tensors = {k: torch.from_numpy(v.copy()) for k, v in checkpoint().items()}
    return TorchTrainerEngine, DictSource(tensors, describe_tensor), TorchStoreGroup()


def attempt(engine: Any) -> dict[str, Any]:
    started = time.monotonic()
    try:
        metrics = engine.send_weights()
        outcome = {"kind": "ok", "message": str(metrics.version)}
    except WeightwireError as exc:
        outcome = {"kind": type(exc).__name__, "message": str(exc)}
    outcome["seconds"] = time.monotonic() - started
    return outcome


def main() -> None:
    engine_cls, source, group = engine_and_source()
    info = TrainerInitInfo(
        backend="weightwire_tcp",
        rank=RANK,
        pause_mode="keep",
        timeouts=Timeouts(http_s=HTTP_S, connect_s=30, warmup_s=30, transfer_s=20),
    )
    client = HTTPWeightSyncClient(URL, timeout=60) if RANK == 0 else None
    engine = engine_cls.trainer_init(info, client=client, source=source, group=group)
    rounds = [attempt(engine)]
    if RANK == 1:
        time.sleep(SLOW_S)  # a long step: its beat thread beats on meanwhile
    rounds.append(attempt(engine))
    if RANK == 1:
        print(json.dumps({"rounds": rounds}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # dies between rounds, no shutdown, no word
    rounds.append(attempt(engine))
    try:
        engine.shutdown()
    except WeightwireError as exc:
        rounds.append({"kind": type(exc).__name__, "message": str(exc), "seconds": 0.0})
    Path(OUT).write_text(json.dumps({"rounds": rounds, "slow_s": SLOW_S, "http_s": HTTP_S}))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip jax.distributed / gloo teardown with a dead peer
