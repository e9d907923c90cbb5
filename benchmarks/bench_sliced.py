"""Sliced rounds against the broadcast, TP workers on CPU over ``weightwire_tcp`` (or on GPUs
over ``weightwire_nccl``), one run.

    python benchmarks/bench_sliced.py [--tp 2] [--mb 64] [--rounds 5] [--engine torch|jax]
                                      [--delta]
                                      [--backend tcp|nccl]

A synthetic decoder-shaped model of about ``--mb`` MB (float32): per layer a fused-like
``[4H, H]`` matrix split by rows over the TP ranks, a ``[H, 4H]`` one split by columns and a
replicated norm. ``--tp`` in-process standalone TCP workers each load their rank's slices
(vLLM-style narrowing ``load_weights``) behind one in-process client. The same source is
sent ``--rounds`` times with ``sliced="auto"`` and with ``sliced="off"``; per mode: the
median round time, the bytes each worker received (counted by the worker) and their sum,
what went over the trainer's links. Both ends share the host's cores (and, in one process, the GIL).
``--engine jax`` sends from a JAX trainer whose arrays sit on 8 forced host devices (an
FSDP 4 x TP 2 mesh): the sliced rounds read each piece from its shard. ``--delta``: both
modes with ``delta="auto"``, a dense first round, then rounds that change ``--rate`` (2 %) of
every tensor's elements: the sliced delta rounds send each worker only the patch elements in
its slices, the broadcast delta rounds every patch to every worker (the rows: the delta
rounds' median time, the last delta round's bytes).

Numbers (2-core shared CPU box, torch 2.13 CPU, jax CPU; TP 2, 65 MB float32, 5 rounds,
``python benchmarks/bench_sliced.py [--engine jax]``):

  ======  =========  =======  ==============  ==============
  engine  mode       round s  per worker MB   on the wire MB
  ======  =========  =======  ==============  ==============
  torch   sliced     0.057    32.5, 32.5      65.1
  torch   broadcast  0.065    65.0, 65.0      130.1
  jax     sliced     0.080    32.5, 32.5      65.1
  jax     broadcast  0.063    65.0, 65.0      130.1
  ======  =========  =======  ==============  ==============

On loopback with both ends on two shared cores the wire is not the bottleneck, so the halved
bytes barely show in the round time; the JAX sliced round pays one device read per shard
piece (32 layers x 8 shards here) where the broadcast copies each array to the host once.
Across hosts, each worker's link carries half the bytes (1/TP in general).

``--delta`` (torch, the same box, 2 % of the elements changed per round; the last delta
round's bytes, the median of 5 delta rounds):

  ===============  =======  ==============  ==============
  mode             round s  per worker MB   on the wire MB
  ===============  =======  ==============  ==============
  sliced delta     0.107    1.29, 1.29      2.58
  broadcast delta  0.125    2.58, 2.58      5.15
  ===============  =======  ==============  ==============

``--delta --engine jax`` (the forced 8-device host mesh; the patches extracted shard by
shard, ``jax_side.shard_delta``, never gathered): sliced delta 0.158 s, 1.29 + 1.29 MB, 2.58
MB on the wire; broadcast delta 0.148 s, 2.58 + 2.58 MB, 5.15 MB.

``--backend nccl`` needs ``--tp + 1`` GPUs and CuPy: the trainer sends from GPU 0 (torch
tensors there, or a JAX array on the first GPU), each TP worker receives on its own GPU
(GPU 1 ..), all in this process; the sliced rounds go by grouped ``ncclSend`` / ``ncclRecv``,
the broadcast by ``ncclBroadcast``. On 2 GPUs, ``--hosted 1`` runs TP rank 0 alone (a TP 2
worker: half the bytes). Not yet run (needs a machine with 2+ GPUs):
``python benchmarks/bench_sliced.py --backend nccl --mb 1024 --hosted 1 [--engine jax]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

# the CPU mesh; over NCCL the trainer's arrays sit on a GPU
if (
    "--engine" in sys.argv
    and sys.argv[sys.argv.index("--engine") + 1] == "jax"
    and "nccl" not in sys.argv
):
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import torch

from weightwire.shared.timeouts import Timeouts
from weightwire.testing.sources import DictSource
from weightwire.torch_side.worker.engines import WeightwireNCCLEngine, WeightwireTCPEngine
from weightwire.torch_side.worker.spec import ModelSpec, TensorSpec
from weightwire.trainer import TrainerInitInfo


def shapes(mb: int, hidden: int = 256) -> dict[str, tuple[int, ...]]:
    per_layer = (4 * hidden * hidden * 2 + hidden) * 4
    layers = max(1, (mb << 20) // per_layer)
    out: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        out[f"model.layers.{i}.up.weight"] = (4 * hidden, hidden)
        out[f"model.layers.{i}.down.weight"] = (hidden, 4 * hidden)
        out[f"model.layers.{i}.norm.weight"] = (hidden,)
    return out


class RankModel(torch.nn.Module):
    """One TP rank: ``up`` split by rows, ``down`` by columns, ``norm`` whole."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], rank: int, tp: int) -> None:
        super().__init__()
        self.rank, self.tp = rank, tp
        self.weights = torch.nn.ParameterDict()
        for name, shape in shapes.items():
            local = list(shape)
            if ".up." in name:
                local[0] //= tp
            elif ".down." in name:
                local[1] //= tp
            self.weights[name.replace(".", "_")] = torch.nn.Parameter(
                torch.zeros(local), requires_grad=False
            )

    def load_weights(self, weights: Any) -> set[str]:
        done = set()
        for name, t in weights:
            param = self.weights[name.replace(".", "_")]
            if ".up." in name:
                t = t.narrow(0, self.rank * param.shape[0], param.shape[0])
            elif ".down." in name:
                t = t.narrow(1, self.rank * param.shape[1], param.shape[1])
            param.data.copy_(t)
            done.add(name)
        return done


