"""Subprocess body of test_multi_source_cpu: one trainer rank of a 2-process trainer.

``python _multi_source_rank.py MODE RANK PORT URL OUT``; MODE is ``jax`` (jax.distributed,
params sharded across both processes' CPU devices, ``MultiProcessSource``) or ``torch``
(gloo ranks, each a full HF copy, ``OwnedSource`` splits the layers; then the faults: an
orphan name, disagreeing metadata, a broadcaster that dies mid-turn). Rank 0
writes a JSON report to OUT: what the server holds after every round and what the
unsharded model says it must hold, per-round seconds, and error messages.
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
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import hashlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from weightwire.control import HTTPWeightSyncClient  # noqa: E402
from weightwire.shared.timeouts import Timeouts  # noqa: E402
from weightwire.trainer import TrainerInitInfo  # noqa: E402

TIMEOUTS = Timeouts(http_s=60, connect_s=30, warmup_s=30, transfer_s=20)
ROUNDS = 3


def model_dir() -> str:
    from weightwire.tools.server.tiny import resolve_model

    return resolve_model("tiny-llama")


def server_checksums(client: HTTPWeightSyncClient) -> list[dict[str, str]]:
    (reply,) = client.weight_checker("checksum")
    return reply["replica_checksums"]


def info(**kw: Any) -> TrainerInitInfo:
    kw.setdefault("rank", RANK)
    return TrainerInitInfo(
        backend="weightwire_tcp",
        packed_buffer_size_bytes=16 << 10,
        pause_mode="keep",
        timeouts=TIMEOUTS,
        **kw,
    )


def rounds(
    engine: Any, client: HTTPWeightSyncClient, perturb: Any, expected: Any
) -> list[dict[str, Any]]:
    out = []
    for step in range(1, ROUNDS + 1):
        perturb(step)
        started = time.perf_counter()
        metrics = engine.send_weights()
        seconds = time.perf_counter() - started
        if RANK == 0:
            want = expected()
            held = server_checksums(client)
            out.append(
                {
                    "version": metrics.version,
                    "seconds": seconds,
                    "reused": metrics.reused_metadata,
                    "match": all({n: r.get(n) for n in want} == want for r in held),
                    "tensors": len(want),
                    "version_on_server": client.weight_info()[0]["weight_version"],
                }
            )
    return out


def run_jax() -> dict[str, Any]:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{PORT}", num_processes=2, process_id=RANK
    )
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from weightwire.jax_side.engine import JAXTrainerEngine
    from weightwire.jax_side.multiprocess import JaxProcessGroup, MultiProcessSource
    from weightwire.jax_side.source import PytreeSource
    from weightwire.tools.models import llama

    with open(os.path.join(model_dir(), "config.json")) as f:
        cfg = llama.LlamaConfig.from_hf_config(json.load(f))
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))  # 4 devices, 2 per process
    n = mesh.size

    def shard(x: np.ndarray) -> jax.Array:  # leading axis over every device of both processes
        spec = PartitionSpec("fsdp") if x.ndim and x.shape[0] % n == 0 else PartitionSpec()
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])

    host = {"params": jax.device_get(llama.init(jax.random.key(0), cfg))}  # same on both processes
    state = {"params": jax.tree.map(shard, host["params"])}
    cross = sum(not x.is_fully_addressable for x in jax.tree.leaves(state["params"]))
    source = MultiProcessSource(lambda: state["params"], llama.naming(cfg))

    def perturb(step: int) -> None:
        host["params"] = jax.tree.map(
            lambda x: x * np.asarray(1 + 0.01 * step, x.dtype), host["params"]
        )
        state["params"] = jax.tree.map(shard, host["params"])

    def expected() -> dict[str, str]:  # the unsharded model's bytes
        return {
            k: hashlib.sha256(np.asarray(v).tobytes()).hexdigest()
            for k, v in PytreeSource(
                host["params"], llama.naming(cfg), device=jax.local_devices()[0]
            )
        }

    client = HTTPWeightSyncClient(URL, timeout=60)
    owners = sorted({m.owners[0] for m in source.metadata()})
    engine = JAXTrainerEngine.trainer_init(
        info(), client=client, source=source, group=JaxProcessGroup()
    )
    try:
        multi = rounds(engine, client, perturb, expected)
    finally:
        engine.shutdown()
    report: dict[str, Any] = {
        "cross_process_leaves": cross,
        "broadcasters": owners,
        "rounds": multi,
    }
    if RANK == 0:  # the same model from one sender, for the per-round time
        local = PytreeSource(
            lambda: host["params"], llama.naming(cfg), device=jax.local_devices()[0]
        )
        single = JAXTrainerEngine.trainer_init(info(rank=0), client=client, source=local)
        try:
            report["single"] = rounds(single, client, perturb, expected)
        finally:
            single.shutdown()
    return report


def torch_setup() -> tuple[Any, Any]:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=RANK, world_size=2)
    model = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32)
    return torch, model


def torch_owner(name: str) -> int:
    """Rank 0: embeddings and layer 0; rank 1: layer 1, the final norm, the LM head."""
    return 0 if name.startswith("model.embed_tokens") or name.startswith("model.layers.0.") else 1


def run_torch() -> dict[str, Any]:
    """Rounds with owners, then (same process group) the fault cases."""
    from weightwire.torch_side.sender.group import TorchStoreGroup

    torch, model = torch_setup()
    group = TorchStoreGroup()  # one for every engine: each engine's exchange gets its own namespace
    report = torch_rounds(torch, model, group)
    report.update(torch_faults(model, group))
    return report


def torch_rounds(torch: Any, model: Any, group: Any) -> dict[str, Any]:
    from weightwire.shared.owned import OwnedSource
    from weightwire.torch_side.sender.engine import TorchTrainerEngine, tensor_bytes
    from weightwire.torch_side.sender.source import ModuleSource

    full = ModuleSource(model)
    source = OwnedSource(full, torch_owner, rank=RANK)

    @torch.no_grad()
    def perturb(step: int) -> None:
        for p in model.parameters():
            p.mul_(1 + 0.01 * step)

    def expected() -> dict[str, str]:
        return {n: hashlib.sha256(tensor_bytes(t).numpy()).hexdigest() for n, t in full}

    client = HTTPWeightSyncClient(URL, timeout=60)
    engine = TorchTrainerEngine.trainer_init(info(), client=client, source=source, group=group)
    try:
        multi = rounds(engine, client, perturb, expected)
    finally:
        engine.shutdown()
    report: dict[str, Any] = {"rounds": multi}
    # verify=True with both broadcasters: rank 0 checks the union of both slices' digests
    engine = TorchTrainerEngine.trainer_init(
        info(verify=True), client=client, source=source, group=group
    )
    try:
        verified = engine.send_weights()
        if RANK == 0:
            assert verified.verify is not None
            report["verify"] = {
                "mode": verified.verify.mode,
                "checked": verified.verify.checked,
                "tensors": len(full.metadata()),
            }
    finally:
        engine.shutdown()
    if RANK == 0:
        single = TorchTrainerEngine.trainer_init(info(rank=0), client=client, source=full)
        try:
            report["single"] = rounds(single, client, perturb, expected)
        finally:
            single.shutdown()
    return report


def torch_faults(model: Any, group: Any) -> dict[str, Any]:
    from weightwire.shared.owned import OwnedSource
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.torch_side.sender.source import ModuleSource

    client = HTTPWeightSyncClient(URL, timeout=60)
    errors: dict[str, str] = {}

    class Forgetful(ModuleSource):  # rank 1 cannot produce the LM head it is the first owner of
        def held_names(self) -> set[str] | None:
            return {m.name for m in self.metadata() if m.name != "lm_head.weight"}

    class Dying(ModuleSource):  # rank 1 dies after its first tensors went out
        def __iter__(self):  # type: ignore[no-untyped-def]
            for i, pair in enumerate(super().__iter__()):
                if i == 14:  # 4 of its own tensors (layer 1 starts at 10), some chunks, are out
                    os._exit(17)
                yield pair

    cases = [
        (
            "orphan",
            OwnedSource(
                Forgetful(model) if RANK == 1 else ModuleSource(model), torch_owner, rank=RANK
            ),
        ),
        # rank 1 believes rank 0 broadcasts everything
        (
            "disagree",
            OwnedSource(
                ModuleSource(model), (lambda n: 0) if RANK == 1 else torch_owner, rank=RANK
            ),
        ),
        (
            "dies",
            OwnedSource(Dying(model) if RANK == 1 else ModuleSource(model), torch_owner, rank=RANK),
        ),
    ]
    for name, source in cases:
        started = time.perf_counter()
        engine = None
        try:
            engine = TorchTrainerEngine.trainer_init(
                info(), client=client, source=source, group=group
            )
            engine.send_weights()
            errors[name] = "no error"
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as exc:  # the server already ended the failed session
                errors[name + "_shutdown"] = f"{type(exc).__name__}: {exc}"
        errors[name + "_seconds"] = f"{time.perf_counter() - started:.1f}"
    return {"errors": errors}


if __name__ == "__main__":
    report = {"jax": run_jax, "torch": run_torch}[MODE]()
    if RANK == 0:
        with open(OUT, "w") as f:
            json.dump(report, f)
    sys.stdout.flush()
    os._exit(0)  # skip jax.distributed / gloo teardown races between the two processes
