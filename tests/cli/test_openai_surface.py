"""The reference server's OpenAI-compatible surface a vLLM user expects: ``/v1/models``,
``/v1/chat/completions`` rendered with the tokenizer's own chat template, and 404 for a
request naming a model the server does not serve."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

# The template writes the BOS token itself, so the rendered text is tokenized without special
# tokens.
TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "the tree sees the sea"},
]


@pytest.fixture(scope="module")
def chat_dir(tiny_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with a chat template added to its tokenizer config."""
    out = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_dir, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(out)


@pytest.fixture(scope="module")
def servers(launch_server: Any, tiny_dir: str, chat_dir: str) -> Iterator[tuple[str, str]]:
    plain, chat = launch_server(tiny_dir), launch_server(chat_dir)
    yield plain.wait_ready(), chat.wait_ready()


def test_models_lists_the_served_model(servers: tuple[str, str], chat_dir: str) -> None:
    reply = httpx.get(f"{servers[1]}/v1/models").json()
    assert reply["object"] == "list" and len(reply["data"]) == 1
    model = reply["data"][0]
    assert model["id"] == "tiny-chat" and model["object"] == "model"
    assert model["root"] == os.path.abspath(chat_dir) and model["max_model_len"] == 256


def test_chat_uses_the_tokenizers_chat_template(servers: tuple[str, str], chat_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(chat_dir)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.endswith("user: the tree sees the sea\nassistant:")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    common = {"max_tokens": 6, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    chat = httpx.post(
        f"{servers[1]}/v1/chat/completions",
        json={
            "model": "tiny-chat",
            "messages": MESSAGES,
            "logprobs": True,
            "top_logprobs": 2,
            **common,
        },
    ).json()
    plain = httpx.post(
        f"{servers[1]}/v1/completions", json={"prompt": ids, "logprobs": 2, **common}
    ).json()
    assert chat["object"] == "chat.completion" and chat["model"] == "tiny-chat"
    got, want = chat["choices"][0], plain["choices"][0]
    assert got["prompt_token_ids"] == ids  # the server rendered exactly the template's prompt
    assert got["token_ids"] == want["token_ids"] and len(got["token_ids"]) == 6
    assert got["message"] == {"role": "assistant", "content": want["text"]}
    assert got["finish_reason"] == "length"
    content = got["logprobs"]["content"]
    assert [c["logprob"] for c in content] == want["logprobs"]["token_logprobs"]
    assert [c["token"] for c in content] == want["logprobs"]["tokens"]
    assert all(len(c["top_logprobs"]) >= 2 for c in content)
    assert chat["usage"] == plain["usage"]


def test_chat_without_a_template_is_refused(servers: tuple[str, str]) -> None:
    r = httpx.post(
        f"{servers[0]}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}
    )
    assert r.status_code == 400
    assert "tokenizer has no chat template" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"messages": []}, "messages", "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "must be one of"),
        (
            {"messages": [{"role": "user", "content": 3}]},
            "messages[0].content",
            "a string or a list of text parts",
        ),
        ({"messages": MESSAGES, "stream": True}, "stream", "not supported"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ({"messages": MESSAGES, "functions": []}, "functions", "unsupported fields"),
    ],
)
def test_chat_refuses_a_bad_body_naming_the_field(
    servers: tuple[str, str], body: dict, param: str, message: str
) -> None:
    r = httpx.post(f"{servers[1]}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"]


def test_a_request_for_another_model_gets_404(servers: tuple[str, str], chat_dir: str) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "the", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}),
    ):
        r = httpx.post(f"{servers[1]}{path}", json={**body, "model": "gpt-4o"})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["message"].startswith(
            "The model `gpt-4o` does not exist: this server serves `tiny-chat`"
        )
        # The served name, and the --model value it was started with (a path, as vLLM's default
        # name), both serve.
        for name in ("tiny-chat", chat_dir, str(Path(chat_dir).resolve())):
            ok = httpx.post(f"{servers[1]}{path}", json={**body, "model": name})
            assert ok.status_code == 200, ok.text
            assert ok.json()["model"] == name