class Workers:
    """The weight-sync calls, fanned out to ``tp`` in-process TCP workers."""

    def __init__(
        self, shapes: dict[str, tuple[int, ...]], tp: int, backend: str, hosted: int
    ) -> None:
        spec = ModelSpec({n: TensorSpec(s, "float32") for n, s in shapes.items()})
        nccl = backend == "nccl"
        engine = WeightwireNCCLEngine if nccl else WeightwireTCPEngine
        devices = [f"cuda:{r + 1}" if nccl else "cpu" for r in range(hosted)]
        self.engines = [
            engine(
                model=RankModel(shapes, r, tp).to(devices[r]),
                device=devices[r],
                worker_rank=r,
                spec=lambda: spec,
            )
            for r in range(hosted)
        ]
        self.received = [0] * hosted
        self._pool = cf.ThreadPoolExecutor(max_workers=hosted)

    def _all(self, call: Callable[[int, Any], Any]) -> None:
        for f in [self._pool.submit(call, r, e) for r, e in enumerate(self.engines)]:
            f.result(timeout=600)

    def version(self) -> str:
        return "0.33.0"

    def get_world_size(self) -> int:
        return len(self.engines)

    def init_weight_transfer_engine(self, info: dict[str, Any]) -> None:
        self._all(lambda r, e: e.init_transfer_engine(e.parse_init_info(dict(info))))

    def start_weight_update(self) -> None:
        self._all(lambda r, e: e.start_weight_update())

    def update_weights(self, update: dict[str, Any]) -> None:
        def one(r: int, e: Any) -> None:
            e.update_weights(dict(update))
            self.received[r] = e.last_stats.nbytes

        self._all(one)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all(lambda r, e: e.finish_weight_update())

    def reset_prefix_cache(self) -> None:
        return None

    def shutdown_weight_transfer_engine(self) -> None:  # a refused delta round's reopen
        self._all(lambda r, e: e.shutdown())

    def close(self) -> None:
        for e in self.engines:
            e.shutdown()
        self._pool.shutdown()


