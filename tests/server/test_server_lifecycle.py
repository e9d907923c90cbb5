"""Process lifecycle and completions: CLI errors, ready line, name-resolved tiny-qwen2,
seeded sampling, and workers that never outlive the API process."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from weightwire.tools.server import serve_main

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads /proc for child processes"
)


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["--model", "tiny-llama", "--replicas", "0"], 2, "--replicas must be in [1, 64]"),
        (
            ["--model", "tiny-llama", "--backend", "weightwire_nccl"],
            2,
            "weightwire_nccl needs --device cuda",
        ),
        (["--model", "tiny-llama", "--port", "70000"], 2, "--port must be in [0, 65535]"),
        (
            ["--model", "/nonexistent/model"],
            2,
            "no such directory (or pass tiny-llama / tiny-qwen2)",
        ),
        (["--model", "tiny-llama", "--backend", "nccl"], 2, "invalid choice: 'nccl'"),
        (
            ["--model", "tiny-llama", "--decode-step-delay", "nan"],
            2,
            "--decode-step-delay must be in [0, 10] seconds, got nan",
        ),
    ],
)
def test_cli_errors_exit_nonzero_with_a_reason(argv, code, message, capsys, tiny_cache) -> None:
    assert serve_main(argv) == code
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def qwen(server_factory, tiny_cache):
    # By name: the server builds / finds tiny-qwen2 in $WEIGHTWIRE_CACHE itself.
    return server_factory(["--model", "tiny-qwen2", "--replicas", "1"])


def test_ready_line_names_the_real_port(qwen) -> None:
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", qwen.url) and not qwen.url.endswith(":0")
    # The progress lines say what is loaded; the ready line comes once, after them.
    # (the launcher may or may not have read the routes line that follows the ready line)
    ready = f"weightwire server ready on {qwen.url}"
    assert qwen.lines.count(ready) == 1, qwen.lines
    before = qwen.lines[: qwen.lines.index(ready)]
    assert any("loading" in line and "tiny-qwen2" in line for line in before), qwen.lines


def test_seeded_sampling_is_reproducible_and_shaped_like_openai(qwen) -> None:
    body = {
        "prompt": ["Hello world", [5, 6, 7]],
        "max_tokens": 6,
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 1234,
        "n": 2,
        "logprobs": 3,
        "ignore_eos": True,
        "model": "tiny-qwen2",
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }
    a = httpx.post(qwen.url + "/v1/completions", json=body, timeout=60).json()
    b = httpx.post(qwen.url + "/v1/completions", json=body, timeout=60).json()
    c = httpx.post(qwen.url + "/v1/completions", json={**body, "seed": 99}, timeout=60).json()
    assert a["object"] == "text_completion" and a["model"] == "tiny-qwen2"
    assert [ch["index"] for ch in a["choices"]] == [0, 1, 2, 3]
    assert [ch["logprobs"] for ch in a["choices"]] == [ch["logprobs"] for ch in b["choices"]]
    assert [ch["text"] for ch in a["choices"]] == [ch["text"] for ch in b["choices"]]
    assert [ch["logprobs"]["tokens"] for ch in a["choices"]] != [
        ch["logprobs"]["tokens"] for ch in c["choices"]
    ]
    assert (
        a["usage"]["completion_tokens"] == 4 * 6
        and a["usage"]["prompt_tokens"] == a["usage"]["total_tokens"] - 24
    )
    for ch in a["choices"]:
        lp = ch["logprobs"]
        assert (
            len(lp["tokens"])
            == len(lp["token_logprobs"])
            == len(lp["top_logprobs"])
            == len(lp["text_offset"])
            == 6
        )
        for tok, val, top in zip(
            lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
        ):
            assert val < 0 and top[tok] == val and 3 <= len(top) <= 4
            assert max(top.values()) >= val
        assert lp["tokens"] == [f"token_id:{t}" for t in ch["token_ids"]]
        assert ch["finish_reason"] == "length"


def test_greedy_is_the_argmax_of_its_own_logprobs(qwen) -> None:
    r = httpx.post(
        qwen.url + "/v1/completions",
        json={
            "prompt": "Once upon",
            "max_tokens": 5,
            "temperature": 0,
            "logprobs": 5,
            "ignore_eos": True,
            "return_tokens_as_token_ids": True,
        },
        timeout=60,
    ).json()
    lp = r["choices"][0]["logprobs"]
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) == 5 and top[tok] == val == max(top.values())


def test_sigterm_stops_server_and_workers(qwen) -> None:
    workers = children(qwen.proc.pid)
    assert len(workers) == 1
    qwen.proc.send_signal(signal.SIGTERM)
    assert qwen.proc.wait(30) == 0
    assert wait_gone(workers) == []


def test_workers_die_with_a_killed_api_process(server_factory, tiny_llama) -> None:
    server = server_factory(["--model", tiny_llama, "--replicas", "2"])
    workers = children(server.proc.pid)
    assert len(workers) == 2 and all(alive(p) for p in workers)
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    assert wait_gone(workers) == [], "workers outlived the API process"
