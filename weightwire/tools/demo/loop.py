"""``weightwire demo``: an on-policy RL loop whose every step ends in a weight sync.

One step: sample completions from the server (``/v1/completions``, token ids and
logprobs) -> score them (``reward.CharReward``) -> one REINFORCE step in JAX
(``policy.Policy``) -> ``send_weights()`` -> prove the sync landed:

- the server now reports the weight version just sent (``GET /weight_info``);
- its greedy completion of a fixed prompt carries log-probabilities equal to the
  JAX policy's for the same tokens (``|diff| < tolerance``, fp32);
- the next step's rollouts, sampled by the server, carry log-probabilities equal to
  the JAX policy's (checked inside the policy step, before it changes the params).

Before the first step the same fixed-prompt check proves that server and policy
start from identical weights. The demo succeeds (``DemoResult.ok``) only if every
check passed and the reward rose (mean of the last third of the steps above the
mean of the first third).
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.console import Console

from weightwire import backends
from weightwire._extras import require
from weightwire._lifetime import raise_if_stopped
from weightwire.control.ready import ServerNotReady, wait_until_ready
from weightwire.tools._cli import CommandError, probe_server
from weightwire.tools.demo.checks import first_sync, fixed_prompt_check, verdict
from weightwire.tools.demo.config import DemoConfig, DemoContext, DemoResult
from weightwire.tools.demo.evidence import RATE_MIN_BYTES, MetricsFile, StepRecord, shown_rate
from weightwire.tools.demo.overlap import OverlapSync, blocking_steps
from weightwire.tools.demo.render import StartupProgress, StepRow, StepTable


def run_demo(cfg: DemoConfig, console: Console | None = None) -> DemoResult:
    console = console or Console()
    result = DemoResult()
    t_start = time.perf_counter()
    with ExitStack() as stack:
        metrics_file = None
        if (
            cfg.metrics_file is not None
        ):  # opened first: an unwritable path fails before any start-up
            metrics_file = MetricsFile(cfg.metrics_file)
            stack.callback(metrics_file.close)
        ctx = _start(cfg, console, stack)
        result.startup_seconds = time.perf_counter() - t_start
        _train(cfg, console, ctx, result, metrics_file)
    result.total_seconds = time.perf_counter() - t_start
    verdict(cfg, console, result)
    return result


def _start(cfg: DemoConfig, console: Console, stack: ExitStack) -> DemoContext:
    from weightwire.tools.demo.server import EmbeddedServer, build_tiny_model

    backend = cfg.backend_name
    on_gpu = backends.get(backend).needs_cuda
    # Checked before any child starts: a missing extra fails in milliseconds with the extra's name.
    require(
        "jax", "flax", "optax", "safetensors", "tokenizers", purpose="weightwire demo's JAX policy"
    )
    if cfg.server is None:
        require(
            "torch",
            "transformers",
            "fastapi",
            "uvicorn",
            purpose="the embedded reference server (or pass --server URL --model-dir DIR)",
        )
    elif cfg.wait_ready is not None:  # a server started beside the demo: wait, bounded
        try:
            wait_until_ready(cfg.server, cfg.wait_ready, api_key=cfg.api_key)
        except ServerNotReady as exc:
            raise CommandError(
                f"the server at {exc.server} was not ready after {exc.waited:.1f} s (last GET "
                f"/health: {exc.last}): start it, check --server, or raise --wait-ready"
            ) from None
    else:  # a wrong URL or a stopped server fails here, in a second, not after JAX's start-up
        probe_server(cfg.server)
    if on_gpu:
        import jax

        # XLA's default f32 matmul on a GPU is reduced precision (TF32); the server computes
        # in full f32, so the sync checks would see ~1e-3 log-prob differences that are not
        # a sync fault (seen with --colocated on an H200).
        jax.config.update("jax_default_matmul_precision", "highest")
        if jax.default_backend() != "gpu":
            what = "--colocated" if cfg.colocated else f"--backend {backend}"
            raise CommandError(
                f"{what} needs JAX on a CUDA GPU (JAX runs on "
                f"{jax.default_backend()}); use --backend weightwire_tcp on a CPU-only host"
            )
    server: EmbeddedServer | None = None
    with StartupProgress(console, phases=6 if cfg.server is None else 3) as prog:
        if cfg.server is None:
            # The server loads while this process builds the policy: the two start-ups overlap.
            prog.phase(f"launching the reference server ({backend}, child process)")
            gpu = cfg.server_gpu
            if cfg.colocated:  # the GPU JAX calls device 0
                gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
            served, dummy_weights = _served_model(cfg)
            server = EmbeddedServer(
                served,
                backend=backend,
                device="cuda" if on_gpu else "cpu",
                cuda_visible_devices=gpu if on_gpu else None,
            )
            stack.callback(server.stop)
            server.launch()
            prog.phase(f"locating {cfg.model} (child process; built and cached on first use)")
            model_dir = cfg.model_dir or build_tiny_model(cfg.model)
        else:
            model_dir, dummy_weights = str(cfg.model_dir), False
        prog.phase("importing JAX, loading the checkpoint into the Flax policy")
        from weightwire.control.client import HTTPWeightSyncClient
        from weightwire.jax_side.engine import JAXTrainerEngine
        from weightwire.jax_side.source import PytreeSource
        from weightwire.tools.demo.policy import Policy
        from weightwire.tools.demo.reward import CharReward
        from weightwire.tools.demo.rollout import CompletionsClient
        from weightwire.tools.models import decoder
        from weightwire.tools.models.loading import load_decoder
        from weightwire.trainer.config import TrainerInitInfo

        model_cfg, params = load_decoder(model_dir)
        policy = Policy(model_cfg, params, lr=cfg.lr)
        reward = CharReward.from_model_dir(model_dir, model_cfg.vocab_size, cfg.target)
        prog.phase("compiling the policy (jit)")
        dummy = np.zeros((cfg.batch, cfg.prompt_len + cfg.max_tokens), np.int32)
        policy.warmup(dummy, cfg.prompt_len)
        policy.logprobs(dummy[:1, : cfg.prompt_len + cfg.check_tokens])
        if server is not None:
            prog.phase("waiting for the reference server")
            url = server.wait_ready()
        else:
            url = str(cfg.server).rstrip("/")
        prog.phase(f"weight-transfer rendezvous with {url} ({backend})")
        client = HTTPWeightSyncClient(url, timeout=120.0, api_key=cfg.api_key)
        stack.callback(client.close)
        source = PytreeSource(lambda: policy.params, decoder.naming(model_cfg))
        info = TrainerInitInfo(
            backend=backend, packed_buffer_size_bytes=64 << 20, device=0 if on_gpu else None
        )
        engine = JAXTrainerEngine.trainer_init(info, client=client, source=source)
        stack.callback(engine.shutdown)
        completions = CompletionsClient(url, api_key=cfg.api_key, model=cfg.served_model)
        stack.callback(completions.close)
    return DemoContext(url, model_dir, dummy_weights, policy, reward, completions, client, engine)


DUMMY_SEED = 1
"""The tiny model's seed for the embedded server's dummy weights (the policy loads seed 0)."""


def _served_model(cfg: DemoConfig) -> tuple[str, bool]:
    """``(what the embedded server loads, whether those are dummy weights)``.

    The dummy directory is the same tiny model (architecture, tokenizer) built with another
    seed; located without torch when cached, else built in a child like the policy's."""
    if cfg.model_dir is not None or not cfg.dummy_start:
        return cfg.model_dir or cfg.model, False
    from weightwire.tools.demo.server import build_tiny_model
    from weightwire.tools.server.tiny import MATRIX_NAMES, cached_tiny_dir

    if cfg.model not in MATRIX_NAMES:
        return cfg.model, False
    return cached_tiny_dir(cfg.model, DUMMY_SEED) or build_tiny_model(
        cfg.model, seed=DUMMY_SEED
    ), True


