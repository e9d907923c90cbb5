"""Median timeline of traced ``weightwire_ipc`` rounds, both sides on one clock.

    WEIGHTWIRE_IPC_TRACE=/tmp/tr/x python benchmarks/bench_ipc.py --models qwen2-0.5b \\
        --rounds 50 ...
    python benchmarks/ipc_timeline.py /tmp/tr/x

Every process appends ``(perf_counter, mark)`` pairs to ``<prefix>.<side>.<pid>.jsonl``
(``weightwire._trace.trace``: trainer, API server, worker; ``perf_counter`` is the host's
monotonic clock, the same in every process). This merges them, cuts rounds at the trainer's
``send>`` marks (written by ``bench_ipc.py`` around each timed ``send_weights``), and prints,
per configuration, each mark's median offset from the round's start in ms, in time order:
where a round's milliseconds go, which side is waiting on which.
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
from collections import defaultdict


def load(prefix: str) -> list[tuple[float, str, str]]:
    marks: list[tuple[float, str, str]] = []
    for path in glob.glob(f"{prefix}.*.jsonl"):
        side = path[len(prefix) + 1 :].split(".")[0]
        with open(path) as f:
            for line in f:
                marks.extend((t, side, name) for t, name in json.loads(line))
    marks.sort()
    return marks


def rounds(marks: list[tuple[float, str, str]]) -> dict[str, list[list[tuple[float, str]]]]:
    """Per configuration (the ``send>`` mark's label), each round's marks as (ms from start, "side
    mark")."""
    out: dict[str, list[list[tuple[float, str]]]] = defaultdict(list)
    current: list[tuple[float, str]] | None = None
    t0 = 0.0
    for t, side, name in marks:
        if side == "trainer" and name.startswith("send> "):
            current, t0 = [], t
            out[name[6:]].append(current)
        elif current is not None:
            current.append(((t - t0) * 1e3, f"{side[0]} {name}"))
            if side == "trainer" and name == "send<":
                current = None
    return out


def summary(per_round: list[list[tuple[float, str]]]) -> list[tuple[float, str, int]]:
    offsets: dict[str, list[float]] = defaultdict(list)
    for marks in per_round:
        seen: dict[str, int] = defaultdict(int)
        for ms, name in marks:
            seen[name] += 1
            offsets[name if seen[name] == 1 else f"{name} #{seen[name]}"].append(ms)
    rows = [(statistics.median(v), k, len(v)) for k, v in offsets.items()]
    return sorted(rows)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    for label, per_round in rounds(load(argv[0])).items():
        print(
            f"## {label}: {len(per_round)} rounds (median ms from send_weights' start; n = "
            "rounds with the mark)"
        )
        for ms, name, n in summary(per_round):
            print(f"{ms:8.3f}  {name}{'' if n == len(per_round) else f'  (n={n})'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
