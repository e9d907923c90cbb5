"""Overlapped rounds: the trainer-visible stall per step next to the blocking round's time.

    python benchmarks/bench_overlap.py --device cpu [--size small|tiny] [--steps 8] [--out F]
    python benchmarks/bench_overlap.py --device cuda [--engines jax,torch] [--model llama3-8b]
        [--steps 6] [--train-ms 400] [--out F]

One run, two phases over the same engine and receiver: ``blocking`` (train, then
``send_weights()``) and ``overlap`` (train, then wait for the previous round's handle and
``send_weights(wait=False)``). Per step it records the training time, the blocking round's
wall time, the overlapped stall (the time inside ``send_weights(wait=False)`` plus the wait
for the previous round) and the step's wall time; the table shows medians and the stall as a
share of the blocking round.

``--device cpu``: a JAX decoder (``tools.models.decoder``) trained by the demo's REINFORCE
step on random tokens, synced over ``weightwire_tcp`` into the reference server (a child
process) with ``verify=True`` (every round's checksums compared on the server). ``small``
is a ~64 MB float32 Llama built next to tiny-llama's tokenizer (the fault suite's,
``tools.server.scaled``); ``tiny`` is tiny-llama.
A training step runs as many updates as it takes to last ``--train-ratio`` times the
blocking round (measured first), the regime overlap is for: with a step shorter than the
round, the stall is the difference (one round in flight at most).

``--engines`` picks the trainers: ``jax``, ``torch`` (``snapshot="copy"``: every tensor
copied before ``send_weights(wait=False)`` returns) and ``torch-cow`` (``snapshot="cow"``:
nothing copied up front, a tensor copied only when the step would write it before the round
read it). ``trainer extra MB`` is the most memory the snapshots held at once, by their own
accounting (``TorchTrainerEngine.snapshot_peak_bytes``; JAX references its arrays: 0). On
the CPU the torch trainers load the checkpoint's tensors and step them with ``torch.optim.SGD``
on a quadratic loss (plus matmuls to last the step), so ``cow`` copies through the optimizer's
step hook.

``--device cuda``: trainer and a sink receiver on ONE GPU over ``weightwire_ipc`` (the
control shim of ``bench_ipc.py``; no vLLM needed): synthetic bf16 weights of ``--model``'s HF
shapes; a training step rewrites every weight (``torch-cow``: after ``before_update()``)
and runs matmuls for about ``--train-ms``. ``--write-at start`` (the default) rewrites first,
right after ``send_weights(wait=False)`` returned: ``torch-cow`` then copies every tensor the
round has not read yet (all of them). ``--write-at end`` rewrites after the step's matmuls
finished, as an optimizer's step ends a training step: a round shorter than the step has
read everything by then, so ``torch-cow`` copies nothing. The row's ``cow`` field is the
snapshots' own accounting (bytes copied, the most held, seconds a write waited).
Besides the stall it reports the step time with and without overlap (the round's copies
share the GPU with the step).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from overlap_phases import report, row_of, run_phases  # beside this script

REPO = Path(__file__).resolve().parents[1]


# -- CPU: JAX decoder -> reference server over weightwire_tcp --------------------------------


def run_cpu(args: argparse.Namespace) -> list[dict[str, Any]]:
    import tempfile

    import numpy as np

    from weightwire.control.client import HTTPWeightSyncClient
    from weightwire.jax_side.engine import JAXTrainerEngine
    from weightwire.jax_side.source import PytreeSource
    from weightwire.tools.demo.policy import Policy
    from weightwire.tools.demo.server import EmbeddedServer
    from weightwire.tools.models import decoder
    from weightwire.tools.models.loading import load_decoder
    from weightwire.tools.server.scaled import scaled_llama_dir
    from weightwire.trainer.config import TrainerInitInfo

    with tempfile.TemporaryDirectory(prefix="weightwire-bench-overlap-") as tmp:
        if args.size == "small":
            model_dir = str(scaled_llama_dir(Path(tmp) / "small-llama"))
        else:
            from weightwire.tools.server.tiny import tiny_model_dir

            model_dir = str(tiny_model_dir("tiny-llama"))
        with EmbeddedServer(model_dir, startup_timeout=300) as server:
            assert server.url is not None
            cfg, params = load_decoder(model_dir)
            policy = Policy(cfg, params, lr=1e-3)
            rng = np.random.default_rng(0)
            seqs = rng.integers(3, cfg.vocab_size, (args.batch, 32)).astype(np.int32)
            rewards = rng.random((args.batch, 32 - 8)).astype(np.float32)
            policy.warmup(seqs, 8)

            def update() -> None:
                policy.step(seqs, 8, rewards)  # returns host logprobs: the update is done

            rows = []
            first = 1
            for kind in args.engines.split(","):
                client = HTTPWeightSyncClient(server.url, timeout=120.0)
                info = TrainerInitInfo(
                    backend="weightwire_tcp",
                    verify=args.verify,
                    packed_buffer_size_bytes=16 << 20,
                    snapshot="cow" if kind == "torch-cow" else "copy",
                )
                if kind == "jax":
                    source = PytreeSource(lambda: policy.params, decoder.naming(cfg))
                    engine: Any = JAXTrainerEngine.trainer_init(info, client=client, source=source)
                    one_update = update
                else:
                    engine, one_update = _torch_cpu_trainer(model_dir, info, client)
                try:
                    for i in range(2):  # warm-up: plan, connections, compiled transforms
                        engine.send_weights(f"w{first + i}")
                    t = time.perf_counter()
                    one_update()
                    one = time.perf_counter() - t
                    t = time.perf_counter()
                    metrics = engine.send_weights(f"w{first + 2}")
                    round_s = time.perf_counter() - t
                    updates = args.updates or max(1, math.ceil(args.train_ratio * round_s / one))
                    print(
                        f"{kind} calibration: one update {one * 1e3:.1f} ms, one blocking round "
                        f"{round_s * 1e3:.1f} ms -> {updates} update(s) per step",
                        file=sys.stderr,
                    )

                    def train(update: Any = one_update, updates: int = updates) -> None:
                        for _ in range(updates):
                            update()

                    phases = run_phases(engine, train, args.steps, first)
                    served = client.weight_info()[0]["weight_version"]
                finally:
                    engine.shutdown()
                    client.close()
                row = row_of(kind, "cpu", f"llama {args.size}", metrics.nbytes, phases, first)
                row.update(
                    updates=updates,
                    verify="passed every round" if args.verify else "off",
                    served_last=served,
                    in_order=row["in_order"] and served == str(phases[2] - 1),
                    extra_bytes=getattr(engine, "snapshot_peak_bytes", 0),
                )
                cows = getattr(engine, "_cows", None)
                if cows is not None:  # where a cow round's extra memory and waits came from
                    row.update(cow=vars(cows.stats))
                    print(f"{kind}: {cows.stats}", file=sys.stderr)
                rows.append(row)
                first = phases[2] + 3  # past the next engine's warm-up versions
    return rows


def _torch_cpu_trainer(model_dir: str, info: Any, client: Any) -> Any:
    """The checkpoint's tensors as torch parameters; per call a few matmuls (a step's
    compute), then one SGD update of a quadratic loss (every tensor written in place by the
    optimizer's step, at the end of the step as in training)."""
    import torch
    from safetensors.torch import load_file

    from weightwire.shared.meta import ParamMeta
    from weightwire.shared.source import WeightSource
    from weightwire.torch_side.dtypes import wire_name
    from weightwire.torch_side.sender.engine import TorchTrainerEngine

    params: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            params[name] = t.clone().requires_grad_(True)
    opt = torch.optim.SGD(list(params.values()), lr=1e-4)
    a = torch.ones((256, 256))

    class Source(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, wire_name(t.dtype), tuple(t.shape)) for n, t in params.items()]

        def __iter__(self) -> Any:
            return ((n, t.detach()) for n, t in params.items())

    def update() -> None:
        x = a  # the forward and backward passes' compute, before the step writes
        for _ in range(20):
            x = torch.tanh(x @ x * 1e-4)
        opt.zero_grad()
        sum((p * p).sum() for p in params.values()).backward()  # type: ignore[union-attr]
        opt.step()

    engine = TorchTrainerEngine.trainer_init(info, client=client, source=Source())
    return engine, update


