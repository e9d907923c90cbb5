"""``weightwire demo`` end to end, and the pieces it is built from."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.cli.conftest import run_cli
from weightwire.jax_side.checkpoint import CheckpointError, pytree_from_hf, read_safetensors
from weightwire.tools.demo.config import DemoConfig, DemoResult
from weightwire.tools.demo.evidence import sparkline
from weightwire.tools.demo.reward import CharReward
from weightwire.tools.demo.rollout import CompletionsClient, RolloutError
from weightwire.tools.models import decoder
from weightwire.tools.models.loading import load_decoder

ROW = re.compile(r"^(\d+) \| ([0-9.]+) \| .* \| (\S+) \| (\S+)$")
ROW_NOTE = re.compile(
    r"^(\d+) \| [0-9.]+ \| .* \| [0-9.]+ \| [0-9.]+ \| \S+ \| (\S+) \| \S+ \| [0-9.]+ \| "
    r"(ok|FAIL) ?(.*)$"
)


def test_default_demo_rises_and_every_sync_check_passes(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    done = run_cli("demo", "--metrics-file", str(metrics), timeout=400)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    flat = " ".join(out.split())
    assert "tiny-llama, a tiny model with random weights" in flat
    # The server starts from dummy weights: the first push visibly changes what it writes.
    before = re.search(
        r"starts from dummy weights .*?: it writes '(.*?)' \(max \|Δlogp\| vs the "
        r"policy ([0-9.e+-]+)\)",
        flat,
    )
    after = re.search(
        r"pushed the policy's weights as version '0' .*?; the server now writes '(.*?)'", flat
    )
    assert before and after and before[1] != after[1] and float(before[2]) > 1e-2, flat
    assert "server and JAX policy agree" in out
    # Not a terminal: start-up progress comes as plain lines while it happens, not a bar at the end.
    phases = [line for line in out.splitlines() if re.match(r"^\[\d/6\] ", line)]
    assert [p[:5] for p in phases] == [f"[{i}/6]" for i in range(1, 7)], out
    assert phases[0].startswith("[1/6] launching the reference server (weightwire_tcp")
    rows = [m for m in (ROW.match(line) for line in out.splitlines()) if m]
    assert [int(m.group(1)) for m in rows] == list(range(1, DemoConfig().steps + 1))
    assert all(m.group(4) == "ok" for m in rows), out
    rewards = [float(m.group(2)) for m in rows]
    assert np.mean(rewards[-4:]) > np.mean(rewards[:4]) + 0.2, rewards
    assert "PASS" in out and "trainer process imported torch: no" in out
    assert "\ufffd" not in out  # a random model's partial UTF-8 is shown as ·
    # 0.56 MB rounds: no GB/s (a fixed cost, not bandwidth), and the table says why.
    assert all(line.split(" | ")[5] == "-" for line in out.splitlines() if ROW.match(line))
    assert "GB/s is shown for rounds of 64 MiB or more only" in flat
    # --metrics-file: one JSON line per step, the table's numbers; the curve as a sparkline.
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, DemoConfig().steps + 1))
    assert [f"{r['reward']:.3f}" for r in records] == [m.group(2) for m in rows]
    assert all(
        r["ok"] and r["sync_bytes"] > 0 and r["weight_version"] == str(r["step"]) for r in records
    )
    assert f"reward per step: {sparkline([r['reward'] for r in records])}" in out


def test_demo_overlap_prints_the_stall_next_to_the_blocking_rounds() -> None:
    done = run_cli("demo", "--overlap", "--steps", "5", timeout=400)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    rows = [m for m in (ROW_NOTE.match(line) for line in out.splitlines()) if m]
    assert [int(m.group(1)) for m in rows] == [1, 2, 3, 4, 5], out
    # Step 1 syncs blocking; steps 2-5 overlapped: each checks the round before it, in order.
    assert [m.group(2) for m in rows] == ["1", "1", "2", "3", "4"], out
    assert all(m.group(3) == "ok" for m in rows), out
    assert not rows[0].group(4) and all("overlapped: round" in m.group(4) for m in rows[1:])
    assert all(f"round {s - 1} took" in rows[s - 1].group(4) for s in (3, 4, 5))
    flat = " ".join(out.split())
    assert "last round 5: landed" in flat and "server reports '5'" in flat, flat
    assert re.search(
        r"overlap: the trainer stood still [0-9.]+ ms per overlapped step \(median of 4: .*\), "
        r"against [0-9.]+ ms per blocking round \(median of 1\): [0-9.]+%",
        flat,
    ), flat
    assert "PASS" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "1"], "--overlap needs --steps >= 2"),
        (["--colocated"], "--overlap and --colocated exclude each other"),
    ],
)
def test_demo_overlap_refuses_what_it_cannot_compare(args: list[str], message: str) -> None:
    done = run_cli("demo", "--overlap", *args, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stdout + done.stderr


def test_demo_exits_nonzero_when_a_sync_check_fails() -> None:
    # No two fp32 implementations agree to 1e-12: the step-0 check must fail and say why.
    done = run_cli("demo", "--steps", "2", "--tolerance", "1e-12", timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    out = " ".join(done.stdout.split())
    assert "check failed: step 0: the server's weights differ" in out and "FAIL" in out


def test_demo_result_judges_the_reward_trend() -> None:
    assert DemoResult(rewards=[0.2, 0.3, 0.5], max_diffs=[0.0]).ok
    assert not DemoResult(rewards=[0.2, 0.3, 0.2], max_diffs=[0.0]).ok
    assert not DemoResult(rewards=[0.2, 0.9], max_diffs=[0.0], failures=["x"]).ok
    assert not DemoResult(rewards=[0.5], max_diffs=[0.0]).ok  # one step cannot show a rise


# ---------------------------------------------------------------- checkpoint -> Flax
@pytest.mark.parametrize(
    "layout", [{}, {"scan_layers": True}, {"fused_qkv": True, "fused_gate_up": True}]
)
def test_checkpoint_loads_into_every_flax_layout_with_hf_logits(
    tiny_dir: str, layout: dict
) -> None:
    cfg, params = load_decoder(tiny_dir, **layout)
    tokens = np.array([[5, 17, 42, 99, 123, 7, 256]])
    mine = np.asarray(decoder.apply(params, jnp.asarray(tokens), cfg))
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(mine, ref, atol=2e-5)


def test_loader_names_missing_and_misshaped_tensors(tiny_dir: str) -> None:
    cfg, _ = load_decoder(tiny_dir)
    template = jax.eval_shape(lambda: decoder.init(jax.random.key(0), cfg))
    tensors = read_safetensors(tiny_dir)
    naming = decoder.naming(cfg)
    with pytest.raises(CheckpointError, match="lacks 1 tensor.*model.norm.weight"):
        pytree_from_hf(
            naming, template, {k: v for k, v in tensors.items() if k != "model.norm.weight"}
        )
    with pytest.raises(
        CheckpointError,
        match="model.norm.weight: checkpoint shape \\[63\\], model expects \\[64\\]",
    ):
        pytree_from_hf(naming, template, {**tensors, "model.norm.weight": np.ones(63, np.float32)})
    with pytest.raises(CheckpointError, match="does not map, e.g. \\['extra.weight'\\]"):
        pytree_from_hf(naming, template, {**tensors, "extra.weight": np.ones(2, np.float32)})


# ---------------------------------------------------------------- reward and rollouts
def test_reward_counts_tokens_containing_the_target() -> None:
    reward = CharReward(["", "e", "the", "a", "xyz"], "e")
    assert reward.hits(np.array([[1, 2, 3, 4]])).tolist() == [[1.0, 1.0, 0.0, 0.0]]
    assert reward.score(np.array([[1, 2, 3, 4], [3, 3, 3, 1]])).tolist() == [0.5, 0.25]
    assert reward.text([2, 3]) == "thea"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        reward.hits(np.array([5]))
    with pytest.raises(ValueError, match="no token of the vocabulary contains 'q'"):
        CharReward(["a", "b"], "q")


def _mock(reply: dict) -> CompletionsClient:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=reply))
    return CompletionsClient("http://server", transport=transport)


def _choice(i: int, ids: list[int], prompt: list[int]) -> dict:
    return {
        "index": i,
        "token_ids": ids,
        "prompt_token_ids": prompt,
        "logprobs": {"token_logprobs": [-1.0] * len(ids)},
    }


def test_rollouts_come_back_prompt_major() -> None:
    prompts = np.array([[7, 8], [9, 10]])
    reply = {
        "choices": [_choice(i, [100 + i, 200 + i], prompts[i // 2].tolist()) for i in (3, 1, 0, 2)]
    }
    out = _mock(reply).generate(prompts, max_tokens=2, temperature=1.0, n=2)
    assert out.completions.tolist() == [[100, 200], [101, 201], [102, 202], [103, 203]]
    assert out.sequences[2].tolist() == [9, 10, 102, 202]


@pytest.mark.parametrize(
    ("choice", "message"),
    [
        (_choice(0, [1, 2, 3], [7]), "expected 2 token_ids"),
        (_choice(0, [1, 2], [0, 7]), "did it add a BOS token"),
        ({"index": 0, "token_ids": [1, 2], "logprobs": None}, "expected 2 token_logprobs"),
    ],
)
def test_rollouts_refuse_a_reply_they_cannot_train_on(choice: dict, message: str) -> None:
    with pytest.raises(RolloutError, match=message):
        _mock({"choices": [choice]}).generate(np.array([[7]]), max_tokens=2, temperature=1.0)


def test_rollouts_surface_http_errors() -> None:
    transport = httpx.MockTransport(
        lambda request: httpx.Response(400, json={"error": "bad max_tokens"})
    )
    with pytest.raises(RolloutError, match="HTTP 400.*bad max_tokens"):
        CompletionsClient("http://server", transport=transport).generate(
            np.array([[7]]), max_tokens=2, temperature=1.0
        )


def test_tiny_model_fits_vllm_cpu_attention(tiny_dir: str) -> None:
    # The tiny model the demo serves must be one vLLM's CPU attention accepts (head_dim >= 32).
    hf = json.loads(Path(tiny_dir, "config.json").read_text())
    assert hf["hidden_size"] // hf["num_attention_heads"] >= 32


def test_sample_column_stays_on_one_line() -> None:
    from weightwire.tools.demo.render import _sample_markup

    shown = _sample_markup("ab\ne\x85[x]\u2028", "e")
    assert "\n" not in shown and "\x85" not in shown and "\u2028" not in shown
    assert (
        "[bold green]e[/]" in shown and "\\[x]" in shown
    )  # the target is highlighted, markup escaped


def test_the_demo_evidence_helpers() -> None:
    from weightwire.tools.demo.evidence import RATE_MIN_BYTES, readable, shown_rate

    assert sparkline([0.0, 0.5, 1.0, 0.99]) == "▁▅██"
    assert readable("a\ufffd\nb\x85c") == "a··b·c"
    assert shown_rate(558336, 0.02) is None and shown_rate(RATE_MIN_BYTES, 3.5) == 3.5


def test_the_reward_curve_is_a_png_where_matplotlib_is_installed(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from weightwire.tools.demo.evidence import save_plot

    png = save_plot([0.2, 0.5, 0.9], tmp_path / "curve.png", title="t")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unwritable_metrics_file_fails_before_start_up() -> None:
    done = run_cli("demo", "--metrics-file", "/no/such/dir/m.jsonl", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (
        "weightwire demo: error: --metrics-file '/no/such/dir/m.jsonl': cannot write it "
        "(No such file or directory)"
    )
    assert "launching" not in done.stdout
