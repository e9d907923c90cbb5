"""What ``bench_overlap.py`` measures per step, whatever the device: the blocking phase, the
overlapped phase, and the table that sets them side by side.

A module of its own so the CPU run, the CUDA sender process and the report read one
definition of a step's timings.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Phase:
    """One phase's per-step seconds."""

    name: str
    train: list[float] = field(default_factory=list)
    sync: list[float] = field(default_factory=list)
    """blocking: the round's wall time; overlap: the stall (call + wait for the previous)."""
    wait: list[float] = field(default_factory=list)
    step: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)

    def median(self, what: str) -> float:
        values = getattr(self, what)
        return statistics.median(values) if values else 0.0


# -- the loop, whatever the device ----------------------------------------------------------


def run_phases(engine: Any, train: Any, steps: int, first: int) -> tuple[Phase, Phase, int]:
    """``steps`` blocking steps, then ``steps`` overlapped ones; versions count from
    ``first``. Returns both phases and the next version number."""
    blocking, overlap = Phase("blocking"), Phase("overlap")
    n = first
    for _ in range(steps):
        t0 = time.perf_counter()
        train()
        t1 = time.perf_counter()
        metrics = engine.send_weights(str(n))
        t2 = time.perf_counter()
        blocking.train.append(t1 - t0)
        blocking.sync.append(t2 - t1)
        blocking.step.append(t2 - t0)
        blocking.versions.append(str(metrics.version))
        n += 1
    pending = None
    for _ in range(steps):
        t0 = time.perf_counter()
        train()
        t1 = time.perf_counter()
        if pending is not None:
            overlap.versions.append(str(pending.result().version))
        t2 = time.perf_counter()
        pending = engine.send_weights(str(n), wait=False)
        t3 = time.perf_counter()
        overlap.train.append(t1 - t0)
        overlap.wait.append(t2 - t1)
        overlap.sync.append(t3 - t1)
        overlap.step.append(t3 - t0)
        n += 1
    assert pending is not None
    overlap.versions.append(str(pending.result().version))
    return blocking, overlap, n


def report(rows: list[dict[str, Any]]) -> str:
    head = (
        "| engine | device | model | MB/round | updates/step | train ms blocking / overlap | "
        "blocking round ms | overlap stall ms (wait) | stall / round | step ms blocking | "
        "step ms overlap | trainer extra MB | rounds in order | verify |\n" + "|---" * 14 + "|\n"
    )
    lines = []
    for r in rows:
        b, o = r["blocking"], r["overlap"]
        lines.append(
            f"| {r['engine']} | {r['device']} | {r['model']} | {r['nbytes'] / 1e6:.1f} | "
            f"{r.get('updates', '')} | {b['train_ms']:.1f} / {o['train_ms']:.1f} | "
            f"{b['sync_ms']:.1f} | "
            f"{o['sync_ms']:.2f} ({o['wait_ms']:.2f}) | {o['sync_ms'] / b['sync_ms']:.1%} | "
            f"{b['step_ms']:.1f} | {o['step_ms']:.1f} | {r.get('extra_bytes', 0) / 1e6:.1f} | "
            f"{'yes' if r['in_order'] else 'NO'} | "
            f"{r['verify']} |"
        )
    return head + "\n".join(lines) + "\n"


def summarize(phase: Phase) -> dict[str, Any]:
    return {
        "train_ms": 1e3 * phase.median("train"),
        "sync_ms": 1e3 * phase.median("sync"),
        "wait_ms": 1e3 * phase.median("wait"),
        "step_ms": 1e3 * phase.median("step"),
        "per_step": asdict(phase),
    }


def row_of(engine: str, device: str, model: str, nbytes: int, phases: Any, first: int) -> dict:
    blocking, overlap, _ = phases
    want = [str(first + i) for i in range(len(blocking.versions) + len(overlap.versions))]
    return {
        "engine": engine,
        "device": device,
        "model": model,
        "nbytes": nbytes,
        "blocking": summarize(blocking),
        "overlap": summarize(overlap),
        "in_order": blocking.versions + overlap.versions == want,
    }