# -- CUDA: one GPU, weightwire_ipc into a sink receiver ----------------------------------------


def run_cuda(args: argparse.Namespace) -> list[dict[str, Any]]:
    import subprocess
    import tempfile

    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_ipc  # the receiver role (IPC engine over a sink) and its control shim

    rows = []
    with tempfile.TemporaryDirectory(prefix="weightwire-bench-overlap-") as tmp:
        port_file = Path(tmp, "port")
        receiver = bench_ipc._spawn(
            "receiver",
            {
                "port_file": str(port_file),
                "deadline": time.time() + len(args.engines.split(",")) * args.deadline_s + 60,
            },
            Path(tmp, "r.json"),
        )
        try:
            deadline = time.time() + 120
            while not port_file.exists():
                if receiver.poll() is not None or time.time() > deadline:
                    raise RuntimeError("the receiver process did not start its control shim")
                time.sleep(0.1)
            port = int(port_file.read_text())
            for kind in args.engines.split(","):
                cfg = {"port": port, "engine": kind, **vars(args)}
                path = Path(tmp, f"s-{kind}.json")
                path.write_text(json.dumps(cfg))
                env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
                env["PYTHONPATH"] = os.pathsep.join(
                    p for p in (str(REPO), env.get("PYTHONPATH", "")) if p
                )
                try:
                    proc = subprocess.run(
                        [sys.executable, __file__, "--role", "sender", "--config", str(path)],
                        env=env,
                        stdout=subprocess.PIPE,
                        text=True,
                        timeout=args.deadline_s,
                    )
                except subprocess.TimeoutExpired:
                    rows.append({"engine": kind, "error": f"no row within {args.deadline_s} s"})
                    continue
                got = [line for line in proc.stdout.splitlines() if line.startswith("{")]
                rows.append(
                    json.loads(got[-1])
                    if got
                    else {"engine": kind, "error": f"sender exited {proc.returncode}"}
                )
        finally:
            receiver.kill()
            receiver.wait(30)
    return rows


