"""bench_delta_round.py's run on one card (#49): the IPC floor is measured before the
trainer joins (its source buffer, a round's bytes, did not fit beside the trainer's base at
the end of an 8B run on an 80 GB card) and a failed floor costs the note, not the rows;
``--probe``'s allocator deltas per round."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from benchmarks import bench_delta_round as bench


class _Client:
    def __init__(self, calls: list[str], floor: Exception | None = None) -> None:
        self.calls, self.floor = calls, floor

    def call(self, op: str, body: Any = None) -> Any:
        self.calls.append(op)
        if op == "floor" and self.floor is not None:
            raise self.floor
        return 0.0125 if op == "floor" else None


BENCH = bench.Bench


def _bench(monkeypatch: pytest.MonkeyPatch, client: _Client) -> bench.Bench:
    monkeypatch.setattr(BENCH, "_worker", lambda self: (None, client))
    monkeypatch.setattr(BENCH, "_trainer", lambda self: client.calls.append("trainer"))
    args = argparse.Namespace(device="cpu", probe=True, rate_mb_s=1.0)
    return BENCH(args, bench.IPC, bench.WeightSets([{}], [{}]))


def test_ipc_floor_is_measured_before_the_trainer_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    got = _bench(monkeypatch, _Client(calls))
    assert calls == ["floor", "trainer"]
    assert got.floor_s == 0.0125 and got.floor_note == ""


def test_a_failed_floor_is_a_note_and_the_rows_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    oom = RuntimeError("OutOfMemoryError: Tried to allocate 14.96 GiB")
    monkeypatch.setattr(BENCH, "rows", lambda self: ["row"])
    monkeypatch.setattr(BENCH, "close", lambda self: None)
    monkeypatch.setattr(bench, "Bench", lambda *a: _bench(monkeypatch, _Client(calls, oom)))
    notes: list[str] = []
    args = argparse.Namespace(device="cpu", probe=False, rate_mb_s=1.0)
    rows = bench.run_backend(args, bench.IPC, bench.WeightSets([{}], [{}]), notes)
    assert rows == ["row"] and calls == ["floor", "trainer"]
    assert notes == [f"{bench.IPC} floor failed: RuntimeError: {oom}"]


def test_round_memory_is_the_allocator_deltas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "card_free", lambda: 5_260_000_000)
    before = {"retries": 3, "mallocs": 10, "frees": 4, "allocated": 100, "reserved": 1000}
    after = {"retries": 5, "mallocs": 12, "frees": 9, "allocated": 100, "reserved": 3_000_000}
    before["gc_us"], after["gc_us"] = 500, 2000
    extract = {"retries": 2, "mallocs": 1, "workspace": 0, "allocated": 0, "reserved": 0}
    got = bench.round_memory(before, after, extract)
    assert got["round.retries"] == 2 and got["round.frees"] == 5
    assert got["round.reserved"] == 2_999_000 and got["extract.retries"] == 2
    assert got["free"] == 5_260_000_000
    line = bench.memory_line(got)
    assert line.startswith("extract: retries=+2 mallocs=+1 workspace=+0")
    assert "round: retries=+2 mallocs=+2 frees=+5 allocated=+0.0MB reserved=+3.0MB gc=1.5ms" in line
    assert line.endswith("card free 5.26 GB")
    assert bench.round_memory({}, {}, {}) == {}  # no --probe: nothing read
    cpu = bench.round_memory({"gc_us": 0}, {"gc_us": 7}, {})
    assert cpu == {"round.gc_us": 7}  # a CPU: no allocator, no card
