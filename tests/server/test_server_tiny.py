"""``build_tiny``: offline, deterministic, loadable tiny Llama / Qwen2 checkpoints."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from weightwire.tools.server.tiny import TINY_NAMES, build_tiny, resolve_model, tiny_model_dir


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", TINY_NAMES)
def test_build_writes_a_loadable_hf_dir(name: str, tiny_cache: Path, tmp_path: Path) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = build_tiny(name, str(tmp_path / name))
    cfg = json.loads((Path(out) / "config.json").read_text())
    arch = {"tiny-llama": "LlamaForCausalLM", "tiny-qwen2": "Qwen2ForCausalLM"}[name]
    assert cfg["architectures"] == [arch]
    assert cfg["torch_dtype"] == "float32"
    assert (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
        cfg["max_position_embeddings"],
    ) == (64, 2, 2, 1, 128, 512, 256)
    assert (
        cfg["hidden_size"] // cfg["num_attention_heads"] >= 32
    )  # vLLM's CPU attention needs head size >= 32

    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == arch and model.dtype == torch.float32
    tok = AutoTokenizer.from_pretrained(out)
    raw = Tokenizer.from_file(str(Path(out) / "tokenizer.json"))
    # transformers rebuilds Qwen2's tokenizer pipeline on load; ids must still match the raw file.
    assert len(tok) <= cfg["vocab_size"]
    for text in (
        "Hello world, the trainer sends weights.",
        "it's 12345 café  \n\t tabs",
        "<|eos|> x",
    ):
        assert tok(text)["input_ids"] == raw.encode(text).ids
        assert tok.decode(tok(text)["input_ids"]) == text
    assert (
        (tok.bos_token_id, tok.eos_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1)
    )
    ids = torch.tensor([tok("Hello world")["input_ids"]])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], 512)


def test_same_recipe_same_bytes_even_when_rebuilt(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = Path(tiny_model_dir("tiny-llama"))
    monkeypatch.setenv("WEIGHTWIRE_CACHE", str(tmp_path / "other-cache"))  # forces a real rebuild
    second = Path(tiny_model_dir("tiny-llama"))
    assert first != second and str(second).startswith(str(tmp_path))
    for fname in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _digest(first / fname) == _digest(second / fname), fname
    third = Path(tiny_model_dir("tiny-llama", seed=1))
    assert _digest(third / "model.safetensors") != _digest(second / "model.safetensors")
    assert _digest(third / "tokenizer.json") == _digest(second / "tokenizer.json")


def test_cache_hit_reuses_the_directory(tiny_cache: Path) -> None:
    a = tiny_model_dir("tiny-qwen2")
    before = (Path(a) / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_dir("tiny-qwen2") == a
    assert (Path(a) / "model.safetensors").stat().st_mtime_ns == before
    assert Path(a).parent.parent == tiny_cache


def test_bad_names_and_paths_are_refused(tiny_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model 'tiny-gpt9'"):
        build_tiny("tiny-gpt9", str(tmp_path / "x"))
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        build_tiny("tiny-llama", str(tmp_path / "x"), seed=-1)
    with pytest.raises(
        ValueError, match="neither tiny-llama / tiny-qwen2 nor a directory with config.json"
    ):
        resolve_model(str(tmp_path))
    assert resolve_model("tiny-llama") == tiny_model_dir("tiny-llama")
