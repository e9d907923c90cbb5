"""The vLLM plugin: harmless without vLLM, idempotent with a duplicate-refusing factory.
Inside a real vLLM (the interop lane): ``tests/interop/test_vllm_plugin.py``."""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from importlib.metadata import entry_points

import pytest

from weightwire.torch_side.worker import plugin


def test_entry_point_is_declared():
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "weightwire"]
    assert ep.value == "weightwire.torch_side.worker.plugin:register"
    assert ep.load() is plugin.register


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_register_without_vllm_is_quiet(caplog):
    with caplog.at_level(logging.DEBUG, logger="weightwire.torch_side.worker.plugin"):
        assert plugin.register() is None
        assert plugin.register() is None
    assert all(r.levelno == logging.DEBUG for r in caplog.records)
    assert "nothing registered" in caplog.text
    assert "vllm" not in sys.modules


class FakeFactory:
    """Mimics vLLM 0.32/0.33: lazy registration by module path, ValueError on a duplicate."""

    registry: dict[str, tuple[str, str]] = {}

    @classmethod
    def register_engine(cls, name, module_path_or_cls, class_name=None):
        if name in cls.registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        cls.registry[name] = (module_path_or_cls, class_name)


def test_register_is_lazy_and_idempotent(monkeypatch):
    for mod in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        monkeypatch.setitem(sys.modules, mod, types.ModuleType(mod))
    factory_mod = types.ModuleType("vllm.distributed.weight_transfer.factory")
    factory_mod.WeightTransferEngineFactory = FakeFactory  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.factory", factory_mod)
    monkeypatch.setattr(FakeFactory, "registry", {"nccl": ("vllm.x", "NCCLWeightTransferEngine")})
    plugin.register()
    plugin.register()  # vLLM may load plugins twice in one process
    assert FakeFactory.registry == {
        "nccl": ("vllm.x", "NCCLWeightTransferEngine"),
        "weightwire_tcp": ("weightwire.torch_side.worker.vllm_engines", "VllmWeightwireTCPEngine"),
        "weightwire_nccl": (
            "weightwire.torch_side.worker.vllm_engines",
            "VllmWeightwireNCCLEngine",
        ),
        "weightwire_ipc": ("weightwire.torch_side.worker.vllm_engines", "VllmWeightwireIPCEngine"),
    }
    assert "weightwire.torch_side.worker.vllm_engines" not in sys.modules, (
        "registration must not import the engines"
    )
