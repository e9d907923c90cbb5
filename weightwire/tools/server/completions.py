"""``POST /v1/completions``: the OpenAI-compatible subset a trainer rolls out with.

Parsing lives here (API process, no torch): every field is type- and range-checked
and a bad one is refused naming the field, before any worker is asked to generate.
Generation lives in ``generate.py`` (worker process).

Supported: ``prompt`` (a string, a list of token ids, or a batch of either),
``max_tokens``, ``temperature`` (0 = greedy; a positive value below 0.01 counts as 0.01,
as in vLLM), ``top_p``, ``top_k``, ``logprobs``
(log-probabilities of the sampled tokens under the raw model distribution, plus the
top ``logprobs`` alternatives; OpenAI's legacy shape), ``seed``, ``n``, ``ignore_eos``,
and vLLM's ``return_token_ids`` / ``return_tokens_as_token_ids`` (token strings become
``"token_id:<id>"``, so byte pieces that decode alike stay distinct keys in
``top_logprobs``). OpenAI fields this server cannot honour are refused when set to
anything but their neutral value, rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from weightwire.shared.errors import ReferenceServerError

MAX_N = 64
MAX_LOGPROBS = 20
MAX_PROMPTS = 256
MIN_TEMPERATURE = 1e-2
"""A positive temperature below this samples at this temperature, as vLLM does: dividing
logits by 1e-40 overflows to infinity and leaves no distribution to sample from."""


class CompletionRequestError(ReferenceServerError, ValueError):
    """A completion body that cannot be served; ``param`` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[str | list[int]]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    logprobs: int | None = None
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    model: str | None = None
    messages: list[dict[str, str]] | None = None
    """``/v1/chat/completions``: the worker renders these with the tokenizer's chat template
    (then ``prompts`` is empty)."""

    def to_worker(self) -> dict[str, Any]:
        return asdict(self)


_NEUTRAL: dict[str, tuple[Any, ...]] = {
    # field: accepted values (the ones that change nothing)
    "stream": (False, None),
    "echo": (False, None),
    "stop": (None, [], ""),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "stream_options": (None,),
}
_IGNORED = ("user",)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    # No math.isfinite: it raises OverflowError on ints past float range (10**400); the
    # chained comparison is exact for ints and false for nan and +-inf.
    if not (_is_int(v) or isinstance(v, float)) or not lo <= v <= hi:
        raise CompletionRequestError(key, f"{key} must be a number in [{lo}, {hi}], got {v!r:.40}")
    return float(v)


def _temperature(body: dict[str, Any]) -> float:
    t = _number(body, "temperature", 1.0, 0.0, 100.0)
    return MIN_TEMPERATURE if 0.0 < t < MIN_TEMPERATURE else t


