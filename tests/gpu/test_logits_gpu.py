"""GPU acceptance: a JAX trainer on GPU 0 pushes weights into the reference server's
HF worker on GPU 1, whose logits then equal the JAX model's.

Sender: the real trainer path. The tiny HF checkpoint is loaded into the Flax decoder
with ``load_decoder``, perturbed on the GPU with ``jax.random`` (so the worker must
load new values, not keep what it read from disk), wrapped in ``PytreeSource`` with the
Llama preset and sent by ``JAXTrainerEngine`` over ``weightwire_nccl``, two rounds
with different perturbations (the second reuses the metadata).

Receiver: the reference server's own worker process (``ReplicaPool`` + ``worker_proc``,
``CUDA_VISIBLE_DEVICES=1`` in its environment only), driven directly through the pool:
the GPU host has no fastapi/uvicorn, and the API layer adds nothing to this check.

After each round: the worker's per-tensor sha256 equals the bytes JAX sent (bit-exact
transport, every tensor written), and a greedy generation with top-20 logprobs on the
worker equals the Flax model's argmax and log-softmax on GPU 0 for the same tokens.

JAX lives in this process (it must see GPU 0 for the sender and the reference logits);
only the worker process is narrowed to GPU 1. Run on the 2-GPU host with
``pytest -m gpu tests/gpu/test_logits_gpu.py``. ``run_logits_scenario`` takes the
backend and devices as arguments: ``test_cpu_tcp_harness`` runs the very same flow on
CPU over ``weightwire_tcp`` (~10 s), so the harness itself is exercised in every CI run.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from tests.gpu.pool_client import OP_S, ROUND_S, PoolClient

PROMPT = [5, 6, 7, 8, 9, 10]
MAX_TOKENS = 8
TOP_LOGPROBS = 20  # the server's maximum: the widest view of the logits it gives
BUFFER_BYTES = 64 << 10  # the ~545 KiB model spans several packed chunks
# Both sides compute in float32 with full-precision matmuls (torch's default on CUDA
# is IEEE fp32; JAX is forced to "highest" so XLA uses no TF32). What remains is
# summation order (cuBLAS vs XLA kernels, KV-cached decode vs one full-sequence pass):
# ~1e-6 on logprobs of magnitude ~6. 1e-4 leaves ~100x margin, while a single wrong
# tensor (perturbations are 0.05-scale) moves logprobs by >1e-2; the test checks that
# the previous round's params are indeed rejected by this tolerance.
ATOL = 1e-4
PERTURB_SCALE = 0.05


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny HF Llama directory, built in an isolated cache.

    Built in a subprocess: a cache miss imports torch, and this process hosts JAX on
    the GPU; keeping torch's CUDA libraries out of it avoids two CUDA stacks in one
    process (the worker is torch's process, this one is JAX's).
    """
    env = {**os.environ, "WEIGHTWIRE_CACHE": str(tmp_path_factory.mktemp("weightwire-cache"))}
    code = (
        "from weightwire.tools.server.tiny import tiny_model_dir; "
        "print(tiny_model_dir('tiny-llama'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, f"building tiny-llama failed:\n{out.stderr[-4000:]}"
    return out.stdout.strip().splitlines()[-1]


@dataclass
class Scenario:
    """Where each side runs: the GPU test uses NCCL GPU0 -> GPU1; the CPU check uses TCP."""

    backend: str
    worker_device: str
    worker_env: dict[str, str]
    jax_platform: str
    cuda_ordinal: int | None
    packed: bool
    log: list[str] = field(default_factory=list)


def _jax_device(platform: str, ordinal: int | None) -> Any:
    import jax

    try:
        devices = jax.devices(platform)
    except RuntimeError:
        pytest.skip(f"jax sees no {platform} device")
    if ordinal is None:
        return devices[0]
    match = [d for d in devices if getattr(d, "local_hardware_id", d.id) == ordinal]
    if not match:
        pytest.skip(f"jax has no {platform} device with CUDA ordinal {ordinal}")
    return match[0]


def _perturbed(base: Any, seed: int, device: Any) -> Any:
    """``base`` plus 0.05-scale gaussian noise, drawn on ``device`` (no host round trip)."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(base)
    keys = jax.random.split(jax.device_put(jax.random.key(seed), device), len(leaves))
    noisy = [
        x + PERTURB_SCALE * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, noisy)


def _sent_digests(source: Any) -> dict[str, str]:
    """sha256 per HF name of exactly what the source hands the engine (post-transform)."""
    return {name: hashlib.sha256(np.asarray(array).tobytes()).hexdigest() for name, array in source}


def _jax_logprobs(fn: Any, params: Any, ids: list[int], device: Any) -> np.ndarray:
    """Log-softmax ``[T, vocab]`` of the Flax model over ``ids``, float32, on ``device``."""
    import jax
    import jax.numpy as jnp

    tokens = jax.device_put(jnp.asarray([ids], jnp.int32), device)
    with jax.default_matmul_precision("highest"):
        logits = fn(params, tokens)
        return np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))


def _compare(choice: dict[str, Any], logp: np.ndarray, round_no: int) -> float:
    """Assert the worker's greedy tokens and logprobs equal the JAX model's; return the
    largest absolute logprob difference seen."""
    tokens = choice["token_ids"]
    assert choice["prompt_token_ids"] == PROMPT
    assert len(tokens) == MAX_TOKENS
    chosen = choice["logprobs"]["token_logprobs"]
    tops = choice["logprobs"]["top_logprobs"]
    worst = 0.0
    for i, tok in enumerate(tokens):
        row = logp[len(PROMPT) - 1 + i]  # position t predicts token t+1
        order = np.argsort(-row, kind="stable")
        where = f"round {round_no} step {i}"
        if row[order[0]] - row[order[1]] > 2 * ATOL:
            assert tok == int(order[0]), (
                f"{where}: worker chose {tok}, JAX argmax is {int(order[0])}"
            )
        else:  # a near tie: either id is a correct greedy choice within the tolerance
            assert row[tok] >= row[order[0]] - ATOL, (
                f"{where}: worker token {tok} is not a JAX argmax"
            )
        assert abs(chosen[i] - row[tok]) <= ATOL, f"{where}: logprob {chosen[i]} vs JAX {row[tok]}"
        ids = [int(key.split(":", 1)[1]) for key in tops[i]]
        assert len(ids) == TOP_LOGPROBS and tok in ids
        got = np.asarray([tops[i][key] for key in tops[i]], np.float64)
        np.testing.assert_allclose(
            got, row[ids], rtol=0, atol=ATOL, err_msg=f"{where}: top-{TOP_LOGPROBS} by id"
        )
        # Tie-insensitive: the sorted top-k values equal JAX's top-k values.
        np.testing.assert_allclose(
            np.sort(got)[::-1],
            row[order[:TOP_LOGPROBS]],
            rtol=0,
            atol=ATOL,
            err_msg=f"{where}: top-{TOP_LOGPROBS} values",
        )
        worst = max(worst, float(np.max(np.abs(got - row[ids]))))
    return worst


def run_logits_scenario(model_dir: str, monkeypatch: pytest.MonkeyPatch, sc: Scenario) -> None:
    """Two JAX trainer rounds into one reference worker; bytes and logits checked after each."""
    jax = pytest.importorskip("jax")
    from weightwire.jax_side import JAXTrainerEngine, PytreeSource
    from weightwire.jax_side.checkpoint import read_safetensors
    from weightwire.shared.framing import plan
    from weightwire.shared.timeouts import Timeouts
    from weightwire.tools.models import llama
    from weightwire.tools.models.loading import load_decoder
    from weightwire.tools.server.replica import WorkerSpec
    from weightwire.trainer import TrainerInitInfo

    device = _jax_device(
        sc.jax_platform, sc.cuda_ordinal
    )  # JAX owns its devices before the env narrows
    cfg, base = load_decoder(model_dir)
    base = jax.device_put(base, device)
    state = {"params": _perturbed(base, 1, device)}
    source = PytreeSource(lambda: state["params"], llama.naming(cfg), device=device)
    metas = source.metadata()
    on_disk = read_safetensors(model_dir)
    assert {m.name for m in metas} == set(on_disk)  # the preset maps every checkpoint tensor
    chunks = plan(metas, packed=sc.packed, buffer_size_bytes=BUFFER_BYTES)
    assert not sc.packed or 2 < len(chunks) < len(
        metas
    )  # packing really groups, over several chunks
    apply_fn = llama.make_apply(cfg)

    spec = WorkerSpec(
        model_dir=model_dir, backend=sc.backend, device=sc.worker_device, replicas=1, threads=2
    )
    with monkeypatch.context() as env:
        for key, value in sc.worker_env.items():
            env.setenv(key, value)  # seen by the worker process only: the pool spawns it now
        client = PoolClient(spec)
    engine = None
    try:
        if sc.worker_device == "cuda":
            assert client.worker_info["device"] == "cuda:0"  # GPU 1 of the host, alone in its view
        disk_sums = {k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in on_disk.items()}
        assert client.checksums() == disk_sums  # the worker starts from the checkpoint
        info = TrainerInitInfo(
            backend=sc.backend,
            device=sc.cuda_ordinal,
            server_version="0.33.0",
            inference_world_size=1,
            packed=sc.packed,
            packed_buffer_size_bytes=BUFFER_BYTES,
            packed_num_buffers=2,
            timeouts=Timeouts(http_s=ROUND_S, connect_s=OP_S, warmup_s=OP_S, transfer_s=OP_S),
        )
        engine = JAXTrainerEngine.trainer_init(info, client=client, source=source)
        previous: tuple[Any, dict[str, str]] | None = None
        for round_no in (1, 2):
            if round_no == 2:
                state["params"] = _perturbed(base, 2, device)  # the "training step"
            sent = _sent_digests(source)
            metrics = engine.send_weights()
            assert metrics.version == str(round_no) and metrics.reused_metadata == (round_no == 2)
            assert metrics.tensors == len(metas) and metrics.chunks == len(chunks)
            stats = client.update_stats[-1]
            assert (stats["tensors"], stats["chunks"]) == (len(metas), len(chunks))
            assert stats["nbytes"] == sum(m.nbytes for m in metas)

            got = client.checksums()
            assert got == sent, (
                f"tensors whose bytes differ: {sorted(k for k in sent if got.get(k) != sent[k])}"
            )
            changed_from = disk_sums if previous is None else previous[1]
            assert all(got[k] != changed_from[k] for k in got)  # every tensor took new values

            out = client.generate(
                {
                    "prompt": PROMPT,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "logprobs": TOP_LOGPROBS,
                    "ignore_eos": True,
                    "return_token_ids": True,
                    "return_tokens_as_token_ids": True,
                }
            )
            choice = out["choices"][0]
            ids = PROMPT + choice["token_ids"][:-1]
            worst = _compare(
                choice, _jax_logprobs(apply_fn, state["params"], ids, device), round_no
            )
            sc.log.append(f"round {round_no}: max |logprob diff| {worst:.2e}, {metrics.summary()}")
            if previous is not None:
                # The tolerance separates rounds: the last round's params do not pass it.
                stale = _jax_logprobs(apply_fn, previous[0], ids, device)
                rows = stale[len(PROMPT) - 1 :]
                diff = np.abs(
                    rows[np.arange(MAX_TOKENS), choice["token_ids"]]
                    - choice["logprobs"]["token_logprobs"]
                )
                sc.log.append(
                    f"round {round_no}: previous round's params are off by up to "
                    f"{float(diff.max()):.2e}"
                )
                assert float(diff.max()) > 100 * ATOL
            previous = (state["params"], got)
        assert client.versions == ["1", "2"]
    finally:
        try:
            if engine is not None:
                engine.shutdown()
        finally:
            client.close()


@pytest.mark.gpu(count=2)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_jax_trainer_to_hf_worker_logits_match(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch, packed: bool
) -> None:
    cp = pytest.importorskip("cupy")
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    cp.cuda.Device(0).use()
    sc = Scenario(
        backend="weightwire_nccl",
        worker_device="cuda",
        worker_env={"CUDA_VISIBLE_DEVICES": "1"},
        jax_platform="gpu",
        cuda_ordinal=0,
        packed=packed,
    )
    run_logits_scenario(tiny_llama, monkeypatch, sc)
    print("\n".join(sc.log))


@pytest.mark.slow
def test_cpu_tcp_harness(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same scenario on CPU (JAX on CPU, worker on CPU, ``weightwire_tcp``): keeps the
    harness honest where no GPU is available. Packed only; the GPU test covers both."""
    if (
        importlib.util.find_spec("torch") is None
        or importlib.util.find_spec("transformers") is None
    ):
        pytest.skip("the reference worker needs torch and transformers")
    sc = Scenario(
        backend="weightwire_tcp",
        worker_device="cpu",
        worker_env={},
        jax_platform="cpu",
        cuda_ordinal=None,
        packed=True,
    )
    run_logits_scenario(tiny_llama, monkeypatch, sc)
