"""The PyTorch side: the torch trainer (``torch_side.sender``: ``TorchTrainerEngine``,
``ModuleSource``), the receiving workers (``torch_side.worker``: the worker engines,
``HFModelHost``, the vLLM plugin) and the torch <-> wire dtype names (``torch_side.dtypes``).
The reference server is ``weightwire.tools.server`` (``weightwire serve``).

Never imports jax. Importing this package is cheap: it loads neither torch nor vLLM;
each export is resolved on first attribute access, so the vLLM plugin entry point
(``torch_side.worker.plugin``) can be imported in every vLLM process for free. The
worker names come through ``torch_side.worker``, whose own list says where they live.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightwire._extras import require
from weightwire._lazy import attach

# find_spec only (torch is not imported): a host without the extra learns which one to install.
require("torch", purpose="weightwire.torch_side")

if TYPE_CHECKING:  # the export list (``weightwire._lazy``): each name is imported on first use
    from weightwire.torch_side.dtypes import torch_dtype as torch_dtype
    from weightwire.torch_side.dtypes import wire_name as wire_name
    from weightwire.torch_side.sender.engine import TorchTrainerEngine as TorchTrainerEngine
    from weightwire.torch_side.sender.source import ModuleSource as ModuleSource
    from weightwire.torch_side.sender.source import describe_tensor as describe_tensor
    from weightwire.torch_side.worker import HFModelHost as HFModelHost
    from weightwire.torch_side.worker import WeightwireNCCLEngine as WeightwireNCCLEngine
    from weightwire.torch_side.worker import WeightwireTCPEngine as WeightwireTCPEngine

__getattr__, __dir__ = attach(__name__, globals())
