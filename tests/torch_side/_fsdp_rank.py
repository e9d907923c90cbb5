"""One rank of the FSDP2 ModuleSource test (run twice, as separate processes, over gloo).

Prints one JSON line: what metadata() declared, how many collectives metadata() and
iteration ran, and the sha256 of every tensor iteration yielded.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.ranks import join_gloo_pair


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(11, 6)  # odd row count: uneven shards
    model.layers = torch.nn.ModuleList([torch.nn.Linear(6, 5), torch.nn.Linear(5, 6)])
    model.norm = torch.nn.LayerNorm(6)
    return model


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


class CountCollectives(TorchDispatchMode):
    """Counts every c10d op dispatched (functional collectives used by DTensor included)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("_c10d_functional", "c10d", "_c10d_functional_autograd"):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def main() -> None:
    rank = join_gloo_pair()
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from weightwire.shared.source import checked_iter
    from weightwire.torch_side.sender.source import ModuleSource, describe_tensor

    model = build()
    reference = {n: sha(p) for n, p in model.named_parameters()}
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert all(isinstance(p, DTensor) for p in model.parameters())

    calls = {"full_tensor": 0, "dist": 0}
    real_full = DTensor.full_tensor

    def counting_full(self, *a, **k):
        calls["full_tensor"] += 1
        return real_full(self, *a, **k)

    DTensor.full_tensor = counting_full
    for fn in ("all_gather_into_tensor", "all_gather", "broadcast", "all_reduce", "barrier"):
        real = getattr(dist, fn)
        setattr(
            dist,
            fn,
            lambda *a, _real=real, **k: (
                calls.__setitem__("dist", calls["dist"] + 1),
                _real(*a, **k),
            )[1],
        )

    src = ModuleSource(model)
    with CountCollectives() as mode:
        metas = src.metadata()
        held = src.held_names()
    meta_counts = {"ops": len(mode.ops), **calls}
    with CountCollectives() as mode:
        pairs = list(checked_iter(src, metas, describe_tensor))
    iter_counts = {"ops": len(mode.ops), **calls}
    local_shapes = {n: list(p.to_local().shape) for n, p in model.named_parameters()}
    print(
        json.dumps(
            {
                "rank": rank,
                "metas": [m.to_dict() for m in metas],
                "held": held,
                "meta_counts": meta_counts,
                "iter_counts": iter_counts,
                "reference": reference,
                "got": {n: sha(t) for n, t in pairs},
                "local_shapes": local_shapes,
            }
        ),
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown: gloo's background threads occasionally race static
    # destructors at exit ("terminate called without an active exception", SIGABRT)
    # after all work is done and reported.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
