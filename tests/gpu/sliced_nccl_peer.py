"""One process of the GPU sliced-round test over ``weightwire_nccl``
(``python sliced_nccl_peer.py CONFIG.json``).

- ``workers``: hosts ``SlicedTP`` ranks of a TP 2 model, one ``WeightwireNCCLEngine`` per
  visible GPU (``TPClient``), and answers the trainer's weight-sync calls on a local
  ``multiprocessing.connection`` listener (one connection per call, so calls may overlap
  as HTTP calls do). ``check`` compares every hosted rank's parameters with
  ``load_weights`` of the round's full tensors and says what each worker received.
- ``trainer``: rank 0 on its one GPU, a torch or a torch-free JAX engine over
  ``weightwire_nccl``; three sliced rounds, each checked by the workers.

Each process prints one JSON report line last and leaves with ``os._exit`` (a thread still
parked in NCCL must not hold up teardown).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

CONFIG = (2, 4, 1, False, True)  # TP 2, one KV head, tied head
AUTH = b"weightwire-sliced-nccl-test"


def full_tensors(step: int) -> dict[str, np.ndarray]:
    from tests.trainer._sliced_workers import shapes_of

    rng = np.random.default_rng(step)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes_of(CONFIG).items()}


def workers(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from tests.trainer._sliced_workers import TPClient, expected
    from weightwire.torch_side.worker.engines import WeightwireNCCLEngine

    ranks = cfg["ranks"]
    client = TPClient(
        CONFIG,
        engine=WeightwireNCCLEngine,
        ranks=ranks,
        devices=[
            f"cuda:{i}" if cfg.get("device", "cuda") == "cuda" else "cpu" for i in range(len(ranks))
        ],
    )
    listener = Listener(("127.0.0.1", 0), authkey=AUTH)
    Path(cfg["address"]).write_text(json.dumps(list(listener.address)))
    done = threading.Event()

    def check(step: int) -> dict[str, Any]:
        full = full_tensors(step)
        wrong = []
        for i, rank in enumerate(ranks):
            got = client.params(i)
            for name, want in expected(CONFIG, full, rank).items():
                if not torch.equal(got[name], want):
                    wrong.append(f"tp{rank}:{name}")
        return {"wrong": wrong, "received": list(client.received)}

    def serve(conn: Any) -> None:
        with conn:
            call, args = conn.recv()
            try:
                if call == "check":
                    out: Any = check(*args)
                elif call == "stop":
                    done.set()
                    out = None
                else:
                    out = getattr(client, call)(*args)
                conn.send(("ok", out))
            except BaseException as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))

    def accept() -> None:
        while True:
            conn = listener.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    done.wait(cfg["timeout"])
    client.close()
    return {"role": "workers", "ranks": ranks}


class RemoteWorkers:
    """The weight-sync client calls, each on its own connection to the workers' process."""

    def __init__(self, address: tuple[str, int], world: int) -> None:
        self._address, self._world = address, world

    def _call(self, call: str, *args: Any) -> Any:
        with Client(self._address, authkey=AUTH) as conn:
            conn.send((call, args))
            status, out = conn.recv()
        if status != "ok":
            raise RuntimeError(f"the workers' {call} failed: {out}")
        return out

    def version(self) -> str:
        return "0.33.0"

    def get_world_size(self) -> int:
        return self._world

    def reset_prefix_cache(self) -> None:
        return None

    def pause(self, mode: str = "keep") -> None:
        return None

    def resume(self) -> None:
        return None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def check(self, step: int) -> dict[str, Any]:
        out: dict[str, Any] = self._call("check", step)
        return out

    def stop(self) -> None:
        self._call("stop")


def trainer(cfg: dict[str, Any]) -> dict[str, Any]:
    from weightwire.shared.timeouts import Timeouts
    from weightwire.testing.sources import DictSource
    from weightwire.trainer import TrainerInitInfo

    deadline = time.monotonic() + 120
    while not Path(cfg["address"]).exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the workers' process never listened")
        time.sleep(0.1)
    address = tuple(json.loads(Path(cfg["address"]).read_text()))
    client = RemoteWorkers(address, len(cfg["ranks"]))  # type: ignore[arg-type]
    on_gpu = cfg.get("device", "cuda") == "cuda"  # "cpu": a dry run under a stand-in NCCL
    info = TrainerInitInfo(
        backend="weightwire_nccl",
        pause_mode=None,
        packed_buffer_size_bytes=1 << 10,  # several chunks per worker, several waves
        packed_num_buffers=2,
        device=0 if on_gpu else None,
        timeouts=Timeouts(http_s=120, connect_s=120, warmup_s=120, transfer_s=60),
    )
    tensors: dict[str, Any] = {}
    if cfg["engine"] == "torch":
        import torch

        from weightwire.torch_side.sender.engine import TorchTrainerEngine
        from weightwire.torch_side.sender.source import describe_tensor

        def place(a: np.ndarray) -> Any:
            return torch.from_numpy(a).to("cuda:0" if on_gpu else "cpu")

        engine: Any = TorchTrainerEngine.trainer_init(
            info, client=client, source=DictSource(tensors, describe_tensor)
        )
    else:
        import jax

        from weightwire.jax_side.dtypes import describe
        from weightwire.jax_side.engine import JAXTrainerEngine

        gpu = jax.devices("gpu" if on_gpu else "cpu")[0]

        def place(a: np.ndarray) -> Any:
            return jax.device_put(a, gpu)

        engine = JAXTrainerEngine.trainer_init(
            info, client=client, source=DictSource(tensors, describe)
        )
    rounds = []
    try:
        for step in (1, 2, 3):
            tensors.clear()
            tensors.update({n: place(a) for n, a in full_tensors(step).items()})
            metrics = engine.send_weights()
            checked = client.check(step)
            rounds.append({"sent": metrics.nbytes, "seconds": metrics.seconds, **checked})
        sliced = engine.session.slicing is not None and engine.session.slicing.plans.builds == 1
    finally:
        engine.shutdown()
        client.stop()
    dense = sum(a.nbytes for a in full_tensors(0).values())
    return {"role": "trainer", "rounds": rounds, "dense": dense, "sliced": sliced}


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    try:
        report = workers(cfg) if cfg["role"] == "workers" else trainer(cfg)
    except BaseException as exc:
        report = {"role": cfg["role"], "error": repr(exc), "traceback": traceback.format_exc()}
    print(json.dumps(report), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
