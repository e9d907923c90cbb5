"""How big a worker's reply can get, and what happens when one would be too big.

A completion's reply travels from the worker to the API process as one JSON line. Its
size follows from the request: prompts x ``n`` choices x ``max_tokens`` tokens, each
token carrying its text, and with ``logprobs`` up to ``logprobs + 1`` alternatives, each
a token string and a float. ``reply_bound`` computes an upper bound from the parsed
request and the longest JSON-encoded token string of the vocabulary (measured once by
the worker at start, ``max_piece_json_bytes``); the API refuses a request whose bound is
over ``--max-reply-bytes`` with a 400 before any worker computes anything.

``encode_reply`` is the worker's side of the same limit: it never writes a line longer
than the limit, nor fails silently on a value JSON cannot hold (NaN, infinity): such a
reply becomes a small error reply for the one call it answers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from weightwire.tools.server.completions import CompletionRequestError

FLOAT_JSON_BYTES = 25
"""``-1.2345678901234567e-308,``: the longest ``repr`` of a float, with its separator."""
CHOICE_OVERHEAD_BYTES = 256
"""Keys, index, finish_reason, braces of one choice."""
REPLY_OVERHEAD_BYTES = 1024
"""id, object, created, model, usage of the whole reply."""


def max_piece_json_bytes(tokenizer: Any, vocab_size: int) -> int:
    """The longest JSON encoding (``ensure_ascii``, quotes included) of one token decoded
    alone, over every id the model can emit. A sequence's text is never longer than the
    sum of its tokens' pieces (a character split across byte tokens decodes to one
    replacement character per token alone, which is at least as long)."""
    pieces = tokenizer.batch_decode([[i] for i in range(vocab_size)])
    return max((len(json.dumps(p)) for p in pieces), default=2) + 1


def _digits(n: int) -> int:
    return len(str(max(1, n)))


def reply_bound(req: Any, *, piece_bytes: int, vocab_size: int, max_model_len: int) -> int:
    """Upper bound, in bytes, of the worker's JSON reply to ``req`` (a ``CompletionRequest``).

    A text prompt's (or a chat's) token count is unknown before tokenizing; it is at most
    ``max_model_len - max_tokens``, which the worker enforces."""
    steps = req.max_tokens
    id_bytes = _digits(vocab_size) + 1
    as_ids_piece = len('"token_id:",') + _digits(vocab_size)
    piece = as_ids_piece if req.return_tokens_as_token_ids else piece_bytes
    per_choice = CHOICE_OVERHEAD_BYTES + steps * piece_bytes  # text: at most every token's piece
    if req.logprobs is not None:
        entry = piece + FLOAT_JSON_BYTES + 1  # "piece":value,
        per_step = (
            piece + FLOAT_JSON_BYTES + (req.logprobs + 1) * entry + 2 + _digits(steps * piece) + 1
        )
        per_choice += steps * per_step
    if req.return_token_ids:
        per_choice += steps * id_bytes
        prompts = req.prompts or [None]  # chat: one rendered prompt
        prompt_ids = sum(len(p) if isinstance(p, list) else max_model_len - steps for p in prompts)
        per_choice_prompt = math.ceil(prompt_ids / len(prompts)) * id_bytes
        per_choice += per_choice_prompt
    choices = max(1, len(req.prompts)) * req.n
    return REPLY_OVERHEAD_BYTES + choices * per_choice


def check_reply_size(
    req: Any, *, limit: int, piece_bytes: int, vocab_size: int, max_model_len: int
) -> None:
    """Raise ``CompletionRequestError`` naming the fields to lower when ``req``'s reply could
    exceed ``limit`` bytes."""
    bound = reply_bound(
        req, piece_bytes=piece_bytes, vocab_size=vocab_size, max_model_len=max_model_len
    )
    if bound <= limit:
        return
    fields = [f"{max(1, len(req.prompts))} prompt(s)", f"n={req.n}", f"max_tokens={req.max_tokens}"]
    fields += [f"logprobs={req.logprobs}"] if req.logprobs is not None else []
    fields += ["return_token_ids"] if req.return_token_ids else []
    raise CompletionRequestError(
        "max_tokens",
        (
            f"the reply to this request could reach {bound} bytes ({', '.join(fields)}; every "
            f"token counted at {piece_bytes} bytes, this vocabulary's longest as JSON), over "
            f"this server's limit of {limit} bytes (--max-reply-bytes); lower n, max_tokens, "
            "logprobs or the number of prompts, or split the request"
        ),
    )


@dataclass(frozen=True)
class EncodedReply:
    data: bytes
    """One JSON line, at most the limit (plus the small error envelope)."""
    problem: str | None = None
    """Why ``data`` is an error reply in place of the one asked for (for the worker's log)."""


def encode_reply(msg: dict[str, Any], limit: int, *, op: str | None = None) -> EncodedReply:
    """``msg`` as one JSON line of at most ``limit`` bytes; otherwise an error reply for
    the same id (never an exception: a reply that cannot be sent must still answer). A
    too-big ``generate`` reply is the request's doing (400); any other op's, the server's."""
    msg_id = msg.get("id")
    try:
        data = (json.dumps(msg, separators=(",", ":"), allow_nan=False) + "\n").encode()
    except ValueError as exc:  # NaN / infinity: JSON has no such numbers
        return _error_line(
            msg_id,
            "internal",
            f"the result holds a value JSON cannot carry ({exc}); "
            "if it is a logprob, the model's weights are probably not finite",
        )
    except (TypeError, RecursionError) as exc:
        return _error_line(
            msg_id, "internal", f"the result could not be encoded ({type(exc).__name__}: {exc})"
        )
    if len(data) > limit:
        hint = (
            "; lower n, max_tokens, logprobs or the number of prompts" if op == "generate" else ""
        )
        return _error_line(
            msg_id,
            "invalid" if op == "generate" else "internal",
            (
                f"the {op or 'call'}'s reply was {len(data)} bytes, over this server's limit of "
                f"{limit} bytes (--max-reply-bytes){hint}"
            ),
        )
    return EncodedReply(data)


def _error_line(msg_id: Any, kind: str, error: str) -> EncodedReply:
    line = (
        json.dumps({"id": msg_id, "ok": False, "kind": kind, "error": error}, separators=(",", ":"))
        + "\n"
    )
    return EncodedReply(line.encode(), error)
