"""``RoundMetrics``: what one ``send_weights`` moved and where its time went."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from weightwire.shared.quant import QuantStats


class Fp8Report(NamedTuple):
    """A round's FP8 part (``trainer.fp8_source``): what quantizing saved and cost."""

    weights: int
    """How many ``X.weight``s went as FP8 pairs."""
    bytes_saved: int
    """Wire bytes the pairs saved against the tensors they replace (a dense round's)."""
    errors: dict[str, QuantStats]
    """Per quantized weight, the max and mean abs error of its dequantized values against
    the trainer's (``fp8_source(..., stats=True)``; empty when off), measured on the
    trainer's device as the round quantized it."""

    @property
    def max_abs_error(self) -> float | None:
        """The largest error of any weight (``None`` without stats)."""
        return max((e.max_abs_error for e in self.errors.values()), default=None)


@dataclass(frozen=True)
class RoundMetrics:
    """One round, as seen by this trainer rank.

    Phases (seconds): ``metadata`` (declare the round, build the update info),
    ``control`` (pause + ``start_weight_update``), ``transfer`` (broadcasts and the
    concurrent ``update_weights`` until every worker loaded), ``finish``
    (``finish_weight_update`` + resume), ``verify`` (checksum comparison, if on).
    ``gbps`` is payload bytes over the transfer phase, in GB/s (1e9). A non-sender
    rank reports ``sender=False`` and only its iteration time under ``transfer``.
    """

    version: str | None
    nbytes: int
    tensors: int
    chunks: int
    reused_metadata: bool
    sender: bool = True
    seconds: dict[str, float] = field(default_factory=dict)
    verify: Any = None
    """``verify.VerifyReport`` of the round when ``verify=True``: what the check proved."""
    dense_bytes: int = 0
    """Bytes the round stands for: every tensor of the source, dense (a delta round sends
    fewer, ``wire_bytes``)."""
    density: float | None = None
    """A delta round: the fraction of the source's elements that changed (``None`` for a
    dense round, which compares nothing)."""
    extract_seconds: float = 0.0
    """A delta round: device time finding the changed elements (also the ``extract`` phase)."""
    fp8: Fp8Report | None = None
    """A round of an FP8 source: weights quantized, bytes saved, their errors (if asked)."""
    http_calls: int | None = None
    """HTTP requests the engine's client sent while the round ran, every server's (the
    control plane's fixed cost: ``HTTPWeightSyncClient.http_calls``); None for a client that
    counts none."""

    @property
    def wire_bytes(self) -> int:
        """Payload bytes that crossed the wire (``nbytes``)."""
        return self.nbytes

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def gbps(self) -> float:
        seconds = self.seconds.get("transfer", 0.0)
        return self.nbytes / seconds / 1e9 if seconds > 0 else 0.0

    def __str__(self) -> str:  # logging formats it only when the record is emitted
        return self.summary()

    def summary(self) -> str:
        """One log line (no names, no secrets)."""
        phases = " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in self.seconds.items())
        reuse = " reused-metadata" if self.reused_metadata else ""
        delta = (
            ""
            if self.density is None
            else f" (delta: {self.density:.2%} changed, {self.dense_bytes / 1e6:.1f} MB dense)"
        )
        fp8 = ""
        if self.fp8 is not None:
            worst = self.fp8.max_abs_error
            fp8 = (
                f" (fp8: {self.fp8.weights} weights, {self.fp8.bytes_saved / 1e6:.1f} MB saved"
                + ("" if worst is None else f", max abs error {worst:.3g}")
                + ")"
            )
        calls = "" if self.http_calls is None else f" http_calls={self.http_calls}"
        return (
            f"round {self.version}: {self.tensors} tensor{'' if self.tensors == 1 else 's'}, "
            f"{self.nbytes / 1e6:.1f} MB{delta}{fp8} in {self.chunks} "
            f"broadcast{'' if self.chunks == 1 else 's'}, {self.gbps:.2f} GB/s{reuse}; {phases} "
            f"total={self.total_seconds * 1e3:.1f}ms{calls}"
        )


def http_calls(client: Any) -> int | None:
    """The HTTP requests ``client`` sent so far (``HTTPWeightSyncClient.http_calls``), or None
    for a client that counts none."""
    n = getattr(client, "http_calls", None)
    return n if type(n) is int else None


def http_calls_since(before: int | None, client: Any) -> int | None:
    """The HTTP requests ``client`` sent since it had sent ``before`` (None: not counted)."""
    after = http_calls(client)
    return None if before is None or after is None else after - before


class PhaseClock:
    """Accumulates wall time per phase: ``with clock("transfer"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._name: str | None = None
        self._start = 0.0

    def __call__(self, name: str) -> PhaseClock:
        self._name = name
        return self

    def shift(self, source: str, target: str, seconds: float) -> None:
        """Book ``seconds`` that were spent inside ``source``'s span under ``target`` instead.

        Callable while ``source`` is open: its share is subtracted when it closes."""
        self.seconds[source] = self.seconds.get(source, 0.0) - seconds
        self.seconds[target] = self.seconds.get(target, 0.0) + seconds

    def __enter__(self) -> PhaseClock:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._name is not None
        self.seconds[self._name] = (
            self.seconds.get(self._name, 0.0) + time.perf_counter() - self._start
        )
        self._name = None
