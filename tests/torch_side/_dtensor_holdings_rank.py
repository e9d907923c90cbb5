"""One rank of test_sender_holdings' DTensor run (2 processes over gloo).

Prints one JSON line: every tensor's holdings as this rank computes them (for every rank),
and whether this rank's own box of each tensor is exactly its local shard's values.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from tests.ranks import join_gloo_pair


def main() -> None:
    rank = join_gloo_pair()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from weightwire.torch_side.sender.holdings import holdings_of

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    full = {
        "rows": torch.randn(11, 6),  # uneven: 6 + 5
        "cols": torch.randn(4, 3),  # uneven: 2 + 1
        "norm": torch.randn(6),
        "tiny": torch.randn(1, 4),  # one row over two ranks: rank 1 holds nothing
    }
    tensors = {
        "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
        "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
        "norm": distribute_tensor(full["norm"], mesh, [Replicate()]),
        "tiny": distribute_tensor(full["tiny"], mesh, [Shard(0)]),
        "plain": torch.arange(5.0),
    }
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 7))
    full |= {f"fsdp.{n}": p.detach().clone() for n, p in model.named_parameters()}
    full["plain"] = tensors["plain"]
    fully_shard(model, mesh=mesh)
    tensors |= {f"fsdp.{n}": p for n, p in model.named_parameters()}
    holdings = holdings_of(tensors, rank=rank)
    own_ok = {}
    for name, t in tensors.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        mine = [h.box for h in holdings.held[name] if h.rank == rank]
        own_ok[name] = (len(mine) == 1 and torch.equal(full[name][mine[0].slices()], local)) or (
            not mine and local.numel() == 0
        )
    print(
        json.dumps(
            {
                "held": {
                    n: sorted([h.rank, [list(r) for r in h.box.ranges]] for h in hs)
                    for n, hs in holdings.held.items()
                },
                "own_ok": own_ok,
            }
        )
    )
    dist.destroy_process_group()


main()
