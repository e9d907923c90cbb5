"""The worker's adapter round (``torch_side.worker.lora``) and the vLLM host's refusals and
memory path (``torch_side.worker.vllm_lora``) without a vLLM: stand-in modules with the
internals' names and signatures."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from weightwire.shared.lora import LoRASpec, wire_name, write_adapter_dir
from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.worker import vllm_lora
from weightwire.torch_side.worker.lora import LoRARound, adapter_round
from weightwire.torch_side.worker.strategy import RoundTarget, StagedRound

Q = "model.layers.0.self_attn.q_proj"
METAS = [
    ParamMeta(wire_name(Q, "A", "pol"), "float32", (2, 8)),
    ParamMeta(wire_name(Q, "B", "pol"), "float32", (8, 2)),
]
SPEC = LoRASpec.from_metas(METAS)
TARGET = RoundTarget("weightwire_tcp", model=None, model_config=None, framework=None)


class Host:
    def __init__(self, refuse: str | None = None) -> None:
        self.refuse, self.swapped = refuse, []

    def check(self, spec: LoRASpec) -> None:
        if self.refuse:
            raise ValueError(self.refuse)

    def swap(self, spec: LoRASpec, tensors: dict[str, torch.Tensor]) -> None:
        self.swapped.append((spec, tensors))


def _chunks(buffer: torch.Tensor) -> Iterator[list[tuple[str, torch.Tensor]]]:
    yield [(METAS[0].name, buffer[:16].view(2, 8)), (METAS[1].name, buffer[16:].view(8, 2))]


def test_an_adapter_round_swaps_its_own_copy_at_commit_and_nothing_before() -> None:
    host = Host()
    round_ = adapter_round(StagedRound(TARGET), METAS, lambda: host)
    assert isinstance(round_, LoRARound)
    buffer = torch.arange(32, dtype=torch.float32)
    round_.receive(_chunks(buffer))
    buffer.zero_()  # the receive buffer is reused for the next chunk
    assert host.swapped == []
    round_.commit()
    ((spec, tensors),) = host.swapped
    a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert spec == SPEC and torch.equal(a, torch.arange(16, dtype=torch.float32).view(2, 8))


def test_an_aborted_or_partial_adapter_round_swaps_nothing() -> None:
    host = Host()
    round_ = adapter_round(StagedRound(TARGET), METAS, lambda: host)
    assert round_ is not None
    round_.receive(iter([[(METAS[0].name, torch.zeros(2, 8))]]))
    with pytest.raises(ValueError, match="1 tensor\\(s\\) never arrived"):
        round_.commit()
    round_.abort("trainer gone")
    assert host.swapped == [] and not round_.wrote


def test_what_a_worker_cannot_take_is_refused_before_any_byte() -> None:
    assert (
        adapter_round(StagedRound(TARGET), [ParamMeta("lm_head.weight", "float32", (2,))], None)
        is None
    )
    with pytest.raises(ValueError, match="does not serve LoRA adapters"):
        adapter_round(StagedRound(TARGET), METAS, lambda: None)
    with pytest.raises(ValueError, match="rank 2 is over"):
        adapter_round(StagedRound(TARGET), METAS, lambda: Host("rank 2 is over"))
    holding = StagedRound(TARGET)
    holding.held = [("lm_head.weight", torch.zeros(2))]
    with pytest.raises(ValueError, match="alone"):
        adapter_round(holding, METAS, lambda: Host())
    lora = LoRARound(TARGET, SPEC, Host())
    with pytest.raises(ValueError, match="mixes an adapter with base weights"):
        adapter_round(lora, [ParamMeta("lm_head.weight", "float32", (2,))], lambda: Host())


def test_vllm_without_lora_or_without_its_internals_refuses_clearly() -> None:
    no_lora = SimpleNamespace(vllm_config=SimpleNamespace(lora_config=None))
    with pytest.raises(ValueError, match="without --enable-lora"):
        vllm_lora.VllmAdapterHost(lambda: no_lora).check(SPEC)
    with pytest.raises(ValueError, match="worker of this engine is unknown"):
        vllm_lora.VllmAdapterHost(None).check(SPEC)


# -- vLLM's two internals, stood in for ------------------------------------------------------


class _LoRAModel:
    calls: list[str] = []

    @classmethod
    def from_local_checkpoint(
        cls,
        lora_dir: str,
        expected_lora_modules: set[str],
        peft_helper: Any,
        *,
        lora_model_id: int | None = None,
        device: str = "cuda",
        dtype: Any = None,
    ) -> Any:
        return ("disk", lora_dir, lora_model_id)

    @classmethod
    def from_lora_tensors(
        cls, lora_model_id: int, tensors: dict[str, Any], peft_helper: Any, device: str = "cuda"
    ) -> Any:
        return ("memory", lora_model_id, tensors, device)


class _WorkerLoRAManager:
    def _load_adapter(self, lora_request: Any) -> Any:
        model_cls = sys.modules["vllm.lora.lora_model"].LoRAModel  # vLLM: self._lora_model_cls
        return model_cls.from_local_checkpoint(
            lora_request.lora_path,
            set(),
            None,
            lora_model_id=lora_request.lora_int_id,
            device="cpu",
        )


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.33.0"  # type: ignore[attr-defined]
    lora_model = types.ModuleType("vllm.lora.lora_model")
    worker_manager = types.ModuleType("vllm.lora.worker_manager")
    lora_model.LoRAModel = type("LoRAModel", (_LoRAModel,), {})  # type: ignore[attr-defined]
    worker_manager.WorkerLoRAManager = type("WorkerLoRAManager", (_WorkerLoRAManager,), {})  # type: ignore[attr-defined]
    for name, mod in {
        "vllm": vllm,
        "vllm.lora": types.ModuleType("vllm.lora"),
        "vllm.lora.lora_model": lora_model,
        "vllm.lora.worker_manager": worker_manager,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(vllm_lora, "REGISTRY", vllm_lora._Registry())
    yield vllm


def test_another_vllm_release_is_refused_by_name(fake_vllm: types.ModuleType) -> None:
    fake_vllm.__version__ = "0.40.1"  # type: ignore[attr-defined]
    why = vllm_lora._install()
    assert (
        why is not None and "vLLM 0.40.1 is not a release" in why and vllm_lora.UNTESTED_ENV in why
    )


def test_a_replaced_adapter_loads_from_memory_and_others_from_disk(
    fake_vllm: types.ModuleType, tmp_path: Path
) -> None:
    assert vllm_lora._install() is None
    from vllm.lora.worker_manager import WorkerLoRAManager  # the stand-in, now wrapped

    adapter = write_adapter_dir(
        tmp_path / "pol",
        SPEC,
        {m.name: np.zeros(m.shape, np.float32) for m in METAS},
        alpha=4.0,
    )
    request = SimpleNamespace(lora_name="pol", lora_int_id=3, lora_path=str(adapter))
    manager = WorkerLoRAManager()
    assert manager._load_adapter(request)[0] == "disk"  # registration: vLLM reads the directory
    known = vllm_lora.REGISTRY.by_name["pol"]
    assert (known.lora_int_id, known.spec) == (3, SPEC)
    new = {"k": torch.ones(2)}
    vllm_lora.REGISTRY.memory[known.path] = new
    source, lora_id, tensors, device = manager._load_adapter(request)
    assert (source, lora_id, device) == ("memory", 3, "cpu")
    assert torch.equal(tensors["k"], new["k"]) and tensors["k"] is not new["k"]  # a copy per load
    other = SimpleNamespace(lora_name="x", lora_int_id=4, lora_path=str(tmp_path))
    assert manager._load_adapter(other)[0] == "disk"
