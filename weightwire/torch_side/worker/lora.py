"""An adapter round on a worker: stage the adapter, swap it in whole at finish.

A round whose names are an adapter's (``shared.lora``) is checked against the host's
registered adapter before a byte is received (``AdapterHost.check``: LoRA enabled, the
adapter registered, the same rank and modules), received into fresh CPU tensors, and
handed to ``AdapterHost.swap`` at ``finish_weight_update``: until then, and if the round
fails, the previous adapter serves; base weights are never touched. An adapter round is
always staged, whatever ``stage_budget_bytes`` says (an adapter is small next to its
base model).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from weightwire.shared.lora import LoRASpec, is_adapter_round, parse_name
from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.worker.load import Pairs
from weightwire.torch_side.worker.strategy import ReceiveStrategy, RoundTarget

log = logging.getLogger(__name__)


class AdapterHost(Protocol):
    """Where a worker's adapters live (vLLM's LoRA manager, the reference model)."""

    def check(self, spec: LoRASpec) -> None:
        """``ValueError`` saying why ``spec`` cannot replace the served adapter of its name."""

    def swap(self, spec: LoRASpec, tensors: dict[str, torch.Tensor]) -> None:
        """Serve ``tensors`` (saved PEFT names -> CPU tensors) as ``spec.adapter`` from the
        next request on; on failure the previous adapter keeps serving."""


AdapterHostFn = Callable[[], "AdapterHost | None"]


class LoRARound(ReceiveStrategy):
    """Holds one adapter's tensors; ``commit`` swaps them in through the host."""

    name = "adapter"

    def __init__(self, target: RoundTarget, spec: LoRASpec, host: AdapterHost) -> None:
        super().__init__(target)
        self.spec, self.host = spec, host
        self.held: dict[str, torch.Tensor] = {}
        self.updates = 0

    def held_tensors(self) -> Pairs:
        # The adapter is applied only at commit: checks before it (--check-finite) see it all.
        return list(self.held.items())

    def begin(self) -> None:
        pass

    def receive(self, chunks: Iterator[Pairs]) -> None:
        received: dict[str, torch.Tensor] = {}
        for pairs in chunks:
            for name, tensor in pairs:
                parsed = parse_name(name)
                assert parsed is not None  # the round's names were checked before any byte
                # The chunk buffer is reused for the next chunk: keep a copy of our own.
                received[parsed.saved] = tensor.detach().to("cpu", copy=True)
        self.held.update(received)
        self.names.update(received)
        self.updates += 1

    def commit(self) -> None:
        held, self.held = self.held, {}
        missing = len(self.spec.modules) * 2 - len(held)
        if missing:
            raise ValueError(f"adapter {self.spec.adapter!r}: {missing} tensor(s) never arrived")
        self.host.swap(self.spec, held)
        log.info(
            "%s: adapter %r swapped in (rank %d, %d modules)",
            self.target.backend,
            self.spec.adapter,
            self.spec.rank,
            len(self.spec.modules),
        )

    def abort(self, why: str) -> None:
        self.held = {}
        log.info(
            "%s: adapter round dropped (%s); adapter %r unchanged",
            self.target.backend,
            why,
            self.spec.adapter,
        )


def adapter_round(
    current: ReceiveStrategy | None,
    metas: Sequence[ParamMeta],
    host: AdapterHostFn | None,
) -> LoRARound | None:
    """The round as an adapter round when ``metas`` are an adapter's (None otherwise);
    ``ValueError`` before any byte for what the worker cannot take."""
    if not is_adapter_round([m.name for m in metas]):
        if isinstance(current, LoRARound):
            raise ValueError("a round mixes an adapter with base weights: send them apart")
        return None
    spec = LoRASpec.from_metas(metas)
    if current is None:
        raise ValueError("update_weights called without start_weight_update")
    if isinstance(current, LoRARound) or current.held_tensors() or current.wrote:
        raise ValueError(
            f"adapter {spec.adapter!r}: an adapter round carries the adapter in one update, "
            "alone (one broadcasting rank, no base weights in the same round)"
        )
    served = host() if host is not None else None
    if served is None:
        raise ValueError(
            f"adapter {spec.adapter!r}: this server does not serve LoRA adapters "
            "(vLLM: start it with --enable-lora; the reference server: --enable-lora)"
        )
    served.check(spec)
    return LoRARound(current.target, spec, served)
