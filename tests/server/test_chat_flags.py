"""Chat validation names the bad value and its type (a string "yes" is not false)."""

from __future__ import annotations

import pytest

from weightwire.tools.server.openai import parse_chat_request

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("yes", "add_generation_prompt must be true or false, got str 'yes'"),
        (1, "add_generation_prompt must be true or false, got int 1"),
        (None, "add_generation_prompt must be true or false, got NoneType None"),
        (False, "add_generation_prompt=false is not supported"),
    ],
)
def test_add_generation_prompt_errors_name_the_value(value: object, says: str) -> None:
    with pytest.raises(ValueError, match="add_generation_prompt") as info:
        parse_chat_request(
            {"messages": MESSAGES, "add_generation_prompt": value}, vocab_size=512, max_model_len=64
        )
    assert says in str(info.value)


def test_add_generation_prompt_true_is_accepted() -> None:
    request = parse_chat_request(
        {"messages": MESSAGES, "add_generation_prompt": True}, vocab_size=512, max_model_len=64
    )
    assert request is not None
