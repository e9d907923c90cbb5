"""Token generation for ``/v1/completions`` inside a worker process.

A plain KV-cached decode loop over a Hugging Face causal LM: greedy when
``temperature == 0``, otherwise sampling from a ``torch.Generator`` seeded by the
request (so a seeded request is reproducible). Logprobs are the raw model's
log-softmax of the sampled token (temperature and top-p/top-k shape only the
sampling), which is what a trainer needs for importance ratios.

Hand-written rather than ``model.generate``: we need per-step raw logprobs, a
cancellation check between steps (``/pause?mode=abort``, or the API no longer waiting
for the request) and exact control of the generator, none of which ``generate``
exposes together.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from weightwire.shared.errors import ReferenceServerError


class NonFiniteOutput(ReferenceServerError):
    """The model computed NaN (or +inf) logits: its weights are not finite. No reply could
    carry such logprobs, and its samples would be noise, so the request fails at once."""


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the mass before it already reaches top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


class Generator:
    """Serves completion requests (parsed by ``completions.parse_completion_request``)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: torch.device,
        model_name: str,
        max_model_len: int,
        step_lock: threading.Lock | None = None,
        step_delay_s: float = 0.0,
    ) -> None:
        """``step_lock``: held through each forward pass (a prefill, one decode step), so a
        round's start waits for the step in progress, never for the whole request.
        ``step_delay_s``: slept after each decode step, the lock released."""
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.model_name, self.max_model_len = model_name, max_model_len
        self.eos_token_id = tokenizer.eos_token_id
        self.step_lock = threading.Lock() if step_lock is None else step_lock
        self.step_delay_s = step_delay_s

    def _step(self, **inputs: Any) -> tuple[Any, torch.Tensor]:
        """One forward pass: its KV cache and the last position's logits (float32)."""
        with self.step_lock:
            out = self.model(**inputs, use_cache=True)
            return out.past_key_values, out.logits[:, -1, :].float()

    def _encode(self, prompt: str | list[int], index: int) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if not ids:
            raise ValueError(f"prompt[{index}] encodes to zero tokens")
        return ids

    def _chat_prompts(self, req: dict[str, Any]) -> list[list[int]]:
        """``[ids]`` of ``req["messages"]`` rendered by the tokenizer's chat template; ``[]`` for a
        plain completion. Tokenized without special tokens, as vLLM does: the template writes
        them."""
        messages = req.get("messages")
        if not messages:
            return []
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "this model's tokenizer has no chat template (no 'chat_template' in its tokenizer "
                "config), so /v1/chat/completions cannot render messages; use /v1/completions"
            )
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise ValueError("the chat template rendered the messages to zero tokens")
        return [ids]

    def _piece(self, token_id: int, as_ids: bool = False) -> str:
        return f"token_id:{token_id}" if as_ids else self.tokenizer.decode([token_id])

    @torch.no_grad()
    def _decode_rows(
        self,
        ids: list[int],
        req: dict[str, Any],
        gen: torch.Generator,
        cancelled: Callable[[], bool],
    ) -> list[tuple[dict[str, Any], int]]:
        n, max_tokens, temperature = req["n"], req["max_tokens"], req["temperature"]
        want_top = req["logprobs"] or 0
        as_ids = req["return_tokens_as_token_ids"]
        rows = torch.tensor([ids] * n, dtype=torch.long, device=self.device)
        past, logits = self._step(input_ids=rows)
        tokens: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        tops: list[list[dict[str, float]]] = [[] for _ in range(n)]
        finish = ["length"] * n
        done = [False] * n
        for step in range(max_tokens):
            logp = torch.log_softmax(logits, dim=-1)
            if bool(torch.isnan(logp).any()):  # NaN or +inf logits both leave NaN here
                raise NonFiniteOutput(
                    f"the model's logits are not finite (NaN or infinity at decode step {step}), "
                    "so no token or logprob can be computed: the served weights hold non-finite "
                    "values (a round that pushed NaN/inf? `weightwire serve --check-finite` "
                    "refuses such rounds)"
                )
            if temperature == 0.0:
                nxt = torch.argmax(logits, dim=-1)
            else:
                probs = torch.softmax(
                    _filter_logits(logits / temperature, req["top_k"], req["top_p"]), dim=-1
                )
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            chosen = logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1).tolist()
            nxt_list = nxt.tolist()
            top_vals: list[Any] | None = None
            top_idx: list[Any] | None = None
            if want_top:
                top = torch.topk(logp, want_top, dim=-1)
                # An alternative the model rules out (-inf) is reported as -9999.0, as vLLM does:
                # JSON has no -inf.
                top_vals, top_idx = top.values.clamp_min(-9999.0).tolist(), top.indices.tolist()
            for i in range(n):
                if done[i]:
                    continue
                tokens[i].append(nxt_list[i])
                lps[i].append(chosen[i])
                if top_idx is not None and top_vals is not None:
                    entry: dict[str, float] = {}
                    for t, v in zip(top_idx[i], top_vals[i], strict=True):
                        # Descending order: when two ids decode alike, the likelier one keeps the
                        # key.
                        entry.setdefault(self._piece(t, as_ids), v)
                    entry.setdefault(self._piece(nxt_list[i], as_ids), chosen[i])
                    tops[i].append(entry)
                if nxt_list[i] == self.eos_token_id and not req["ignore_eos"]:
                    done[i], finish[i] = True, "stop"
            if all(done) or step == max_tokens - 1:
                break
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            if cancelled():
                finish = ["abort" if not d else f for d, f in zip(done, finish, strict=True)]
                break
            past, logits = self._step(input_ids=nxt.view(n, 1), past_key_values=past)
        return [
            (
                self._choice(tokens[i], lps[i], tops[i] if want_top else None, finish[i], req),
                len(tokens[i]),
            )
            for i in range(n)
        ]

    def _aborted_rows(self, req: dict[str, Any]) -> list[tuple[dict[str, Any], int]]:
        return [
            (self._choice([], [], [] if req["logprobs"] else None, "abort", req), 0)
            for _ in range(req["n"])
        ]

    def _choice(
        self,
        tokens: list[int],
        lps: list[float],
        tops: list[dict[str, float]] | None,
        finish: str,
        req: dict[str, Any],
    ) -> dict[str, Any]:
        visible = tokens[:-1] if finish == "stop" else tokens  # the EOS token is not text
        choice: dict[str, Any] = {
            "text": self.tokenizer.decode(visible, skip_special_tokens=True),
            "finish_reason": finish,
            "logprobs": None,
        }
        if req["logprobs"] is not None:
            pieces = [self._piece(t, req["return_tokens_as_token_ids"]) for t in tokens]
            offsets, pos = [], 0
            for piece in pieces:
                offsets.append(pos)
                pos += len(piece)
            choice["logprobs"] = {
                "tokens": pieces,
                "token_logprobs": lps,
                "top_logprobs": tops,
                "text_offset": offsets,
            }
        if req["return_token_ids"]:
            choice["token_ids"] = tokens
        return choice

    def complete(self, req: dict[str, Any], cancelled: Callable[[], bool]) -> dict[str, Any]:
        """One OpenAI ``text_completion`` response for a parsed request."""
        gen = torch.Generator(device=self.device)
        if req["seed"] is None:
            gen.seed()
        else:
            gen.manual_seed(req["seed"] % (1 << 64))
        encoded = [
            self._encode(p, i) for i, p in enumerate(self._chat_prompts(req) or req["prompts"])
        ]
        for i, ids in enumerate(encoded):
            if len(ids) + req["max_tokens"] > self.max_model_len:
                raise ValueError(
                    f"prompt[{i}] has {len(ids)} tokens; with max_tokens={req['max_tokens']} "
                    f"that exceeds the model's {self.max_model_len} positions"
                )
        choices: list[dict[str, Any]] = []
        completion_tokens = 0
        for p_index, ids in enumerate(encoded):
            # A cancelled request computes no further prompt (each starts with a prefill).
            rows = (
                self._aborted_rows(req)
                if cancelled()
                else self._decode_rows(ids, req, gen, cancelled)
            )
            for j, (choice, count) in enumerate(rows):
                choice["index"] = p_index * req["n"] + j
                if req["return_token_ids"]:
                    choice["prompt_token_ids"] = ids
                completion_tokens += count
                choices.append(choice)
        prompt_tokens = sum(len(ids) for ids in encoded)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.get("model") or self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