def _train(
    cfg: DemoConfig,
    console: Console,
    ctx: DemoContext,
    result: DemoResult,
    metrics_file: MetricsFile | None,
) -> None:
    policy, reward, completions, client = ctx.policy, ctx.reward, ctx.completions, ctx.client
    rng = np.random.default_rng(cfg.seed)
    low, high = (
        min(3, reward.n_tokens - 1),
        reward.n_tokens,
    )  # skip the tiny tokenizer's special ids
    fixed = rng.integers(low, high, cfg.prompt_len).astype(np.int32)
    if not first_sync(cfg, console, ctx, result, fixed):
        return
    table = StepTable(console, cfg.target)
    overlap = OverlapSync(ctx, cfg, fixed) if cfg.overlap else None
    first_overlapped = blocking_steps(cfg.steps) if cfg.overlap else cfg.steps
    with table.shown():
        for step in range(cfg.steps):
            raise_if_stopped()  # a SIGTERM whose KeyboardInterrupt a gc callback swallowed
            clock: dict[str, float] = {}
            t = time.perf_counter()
            prompts = rng.integers(
                low, high, (cfg.batch // cfg.samples_per_prompt, cfg.prompt_len)
            ).astype(np.int32)
            rollouts = completions.generate(
                prompts, max_tokens=cfg.max_tokens, temperature=1.0, n=cfg.samples_per_prompt
            )
            t = _lap(clock, "rollouts", t)
            if cfg.colocated:  # the server gives its GPU memory back while the policy trains
                client.sleep(cfg.sleep_level, mode="wait")
            hits = reward.hits(rollouts.completions)
            _, mine = policy.step(rollouts.sequences, cfg.prompt_len, hits)
            if overlap is not None:  # rollouts may come from the round before the one in flight
                seen = overlap.rollouts(rollouts.sequences, cfg.prompt_len, rollouts.logprobs, mine)
                rollout_diff, stale = seen.diff, seen.stale
            else:
                rollout_diff, stale = float(np.max(np.abs(mine - rollouts.logprobs))), 0.0
            if cfg.colocated:
                client.wake_up()
            t = _lap(clock, "train", t)
            version = str(step + 1)
            if overlap is not None and step >= first_overlapped:
                sync = _overlapped(overlap, version, clock, t)
                result.stall_seconds.append(clock["sync"])
                result.stale_shares.append(stale)
            else:
                sync = _blocking(ctx, cfg, version, clock, t, fixed)
                if overlap is not None:
                    overlap.landed_blocking()
                    result.round_seconds.append(clock["sync"])
            max_diff = max(rollout_diff, sync.diff)
            notes = list(sync.notes)
            if sync.served != sync.version:
                notes.append(f"server reports version {sync.served!r}")
            if max_diff >= cfg.tolerance:
                notes.append("logprobs differ")
            for note in notes[len(sync.notes) :]:
                result.failures.append(f"step {step + 1}: {note} (max |Δlogp| {max_diff:.2e})")
            if stale:
                notes.append(f"{stale:.0%} of rollout tokens one round behind")
            result.rewards.append(float(hits.mean()))
            result.max_diffs.append(max_diff)
            result.sync_seconds.append(clock["sync"])  # what the trainer waited for
            result.sync_bytes.append(sync.nbytes)
            result.texts.append(sync.text)
            for k, v in clock.items():
                result.phase_seconds[k] = result.phase_seconds.get(k, 0.0) + v
            ok = max_diff < cfg.tolerance and sync.served == sync.version
            table.add(
                StepRow(
                    step=step + 1,
                    reward=float(hits.mean()),
                    sample=sync.text,
                    sync_ms=clock["sync"] * 1e3,
                    megabytes=sync.nbytes / 1e6,
                    gbps=shown_rate(sync.nbytes, sync.gbps),
                    version=str(sync.served),
                    max_diff=max_diff,
                    ok=ok,
                    step_s=sum(clock.values()),
                    note="; ".join(notes),
                )
            )
            if metrics_file is not None:
                metrics_file.write(
                    StepRecord(
                        step=step + 1,
                        reward=float(hits.mean()),
                        weight_version=str(sync.served),
                        sync_seconds=clock["sync"],
                        sync_bytes=sync.nbytes,
                        tensors=sync.tensors,
                        max_abs_logprob_diff=max_diff,
                        ok=ok,
                        step_seconds=sum(clock.values()),
                        phase_seconds=dict(clock),
                        server_text=sync.text,
                    )
                )
    if overlap is not None:
        _land_last(overlap, console, cfg, result)
    if result.sync_bytes and max(result.sync_bytes) < RATE_MIN_BYTES:
        console.print(
            f"(GB/s is shown for rounds of {RATE_MIN_BYTES >> 20} MiB or more only: a "
            f"{max(result.sync_bytes) / 1e6:.2f} MB round's time is its fixed cost, not bandwidth)",
            highlight=False,
            soft_wrap=True,
        )


@dataclass(frozen=True)
class StepSync:
    """What a step's sync showed: the round it checked and how that check went."""

    version: str
    served: str | None
    diff: float
    text: str
    nbytes: int
    tensors: int
    gbps: float
    notes: tuple[str, ...] = ()


def _blocking(
    ctx: DemoContext, cfg: DemoConfig, version: str, clock: dict[str, float], t: float, fixed: Any
) -> StepSync:
    metrics = ctx.engine.send_weights(weight_version=version)
    t = _lap(clock, "sync", t)
    served = ctx.client.weight_info()[0].get("weight_version")
    check = fixed_prompt_check(ctx.completions, ctx.policy, ctx.reward, fixed, cfg.check_tokens)
    _lap(clock, "check", t)
    return StepSync(
        version,
        served,
        check.diff,
        check.text,
        metrics.nbytes,
        metrics.tensors,
        metrics.gbps,
    )


def _overlapped(overlap: OverlapSync, version: str, clock: dict[str, float], t: float) -> StepSync:
    """Wait for the round in flight (checked), hand over this step's; the stall is booked
    under ``sync``, the check under ``check``."""
    hand = overlap.handover(version)
    spent = time.perf_counter() - t
    clock["sync"] = hand.stall_seconds
    clock["check"] = max(0.0, spent - hand.stall_seconds)
    landed = hand.landed
    note = f"overlapped: round {version} in flight"
    if landed is None:  # the step before synced blocking: nothing in flight to check
        before = str(int(version) - 1)
        return StepSync(before, before, 0.0, "(checked above)", 0, 0, 0.0, (note,))
    note += f", round {landed.version} took {landed.round_seconds * 1e3:.0f} ms"
    return StepSync(
        landed.version,
        landed.served,
        landed.check.diff,
        landed.check.text,
        landed.nbytes,
        0,
        0.0,
        (note,),
    )


def _land_last(overlap: OverlapSync, console: Console, cfg: DemoConfig, result: DemoResult) -> None:
    """After the last step: its round, waited for and checked like the others."""
    landed = overlap.land()
    if landed is None:
        return
    result.max_diffs.append(landed.check.diff)
    good = landed.served == landed.version and landed.check.diff < cfg.tolerance
    console.print(
        f"last round {landed.version}: landed {landed.wait_seconds * 1e3:.0f} ms after the loop; "
        f"server reports {landed.served!r}, max |Δlogp| {landed.check.diff:.1e} "
        f"({'ok' if good else 'FAIL'})",
        highlight=False,
        soft_wrap=True,
    )
    if not good:
        result.failures.append(
            f"last round {landed.version}: server reports {landed.served!r}, max |Δlogp| "
            f"{landed.check.diff:.2e}"
        )


def _lap(clock: dict[str, float], name: str, since: float) -> float:
    now = time.perf_counter()
    clock[name] = now - since
    return now
