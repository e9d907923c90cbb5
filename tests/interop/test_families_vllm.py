"""The preset families beyond the model matrix against a real vLLM: 2 JAX rounds each.

Each family (``families.FAMILIES``, all of them by default) gets a tiny random Hugging
Face checkpoint (``save_pretrained``'s on-disk names, the ones vLLM loads: per-expert
MoE tensors, Phi-3's fused projections) and its own vLLM. The JAX side holds the
preset's documented layout (``layouts.preset_layout``: stacked ``[experts, in, out]``
expert kernels, separate q/k/v and gate/up for Phi-3), loaded from the checkpoint with
``pytree_from_hf``. After each round vLLM's greedy ids
and logprobs must equal Hugging Face's on a checkpoint written from exactly the tensors
sent (loaded through ``from_pretrained``, so HF's own checkpoint conversion, e.g. of
per-expert names into fused expert parameters, applies), and differ from the previous
round's: a tensor mapped to the wrong name, expert or half of a fused projection, or a
layer whose kernels kept their start-up packing, fails here.

The configs set what makes each family differ from Llama to values that change the
output (Gemma 2's soft caps and Gemma 3's local/global layers act on these tiny
logits; Llama 3's rope scaling starts at 32 positions).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tests.interop.families import FAMILIES, build_family
from tests.interop.helpers import VLLMServer, assert_same_greedy
from tests.interop.launcher import Launcher
from weightwire.control.client import HTTPWeightSyncClient
from weightwire.jax_side.checkpoint import pytree_from_hf, read_hf_config, read_safetensors
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.layouts import preset_for_hf, preset_layout
from weightwire.jax_side.source import PytreeSource
from weightwire.tools.server.tiny import build_tiny
from weightwire.trainer.config import TrainerInitInfo

pytestmark = [pytest.mark.interop, pytest.mark.timeout(900)]


def selected_families() -> tuple[str, ...]:
    """Every family by default; ``WEIGHTWIRE_INTEROP_FAMILIES`` (a comma list) runs a
    subset, e.g. while working on one preset (``all`` is the default spelled out)."""
    raw = os.environ.get("WEIGHTWIRE_INTEROP_FAMILIES", "").strip()
    if not raw or raw == "all":
        return tuple(FAMILIES)
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        known = ", ".join(FAMILIES)
        raise ValueError(
            f"WEIGHTWIRE_INTEROP_FAMILIES names unknown families {unknown}; known: {known}"
        )
    return names


# Round noise (embedding, every other leaf). A tiny random Gemma's scaled, tied embedding
# dominates its logits (greedy repeats the last prompt token) unless the layers move more
# than it; at (0.05, 0.2) Gemma 2's final soft cap moves the logprobs by > 0.1.
SCALE = {"gemma2": (0.05, 0.2), "gemma3": (0.05, 0.2)}


def round_params(params: Any, seed: int, family: str) -> Any:
    """``params`` plus seeded normal noise (``SCALE``; 0.05 everywhere by default)."""
    embed, rest = SCALE.get(family, (0.05, 0.05))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [
        x
        + (embed if "embed_tokens" in jax.tree_util.keystr(path) else rest)
        * jax.random.normal(k, x.shape, x.dtype)
        for (path, x), k in zip(leaves, keys, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, noisy)


def hf_reference(model_dir: str, sent: dict[str, np.ndarray], out: Path) -> torch.nn.Module:
    """HF transformers on a checkpoint of exactly ``sent`` (plus the served config): every
    parameter must come from it, except a tied head HF re-ties to the embedding."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(Path(model_dir) / "config.json", out / "config.json")
    save_file(
        {n: torch.from_numpy(np.array(a)).contiguous() for n, a in sent.items()},
        str(out / "model.safetensors"),
    )
    model, info = AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert not info["unexpected_keys"], f"names HF does not have: {info['unexpected_keys']}"
    assert set(info["missing_keys"]) <= tied, (
        f"tensors not sent: {sorted(set(info['missing_keys']) - tied)}"
    )
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(build_tiny("tiny-llama", str(tmp_path_factory.mktemp("tokenizer"))))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_server(
    request: pytest.FixtureRequest,
    launcher: Launcher,
    tokenizer_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, VLLMServer]:
    family = request.param
    if family not in selected_families():
        pytest.skip(f"{family} not in WEIGHTWIRE_INTEROP_FAMILIES")
    name = f"tiny-{family}"
    model_dir = build_family(family, tmp_path_factory.mktemp(name), tokenizer_dir)
    return family, launcher.get(name, str(model_dir)).server


def test_two_jax_rounds_match_hugging_face(
    family_server: tuple[str, VLLMServer], tmp_path: Path
) -> None:
    family, server = family_server
    hf = read_hf_config(server.model_dir)
    checkpoint = read_safetensors(server.model_dir)
    naming = preset_for_hf(family, hf)
    template = preset_layout(family, hf)
    sent_names = {e.name for e in naming.resolve(template).entries}
    params0 = pytree_from_hf(
        naming, template, {n: t for n, t in checkpoint.items() if n in sent_names}
    )
    live = {"params": params0}
    source = PytreeSource(lambda: live["params"], naming)
    tied = {"lm_head.weight"} if hf.get("tie_word_embeddings") else set()
    assert sent_names == set(checkpoint) - tied, "the preset does not send the checkpoint's tensors"
    previous = assert_same_greedy(
        server,
        hf_reference(server.model_dir, dict(source), tmp_path / "r0"),
        f"{family}: checkpoint, before any round",
    )
    client = HTTPWeightSyncClient(server.url, timeout=120)
    # A 16 KiB packing buffer splits the model into many broadcasts (as in the matrix).
    info = TrainerInitInfo(
        backend="weightwire_tcp", packed_buffer_size_bytes=16 << 10, pause_mode="keep"
    )
    engine = JAXTrainerEngine.trainer_init(info, client=client, source=source)
    try:
        for r in (1, 2):
            live["params"] = round_params(params0, r, family)
            metrics = engine.send_weights(weight_version=f"{family}-{r}")
            assert metrics.chunks > 1 and metrics.tensors == len(source.metadata())
            assert server.weight_version() == f"{family}-{r}"
            reference = hf_reference(server.model_dir, dict(source), tmp_path / f"r{r}")
            tokens = assert_same_greedy(server, reference, f"{family}: JAX round {r}")
            assert tokens != previous, (
                f"{family}: JAX round {r} did not change vLLM's greedy output"
            )
            previous = tokens
    finally:
        engine.shutdown()
        client.close()
