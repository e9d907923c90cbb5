"""``repack_cpu_moe_on_reload``: a reprocessed CPU fused-MoE layer is prepacked again.

vLLM 0.32 prepacks CPU MoE weights only on the first ``process_weights_after_loading``;
without the wrapper every round leaves the experts in the wrong layout (the real-vLLM
proof is ``tests/interop/test_families_vllm.py``). vLLM itself is stubbed here.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest
import torch


class FakeCPUExperts:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.calls.append("prepack")


class FakeMoEMethod:
    def __init__(self, experts: object, calls: list[str]) -> None:
        self.moe_kernel = types.SimpleNamespace(fused_experts=experts)
        self.calls = calls

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.calls.append("copy")


@pytest.fixture
def vllm_engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    base = types.ModuleType("vllm.distributed.weight_transfer.base")
    base.WeightTransferEngine = type("WeightTransferEngine", (), {})  # type: ignore[attr-defined]
    cpu_moe = types.ModuleType("vllm.model_executor.layers.fused_moe.experts.cpu_moe")
    cpu_moe.CPUUnquantizedExperts = FakeCPUExperts  # type: ignore[attr-defined]
    for name in (
        "vllm",
        "vllm.distributed",
        "vllm.distributed.weight_transfer",
        "vllm.model_executor",
        "vllm.model_executor.layers",
        "vllm.model_executor.layers.fused_moe",
        "vllm.model_executor.layers.fused_moe.experts",
    ):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, base.__name__, base)
    monkeypatch.setitem(sys.modules, cpu_moe.__name__, cpu_moe)
    monkeypatch.delitem(sys.modules, "weightwire.torch_side.worker.vllm_engines", raising=False)
    import weightwire.torch_side.worker.vllm_engines as mod

    yield mod
    # Imported against the stubs: never leave it for other tests (monkeypatch then
    # restores a real copy imported before, if any).
    sys.modules.pop(mod.__name__, None)


def test_reprocessed_cpu_moe_layers_are_prepacked_again_once(
    vllm_engines: types.ModuleType,
) -> None:
    calls: list[str] = []
    other: list[str] = []
    model = torch.nn.Module()
    model.moe = torch.nn.Module()
    model.moe.quant_method = FakeMoEMethod(FakeCPUExperts(calls), calls)
    model.dense = torch.nn.Module()
    model.dense.quant_method = FakeMoEMethod(object(), other)  # not CPU experts: left alone
    vllm_engines.repack_cpu_moe_on_reload(model)
    vllm_engines.repack_cpu_moe_on_reload(model)  # every round calls it: wrapped once
    model.moe.quant_method.process_weights_after_loading(model.moe)
    model.dense.quant_method.process_weights_after_loading(model.dense)
    assert calls == ["copy", "prepack"]
    assert other == ["copy"]