def cuda_sender(cfg: dict[str, Any]) -> dict[str, Any]:
    from weightwire.shared.timeouts import Timeouts
    from weightwire.tools.bench.sync_models import build_params
    from weightwire.tools.bench.sync_shim import ShimClient
    from weightwire.trainer.config import TrainerInitInfo

    kind, t = cfg["engine"], cfg["timeout"]
    params = build_params(cfg["model"], "jax" if kind == "jax" else "torch")
    nbytes = sum(int(a.nbytes) for a in params.values())
    info = TrainerInitInfo(
        backend="weightwire_ipc",
        snapshot="cow" if kind == "torch-cow" else "copy",
        packed_buffer_size_bytes=1 << 30,
        packed_num_buffers=2,
        device=0,
        server_version="0.33.0",
        inference_world_size=1,
        timeouts=Timeouts(http_s=t + 30, connect_s=t, warmup_s=t, transfer_s=t, round_s=4 * t),
    )
    client = ShimClient(cfg["port"], timeout=t + 60)
    if kind == "jax":
        engine, train = _jax_trainer(params, info, client, cfg["train_ms"], cfg["write_at"])
    else:
        engine, train = _torch_trainer(params, info, client, cfg["train_ms"], cfg["write_at"])
    try:
        for i in range(2):
            engine.send_weights(f"w{i}")
        phases = run_phases(engine, train, cfg["steps"], 1)
    finally:
        engine.shutdown()
    row = row_of(kind, "cuda (one GPU, ipc)", cfg["model"], nbytes, phases, 1)
    row.update(
        verify="off (checksums of 16 GB per round)",
        train_ms_target=cfg["train_ms"],
        write_at=cfg["write_at"],
        extra_bytes=getattr(engine, "snapshot_peak_bytes", 0),
    )
    cows = getattr(engine, "_cows", None)
    if cows is not None:  # where a cow round's extra memory and waits came from
        row.update(cow=vars(cows.stats))
    return row


def _jax_trainer(
    params: dict[str, Any], info: Any, client: Any, train_ms: float, write_at: str
) -> Any:
    import jax
    import jax.numpy as jnp

    from weightwire.jax_side.engine import JAXTrainerEngine
    from weightwire.jax_side.naming import Naming
    from weightwire.jax_side.rules import Rule
    from weightwire.jax_side.source import PytreeSource

    state = {"params": params}
    rewrite = jax.jit(lambda tree: jax.tree.map(lambda p: (p * 0.999).astype(p.dtype), tree))
    a = jnp.ones((8192, 8192) if jax.default_backend() == "gpu" else (256, 256), jnp.bfloat16)
    burn = jax.jit(lambda x: jnp.tanh(x @ x * 1e-4))
    matmuls = _calibrate(lambda: burn(a).block_until_ready(), train_ms)

    def train() -> None:
        if write_at == "start":
            state["params"] = rewrite(state["params"])
        x = a
        for _ in range(matmuls):
            x = burn(x)
        if write_at == "end":
            x.block_until_ready()
            state["params"] = rewrite(state["params"])
        jax.block_until_ready((x, state["params"]))

    source = PytreeSource(lambda: state["params"], Naming([Rule("{x}", "{x}")]))
    return JAXTrainerEngine.trainer_init(info, client=client, source=source), train


