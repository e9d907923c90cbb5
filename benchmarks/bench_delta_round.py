"""Whole delta rounds against dense rounds of the same weights, in the same run.

    python benchmarks/bench_delta_round.py --out delta_round.md      # GPU: 8B, tcp + ipc
    python benchmarks/bench_delta_round.py --device cpu --shape small --rate-mb-s 50

The trainer (``TorchTrainerEngine``, ``delta="auto"``) sends Llama-shaped bf16 weights drawn
like bench_delta.py's (``N(0, 0.02)``) to a real worker: vLLM's plugin engine class run by
``tests/torch_side/vllm_stub.py``, loading into parameters laid out like vLLM's Llama (the
worker bench_vllm_layout.py measures). Per backend, one trainer and one worker:

- dense rows: ``send_weights(dense=True)`` of the weights ``w0`` (the first of them is the
  session's first round, dense anyway);
- delta rows: ``send_weights()`` after one Adam-like step (bench_delta.py's own step,
  imported: ``bf16(w - lr * sign(g))``, lr 1e-6 by default: ~2 % of the elements change),
  alternating ``w1``, ``w0``, ``w1``, ... so every round differs from the last by one step.

``weightwire_tcp`` runs through a link shaped IN THIS BENCHMARK (``shaped_link.py``: a relay
process forwarding each direction through a token bucket, ``--rate-mb-s``, default 1250 =
a 10 GbE line); the relay's count of forwarded bytes gives the link rate each round ran at.
``weightwire_ipc`` (pull) runs on one GPU, with the floor (one device copy of every tensor
into the serving parameters, measured in the worker before the trainer joins: its source
buffer, a round's bytes, fits on an 80 GB card beside the weight sets then, not beside the
trainer's base as well) for reference.

Per row: seconds per round (median of ``--rounds`` after ``--warmup``: the whole
``send_weights()``), wire bytes, dense bytes, density and extraction seconds (the round's
``RoundMetrics``), link bytes (tcp: what the relay forwarded per round), worker extra
memory (torch's peak over its baseline in the last round plus the receive pool) and trainer
extra memory (the trainer's device memory peak beyond the two weight sets: with
``delta="auto"`` it holds the base, one copy of the model, in dense rows too). ``bytes`` is
``ok`` when every tensor read back out of the worker's parameters has the trainer's digest.
On a CPU only ``weightwire_tcp`` runs (a dry run: CUDA IPC needs a GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.shaped_link import RelayedClient, ShapedLink, relay_ceiling  # noqa: E402

IPC, TCP = "weightwire_ipc", "weightwire_tcp"


@dataclass
class Row:
    """One row: a backend's dense or delta rounds."""

    backend: str
    kind: str  # "dense" | "delta"
    walls: list[float]
    wire_bytes: int
    dense_bytes: int
    density: float | None
    extract_s: float
    link_bytes: int | None  # tcp: bytes the relay forwarded to the worker per round
    trainer_extra: int | None  # None: not measured (CPU)
    worker_extra: int | None
    ok: bool
    floor_s: float | None = None  # ipc: one device copy into the serving parameters
    extra: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    """Median seconds per phase (``PHASES``): the trainer's clock, the worker's calls."""

    @property
    def round_s(self) -> float:
        return statistics.median(self.walls)


