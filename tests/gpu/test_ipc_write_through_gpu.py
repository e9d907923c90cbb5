"""``weightwire_ipc`` write-through on ONE GPU: a JAX (torch-free engine) or torch trainer in
this process writes each tensor straight into the serving parameters of vLLM's plugin
engine class (``tests.torch_side.vllm_stub``: vLLM's reload hooks faked, parameters laid out
as vLLM lays them out) in another process on the same device.

Models: ``llama`` (fused ``qkv_proj`` / ``gate_up_proj``), ``llama-tied`` (the head is the
embedding), ``moe`` (fused experts, loaded per expert and shard) and ``dtypes`` (every wire
dtype, a float32 tensor cast into a bfloat16 parameter, a transposed load and column
halves: the strided kernel). After each of two rounds of fresh values every Hugging Face
tensor read back out of the parameters has the trainer's digest, the session ran the
write-through pipeline and the worker used no receive buffer. Then a trainer killed
mid-round leaves the worker refusing (an incomplete model, named) until a complete round.

    CUDA_VISIBLE_DEVICES=0 pytest -m gpu -s tests/gpu/test_ipc_write_through_gpu.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.torch_side._procs import spawn_stub

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {
    "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
}
KINDS = ["llama", "llama-tied", "moe", "dtypes"]


@pytest.fixture(scope="module")
def workers() -> Iterator[Callable[[str], Any]]:
    spawned: dict[str, tuple[Any, Any]] = {}

    def get(kind: str) -> Any:
        if kind not in spawned:
            spawned[kind] = spawn_stub(
                "weightwire_ipc", "cuda:0", "tiny", "--model", kind, env=ENV, timeout=300
            )
        return spawned[kind][1]

    yield get
    for proc, client in spawned.values():
        try:
            client.exit()
        finally:
            proc.wait(timeout=120)


class Tensors:
    """A round's tensors (torch, on the GPU) and what the worker must read back."""

    def __init__(self, kind: str, seed: int, skip: tuple[str, ...] = ()) -> None:
        import torch

        from tests.torch_side.stub_models import byte_digest, hf_tensors, to_torch
        from tests.torch_side.vllm_stub import digest, make_model, trainer_tensors

        device = torch.device("cuda", 0)
        self.dtypes: dict[str, str] = {}
        self.torch: dict[str, Any] = {}
        if kind.startswith("llama"):
            for name, t in trainer_tensors("tiny", device, seed):
                if kind == "llama-tied" and name == "lm_head.weight":
                    continue  # a tied checkpoint has no head of its own
                self.torch[name], self.dtypes[name] = t, "bfloat16"
            self.want = {n: digest(t) for n, t in self.torch.items()}
            if kind == "llama-tied":
                self.want["lm_head.weight"] = self.want["model.embed_tokens.weight"]
            return
        model = make_model(kind, "tiny", torch.device("meta"))
        for name, array, dtype in hf_tensors(model, seed):
            if dtype not in skip:
                self.torch[name], self.dtypes[name] = to_torch(array, dtype, device), dtype
        cast = {"cast.weight": torch.bfloat16}  # the parameter's dtype: torch's cast is the truth
        self.want = {
            n: byte_digest(t.to(cast[n]) if n in cast else t) for n, t in self.torch.items()
        }

    def arrays(self, engine: str) -> dict[str, Any]:
        if engine == "torch":
            return self.torch
        import jax
        import torch

        from weightwire.shared.dtypes import wire_dtype

        out = {}
        for n, t in self.torch.items():  # through the host: every dtype, no DLPack gaps
            raw = t.contiguous().view(-1).view(torch.uint8).cpu().numpy()
            out[n] = jax.device_put(raw.view(wire_dtype(self.dtypes[n]).numpy).reshape(t.shape))
        jax.block_until_ready(list(out.values()))
        return out


def _source(tensors: Tensors, engine: str) -> Any:
    from weightwire.shared.meta import ParamMeta
    from weightwire.shared.source import WeightSource

    class Source(WeightSource):
        def __init__(self) -> None:
            self.arrays = tensors.arrays(engine)

        def metadata(self) -> list[ParamMeta]:
            return [
                ParamMeta(n, tensors.dtypes[n], tuple(int(d) for d in a.shape))
                for n, a in self.arrays.items()
            ]

        def __iter__(self) -> Iterator[tuple[str, Any]]:
            return iter(self.arrays.items())

    return Source()


def _engine(engine: str) -> Any:
    if engine == "jax":
        from weightwire.jax_side.engine import JAXTrainerEngine

        return JAXTrainerEngine
    from weightwire.torch_side.sender.engine import TorchTrainerEngine

    return TorchTrainerEngine


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["torch", "jax"])
@pytest.mark.parametrize("kind", KINDS)
def test_rounds_written_through_are_bit_identical(workers: Any, kind: str, engine: str) -> None:
    from weightwire.trainer import TrainerInitInfo

    client = workers(kind)
    info = TrainerInitInfo(
        backend="weightwire_ipc",
        ipc_mode="write_through",
        packed_buffer_size_bytes=32 << 10,  # several chunks even for the tiny models
        device=0,
    )
    # JAX without jax_enable_x64 has no 64-bit arrays: those dtypes are the torch trainer's
    skip = ("float64", "int64") if engine == "jax" else ()
    first = Tensors(kind, seed=1, skip=skip)
    source = _source(first, engine)
    trainer = _engine(engine).trainer_init(info, client=client, source=source)
    try:
        for seed in (1, 2):
            tensors = first if seed == 1 else Tensors(kind, seed, skip)
            source.arrays = tensors.arrays(engine)
            trainer.send_weights()
            got = client.call("digests")
            bad = [n for n in tensors.want if got.get(n) != tensors.want[n]]
            assert not bad and set(got) >= set(tensors.want), bad
            assert client.call("incomplete") is None
            assert type(trainer.session.sender).__name__ == "IPCWriteThroughPipeline"
            assert client.call("memory").get("pool", 0) == 0  # nothing went through a buffer
    finally:
        trainer.shutdown()


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_a_trainer_killed_mid_round_leaves_the_worker_refusing_until_a_complete_round(
    workers: Any,
) -> None:
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.trainer import TrainerInitInfo

    client = workers("llama")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "gpu", "wthru_trainer.py")]
        + ["--address", client.address, "--kill-at", "12"],
        env={**os.environ, **ENV},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    with pytest.raises(Exception) as err:  # answers once the dead trainer's round failed there
        client.start_weight_update()
    assert "aborted after a failed round" in str(err.value) and "PeerLost" in str(err.value)
    incomplete = client.call("incomplete")
    assert incomplete is not None and "incomplete weight round" in incomplete, incomplete
    tensors = Tensors("llama", seed=3)
    info = TrainerInitInfo(backend="weightwire_ipc", ipc_mode="write_through", device=0)
    trainer = TorchTrainerEngine.trainer_init(info, client=client, source=_source(tensors, "torch"))
    try:
        trainer.send_weights()
    finally:
        trainer.shutdown()
    assert client.call("incomplete") is None
    assert client.call("digests") == tensors.want
