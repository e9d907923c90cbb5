"""What the demo shows as evidence: a metrics file, a reward curve, readable samples.

- ``MetricsFile``: one JSON object per line and step (``--metrics-file``), written as each
  step ends, so a run stopped half-way still leaves its steps.
- ``sparkline``: the reward curve in one terminal line; ``save_plot``: the same as a PNG
  where matplotlib is installed (it is not a dependency).
- ``readable``: a tiny random model's text as one printable line.
- ``shown_rate``: GB/s only for rounds large enough for a rate to mean something.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from weightwire.tools._cli import EXIT_USAGE, CommandError

SPARKS = "▁▂▃▄▅▆▇█"

RATE_MIN_BYTES = 64 << 20
"""Below this a round's time is its fixed cost (HTTP calls, scheduling), not bandwidth: no GB/s
shown."""


@dataclass(frozen=True)
class StepRecord:
    """One line of ``--metrics-file``."""

    step: int
    reward: float
    weight_version: str
    sync_seconds: float
    sync_bytes: int
    tensors: int
    max_abs_logprob_diff: float
    ok: bool
    step_seconds: float
    phase_seconds: dict[str, float] = field(default_factory=dict)
    server_text: str = ""
    """The server's greedy completion of the fixed check prompt after this step's sync."""


class MetricsFile:
    """``--metrics-file PATH``: created (truncated) at open, one flushed JSON line per step."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._file: IO[str] = self.path.open("w", encoding="utf-8")
        except OSError as exc:
            raise CommandError(
                f"--metrics-file {str(path)!r}: cannot write it ({exc.strerror or exc})", EXIT_USAGE
            ) from None

    def write(self, record: StepRecord) -> None:
        self._file.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def sparkline(values: Sequence[float], lo: float = 0.0, hi: float = 1.0) -> str:
    """One block character per value, scaled between ``lo`` and ``hi`` (a reward in [0, 1])."""
    span = hi - lo
    out = []
    for value in values:
        frac = 0.0 if span <= 0 or math.isnan(value) else min(max((value - lo) / span, 0.0), 1.0)
        out.append(SPARKS[min(int(frac * len(SPARKS)), len(SPARKS) - 1)])
    return "".join(out)


def save_plot(rewards: Sequence[float], path: str | Path, *, title: str) -> Path | None:
    """The reward curve as a PNG at ``path``; ``None`` (nothing written) without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib  # type: ignore[import-not-found, unused-ignore]  # optional, not a dependency

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

    fig, ax = plt.subplots(figsize=(6, 3.5))
    try:
        ax.plot(range(1, len(rewards) + 1), rewards, marker="o")
        ax.set(xlabel="step", ylabel="reward", ylim=(0, 1), title=title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return Path(path)


def readable(text: str) -> str:
    """One printable line: byte-level tokens of a random model decode to partial UTF-8
    (shown as U+FFFD), controls and line breaks; each becomes ``·``."""
    return "".join(c if c.isprintable() and c != "\ufffd" else "·" for c in text)


def shown_rate(nbytes: int, gbps: float) -> float | None:
    """``gbps`` where the round moved at least ``RATE_MIN_BYTES``, else ``None`` (shown as
    ``-``)."""
    return gbps if nbytes >= RATE_MIN_BYTES else None
