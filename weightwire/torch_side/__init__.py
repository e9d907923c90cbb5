"""The PyTorch side: ``ModuleSource``, ``TorchTrainerEngine``, the worker engines and
vLLM plugin (``torch_side.worker``), and the reference server (``torch_side.server``).

Never imports jax. Importing this package is cheap: it loads neither torch nor vLLM;
each export is resolved on first attribute access, so the vLLM plugin entry point
(``torch_side.worker.plugin``) can be imported in every vLLM process for free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightwire._extras import require
from weightwire._lazy import lazy_exports

# find_spec only (torch is not imported): a host without the extra learns which one to install.
require("torch", purpose="weightwire.torch_side")

_EXPORTS: dict[str, str] = {
    "ModuleSource": "weightwire.torch_side.sender.source",
    "describe_tensor": "weightwire.torch_side.sender.source",
    "torch_dtype": "weightwire.torch_side.dtypes",
    "wire_name": "weightwire.torch_side.dtypes",
    "TorchTrainerEngine": "weightwire.torch_side.sender.engine",
    "HFModelHost": "weightwire.torch_side.worker.hf_host",
    "WeightwireTCPEngine": "weightwire.torch_side.worker.engines",
    "WeightwireNCCLEngine": "weightwire.torch_side.worker.engines",
}

__all__ = [
    "HFModelHost",
    "ModuleSource",
    "TorchTrainerEngine",
    "WeightwireNCCLEngine",
    "WeightwireTCPEngine",
    "describe_tensor",
    "torch_dtype",
    "wire_name",
]

if TYPE_CHECKING:
    from weightwire.torch_side.dtypes import torch_dtype, wire_name
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.torch_side.sender.source import ModuleSource, describe_tensor
    from weightwire.torch_side.worker.engines import WeightwireNCCLEngine, WeightwireTCPEngine
    from weightwire.torch_side.worker.hf_host import HFModelHost


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
