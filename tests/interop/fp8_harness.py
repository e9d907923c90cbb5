"""vLLM's own FP8 quantizers, loaded unchanged from a vLLM tree into this process.

- ``per_block_cast_to_fp8`` (``vllm/utils/deep_gemm.py``): the module is executed as it is,
  its ``torch.compile`` (inductor on CPU, as vLLM's CPU platform compiles it) included;
- ``input_to_float8`` (``vllm/model_executor/layers/quantization/utils/fp8_utils.py``): that
  module imports triton and half of vLLM, so the one function's source text is cut out of
  the file (``ast``) and executed unchanged beside ``torch`` and the platform stand-in.

The ``vllm.*`` names ``deep_gemm.py`` imports are read from the file and stood in for: the
ones its quantizer calls with working equivalents (the CPU platform's ``float8_e4m3fn`` and
``inductor`` backend, ``get_fp8_min_max``, ``cdiv``), the rest (DeepGEMM hooks, ``envs``)
with placeholders that fail if called. Whatever was in ``sys.modules`` under ``vllm`` is put
back afterwards.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from tests.interop.trees import vllm_tree_root, vllm_trees

DEEP_GEMM = os.path.join("utils", "deep_gemm.py")
"""Inside the ``vllm`` package."""
FP8_UTILS = os.path.join(
    "vllm", "model_executor", "layers", "quantization", "utils", "fp8_utils.py"
)


def trees() -> list[str]:
    """The interop venv's vLLM always; a source tree too when WEIGHTWIRE_VLLM_SRC names one."""
    return vllm_trees()


def tree_path(kind: str) -> str:
    """The directory holding the ``vllm`` package of one tree (skips without the venv)."""
    return vllm_tree_root(kind, DEEP_GEMM)


class CpuPlatform:
    """The attributes of vLLM's ``current_platform`` the quantizers read, as on CPU."""

    simple_compile_backend = "inductor"

    @staticmethod
    def fp8_dtype() -> torch.dtype:
        return torch.float8_e4m3fn

    @staticmethod
    def is_fp8_fnuz() -> bool:
        return False


def _get_fp8_min_max() -> tuple[float, float]:
    finfo = torch.finfo(torch.float8_e4m3fn)
    return finfo.min, finfo.max


def _unused(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"vLLM's {name} is a stand-in here; the quantizer must not call it")

    return call


WORKING: dict[str, Any] = {
    "current_platform": CpuPlatform(),
    "get_fp8_min_max": _get_fp8_min_max,
    "cdiv": lambda a, b: -(a // -b),
    "logger": logging.getLogger("vllm-stand-in"),
    "init_logger": logging.getLogger,
    "has_deep_gemm": lambda: False,
}


def _stand_ins(source: str) -> dict[str, types.ModuleType]:
    """A module for every ``vllm.*`` name ``source`` imports, and each imported attribute."""
    modules: dict[str, types.ModuleType] = {}

    def module(name: str) -> types.ModuleType:
        if name not in modules:
            modules[name] = types.ModuleType(name)
            modules[name].__path__ = []  # a package: children may be imported
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(module(parent), child, modules[name])
        return modules[name]

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm":
                    module(alias.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            mod = module(node.module or "vllm")
            for alias in node.names:
                setattr(mod, alias.name, WORKING.get(alias.name, _unused(alias.name)))
    return modules


def load_per_block_cast_to_fp8(root: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    path = os.path.join(root, "vllm", DEEP_GEMM)
    with open(path, encoding="utf-8") as f:
        stand_ins = _stand_ins(f.read())
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for k in saved:
        del sys.modules[k]
    sys.modules.update(stand_ins)
    try:
        spec = importlib.util.spec_from_file_location("_vllm_deep_gemm_under_test", path)
        assert spec is not None and spec.loader is not None
        deep_gemm = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(deep_gemm)
    finally:
        for k in stand_ins:
            sys.modules.pop(k, None)
        sys.modules.update(saved)
    fn = getattr(deep_gemm, "per_block_cast_to_fp8", None)
    assert fn is not None, f"{path} defines no per_block_cast_to_fp8"
    return fn  # type: ignore[no-any-return]


def load_input_to_float8(root: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    path = os.path.join(root, FP8_UTILS)
    with open(path, encoding="utf-8") as f:
        source = f.read()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == "input_to_float8":
            text = ast.get_source_segment(source, node)
            assert text is not None
            namespace: dict[str, Any] = {"torch": torch, "current_platform": CpuPlatform()}
            exec(compile(text, path, "exec"), namespace)
            return namespace["input_to_float8"]  # type: ignore[no-any-return]
    raise AssertionError(f"{path} defines no input_to_float8")
