"""Terminal output of the demo (rich): a start-up progress bar, one row per step, a verdict.

On a terminal the step table is a live table; in a log (CI, a pipe) every row is
printed as one plain line as soon as the step ends, so progress is visible either way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from weightwire.tools.demo.evidence import readable


@dataclass(frozen=True)
class StepRow:
    step: int
    reward: float
    sample: str
    sync_ms: float | None
    megabytes: float | None
    gbps: float | None
    version: str
    max_diff: float
    ok: bool
    step_s: float | None = None
    note: str = ""


_COLUMNS = (
    "step",
    "reward",
    "server text",
    "sync ms",
    "MB",
    "GB/s",
    "version",
    "max |Δlogp|",
    "step s",
    "check",
)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _sample_markup(text: str, char: str, width: int = 28) -> str:
    # Byte-level tokens decode to any character, line breaks and controls included: keep one line.
    shown = readable(text)[:width]
    # Escape whole runs: rich only recognises "[x]" as a tag when it sees it whole.
    return f"[bold green]{escape(char)}[/]".join(escape(part) for part in shown.split(char))


class StartupProgress:
    """``with StartupProgress(console, phases) as p: p.phase("..."); ...``

    On a terminal a live bar; otherwise (a pipe, a CI log) one plain line per phase as it
    starts, with the seconds since start-up began, because a live bar in a pipe prints
    nothing until it stops and a slow start would look hung.
    """

    def __init__(self, console: Console, phases: int) -> None:
        self._console, self._phases, self._index = console, phases, 0
        self._plain = not console.is_terminal
        self._t0 = time.perf_counter()
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self._task = self._progress.add_task("starting", total=phases)
        self._started = False

    def phase(self, description: str) -> None:
        self._index += 1
        if self._plain:
            self._console.print(
                f"[{self._index}/{self._phases}] {description} "
                f"({time.perf_counter() - self._t0:.1f} s)",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            return
        if self._started:
            self._progress.advance(self._task)
        self._started = True
        self._progress.update(self._task, description=description)

    def __enter__(self) -> StartupProgress:
        if not self._plain:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._plain:
            if exc[0] is None:
                self._console.print(
                    f"ready after {time.perf_counter() - self._t0:.1f} s", highlight=False
                )
            return
        if exc[0] is None:
            self._progress.update(
                self._task, completed=self._progress.tasks[0].total, description="ready"
            )
        self._progress.stop()


class StepTable:
    def __init__(self, console: Console, target_char: str) -> None:
        self.console = console
        self.char = target_char
        self.table = Table(
            *_COLUMNS, title="weightwire demo: JAX policy -> vLLM-style server, every step"
        )
        for col in self.table.columns[1:]:
            col.justify = "right"
        self.table.columns[2].justify = "left"
        self._live: Live | None = None
        self._plain_header = False

    @contextmanager
    def shown(self) -> Iterator[StepTable]:
        if self.console.is_terminal:
            with Live(self.table, console=self.console, refresh_per_second=8) as live:
                self._live = live
                try:
                    yield self
                finally:
                    self._live = None
        else:
            yield self

    def add(self, row: StepRow) -> None:
        cells = (
            str(row.step),
            f"{row.reward:.3f}",
            _sample_markup(row.sample, self.char),
            _fmt(row.sync_ms, ".1f"),
            _fmt(row.megabytes, ".2f"),
            _fmt(row.gbps, ".3f"),
            escape(row.version),
            f"{row.max_diff:.1e}",
            _fmt(row.step_s, ".2f"),
            ("[green]ok[/]" if row.ok else "[bold red]FAIL[/]")
            + (f" {row.note}" if row.note else ""),
        )
        self.table.add_row(*cells)
        if self._live is not None:
            self._live.refresh()
            return
        if not self._plain_header:
            self._plain_header = True
            self.console.print(" | ".join(_COLUMNS), highlight=False, soft_wrap=True)
        self.console.print(" | ".join(cells), highlight=False, soft_wrap=True)
