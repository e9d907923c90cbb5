"""The OpenAI-compatible surface beyond ``/v1/completions``: ``/v1/models``,
``/v1/chat/completions`` and the served-model-name check, as a vLLM user expects them.

- ``GET /v1/models`` lists the one served model (``id`` = the served name, ``root`` =
  its directory, ``max_model_len``).
- ``POST /v1/chat/completions`` renders ``messages`` with the tokenizer's own chat
  template (``apply_chat_template(..., add_generation_prompt=True)``, in the worker
  that holds the tokenizer), then generates exactly as ``/v1/completions`` does.
  ``logprobs: true`` + ``top_logprobs: K`` come back in the chat shape
  (``choices[i].logprobs.content[j].{token, logprob, top_logprobs}``). A model without a
  chat template is refused (400), never rendered with a guessed format.
- A request naming a model this server does not serve gets 404 (vLLM's answer), instead
  of being served by whatever model is loaded: a client pointed at the wrong server
  learns it on the first call.

Parsing only (API process, no torch); generation is the worker's ``generate`` op.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from weightwire.tools.server.completions import (
    MAX_LOGPROBS,
    CompletionRequest,
    CompletionRequestError,
    parse_completion_request,
)
from weightwire.tools.server.web import ApiError, read_json

MODELS_PATH = "/v1/models"
CHAT_PATH = "/v1/chat/completions"
MAX_MESSAGES = 1024
ROLES = ("system", "developer", "user", "assistant", "tool")

_CHAT_ONLY = {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "add_generation_prompt",
}
_COMPLETION_FIELDS = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "n",
    "ignore_eos",
    "return_token_ids",
    "return_tokens_as_token_ids",
    "stream",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stream_options",
    "user",
}


def check_model_name(
    requested: str | None, served: str, aliases: tuple[str, ...] = ()
) -> str | None:
    """``None`` when ``requested`` may be served here, else the 404 message (vLLM's wording)."""
    if requested is None or requested == served or requested in aliases:
        return None
    return (
        f"The model `{requested:.200}` does not exist: this server serves `{served}` (GET "
        f"{MODELS_PATH})"
    )


def models_reply(served: str, root: str | None, max_model_len: int, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": served,
                "object": "model",
                "created": created,
                "owned_by": "weightwire",
                "root": root or served,
                "parent": None,
                "max_model_len": max_model_len,
            }
        ],
    }


def _messages(raw: object) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise CompletionRequestError(
            "messages", "messages must be a non-empty list of {role, content} objects"
        )
    if len(raw) > MAX_MESSAGES:
        raise CompletionRequestError(
            "messages", f"messages holds {len(raw)} entries, over the limit {MAX_MESSAGES}"
        )
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise CompletionRequestError(
                where, f"{where} must be an object, got {type(m).__name__}"
            )
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise CompletionRequestError(
                f"{where}.role", f"{where}.role must be one of {list(ROLES)}, got {role!r:.40}"
            )
        if isinstance(content, list):  # OpenAI content parts: only text can reach a text-only model
            parts = []
            for j, part in enumerate(content):
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise CompletionRequestError(
                        f"{where}.content[{j}]",
                        f"{where}.content[{j}] must be a {{type: text, text: ...}} part",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise CompletionRequestError(
                f"{where}.content", f"{where}.content must be a string or a list of text parts"
            )
        unknown = sorted(set(m) - {"role", "content", "name"})
        if unknown:
            raise CompletionRequestError(where, f"{where} has unsupported fields {unknown}")
        entry = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            entry["name"] = m["name"]
        out.append(entry)
    return out


def parse_chat_request(
    body: object, *, vocab_size: int, max_model_len: int, max_prompt_chars: int | None = None
) -> CompletionRequest:
    """Validate a chat body; the result carries ``messages`` and no prompt (the worker renders it).

    ``max_prompt_chars`` (as for ``/v1/completions``) refuses messages whose text alone
    cannot fit ``max_model_len``, before anything is tokenized or rendered."""
    if not isinstance(body, dict):
        raise CompletionRequestError(
            "body", f"body must be a JSON object, got {type(body).__name__}"
        )
    unknown = sorted(k for k in body if k not in _CHAT_ONLY | _COMPLETION_FIELDS)
    if unknown:
        raise CompletionRequestError(
            unknown[0],
            f"unsupported fields {unknown}; supported: {sorted(_CHAT_ONLY | _COMPLETION_FIELDS)}",
        )
    prompt_flag = body.get("add_generation_prompt", True)
    if not isinstance(prompt_flag, bool):
        raise CompletionRequestError(
            "add_generation_prompt",
            "add_generation_prompt must be true or false, got "
            f"{type(prompt_flag).__name__} {prompt_flag!r:.40}",
        )
    if not prompt_flag:
        raise CompletionRequestError(
            "add_generation_prompt", "add_generation_prompt=false is not supported"
        )
    messages = _messages(body.get("messages"))
    chars = sum(len(m["content"]) + len(m.get("name", "")) for m in messages)
    if max_prompt_chars is not None and chars > max_prompt_chars:
        raise CompletionRequestError(
            "messages",
            (
                f"messages hold {chars} characters: more tokens than the model's positions, "
                f"whatever the tokenizer makes of them (at most {max_prompt_chars} characters "
                "can fit)"
            ),
        )
    want = body.get("logprobs", False)
    if want is not None and not isinstance(want, bool):
        raise CompletionRequestError(
            "logprobs", f"logprobs must be true or false in a chat request, got {want!r:.40}"
        )
    top = body.get("top_logprobs")
    if top is not None and (
        not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS
    ):
        raise CompletionRequestError(
            "top_logprobs", f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]"
        )
    if top and not want:
        raise CompletionRequestError("top_logprobs", "top_logprobs needs logprobs: true")
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise CompletionRequestError(
            "max_completion_tokens", "set max_completion_tokens or max_tokens, not both"
        )
    completion = {k: v for k, v in body.items() if k in _COMPLETION_FIELDS}
    if body.get("max_completion_tokens") is not None:
        completion["max_tokens"] = body["max_completion_tokens"]
    completion["logprobs"] = (top or 0) if want else None
    # A one-token placeholder runs the shared field checks; the worker renders the real prompt.
    req = parse_completion_request(
        {**completion, "prompt": [0]}, vocab_size=vocab_size, max_model_len=max_model_len
    )
    return replace(req, prompts=[], messages=messages)


