"""weightwire: push trainer weights (JAX or PyTorch) into vLLM inference workers.

Layout, following a byte from trainer to worker (``docs/architecture.md``):

- ``shared``     the contract both sides import (numpy only): metadata, init infos, framing,
                 routes, errors.
- ``backends``   one package per wire (``tcp``, ``nccl``, ``ipc``): its bytes on both sides, and
                 the registry.
- ``trainer``    the framework-neutral round driver (``TrainerInitInfo``, ``RoundMetrics``, verify).
- ``control``    the HTTP / Ray clients that drive a vLLM server's weight-sync routes.
- ``jax_side``   pytree -> HF names, ``PytreeSource``, ``JAXTrainerEngine`` (never torch).
- ``torch_side`` ``sender`` (``ModuleSource``, ``TorchTrainerEngine``) and ``worker`` (the
                 receiving engines, the vLLM plugin); never jax.
- ``vllm_guard`` the round guard: middleware for vLLM's API server (torch-free).
- ``testing``    test doubles for users' tests (a loopback receiver, a dict source).
- ``tools``      beside the library, never imported by it: the reference server
                 (``weightwire serve``), the demo, the benchmarks, the CLI.

``from weightwire import JAXTrainerEngine, PytreeSource, TrainerInitInfo, ...``: every name
below is imported on first use, so ``import weightwire`` loads no framework (nor httpx).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightwire._lazy import attach

__version__ = "0.1.0"

if TYPE_CHECKING:  # the export list (``weightwire._lazy``): each name is imported on first use
    from weightwire._extras import MissingExtra as MissingExtra
    from weightwire.backends.base import StockRefusal as StockRefusal
    from weightwire.backends.ipc.info import IPCInitInfo as IPCInitInfo
    from weightwire.backends.nccl.info import NCCLInitInfo as NCCLInitInfo
    from weightwire.backends.nccl.info import WeightwireNCCLInitInfo as WeightwireNCCLInitInfo
    from weightwire.backends.tcp.info import TCPInitInfo as TCPInitInfo
    from weightwire.control.client import HTTPWeightSyncClient as HTTPWeightSyncClient
    from weightwire.control.ray_client import RayWeightSyncClient as RayWeightSyncClient
    from weightwire.control.ready import ServerNotReady as ServerNotReady
    from weightwire.control.ready import wait_until_ready as wait_until_ready
    from weightwire.jax_side import JAXTrainerEngine as JAXTrainerEngine
    from weightwire.jax_side import MergeAxes as MergeAxes
    from weightwire.jax_side import Naming as Naming
    from weightwire.jax_side import NamingError as NamingError
    from weightwire.jax_side import PytreeSource as PytreeSource
    from weightwire.jax_side import Rule as Rule
    from weightwire.jax_side import Stacked as Stacked
    from weightwire.jax_side import Transpose as Transpose
    from weightwire.jax_side import drop as drop
    from weightwire.jax_side import preset as preset
    from weightwire.jax_side import pytree_from_hf as pytree_from_hf
    from weightwire.jax_side import read_safetensors as read_safetensors
    from weightwire.jax_side import register_family as register_family
    from weightwire.jax_side.lora import lora_source as lora_source
    from weightwire.shared.errors import ConfigError as ConfigError
    from weightwire.shared.errors import ControlTimeout as ControlTimeout
    from weightwire.shared.errors import PeerLost as PeerLost
    from weightwire.shared.errors import SourceMismatch as SourceMismatch
    from weightwire.shared.errors import TransferError as TransferError
    from weightwire.shared.errors import TransferTimeout as TransferTimeout
    from weightwire.shared.errors import WeightSyncError as WeightSyncError
    from weightwire.shared.errors import WeightwireError as WeightwireError
    from weightwire.shared.meta import ParamMeta as ParamMeta
    from weightwire.shared.patches import SparsePatch as SparsePatch
    from weightwire.shared.served import ServedModel as ServedModel
    from weightwire.shared.served import ServedModelMismatch as ServedModelMismatch
    from weightwire.shared.source import WeightSource as WeightSource
    from weightwire.shared.timeouts import Timeouts as Timeouts
    from weightwire.shared.update_info import UpdateInfo as UpdateInfo
    from weightwire.tools.models.loading import load_decoder as load_decoder
    from weightwire.torch_side import ModuleSource as ModuleSource
    from weightwire.torch_side import TorchTrainerEngine as TorchTrainerEngine
    from weightwire.torch_side.sender.lora import PeftAdapterSource as PeftAdapterSource
    from weightwire.trainer.config import TrainerInitInfo as TrainerInitInfo
    from weightwire.trainer.engine import EngineBroken as EngineBroken
    from weightwire.trainer.freshness import StaleCacheError as StaleCacheError
    from weightwire.trainer.lora import AdapterRefused as AdapterRefused
    from weightwire.trainer.lora import AdapterSync as AdapterSync
    from weightwire.trainer.metrics import RoundMetrics as RoundMetrics
    from weightwire.trainer.overlap import RoundHandle as RoundHandle
    from weightwire.trainer.overlap import RoundSkipped as RoundSkipped
    from weightwire.trainer.overlap import RoundWaitTimeout as RoundWaitTimeout
    from weightwire.trainer.patch_round import SparseBaseUnknown as SparseBaseUnknown
    from weightwire.trainer.patch_round import anchor_patches as anchor_patches
    from weightwire.trainer.verify import VerifyError as VerifyError
    from weightwire.trainer.verify import VerifyReport as VerifyReport

__getattr__, __dir__ = attach(__name__, globals())
