"""Helpers of the interop lane: the server handle and the Hugging Face reference decode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import torch

from weightwire.shared.routes import ROUND_STATS_METHOD

MAX_TOKENS = 12
PROMPTS = [[5, 17, 42, 99, 123, 7, 256, 300], [3, 4, 5, 6], [400, 401, 402, 403, 404, 405], [77]]


@dataclass(frozen=True)
class VLLMServer:
    url: str
    model_dir: str

    def greedy(
        self,
        prompts: list[list[int]] = PROMPTS,
        max_tokens: int = MAX_TOKENS,
        model: str | None = None,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """The server's greedy token ids and their logprobs, one row per prompt (``model``:
        a LoRA adapter's name; None: the base model)."""
        reply = httpx.post(
            f"{self.url}/v1/completions",
            timeout=120,
            json={
                **({"model": model} if model is not None else {}),
                "prompt": prompts,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "logprobs": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        assert reply.status_code == 200, reply.text
        choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
        return [c["token_ids"] for c in choices], [c["logprobs"]["token_logprobs"] for c in choices]

    def weight_version(self) -> str:
        return httpx.get(f"{self.url}/weight_info", timeout=30).json()["weight_version"]

    def round_stats(self) -> list[dict[str, Any]]:
        """Each worker's latest round as it counted it (the plugin's worker method
        ``weightwire_round_stats`` through ``/collective_rpc``), one per worker, by rank."""
        reply = httpx.post(
            f"{self.url}/collective_rpc",
            json={"method": ROUND_STATS_METHOD, "timeout": 60},
            timeout=90,
        )
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        assert all(isinstance(r, dict) for r in results), f"a worker counted no round: {results}"
        return sorted(results, key=lambda r: r["rank"])


@torch.no_grad()
def hf_greedy(
    model: torch.nn.Module, prompts: list[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS
) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy decoding with full recomputation (no cache, no generate() config): the
    plainest reference there is. Returns token ids and their float32 logprobs."""
    out_ids, out_lps = [], []
    for prompt in prompts:
        ids, lps = list(prompt), []
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            nxt = int(torch.argmax(logits))
            ids.append(nxt)
            lps.append(float(logp[nxt]))
        out_ids.append(ids[len(prompt) :])
        out_lps.append(lps)
    return out_ids, out_lps


def assert_same_greedy(
    server: VLLMServer,
    model: torch.nn.Module,
    what: str,
    prompts: list[list[int]] = PROMPTS,
    served: str | None = None,
) -> list[list[int]]:
    """Server greedy == HF greedy, token for token (and logprobs within 1e-3); ``served``
    names the adapter the server applies (None: the base model)."""
    got, got_lp = server.greedy(prompts, model=served)
    want, want_lp = hf_greedy(model, prompts)
    assert got == want, f"{what}: vLLM greedy {got} != Hugging Face {want}"
    diff = float(np.max(np.abs(np.asarray(got_lp) - np.asarray(want_lp))))
    assert diff < 1e-3, f"{what}: logprobs differ by {diff}"
    return got
