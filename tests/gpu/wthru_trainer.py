"""A torch trainer process for the write-through fault test: sends the stub's tiny Llama over
``weightwire_ipc`` with ``ipc_mode="write_through"`` in small chunks and SIGKILLs itself
while yielding tensor ``--kill-at`` (the first chunks are already written into the worker's
parameters by then).

    python tests/gpu/wthru_trainer.py --address HOST:PORT --kill-at 12
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main() -> int:
    import torch

    from tests.torch_side.vllm_stub import hf_shapes, trainer_tensors
    from weightwire.shared.meta import ParamMeta
    from weightwire.shared.source import WeightSource
    from weightwire.testing.loopback import LoopbackClient
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.trainer import TrainerInitInfo

    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--kill-at", type=int, default=12)
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    tensors = dict(trainer_tensors("tiny", device, seed=7))

    class Dying(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, "bfloat16", tuple(s)) for n, s in hf_shapes("tiny").items()]

        def __iter__(self) -> Iterator[tuple[str, Any]]:
            for i, pair in enumerate(tensors.items()):
                if i == args.kill_at:
                    torch.cuda.synchronize()  # the first chunks' copies have landed
                    os.kill(os.getpid(), signal.SIGKILL)
                yield pair

    info = TrainerInitInfo(
        backend="weightwire_ipc",
        ipc_mode="write_through",
        packed_buffer_size_bytes=16 << 10,
        device=0,
    )
    engine = TorchTrainerEngine.trainer_init(
        info, client=LoopbackClient(args.address), source=Dying()
    )
    engine.send_weights()
    return 0


if __name__ == "__main__":
    sys.exit(main())