class Bench:
    """One backend's trainer, worker and weight sets for a run of dense and delta rows."""

    def __init__(self, args: argparse.Namespace, backend: str, sets: WeightSets) -> None:
        self.args, self.backend, self.sets = args, backend, sets
        self.cuda = args.device.startswith("cuda")
        self.params: dict[str, Any] = dict(sets.native[0])  # the source iterates this dict
        self.current = 0  # which set ``params`` holds
        self.link = ShapedLink(args.rate_mb_s * 1e6) if backend == TCP else None
        self.proc, self.client = self._worker()
        self.base_s = [0.0]  # --probe: this round's base refresh (device-synchronized)
        self.extract_mem: dict[str, int] = {}  # --probe: the allocator over this round's build
        self.floor_s: float | None = None
        self.floor_note = ""
        try:
            card(args, f"{backend}: worker up")
            if backend == IPC:
                self._floor()
            self.before = self._allocated()
            self.trainer = self._trainer()
            card(args, f"{backend}: trainer joined")
        except BaseException:
            self._stop_worker()
            raise

    def _floor(self) -> None:
        """The floor, measured first: its source buffer on the worker is a round's bytes
        (15 GiB for an 8B model), which fits beside the worker's model and the weight sets,
        not beside the trainer's base and a round's memory as well (an 80 GB card ran out
        when it came last). The first round (dense) overwrites the parameters it wrote."""
        try:
            self.floor_s = float(self.client.call("floor", {"reps": 5}))
        except Exception as exc:  # the rows are still worth having
            self.floor_note = f"{self.backend} floor failed: {type(exc).__name__}: {exc}"
            print(self.floor_note, flush=True)
        card(self.args, f"{self.backend}: floor measured")

    def _worker(self) -> tuple[Any, Any]:
        from weightwire.testing.loopback import spawn_loopback_cmd

        env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        if self.args.probe:
            env["WEIGHTWIRE_STUB_PROBE"] = "1"
        cmd = ["-m", "tests.torch_side.vllm_stub", "--backend", self.backend]
        cmd += ["--device", self.args.device, "--shape", self.args.shape]
        proc, client = spawn_loopback_cmd(cmd, env=env, timeout=300)
        if self.link is not None:
            client = RelayedClient(client.address, self.link)
        return proc, client

    def _trainer(self) -> Any:
        from weightwire.tools.bench.sync_models import make_source
        from weightwire.trainer import TrainerInitInfo

        engine: Any
        if self.args.engine == "jax":
            from weightwire.jax_side.engine import JAXTrainerEngine as engine
        else:
            from weightwire.torch_side.sender.engine import TorchTrainerEngine as engine

        info = TrainerInitInfo(
            backend=self.backend,
            delta="auto",
            device=0 if self.cuda else None,  # ipc: the default auto pulls in a delta session
        )
        trainer = engine.trainer_init(info, client=self.client, source=make_source(self.params))
        if self.args.probe:
            probe_base(trainer, self.base_s, self.cuda, self.extract_mem)
            GC.install()
        return trainer

    def _allocated(self) -> int:
        if not self.cuda:
            return 0
        import torch

        torch.cuda.synchronize()
        return int(torch.cuda.memory_allocated())

    def rows(self) -> list[Row]:
        """Dense rows, then delta rows (with the floor measured before the trainer joined)."""
        out = [self._phase("dense", [0]), self._phase("delta", [1, 0])]
        for row in out:
            row.floor_s = self.floor_s
        return out

    def _phase(self, kind: str, cycle: list[int]) -> Row:
        """``--warmup`` + ``--rounds`` rounds of the weight sets in ``cycle``, in turn."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        from weightwire._trace import dump_trace, trace

        walls, metrics, links, phases, memory = [], [], [], [], []
        for i in range(self.args.warmup + self.args.rounds):
            self.current = cycle[i % len(cycle)]
            self.params.update(self.sets.native[self.current])
            sent = self.link.forwarded() if self.link else 0
            self.base_s[0] = 0.0
            self.extract_mem.clear()
            before = allocator_stats(self.cuda) if self.args.probe else {}
            trace(f"send> {self.backend} {kind}")  # WEIGHTWIRE_IPC_TRACE: ipc_timeline.py's rounds
            start = time.perf_counter()
            m = self.trainer.send_weights(dense=kind == "dense")
            wall = time.perf_counter() - start
            trace("send<")
            dump_trace("trainer")
            got = round_phases(wall, m.seconds, self.client.call("seconds"), self.base_s[0])
            after = allocator_stats(self.cuda) if self.args.probe else {}
            mem = round_memory(before, after, self.extract_mem)
            if i >= self.args.warmup:
                walls.append(wall)
                metrics.append(m)
                links.append(self.link.forwarded() - sent if self.link else 0)
                phases.append(got)
            if mem:
                memory.append({"round": i, "warmup": i < self.args.warmup, "s": wall, **mem})
            shown = " ".join(f"{k}={v * 1e3:.1f}" for k, v in got.items() if k != "total")
            print(f"  {self.backend} {kind} round {i}: {wall:.3f} s, {m.summary()}", flush=True)
            print(f"    phases ms: {shown}", flush=True)
            if mem:
                print(f"    trainer allocator: {memory_line(mem)}", flush=True)
        card(self.args, f"{self.backend}: {kind} rounds done")
        trainer_extra = self._trainer_extra()
        mem = self.client.call("memory")
        worker_extra = mem["peak"] - mem["baseline"] + mem.get("pool", 0) if mem else None
        last = metrics[-1]
        return Row(
            backend=self.backend,
            kind=kind,
            walls=walls,
            wire_bytes=last.wire_bytes,
            dense_bytes=last.dense_bytes,
            density=last.density,
            extract_s=statistics.median(m.extract_seconds for m in metrics),
            link_bytes=int(statistics.median(links)) if self.link else None,
            trainer_extra=trainer_extra,
            worker_extra=worker_extra,
            ok=self._holds(),
            extra={"wire_bytes_each": [m.wire_bytes for m in metrics], "memory": memory},
            phases={k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[-1]},
        )

    def _trainer_extra(self) -> int | None:
        """torch: the allocator's peak this phase beyond what it held before the trainer
        started (the weight sets). JAX: every byte JAX allocated (its arrays share the
        torch tensors' memory through DLPack), peak over the run so far."""
        if not self.cuda:
            return None
        if self.args.engine == "jax":
            import jax

            return int(jax.devices()[0].memory_stats().get("peak_bytes_in_use", 0))
        import torch

        return int(torch.cuda.max_memory_allocated()) - self.before

    def _holds(self) -> bool:
        """Every tensor the worker holds has the digest of the trainer's current weights."""
        from tests.torch_side.vllm_stub import digest

        want = {n: digest(t) for n, t in self.sets.torch[self.current].items()}
        return bool(self.client.call("digests") == want)

    def close(self) -> None:
        try:
            self.trainer.shutdown()
        finally:
            self._stop_worker()

    def _stop_worker(self) -> None:
        try:
            self.client.exit()
            self.proc.wait(timeout=120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            if self.link is not None:
                self.link.close()


PHASES = (
    # (key, what): the trainer's RoundMetrics phases, then the worker's calls as it timed them
    ("total", "send_weights() wall"),
    ("metadata", "trainer: the round's plan and update info"),
    ("extract", "trainer: delta extraction on the device (the base refreshed in the same pass)"),
    ("base", "trainer (--probe): base refresh outside extraction (a dense round's snapshot)"),
    ("control", "trainer: pause + start_weight_update"),
    ("transfer", "trainer: the data path beside the update POST, until the worker received"),
    ("w.update", "worker: update_weights (checks, receive, patches held and checked)"),
    ("finish", "trainer: finish_weight_update (+ resume)"),
    ("w.finish", "worker: finish_weight_update (patches applied) + its device sync"),
    ("other", "total less the trainer phases above"),
)
"""The phase breakdown's columns; ``--probe`` adds the worker's steps (``w.<step>``, see
``tests/torch_side/vllm_stub.py:PROBED``: each device-synchronized, so the round is slower)."""


def round_phases(
    wall: float, trainer: dict[str, float], worker: dict[str, float], base: float
) -> dict[str, float]:
    """One round's phases in seconds (``PHASES`` then the worker's probed steps)."""
    out = {"total": wall, **{k: trainer.get(k, 0.0) for k in ("metadata", "extract")}}
    out["base"] = base
    out.update({k: trainer.get(k, 0.0) for k in ("control", "transfer")})
    out["w.update"] = worker.get("update_weights", 0.0)
    out["finish"] = trainer.get("finish", 0.0)
    out["w.finish"] = worker.get("finish_weight_update", 0.0)
    out["other"] = wall - sum(trainer.values())
    out.update({k: v for k, v in sorted(worker.items()) if k.startswith("w.")})
    return out


ALLOCATOR = (
    # (key, torch.cuda.memory_stats()'s counter): the trainer's caching allocator
    ("retries", "num_alloc_retries"),  # a miss that freed the cache (a device sync) and retried
    ("mallocs", "num_device_alloc"),  # cudaMalloc calls
    ("frees", "num_device_free"),  # cudaFree calls
    ("allocated", "allocated_bytes.all.current"),
    ("reserved", "reserved_bytes.all.current"),
)
"""What ``--probe`` reads of the trainer's allocator around each round and its extraction:
retries that coincide with slow rounds are the allocator's (#49)."""


class GcClock:
    """Microseconds the trainer's Python spent in garbage collection (``gc.callbacks``), read
    beside the allocator: a collection pause in a round is the other host stall a slow
    round may hide."""

    def __init__(self) -> None:
        self.us = 0
        self._start = 0.0
        self.installed = False

    def install(self) -> None:
        if not self.installed:
            gc.callbacks.append(self._tick)
            self.installed = True

    def _tick(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._start = now
        else:
            self.us += int((now - self._start) * 1e6)


GC = GcClock()


def allocator_stats(cuda: bool) -> dict[str, int]:
    """The trainer's ``ALLOCATOR`` counters now (on a GPU) and its GC time so far
    (``gc_us``, once ``GC`` is installed: ``--probe``)."""
    out = {"gc_us": GC.us} if GC.installed else {}
    if not cuda:
        return out
    import torch

    stats = torch.cuda.memory_stats()
    return out | {key: int(stats.get(name, 0)) for key, name in ALLOCATOR}


def round_memory(
    before: dict[str, int], after: dict[str, int], extract: dict[str, int]
) -> dict[str, int]:
    """One round's allocator deltas: ``round.<key>`` over the whole ``send_weights``,
    ``extract.<key>`` over its extraction (``probe_base`` fills ``extract``: a delta
    round's build), and the card's free bytes after (``free``)."""
    out = {f"round.{k}": after[k] - before[k] for k in after if k in before}
    out.update({f"extract.{k}": v for k, v in extract.items()})
    if "reserved" in after:  # a GPU
        out["free"] = card_free()
    return out


def memory_line(mem: dict[str, int]) -> str:
    """``round`` and ``extract`` deltas, bytes as MB; the card's free GB."""
    parts = []
    for scope in ("extract", "round"):
        got = {k.split(".", 1)[1]: v for k, v in mem.items() if k.startswith(scope + ".")}
        if got:
            counts = ("retries", "mallocs", "frees", "workspace")
            shown = [f"{k}={got[k]:+d}" for k in counts if k in got]
            shown += [f"{k}={got[k] / 1e6:+.1f}MB" for k in ("allocated", "reserved") if k in got]
            shown += [f"gc={got['gc_us'] / 1e3:.1f}ms"] if "gc_us" in got else []
            parts.append(f"{scope}: " + " ".join(shown))
    if "free" in mem:
        parts.append(f"card free {mem['free'] / 1e9:.2f} GB")
    return "; ".join(parts)


def card_free() -> int:
    """Free bytes on the current CUDA device (every process's use counted)."""
    import torch

    return int(torch.cuda.mem_get_info()[0])


def card(args: argparse.Namespace, where: str) -> None:
    """``--probe`` on a GPU: the card's free memory and this process's allocator at a step of
    the run (the harness must fit one 80 GB card: trainer and worker share it)."""
    if not (args.probe and args.device.startswith("cuda")):
        return
    import torch

    free, total = torch.cuda.mem_get_info()
    print(
        f"  card at {where}: free {free / 1e9:.2f} of {total / 1e9:.2f} GB; this process "
        f"allocated {torch.cuda.memory_allocated() / 1e9:.2f}, reserved "
        f"{torch.cuda.memory_reserved() / 1e9:.2f} GB",
        flush=True,
    )


def probe_base(
    trainer: Any, base_s: list[float], cuda: bool, extract_mem: dict[str, int] | None = None
) -> None:
    """``--probe``: time the trainer's base refresh outside the fused extraction (a dense
    round's snapshot of every tensor, a delta round's tensor sent dense) into ``base_s[0]``,
    each call device-synchronized; mark the extraction for ``WEIGHTWIRE_IPC_TRACE``; the
    allocator's deltas over the extraction into ``extract_mem`` (``ALLOCATOR``; the
    kernel's workspace allocations as ``workspace``)."""
    import torch

    from weightwire._trace import trace

    tracker = trainer._delta.tracker  # the engine's own DeltaTracker
    build = tracker.build

    def workspace_allocations() -> int:
        spaces = getattr(tracker.kernel, "workspaces", {})
        return sum(getattr(w, "allocations", 0) for w in spaces.values())

    def traced(*a: Any) -> Any:  # the extraction on ipc_timeline.py's timeline
        before, made = allocator_stats(cuda), workspace_allocations()
        trace("t.extract>")
        try:
            return build(*a)
        finally:
            trace("t.extract<")
            if extract_mem is not None:
                after = allocator_stats(cuda)
                extract_mem.update({k: after[k] - before[k] for k in after})
                extract_mem["workspace"] = workspace_allocations() - made

    tracker.build = traced
    kernel = tracker.kernel
    for method in ("snapshot", "refresh"):
        fn = getattr(kernel, method)

        def timed(*a: Any, _fn: Any = fn) -> Any:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return _fn(*a)
            finally:
                if cuda:
                    torch.cuda.synchronize()
                base_s[0] += time.perf_counter() - start

        setattr(kernel, method, timed)


@dataclass
class WeightSets:
    """``w0`` and ``w1`` as torch tensors (digests) and as the engine's arrays (the source)."""

    torch: list[dict[str, Any]]
    native: list[dict[str, Any]]


def weight_sets(args: argparse.Namespace) -> WeightSets:
    """``w0`` and ``w1`` = one Adam-like step of ``w0`` (bench_delta.py's step) on the
    trainer's device, in the stub model's checkpoint names and shapes; JAX's arrays are the
    same memory (DLPack)."""
    from benchmarks.delta_frameworks import Torch
    from tests.torch_side.vllm_stub import hf_shapes

    fw = Torch("static")
    w0 = fw.weights(hf_shapes(args.shape))
    w1 = fw.step(w0, args.lr)
    fw.sync(None)
    sets = [w0, w1]
    if args.engine != "jax":
        return WeightSets(sets, sets)
    import jax

    native = [{n: jax.dlpack.from_dlpack(t) for n, t in w.items()} for w in sets]
    jax.block_until_ready([list(w.values()) for w in native])
    return WeightSets(sets, native)


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}"


def table(rows: list[Row], rate: float) -> str:
    lines = [
        "| backend | round | s/round (median) | x faster than dense | wire MB | dense MB "
        "| density | extraction ms | link MB/round (GB/s) | floor s | trainer extra GB "
        "| worker extra GB | bytes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    dense = {r.backend: r.round_s for r in rows if r.kind == "dense"}
    for r in rows:
        speed = dense.get(r.backend, float("nan")) / r.round_s
        link, floor = "-", "-"
        if r.link_bytes is not None:  # the floor: the link's bytes at the shaped rate
            link = f"{_mb(r.link_bytes)} ({r.link_bytes / r.round_s / 1e9:.2f})"
            floor = f"{r.link_bytes / rate:.3f}"
        elif r.floor_s is not None:
            floor = f"{r.floor_s:.4f}"
        lines.append(
            f"| {r.backend}{f' @ {rate / 1e9:g} GB/s' if r.link_bytes is not None else ''} "
            f"| {r.kind} | {r.round_s:.3f} | {speed:.1f}x | {_mb(r.wire_bytes)} "
            f"| {_mb(r.dense_bytes)} | {'-' if r.density is None else f'{r.density:.3%}'} "
            f"| {r.extract_s * 1e3:.1f} | {link} "
            f"| {floor} "
            f"| {_gb(r.trainer_extra)} | {_gb(r.worker_extra)} "
            f"| {'ok' if r.ok else 'MISMATCH'} |"
        )
    return "\n".join(lines)


def phase_table(rows: list[Row]) -> str:
    """Where each row's round went: median ms per phase (``PHASES``, then probed steps)."""
    keys = [k for k, _ in PHASES]
    keys += sorted({k for r in rows for k in r.phases} - set(keys))
    lines = [
        "| backend | round | " + " | ".join(keys) + " |",
        "|---|---|" + "---:|" * len(keys),
    ]
    for r in rows:
        cells = [f"{r.phases[k] * 1e3:.1f}" if k in r.phases else "-" for k in keys]
        lines.append(f"| {r.backend} | {r.kind} | " + " | ".join(cells) + " |")
    legend = "; ".join(f"{k}: {what}" for k, what in PHASES)
    return "\n".join(lines) + f"\n\nms, median per row. {legend}."


def memory_table(rows: list[Row]) -> str:
    """``--probe``: each round's trainer allocator deltas (``round_memory``), warm-up rounds
    too, beside the round's seconds: retries in the slow rounds only is the allocator."""
    lines = [
        "| backend | round | # | s | extract retries / mallocs / workspace | extract "
        "allocated / reserved MB | round retries / mallocs / frees | round allocated / "
        "reserved MB | gc ms extract / round | card free GB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(m: dict[str, Any], scope: str, keys: tuple[str, ...], mb: bool = False) -> str:
        got = [m.get(f"{scope}.{k}") for k in keys]
        if all(v is None for v in got):
            return "-"
        return " / ".join("-" if v is None else f"{v / 1e6:+.1f}" if mb else f"{v:+d}" for v in got)

    def gc_cell(m: dict[str, Any]) -> str:
        got = [m.get(f"{scope}.gc_us") for scope in ("extract", "round")]
        return " / ".join("-" if v is None else f"{v / 1e3:.1f}" for v in got)

    for r in rows:
        for m in r.extra.get("memory", []):
            free = f"{m['free'] / 1e9:.2f}" if "free" in m else "-"
            lines.append(
                f"| {r.backend} | {r.kind} | {m['round']}{' (warm-up)' if m['warmup'] else ''} "
                f"| {m['s']:.4f} | {cell(m, 'extract', ('retries', 'mallocs', 'workspace'))} "
                f"| {cell(m, 'extract', ('allocated', 'reserved'), True)} "
                f"| {cell(m, 'round', ('retries', 'mallocs', 'frees'))} "
                f"| {cell(m, 'round', ('allocated', 'reserved'), True)} "
                f"| {gc_cell(m)} | {free} |"
            )
    return "\n".join(lines) + (
        "\n\nThe trainer's torch.cuda.memory_stats() deltas per round (--probe): retries = "
        "num_alloc_retries (a miss that freed the cache, synchronizing the device), mallocs / "
        "frees = cudaMalloc / cudaFree calls, workspace = device buffers the delta kernel's "
        "workspace allocated; gc = the trainer's Python garbage collection time."
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda:0 when a GPU is there, else cpu")
    ap.add_argument("--shape", default=None, help="llama3-8b (GPU default), small (CPU), tiny")
    ap.add_argument("--backends", default=None, help="weightwire_tcp,weightwire_ipc (GPU)")
    ap.add_argument("--rate-mb-s", type=float, default=1250.0, help="the tcp link, MB/s")
    ap.add_argument("--engine", choices=["torch", "jax"], default="torch")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", help="the table (markdown); the rows as JSON beside it")
    ap.add_argument(
        "--probe",
        action="store_true",
        help="also time the worker's round steps and the trainer's base refresh, each "
        "device-synchronized (slower rounds: where the time goes, not how fast); print the "
        "trainer allocator's deltas per round and extraction (retries, cudaMalloc calls, "
        "allocated / reserved) and the card's free memory at each step",
    )
    args = ap.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    args.device = args.device or ("cuda:0" if gpu else "cpu")
    cuda = args.device.startswith("cuda")
    args.shape = args.shape or ("llama3-8b" if cuda else "small")
    # ipc first: its rows take seconds, a dense 8B round over the shaped link ~13 s
    backends = (args.backends or (f"{IPC},{TCP}" if cuda else TCP)).split(",")
    if not set(backends) <= {IPC, TCP}:
        ap.error(f"--backends: {IPC} and/or {TCP}, got {args.backends!r}")
    if IPC in backends and not cuda:
        ap.error(f"{IPC} needs a GPU (CUDA IPC); on a CPU run --backends {TCP}")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if cuda:
        torch.cuda.set_device(torch.device(args.device))
    note = ""
    if TCP in backends:
        note = f"relay ceiling (not shaped): {relay_ceiling() / 1e9:.2f} GB/s"
        print(note, flush=True)
    card(args, "start")
    sets = weight_sets(args)
    card(args, "weight sets built")
    rows: list[Row] = []
    failed = False
    for backend in backends:
        notes: list[str] = []
        try:
            rows += run_backend(args, backend, sets, notes)
        except Exception as exc:  # one failed backend must not lose the other's rows
            failed = True
            notes.append(f"{backend}: {type(exc).__name__}: {exc}")
            print(f"{backend} failed: {type(exc).__name__}: {exc}", flush=True)
        note += "".join(f"\n{n}" for n in notes)
        report(rows, note, args)
    return 0 if rows and not failed and all(r.ok for r in rows) else 1


def run_backend(
    args: argparse.Namespace, backend: str, sets: WeightSets, notes: list[str]
) -> list[Row]:
    """One backend's rows; its trainer (and base) and worker are gone when it returns.
    What went wrong short of losing the rows (the floor) is added to ``notes``."""
    import torch

    bench = Bench(args, backend, sets)
    if bench.floor_note:
        notes.append(bench.floor_note)
    try:
        return bench.rows()
    finally:
        bench.close()
        del bench  # the trainer's base goes before the next backend's trainer starts
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def report(rows: list[Row], note: str, args: argparse.Namespace) -> None:
    """Print the table so far and write it (and the rows as JSON) to ``--out``."""
    text = table(rows, args.rate_mb_s * 1e6) + (f"\n\n{note.strip()}" if note else "")
    if rows:
        text += "\n\n" + phase_table(rows)
    if any(m for r in rows for m in r.extra.get("memory", [])):
        text += "\n\n" + memory_table(rows)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
        out = [{**asdict(r), "round_s": r.round_s} for r in rows]
        Path(args.out).with_suffix(".json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
