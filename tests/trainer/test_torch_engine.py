"""TorchTrainerEngine on CPU: byte extraction for every wire dtype, a round through
the recording backend, the non-sender path, and import isolation of both engines."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

from tests.trainer.fakes import FAKE, FAST, DictSource, FakeComm, FakeServer
from weightwire.shared.framing import pack_host, plan
from weightwire.torch_side.sender.engine import TorchTrainerEngine
from weightwire.torch_side.sender.source import describe_tensor
from weightwire.trainer import TrainerInitInfo


def engine_for(
    weights: dict[str, torch.Tensor], **info: object
) -> tuple[TorchTrainerEngine, FakeServer]:
    server = FakeServer()
    kw = {"backend": "fake_host", "timeouts": FAST, **info}
    engine = TorchTrainerEngine.trainer_init(
        TrainerInitInfo(**kw), client=server.client(), source=DictSource(weights, describe_tensor)
    )  # type: ignore[arg-type]
    return engine, server


@pytest.mark.parametrize(
    ("dtype", "np_dtype"),
    [
        (torch.bfloat16, ml_dtypes.bfloat16),
        (torch.float16, np.float16),
        (torch.float32, np.float32),
        (torch.int64, np.int64),
        (torch.bool, np.bool_),
        (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
    ],
)
def test_host_bytes_are_the_raw_little_endian_bytes(dtype: torch.dtype, np_dtype: object) -> None:
    values = np.arange(-6, 6, dtype=np.float32).reshape(3, 4) / 4
    reference = (values != 0) if np_dtype is np.bool_ else values.astype(np_dtype)
    tensor = torch.from_numpy(values).to(dtype)
    engine = TorchTrainerEngine.__new__(TorchTrainerEngine)
    assert engine.host_bytes(tensor).tobytes() == np.ascontiguousarray(reference).tobytes()
    # a transposed (non-contiguous) view is sent in its logical C order
    assert engine.host_bytes(tensor.t()).tobytes() == np.ascontiguousarray(reference.T).tobytes()
    assert engine.describe(tensor)[1] == (3, 4)


def test_round_sends_module_bytes_in_plan_order() -> None:
    FAKE.comm = FakeComm()
    gen = torch.Generator().manual_seed(0)
    weights = {
        "model.embed_tokens.weight": torch.randn(10, 4, generator=gen).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=gen),
        "model.layers.0.mlp.scale": torch.tensor(3.0, dtype=torch.float16),
        "lm_head.weight": torch.randn(4, 10, generator=gen).t(),  # non-contiguous
    }
    engine, server = engine_for(weights, packed_buffer_size_bytes=48)
    metrics = engine.send_weights()
    arrays = [np.ascontiguousarray(engine.host_bytes(t)) for t in weights.values()]
    metas = engine.source.metadata()
    want = [
        pack_host(arrays[c.start : c.stop], c).tobytes()
        for c in plan(metas, packed=True, buffer_size_bytes=48)
    ]
    assert FAKE.comm.broadcasts == want and metrics.nbytes == sum(map(len, want))
    assert server.bodies("update_weights")[0]["update_info"]["dtype_names"] == [
        "bfloat16",
        "float32",
        "float16",
        "float32",
    ]
    with pytest.raises(TypeError, match="expected torch.Tensor"):
        engine.describe(np.zeros(2))


def test_other_ranks_iterate_without_touching_the_wire() -> None:
    FAKE.comm = FakeComm()
    weights = {"w": torch.ones(3)}
    engine, server = engine_for(weights, rank=3)
    for _ in range(2):
        metrics = engine.send_weights()
        assert not metrics.sender
    assert engine.source.iterations == 2 and server.calls == [] and FAKE.comm.broadcasts == []
    engine.shutdown()


def test_engines_import_only_their_own_framework() -> None:
    code = (
        "import sys\n"
        "import weightwire.jax_side.engine, weightwire.jax_side.packer, weightwire.trainer, "
        "weightwire.testing.loopback\n"
        "assert 'torch' not in sys.modules, 'jax side imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    code = (
        "import sys\n"
        "import weightwire.torch_side.sender.engine\n"
        "assert 'jax' not in sys.modules, 'torch side imported jax'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_torch_packer_reads_a_resident_contiguous_tensor_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``TorchDevicePacker.regions``' fast path (no GPU here: duck-typed CUDA tensors):
    pointer, byte size and device of the tensor itself; one on another GPU is staged."""
    from types import SimpleNamespace

    from weightwire.torch_side.sender.engine import TorchDevicePacker

    class Stream:
        def wait_stream(self, other: object) -> None:
            pass

    def cuda_tensor(ptr: int, nbytes: int, device: int, contiguous: bool = True) -> SimpleNamespace:
        return SimpleNamespace(
            is_cuda=True,
            get_device=lambda: device,
            is_contiguous=lambda: contiguous,
            data_ptr=lambda: ptr,
            nbytes=nbytes,
        )

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    packer = object.__new__(TorchDevicePacker)
    packer._device, packer._streams = torch.device("cuda", 1), {0x77: Stream()}
    here = [cuda_tensor(0xA0, 12, 1), cuda_tensor(0xB0, 0, 1)]
    got = packer.regions(here, SimpleNamespace(ptr=0x77))
    assert [(g.ptr, g.nbytes, g.device, g.owner) for g in got] == [
        (0xA0, 12, 1, here[0]),
        (0xB0, 0, 1, here[1]),
    ]
    for elsewhere in (cuda_tensor(0xC0, 4, 0), cuda_tensor(0xD0, 4, 1, contiguous=False)):
        with pytest.raises(
            AttributeError, match="'to'"
        ):  # the staging copy (t.to(device)) is attempted
            packer.regions([elsewhere], SimpleNamespace(ptr=0x77))
