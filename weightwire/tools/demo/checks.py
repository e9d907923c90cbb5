"""The demo's checks that server and policy hold the same weights, and its closing report.

Kept apart from the loop (``loop``): ``fixed_prompt_check`` compares the server's greedy
completion of a fixed prompt with the JAX policy's log-probabilities; ``first_sync`` runs it
before step 1 (pushing first where the server starts from dummy weights); ``verdict`` prints
the outcome, the timings and the reward curve.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console

from weightwire.tools.demo.evidence import readable, save_plot, sparkline

if TYPE_CHECKING:
    from weightwire.tools.demo.config import DemoConfig, DemoContext, DemoResult


@dataclass(frozen=True)
class Check:
    diff: float
    """Max |server logprob - policy logprob| over the server's greedy completion."""
    text: str
    """That completion's text, printable."""


def fixed_prompt_check(
    completions: Any,
    policy: Any,
    reward: Any,
    prompt: np.ndarray,
    n_tokens: int,
    *,
    params: Any = None,
) -> Check:
    """The server's greedy completion of ``prompt`` against the policy's log-probabilities
    under ``params`` (default: its current ones)."""
    out = completions.generate(prompt[None, :], max_tokens=n_tokens, temperature=0.0)
    mine = policy.logprobs(out.sequences, params)[:, prompt.shape[0] - 1 :]
    return Check(
        float(np.max(np.abs(mine - out.logprobs))), readable(reward.text(out.completions[0]))
    )


def first_sync(
    cfg: DemoConfig, console: Console, ctx: DemoContext, result: DemoResult, fixed: np.ndarray
) -> bool:
    """Before step 1: prove server and policy hold the same weights, pushing them first where the
    server started from dummy weights (or ``--resync``). False (a failure recorded) if they
    differ."""
    reward = ctx.reward
    check = fixed_prompt_check(ctx.completions, ctx.policy, reward, fixed, cfg.check_tokens)
    result.texts.append(check.text)
    what = (
        f"{cfg.model}, a tiny model with random weights (untrained: its text is gibberish by "
        "design)"
        if cfg.server is None and cfg.model_dir is None
        else ctx.model_dir
    )
    console.print(
        f"model: {what}; reward = fraction of completion tokens containing "
        f"{cfg.target!r} (a random policy scores {reward.base_rate:.3f}); server text "
        "= the server's greedy completion of a fixed prompt after each sync, "
        f"{cfg.target!r} highlighted",
        highlight=False,
        soft_wrap=True,
    )
    pushed = ctx.dummy or (check.diff >= cfg.tolerance and cfg.resync and cfg.server is not None)
    if ctx.dummy:
        console.print(
            "step 0: the server starts from dummy weights (the same model, other "
            f"random values), not the policy's: it writes {check.text!r} (max |Δlogp| "
            f"vs the policy {check.diff:.1e})",
            highlight=False,
            soft_wrap=True,
        )
    elif not pushed:
        result.max_diffs.append(check.diff)
    if pushed:
        metrics = ctx.engine.send_weights(weight_version="0")
        check = fixed_prompt_check(ctx.completions, ctx.policy, reward, fixed, cfg.check_tokens)
        result.max_diffs.append(check.diff)
        result.texts.append(check.text)
        why = "" if ctx.dummy else "--resync: "
        console.print(
            f"{why}pushed the policy's weights as version '0' "
            f"({metrics.nbytes / 1e6:.2f} MB, {metrics.tensors} tensors, "
            f"{metrics.total_seconds * 1e3:.0f} ms); the server now writes "
            f"{check.text!r}",
            highlight=False,
            soft_wrap=True,
        )
    same = check.diff < cfg.tolerance
    console.print(
        f"step-0 weights: server and JAX policy {'agree' if same else '[bold red]DIFFER[/]'} "
        f"(max |Δlogp| {check.diff:.1e} over the server's {cfg.check_tokens}-token greedy "
        f"completion; tolerance {cfg.tolerance:.0e})",
        highlight=False,
        soft_wrap=True,
    )
    if not same and pushed:
        result.failures.append(
            f"step 0: the server's weights differ from the policy's after the first push "
            f"(max |Δlogp| {check.diff:.2e} >= tolerance {cfg.tolerance:.0e})"
        )
    elif not same:
        result.failures.append(
            f"step 0: the server's weights differ from {ctx.model_dir} (max |Δlogp| "
            f"{check.diff:.2e}). Serve that directory unmodified and in float32 (vLLM on CPU "
            "downcasts float32 checkpoints to bfloat16 unless started with --dtype float32)"
            + (
                ""
                if cfg.server is None or cfg.resync
                else ", or pass --resync if an earlier run changed the server's weights"
            )
        )
    return same