def _chat_logprobs(choice: dict[str, Any], top: bool) -> dict[str, Any] | None:
    lp = choice.get("logprobs")
    if lp is None:
        return None
    content = []
    for j, (token, logprob) in enumerate(zip(lp["tokens"], lp["token_logprobs"], strict=True)):
        alternatives = lp["top_logprobs"][j] if top and lp.get("top_logprobs") else {}
        content.append(
            {
                "token": token,
                "logprob": logprob,
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
                    for t, v in alternatives.items()
                ],
            }
        )
    return {"content": content}


def chat_reply(result: dict[str, Any], req: CompletionRequest, model: str) -> dict[str, Any]:
    """A worker's ``text_completion`` result in the ``chat.completion`` shape."""
    choices = []
    for c in result["choices"]:
        choice: dict[str, Any] = {
            "index": c["index"],
            "message": {"role": "assistant", "content": c["text"]},
            "finish_reason": c["finish_reason"],
            "logprobs": _chat_logprobs(c, bool(req.logprobs)),
        }
        for key in ("token_ids", "prompt_token_ids"):
            if key in c:
                choice[key] = c[key]
        choices.append(choice)
    return {
        "id": "chat" + str(result["id"]),
        "object": "chat.completion",
        "created": result.get("created", int(time.time())),
        "model": model,
        "choices": choices,
        "usage": result["usage"],
    }


def check_model(opts: Any, req: CompletionRequest, adapters: Any = ()) -> None:
    """404 for a request naming a model other than the served one or a registered adapter
    (``opts``: ``ServerOptions``)."""
    problem = check_model_name(req.model, opts.model_name, (*opts.model_aliases, *adapters))
    if problem:
        raise ApiError(404, problem, param="model")


Generate = Callable[[Any, CompletionRequest, Request], Awaitable[tuple[dict[str, Any], int]]]


Parser = Callable[..., CompletionRequest]
"""``parse_completion_request`` or ``parse_chat_request``: a body against the model's limits."""


async def parse_generation(request: Request, state: Any, parse: Parser) -> CompletionRequest:
    """A generation request's body parsed against the served model's limits, and its model
    checked (``state``: ``ServerState``): a malformed body is a 400 naming the field, another
    model's name a 404.

    Parsed off the event loop: a body near the size limit holds millions of token ids or
    content parts to check, and the loop also serves the weight routes.
    """
    body = await read_json(request)
    info = state.pool.replicas[0].info
    try:
        req = await asyncio.to_thread(
            parse,
            body,
            vocab_size=info["vocab_size"],
            max_model_len=info["max_model_len"],
            max_prompt_chars=info.get("max_prompt_chars"),
        )
    except CompletionRequestError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    check_model(state.options, req, state.adapters)
    return req


def install_openai_routes(app: FastAPI, state: Any, generate: Generate) -> None:
    """Add ``/v1/models`` and ``/v1/chat/completions`` (``state``: ``ServerState``; ``generate``:
    ``app.generate_on_a_replica``, the same path ``/v1/completions`` takes)."""
    opts, pool = state.options, state.pool
    created = int(time.time())

    @app.get(MODELS_PATH)
    async def models() -> dict[str, Any]:
        reply = models_reply(
            opts.model_name, opts.model_dir, pool.replicas[0].info["max_model_len"], created
        )
        for name, path in state.adapters.items():  # vLLM lists its adapters the same way
            card = {**reply["data"][0], "id": name, "root": path, "parent": opts.model_name}
            reply["data"].append(card)
        return reply

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request) -> JSONResponse:
        req = await parse_generation(request, state, parse_chat_request)
        result, index = await generate(state, req, request)
        return JSONResponse(
            chat_reply(result, req, req.model or opts.model_name),
            headers={"x-weightwire-replica": str(index)},
        )


def describe_routes(app: FastAPI, model_name: str) -> str:
    """One line for the start-up log: what this server answers, grouped for a reader."""
    paths = sorted({getattr(r, "path", "") for r in app.routes} - {""})
    openai = [p for p in paths if p.startswith("/v1/")]
    plain = [p for p in paths if p in ("/health", "/version")]
    weight = [p for p in paths if p not in openai and p not in plain]
    return (
        f"serving model {model_name!r}: OpenAI {', '.join(openai)}; weight sync "
        f"{', '.join(weight)}; {', '.join(plain)}"
    )
