"""Rollouts over OpenAI ``/v1/completions``, in token ids end to end.

Prompts go out as token-id lists and completions come back as ids
(``return_token_ids``) with the log-probability of each sampled token, so the
trainer needs no tokenizer to train and the ids it scores are exactly the ids the
server sampled. Works against a real vLLM and the reference server alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from weightwire.shared.errors import WeightwireError
from weightwire.shared.routes import COMPLETIONS


class RolloutError(WeightwireError, RuntimeError):
    """The server's completion reply is unusable (HTTP error or an unexpected shape)."""


@dataclass(frozen=True)
class Rollouts:
    prompts: np.ndarray
    """``int32 [B, P]``."""
    completions: np.ndarray
    """``int32 [B, N]``: sampled token ids."""
    logprobs: np.ndarray
    """``float32 [B, N]``: the server's log-probability of each sampled token."""

    @property
    def sequences(self) -> np.ndarray:
        return np.concatenate([self.prompts, self.completions], axis=1)


class CompletionsClient:
    """Thin client over one server's ``/v1/completions`` (no retries: a failure is loud)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 120.0,
        api_key: str | None = None,
        model: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout, headers=headers, transport=transport
        )
        self._model = model

    def close(self) -> None:
        self._http.close()

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        if self._model is not None:
            body = {"model": self._model, **body}
        try:
            reply = self._http.post(COMPLETIONS.path, json=body)
        except httpx.HTTPError as exc:
            raise RolloutError(
                f"POST {COMPLETIONS.path} failed: {type(exc).__name__}: {exc}"
            ) from None
        if reply.status_code != 200:
            raise RolloutError(
                f"POST {COMPLETIONS.path} -> HTTP {reply.status_code}: {reply.text[:400]}"
            )
        return reply.json()

    def generate(
        self, prompts: np.ndarray, *, max_tokens: int, temperature: float, n: int = 1
    ) -> Rollouts:
        """``n`` completions per prompt row, each exactly ``max_tokens`` long (EOS ignored).

        Rows of the result are prompt-major (prompt ``i``'s ``n`` samples are rows
        ``i*n .. i*n+n-1``), the order OpenAI servers number their choices in.
        """
        unique = np.asarray(prompts, dtype=np.int32)
        if unique.ndim != 2 or unique.shape[0] == 0 or unique.shape[1] == 0:
            raise ValueError(
                f"prompts must be a non-empty [batch, length] array, got shape {unique.shape}"
            )
        body: dict[str, Any] = {
            "prompt": unique.tolist(),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "logprobs": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if n != 1:
            body["n"] = n
        data = self._post(body)
        prompts = np.repeat(unique, n, axis=0)
        choices = data.get("choices")
        if not isinstance(choices, list) or len(choices) != len(prompts):
            raise RolloutError(
                f"expected {len(prompts)} choices, got {type(choices).__name__} "
                f"of length {len(choices) if isinstance(choices, list) else '-'}"
            )
        ids = np.zeros((len(prompts), max_tokens), np.int32)
        lps = np.zeros((len(prompts), max_tokens), np.float32)
        for choice in sorted(choices, key=lambda c: c.get("index", 0)):
            i = choice.get("index")
            tokens = choice.get("token_ids")
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            if not isinstance(i, int) or not 0 <= i < len(prompts):
                raise RolloutError(f"choice index {i!r} out of range")
            if not isinstance(tokens, list) or len(tokens) != max_tokens:
                raise RolloutError(
                    f"choice {i}: expected {max_tokens} token_ids (return_token_ids + "
                    "ignore_eos), got "
                    f"{tokens if not isinstance(tokens, list) else len(tokens)!r}; does the "
                    "server support return_token_ids?"
                )
            if not isinstance(logprobs, list) or len(logprobs) != max_tokens or None in logprobs:
                raise RolloutError(f"choice {i}: expected {max_tokens} token_logprobs")
            sent = choice.get("prompt_token_ids")
            if sent is not None and sent != prompts[i].tolist():
                raise RolloutError(
                    f"choice {i}: the server prompted with {sent[:12]}..., not the ids sent "
                    "(did it add a BOS token?)"
                )
            ids[i], lps[i] = tokens, logprobs
        return Rollouts(prompts, ids, lps)