def verdict(cfg: DemoConfig, console: Console, result: DemoResult) -> None:
    torch_free = "torch" not in sys.modules
    if result.rewards:
        k = max(1, len(result.rewards) // 3)
        first, last = float(np.mean(result.rewards[:k])), float(np.mean(result.rewards[-k:]))
        sync_ms = 1e3 * float(np.median(result.sync_seconds))
        console.print(
            f"reward {first:.3f} -> {last:.3f} (mean of first / last {k} step(s)); "
            f"{len(result.max_diffs)} sync checks, max |Δlogp| {max(result.max_diffs):.1e}; "
            f"median sync {sync_ms:.1f} ms; start-up {result.startup_seconds:.1f} s, total "
            f"{result.total_seconds:.1f} s; trainer process imported torch: "
            f"{'no' if torch_free else 'yes'}",
            highlight=False,
            soft_wrap=True,
        )
        if result.stall_seconds:
            overlap_line(console, result)
        spent = ", ".join(f"{name} {v:.1f} s" for name, v in result.phase_seconds.items())
        console.print(f"time in steps: {spent}", highlight=False, soft_wrap=True)
        curve(cfg, console, result)
        if not result.rose:
            console.print(
                f"[bold red]the reward did not rise[/] ({first:.3f} -> {last:.3f}); "
                "try more --steps or a larger --lr",
                highlight=False,
                soft_wrap=True,
            )
    for failure in result.failures:
        console.print(f"[bold red]check failed:[/] {failure}", highlight=False, soft_wrap=True)
    if result.ok:
        console.print(
            "[bold green]PASS[/]: the reward rose and every sync check passed", highlight=False
        )
    else:
        console.print("[bold red]FAIL[/]", highlight=False)


def overlap_line(console: Console, result: DemoResult) -> None:
    """``--overlap``: the trainer's stall per overlapped step next to the blocking rounds."""
    stall = 1e3 * float(np.median(result.stall_seconds))
    line = (
        f"overlap: the trainer stood still {stall:.2f} ms per overlapped step (median of "
        f"{len(result.stall_seconds)}: the wait for the previous round plus the call)"
    )
    if result.round_seconds:
        blocking = 1e3 * float(np.median(result.round_seconds))
        line += (
            f", against {blocking:.1f} ms per blocking round (median of "
            f"{len(result.round_seconds)}): {stall / blocking:.1%}"
        )
    stale = float(np.mean(result.stale_shares)) if result.stale_shares else 0.0
    line += f"; {stale:.0%} of rollout tokens were sampled one round behind"
    console.print(line, highlight=False, soft_wrap=True)


def curve(cfg: DemoConfig, console: Console, result: DemoResult) -> None:
    """The reward curve: a sparkline, and a PNG next to ``--metrics-file`` where matplotlib is
    installed."""
    console.print(
        f"reward per step: {sparkline(result.rewards)}  {result.rewards[0]:.2f} -> "
        f"{result.rewards[-1]:.2f}",
        highlight=False,
        soft_wrap=True,
    )
    if cfg.metrics_file is None:
        return
    png = Path(cfg.metrics_file).with_suffix(".png")
    saved = save_plot(
        result.rewards, png, title=f"weightwire demo: reward (tokens containing {cfg.target!r})"
    )
    where = (
        f"; reward curve: {saved}"
        if saved
        else " (install matplotlib for a PNG of the reward curve)"
    )
    console.print(
        f"metrics: {cfg.metrics_file}, one JSON line per step{where}",
        highlight=False,
        soft_wrap=True,
    )