def _torch_trainer(
    params: dict[str, Any], info: Any, client: Any, train_ms: float, write_at: str
) -> Any:
    import torch

    from weightwire.tools.bench.sync_models import make_source
    from weightwire.torch_side.sender.engine import TorchTrainerEngine

    device = next(iter(params.values())).device
    side = 8192 if device.type == "cuda" else 256
    a = torch.ones((side, side), dtype=torch.bfloat16, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def burn_once() -> None:
        torch.tanh(a @ a * 1e-4)
        sync()

    matmuls = _calibrate(burn_once, train_ms)

    def write() -> None:
        engine.before_update()  # snapshot="cow": what the round has not read is copied first
        with torch.no_grad():
            for p in params.values():
                p.mul_(0.999)  # an optimizer writes in place: the snapshot copy is what is sent

    def train() -> None:
        if write_at == "start":
            write()
        with torch.no_grad():
            x = a
            for _ in range(matmuls):
                x = torch.tanh(x @ x * 1e-4)
        if write_at == "end":
            sync()  # the step's compute done, as when a trainer reads its loss before stepping
            write()
        sync()

    engine = TorchTrainerEngine.trainer_init(info, client=client, source=make_source(params))
    return engine, train


def _calibrate(once: Any, train_ms: float) -> int:
    once()
    t = time.perf_counter()
    for _ in range(5):
        once()
    each = (time.perf_counter() - t) / 5
    return max(1, round(train_ms / 1e3 / each))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", help="write the table (markdown) and the rows (JSON) here")
    ap.add_argument("--size", choices=("small", "tiny"), default="small", help="cpu: the model")
    ap.add_argument("--batch", type=int, default=8, help="cpu: sequences per update")
    ap.add_argument("--updates", type=int, default=0, help="cpu: updates per step (0: auto)")
    ap.add_argument("--train-ratio", type=float, default=1.5, help="cpu: step / blocking round")
    ap.add_argument("--no-verify", dest="verify", action="store_false", help="cpu: verify off")
    ap.add_argument(
        "--engines", default=None, help="jax, torch, torch-cow (cpu: jax; cuda: all three)"
    )
    ap.add_argument("--model", default="llama3-8b", help="cuda: the HF shapes sent")
    ap.add_argument("--train-ms", type=float, default=400.0, help="cuda: a step's compute")
    ap.add_argument(
        "--write-at",
        choices=("start", "end"),
        default="start",
        help="cuda: a step rewrites the weights before its compute or after it",
    )
    ap.add_argument("--timeout", type=float, default=120.0, help="cuda: transfer bound")
    ap.add_argument("--deadline-s", type=float, default=240.0, help="cuda: per engine")
    ap.add_argument("--role", choices=("sender",), help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engines is None:
        args.engines = "jax" if args.device == "cpu" else "jax,torch,torch-cow"
    if args.role == "sender":
        try:
            row = cuda_sender(json.loads(Path(args.config).read_text()))
        except Exception as exc:
            cfg = json.loads(Path(args.config).read_text())
            row = {"engine": cfg["engine"], "error": f"{type(exc).__name__}: {exc}"[:400]}
        print(json.dumps(row), flush=True)
        os._exit(0)  # a CUDA context's teardown can outlive the row by seconds
    rows = run_cpu(args) if args.device == "cpu" else run_cuda(args)
    ok = [r for r in rows if "error" not in r]
    text = report(ok) + "".join(f"\n{r['engine']}: {r['error']}" for r in rows if "error" in r)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n```json\n" + json.dumps(rows, indent=1) + "\n```\n")
    return 0 if ok and all(r["in_order"] for r in ok) else 1


if __name__ == "__main__":
    sys.exit(main())