def _integer(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if not _is_int(v) or not lo <= v <= hi:
        raise CompletionRequestError(
            key, f"{key} must be an integer in [{lo}, {hi}], got {v!r:.40}"
        )
    return int(v)


def _boolean(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise CompletionRequestError(key, f"{key} must be true or false, got {v!r:.40}")
    return v


def _token_ids(v: list[Any], where: str, vocab_size: int) -> list[int]:
    if not v:
        raise CompletionRequestError("prompt", f"{where} is an empty list of token ids")
    for i, t in enumerate(v):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise CompletionRequestError(
                "prompt", f"{where}[{i}] must be a token id in [0, {vocab_size}), got {t!r:.40}"
            )
    return list(v)


def _prompts(
    body: dict[str, Any], vocab_size: int, max_chars: int | None = None
) -> list[str | list[int]]:
    if "prompt" not in body:
        raise CompletionRequestError("prompt", "prompt is required")
    p = body["prompt"]
    if isinstance(p, str):
        out: list[str | list[int]] = [p]
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        out = [_token_ids(p, "prompt", vocab_size)]
    elif isinstance(p, list) and p:
        if len(p) > MAX_PROMPTS:
            raise CompletionRequestError(
                "prompt", f"prompt holds {len(p)} prompts, over the limit {MAX_PROMPTS}"
            )
        out = []
        for i, item in enumerate(p):
            if isinstance(item, str):
                out.append(item)
            elif isinstance(item, list):
                out.append(_token_ids(item, f"prompt[{i}]", vocab_size))
            else:
                raise CompletionRequestError(
                    "prompt",
                    f"prompt[{i}] must be a string or a list of token ids, got "
                    f"{type(item).__name__}",
                )
    else:
        raise CompletionRequestError(
            "prompt", "prompt must be a non-empty string, a list of token ids, or a list of those"
        )
    for i, item in enumerate(out):
        where = "prompt" if len(out) == 1 else f"prompt[{i}]"
        if isinstance(item, str) and not item:
            raise CompletionRequestError("prompt", f"{where} is an empty string")
        if isinstance(item, str) and max_chars is not None and len(item) > max_chars:
            raise CompletionRequestError(
                "prompt",
                (
                    f"{where} has {len(item)} characters: more tokens than the model's "
                    f"positions, whatever the tokenizer makes of it (at most {max_chars} "
                    "characters can fit)"
                ),
            )
    return out


_KNOWN = {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "logprobs",
    "seed",
    "n",
    "ignore_eos",
    "return_token_ids",
    "return_tokens_as_token_ids",
    *_NEUTRAL,
    *_IGNORED,
}


def parse_completion_request(
    body: object, *, vocab_size: int, max_model_len: int, max_prompt_chars: int | None = None
) -> CompletionRequest:
    """Validate a ``/v1/completions`` body; raise ``CompletionRequestError`` naming the field.

    ``max_prompt_chars`` (from the worker: no token spans more) refuses a text prompt
    that cannot fit ``max_model_len`` before it is tokenized."""
    if not isinstance(body, dict):
        raise CompletionRequestError(
            "body", f"body must be a JSON object, got {type(body).__name__}"
        )
    unknown = sorted(k for k in body if k not in _KNOWN)
    if unknown:
        raise CompletionRequestError(
            unknown[0], f"unsupported fields {unknown}; supported: {sorted(_KNOWN)}"
        )
    for key, neutral in _NEUTRAL.items():
        # type() too: 0 == False, and stream=0 is a caller bug worth naming.
        if key in body and not any(body[key] == v and type(body[key]) is type(v) for v in neutral):
            raise CompletionRequestError(
                key, f"{key}={body[key]!r:.40} is not supported by the reference server"
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise CompletionRequestError("model", f"model must be a string, got {type(model).__name__}")
    top_k = _integer(body, "top_k", -1, -1, 1 << 20)
    prompts = _prompts(body, vocab_size, max_prompt_chars)
    max_tokens = _integer(body, "max_tokens", 16, 1, max_model_len) or 16
    for i, item in enumerate(prompts):
        if isinstance(item, list) and len(item) + max_tokens > max_model_len:
            raise CompletionRequestError(
                "prompt",
                (
                    f"prompt{'' if len(prompts) == 1 else f'[{i}]'} has {len(item)} tokens; with "
                    f"max_tokens={max_tokens} that exceeds the model's {max_model_len} positions"
                ),
            )
    return CompletionRequest(
        prompts=prompts,
        max_tokens=max_tokens,
        temperature=_temperature(body),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=-1 if top_k in (None, 0) else int(top_k),
        logprobs=_integer(body, "logprobs", None, 0, MAX_LOGPROBS),
        seed=_integer(body, "seed", None, -(1 << 63), (1 << 64) - 1),
        n=_integer(body, "n", 1, 1, MAX_N) or 1,
        ignore_eos=_boolean(body, "ignore_eos"),
        return_token_ids=_boolean(body, "return_token_ids"),
        return_tokens_as_token_ids=_boolean(body, "return_tokens_as_token_ids"),
        model=model,
    )