def engine_for(
    kind: str, info: TrainerInitInfo, client: Workers, full: dict[str, Any], backend: str
) -> tuple[Any, Callable[[dict[str, Any]], None]]:
    """The trainer engine, and how to put new weights into its source."""
    nccl = backend == "nccl"
    if kind == "torch":
        from weightwire.torch_side.sender.engine import TorchTrainerEngine
        from weightwire.torch_side.sender.source import describe_tensor

        where = "cuda:0" if nccl else "cpu"
        tensors = {n: torch.from_numpy(a).to(where) for n, a in full.items()}
        source = DictSource(tensors, describe_tensor)
        engine = TorchTrainerEngine.trainer_init(info, client=client, source=source)
        return engine, lambda new: tensors.update(
            {n: torch.from_numpy(a).to(where) for n, a in new.items()}
        )
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from weightwire.jax_side.dtypes import describe
    from weightwire.jax_side.engine import JAXTrainerEngine

    if nccl:  # whole arrays on the trainer's GPU (the pieces are cut there)
        gpu = jax.devices("gpu")[0]
        on_gpu = {n: jax.device_put(a, gpu) for n, a in full.items()}
        engine = JAXTrainerEngine.trainer_init(
            info, client=client, source=DictSource(on_gpu, describe)
        )
        return engine, lambda new: on_gpu.update(
            {n: jax.device_put(a, gpu) for n, a in new.items()}
        )
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tp"))

    def put(new: dict[str, Any]) -> None:
        arrays.update(
            {
                n: jax.device_put(a, NamedSharding(mesh, P("fsdp", "tp") if a.ndim == 2 else P()))
                for n, a in new.items()
            }
        )

    arrays: dict[str, Any] = {}
    put(full)
    source = DictSource(arrays, describe)
    return JAXTrainerEngine.trainer_init(info, client=client, source=source), put


def changed(full: dict[str, np.ndarray], rate: float, seed: int) -> dict[str, np.ndarray]:
    """``full`` with about ``rate`` of every tensor's elements changed (an optimizer step at a
    small learning rate, roughly)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, a in full.items():
        new = a.copy()
        flat = new.reshape(-1)
        flat[rng.integers(0, flat.size, max(1, int(flat.size * rate)))] += 1e-3
        out[name] = new
    return out


def run(mode: str, args: argparse.Namespace, full: dict[str, Any]) -> dict[str, Any]:
    hosted = args.hosted or args.tp
    client = Workers({n: a.shape for n, a in full.items()}, args.tp, args.backend, hosted)
    info = TrainerInitInfo(
        backend=f"weightwire_{args.backend}",
        device=0 if args.backend == "nccl" else None,
        sliced=mode,
        pause_mode=None,
        delta="auto" if args.delta else "off",
        timeouts=Timeouts(http_s=600, connect_s=60, warmup_s=60, transfer_s=600),
    )
    engine, put = engine_for(args.engine, info, client, full, args.backend)
    try:
        times, sent = [], 0
        weights = full
        for i in range(args.rounds + int(args.delta)):  # --delta: a dense first round, untimed
            if args.delta and i:
                weights = changed(weights, args.rate, seed=i)
                put(weights)
            started = time.perf_counter()
            sent = engine.send_weights().nbytes
            if not args.delta or i:
                times.append(time.perf_counter() - started)
        return {
            "mode": mode,
            "round_s": statistics.median(times),
            "per_worker": list(client.received),
            "sent": sent,
        }
    finally:
        engine.shutdown()
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engine", choices=("torch", "jax"), default="torch")
    parser.add_argument("--delta", action="store_true", help="delta rounds (delta='auto')")
    parser.add_argument("--rate", type=float, default=0.02, help="--delta: elements changed")
    parser.add_argument("--backend", choices=("tcp", "nccl"), default="tcp")
    parser.add_argument(
        "--hosted",
        type=int,
        default=0,
        help="TP ranks that take part (the first ones; default all): 1 on a 2-GPU machine",
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    full = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes(args.mb).items()}
    dense = sum(a.nbytes for a in full.values())
    what = f"delta rounds at {args.rate:.0%} changed" if args.delta else "rounds"
    print(
        f"model {dense / 1e6:.1f} MB, TP {args.tp}, {args.engine} engine, "
        f"weightwire_{args.backend}, {args.rounds} {what}"
    )
    print(f"{'mode':15} {'round s':>8} {'per worker MB':>20} {'on the wire MB':>15}")
    for mode in ("auto", "off"):
        row = run(mode, args, full)
        each = ", ".join(f"{b / 1e6:.2f}" for b in row["per_worker"])
        name = ("sliced" if mode == "auto" else "broadcast") + (" delta" if args.delta else "")
        wire = sum(row["per_worker"]) / 1e6  # a broadcast puts one copy on each worker's link
        print(f"{name:15} {row['round_s']:8.3f} {each:>20} {wire:15.2f}")


if __name__ == "__main__":
    main()
