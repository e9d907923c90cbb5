"""What a demo run is configured with, what it produced, and what its steps share.

Apart from ``loop`` (which runs the steps) and ``checks`` (the sync checks and the closing
report), which both read these records; importing it stays free of jax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from weightwire import backends
from weightwire.backends.ipc.spec import IPC
from weightwire.backends.nccl.spec import NCCL, WEIGHTWIRE_NCCL
from weightwire.backends.tcp.spec import TCP
from weightwire.shared.errors import ConfigError

DEMO_BACKENDS = tuple(
    name
    for name in backends.BACKEND_NAMES
    if not backends.SPECS[name].same_host
    and backends.SPECS[name].dense_rounds
    and backends.SPECS[name].worker_engine is not None
)
"""``--backend`` choices; ``weightwire_ipc`` (one host) comes with ``--colocated`` (one GPU for
both); ``sparse_nccl`` (delta rounds only) is not offered: the demo sends whole models; nor is
a wire only vLLM's own workers receive (``nccl_m2n``): the demo's server could not take it."""


@dataclass(frozen=True)
class DemoConfig:
    server: str | None = None
    """Drive this server; ``None`` starts the embedded reference server."""
    model_dir: str | None = None
    """The server's model directory (required with ``server``): the policy's initial weights."""
    model: str = "tiny-llama"
    """Embedded server only: tiny model to build and serve."""
    steps: int = 12
    backend: str = TCP.name
    """Weight-transfer backend (``weightwire.backends.BACKEND_NAMES``). ``nccl`` against the
    embedded server means its NCCL backend, ``weightwire_nccl`` (the reference server has no stock
    ``nccl``)."""
    batch: int = 64
    """Completions per step: ``batch / samples_per_prompt`` prompts, ``samples_per_prompt`` each."""
    samples_per_prompt: int = 4
    prompt_len: int = 8
    max_tokens: int = 16
    lr: float = 0.1
    target: str = "e"
    tolerance: float = 1e-3
    check_tokens: int = 8
    seed: int = 0
    api_key: str | None = None
    served_model: str | None = None
    """``model`` field of completion requests (a vLLM serving several names needs it)."""
    resync: bool = False
    """External server whose weights may have changed: push the policy's weights first."""
    server_gpu: str = "1"
    """Embedded server with nccl: the GPU it uses (``CUDA_VISIBLE_DEVICES``); JAX uses its device
    0."""
    colocated: bool = False
    """Trainer and embedded server on ONE GPU (JAX's device 0), synced over ``weightwire_ipc``;
    each step is generate -> ``/sleep`` -> train -> ``/wake_up`` -> sync."""
    sleep_level: int = 1
    """``--colocated``: the server's sleep level while the policy trains (vLLM's levels)."""
    dummy_start: bool = True
    """Embedded server with a tiny model: it starts from other random weights than the policy
    (vLLM's RLHF example starts its engine from dummy weights), so the first push visibly
    changes what it writes."""
    overlap: bool = False
    """The first quarter of the steps syncs blocking, the rest overlapped
    (``send_weights(wait=False)``: the round streams while the next step samples and trains);
    each step prints the trainer's stall next to the blocking rounds' time."""
    metrics_file: str | None = None
    """One JSON line per step (``evidence.StepRecord``); with matplotlib, the reward curve as
    a PNG next to it."""
    wait_ready: float | None = None
    """With ``server``: wait up to this many seconds for it to answer ``GET /health`` (a server
    started beside the demo, still loading) instead of failing at once when it does not."""

    def __post_init__(self) -> None:
        if self.backend not in DEMO_BACKENDS:
            raise ConfigError(
                f"--backend must be one of {', '.join(DEMO_BACKENDS)}, got {self.backend!r} "
                "(weightwire_ipc: pass --colocated)"
            )
        if self.server is not None and self.model_dir is None:
            raise ConfigError(
                "--server needs --model-dir: the directory the server loaded, so the JAX policy "
                "starts from the same weights and tokenizer"
            )
        if self.model_dir is not None and not (Path(self.model_dir) / "config.json").is_file():
            raise ConfigError(
                f"--model-dir {self.model_dir!r} is not a Hugging Face model "
                "directory (no config.json); pass the directory the server loaded"
            )
        for name, lo in (
            ("steps", 1),
            ("batch", 1),
            ("prompt_len", 1),
            ("max_tokens", 1),
            ("check_tokens", 1),
        ):
            if getattr(self, name) < lo:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be >= {lo}, got {getattr(self, name)}"
                )
        if self.samples_per_prompt < 1 or self.batch % self.samples_per_prompt:
            raise ConfigError(
                f"--batch {self.batch} must be a multiple of --samples-per-prompt "
                f"{self.samples_per_prompt}"
            )
        if not self.tolerance > 0:
            raise ConfigError(f"tolerance must be > 0, got {self.tolerance}")
        if self.colocated and self.server is not None:
            raise ConfigError(
                "--colocated starts the reference server on this GPU itself; drop --server"
            )
        if self.overlap and self.steps < 2:
            raise ConfigError("--overlap needs --steps >= 2 (one blocking step to compare with)")
        if self.overlap and self.colocated:
            raise ConfigError(
                "--overlap and --colocated exclude each other: a colocated server sleeps while "
                "the policy trains, so no round can stream meanwhile"
            )
        if self.wait_ready is not None:
            if self.server is None:
                raise ConfigError(
                    "--wait-ready waits for --server; the embedded server is waited for anyway"
                )
            if not 0 < self.wait_ready < math.inf:
                raise ConfigError(
                    f"--wait-ready must be a finite number of seconds > 0, got {self.wait_ready}"
                )
        if self.sleep_level not in (0, 1, 2):
            raise ConfigError(f"--sleep-level must be 0, 1 or 2, got {self.sleep_level}")

    @property
    def backend_name(self) -> str:
        if self.colocated:
            return IPC.name
        if self.backend == NCCL.name and self.server is None:
            return WEIGHTWIRE_NCCL.name
        return self.backend


@dataclass
class DemoResult:
    rewards: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    """The server's greedy text of the fixed prompt: at start, after the first push (if any), per
    step."""
    max_diffs: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    sync_seconds: list[float] = field(default_factory=list)
    sync_bytes: list[int] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """Summed over steps: rollouts, train, sync, check."""
    round_seconds: list[float] = field(default_factory=list)
    """``--overlap``: the blocking steps' ``send_weights()`` wall times."""
    stall_seconds: list[float] = field(default_factory=list)
    """``--overlap``: the overlapped steps' stalls (wait for the previous round + the call)."""
    stale_shares: list[float] = field(default_factory=list)
    """``--overlap``: per overlapped step, the share of rollout tokens sampled one round
    behind."""
    startup_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def rose(self) -> bool:
        if len(self.rewards) < 2:
            return False
        k = max(1, len(self.rewards) // 3)
        return float(np.mean(self.rewards[-k:])) > float(np.mean(self.rewards[:k]))

    @property
    def ok(self) -> bool:
        return self.rose and not self.failures and len(self.max_diffs) > 0


@dataclass
class DemoContext:
    """What the steps need; typed loosely so importing this module stays free of jax."""

    url: str
    model_dir: str
    dummy: bool
    """The embedded server started from other random weights than the policy's."""
    policy: Any
    reward: Any
    completions: Any
    client: Any
    engine: Any
