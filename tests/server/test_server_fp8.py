"""FP8 rounds into a model served in FP8: the reference server loads a block-FP8 tiny Llama
as stored (``tools.server.fp8_model``: each quantized linear's e4m3 weight and float32
``weight_scale_inv`` are its parameters), tells the trainer its FP8 linears at init, and a
round from a bf16/fp32 JAX or torch trainer with ``fp8_source(source, "auto")`` leaves the
served parameters equal, bit for bit, to loading the same FP8 checkpoint from disk."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from torch_tensors import Tensors

from weightwire.shared.quant import Fp8Block, quantize_block_reference
from weightwire.shared.served import ServedModelMismatch

CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def write_fp8_checkpoint(tiny: str, out: Path, weights: dict[str, np.ndarray]) -> str:
    """``tiny``'s directory with ``weights`` as a block-FP8 checkpoint: every linear of the
    decoder layers quantized by the reference quantizer (vLLM's bytes), the rest as is."""
    import torch
    from safetensors.torch import save_file

    shutil.copytree(tiny, out)
    stored: dict[str, torch.Tensor] = {}
    for name, x in weights.items():
        if x.ndim == 2 and ".layers." in name:
            q, scale = quantize_block_reference(name, x, Fp8Block())
            stored[name] = torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn)
            stored[name + "_scale_inv"] = torch.from_numpy(scale.copy())
        else:
            stored[name] = torch.from_numpy(x.copy())
    save_file(stored, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": CONFIG}))
    return str(out)


def loaded_from_disk(model_dir: str) -> dict[str, str]:
    """The served parameters' checksums of a server that loaded ``model_dir``."""
    from weightwire.tools.server.fp8_model import fp8_scheme, load_fp8_model
    from weightwire.torch_side.worker.hf_host import HFModelHost

    scheme = fp8_scheme(model_dir)
    assert scheme == Fp8Block()
    return HFModelHost(load_fp8_model(model_dir, scheme)).state_checksums()


@pytest.fixture(scope="module")
def served_dir(tiny_llama: str, base_weights: dict[str, np.ndarray], tmp_path_factory) -> str:
    return write_fp8_checkpoint(tiny_llama, tmp_path_factory.mktemp("fp8") / "m", base_weights)


@pytest.fixture(scope="module")
def server(server_factory, served_dir: str):
    return server_factory(["--model", served_dir])


def trainer(
    framework: str,
    url: str,
    weights: dict[str, np.ndarray],
    spec: Any = "auto",
    group: Any = None,
    **info_fields: Any,
) -> Any:
    from weightwire.control import HTTPWeightSyncClient
    from weightwire.trainer import TrainerInitInfo

    info = TrainerInitInfo(backend="weightwire_tcp", **info_fields)
    client = HTTPWeightSyncClient(url, timeout=60)
    if framework == "jax":
        import jax.numpy as jnp

        from tests.trainer.fakes import DictSource
        from weightwire.jax_side.dtypes import describe
        from weightwire.jax_side.engine import JAXTrainerEngine
        from weightwire.jax_side.quant import fp8_source as jax_fp8

        arrays = {n: jnp.asarray(a) for n, a in weights.items()}
        source = jax_fp8(DictSource(arrays, describe), spec)
        return JAXTrainerEngine.trainer_init(info, client=client, source=source, group=group)
    import torch

    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.torch_side.sender.quant import fp8_source as torch_fp8

    tensors = {n: torch.from_numpy(a.copy()) for n, a in weights.items()}
    source = torch_fp8(Tensors(tensors), spec)
    return TorchTrainerEngine.trainer_init(info, client=client, source=source, group=group)


def served(http: httpx.Client) -> dict[str, str]:
    reply = http.post("/weight_checker", json={"action": "checksum"})
    assert reply.status_code == 200, reply.text
    return reply.json()["replica_checksums"][0]


def test_the_server_serves_the_fp8_checkpoint_as_stored(
    server, http: httpx.Client, served_dir: str
) -> None:
    assert served(http) == loaded_from_disk(served_dir)
    reply = http.post("/v1/completions", json={"prompt": "The trainer", "max_tokens": 4})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(("framework", "seed"), [("jax", 1), ("torch", 2)])
def test_a_round_lands_as_loading_the_same_fp8_checkpoint_from_disk(
    server,
    http: httpx.Client,
    tiny_llama: str,
    base_weights: dict[str, np.ndarray],
    tmp_path: Path,
    framework: str,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    new = {
        n: (a + rng.standard_normal(a.shape).astype(np.float32) * 0.05).astype(np.float32)
        for n, a in base_weights.items()
    }
    engine = trainer(framework, server.url, new)
    try:
        metrics = engine.send_weights()
    finally:
        engine.shutdown()
    assert metrics.fp8 is not None and metrics.fp8.weights == 14 and metrics.fp8.bytes_saved > 0
    on_disk = write_fp8_checkpoint(tiny_llama, tmp_path / "new", new)
    assert served(http) == loaded_from_disk(on_disk)
    reply = http.post("/v1/completions", json={"prompt": "The trainer", "max_tokens": 4})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_auto_on_every_rank_of_a_trainer_group_takes_the_spec_rank_zero_heard(
    server,
    http: httpx.Client,
    tiny_llama: str,
    base_weights: dict[str, np.ndarray],
    tmp_path: Path,
    framework: str,
) -> None:
    """Only rank 0 hears the served model at its init (docs/fp8.md); the other ranks' "auto"
    takes the spec rank 0 heard (was: refused on every rank, rank 0 included, its metadata
    asked before its init could tell it the spec)."""
    import threading

    from weightwire.trainer.group import DictGroup

    rng = np.random.default_rng(4 if framework == "jax" else 5)
    new = {
        n: (a + rng.standard_normal(a.shape).astype(np.float32) * 0.05).astype(np.float32)
        for n, a in base_weights.items()
    }
    groups = DictGroup.make(2)
    outcome: list[Any] = [None, None]

    def rank(r: int) -> None:
        try:
            engine = trainer(framework, server.url, new, group=groups[r], rank=r)
            try:
                outcome[r] = engine.send_weights()
            finally:
                engine.shutdown()
        except BaseException as exc:  # asserted below
            outcome[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    zero, one = outcome
    assert not isinstance(zero, BaseException) and not isinstance(one, BaseException), outcome
    assert zero.fp8 is not None and zero.fp8.weights == 14
    assert one.tensors == zero.tensors  # the same round's metadata: the pairs, agreed
    on_disk = write_fp8_checkpoint(tiny_llama, tmp_path / "new", new)
    assert served(http) == loaded_from_disk(on_disk)


def test_delta_rounds_patch_the_e4m3_bytes_that_changed(
    server, http: httpx.Client, tiny_llama: str, base_weights: dict[str, np.ndarray], tmp_path: Path
) -> None:
    import torch

    new = {n: a.copy() for n, a in base_weights.items()}
    engine = trainer("torch", server.url, new, delta="auto")
    try:
        engine.send_weights()
        down = "model.layers.1.mlp.down_proj.weight"
        new[down][3, :7] *= 1.5  # a few elements: their e4m3 bytes (and one scale) change
        engine.source.inner.tensors[down] = torch.from_numpy(new[down].copy())
        metrics = engine.send_weights()
    finally:
        engine.shutdown()
    assert metrics.density is not None and metrics.wire_bytes < metrics.dense_bytes / 20
    on_disk = write_fp8_checkpoint(tiny_llama, tmp_path / "new", new)
    assert served(http) == loaded_from_disk(on_disk)


def test_a_spec_of_another_block_size_is_refused_by_name_before_any_byte(
    server, http: httpx.Client, base_weights: dict[str, np.ndarray]
) -> None:
    down = "model.layers.0.mlp.down_proj.weight"
    before = served(http)
    with pytest.raises(ServedModelMismatch) as refused:
        trainer("torch", server.url, base_weights, {down: Fp8Block((64, 64))})
    assert (
        f"the FP8 spec quantizes 1 tensor(s) [{down}] as block [64, 64] e4m3; the served "
        "model's checkpoint takes block [128, 128] e4m3" in str(refused.value)
    )
    # the whole model unquantized: every FP8 linear named, with the fix
    engine = trainer("torch", server.url, base_weights, {})
    try:
        with pytest.raises(ServedModelMismatch, match=r"takes 14 tensor\(s\) \[.*\] in FP8 "):
            engine.send_weights()
    finally:
        engine.shutdown()
    assert served(http) == before


@pytest.mark.parametrize("budget", [None, 0], ids=["staged", "in_place"])
def test_check_finite_reads_the_e4m3_weights_a_round_sends(
    server_factory, served_dir: str, base_weights: dict[str, np.ndarray], budget: int | None
) -> None:
    """``--check-finite`` over a model served in FP8: a round's e4m3 weights are read as what
    they hold (torch has no ``isfinite`` for float8), so a finite round commits, staged or
    applied in place (was: every round's finish failed, ``"isfinite" not implemented for
    'Float8_e4m3fn'``); an e4m3 NaN is named (the trainer's quantizer refuses a NaN weight
    before sending, so the check is shown on the bytes)."""
    import torch

    from weightwire.tools.server.guards import NonFiniteRound, refuse_non_finite

    checked = server_factory(["--model", served_dir, "--check-finite"])
    info = {} if budget is None else {"stage_budget_bytes": budget}
    down = "model.layers.1.mlp.down_proj.weight"
    engine = trainer("torch", checked.url, base_weights, **info)
    try:
        engine.send_weights("finite")
    finally:
        engine.shutdown()
    with httpx.Client(base_url=checked.url, timeout=60) as http:
        assert http.get("/weight_info").json()["weight_version"] == "finite"
        assert served(http) == loaded_from_disk(served_dir)
    e4m3 = torch.zeros(4, dtype=torch.uint8)
    refuse_non_finite([(down, e4m3.view(torch.float8_e4m3fn))])  # finite: nothing raised
    e4m3[2] = 0x7F  # e4m3fn's NaN
    with pytest.raises(NonFiniteRound, match=f"'{down}' hold NaN or infinite"):
        refuse_non_finite([(down, e4m3.view(torch.float8_e4m3fn))])
