"""The weightwire engines as vLLM ``WeightTransferEngine`` subclasses.

Imported only by vLLM's ``WeightTransferEngineFactory`` (registered lazily by
``plugin.register``), i.e. only in processes where vLLM is installed. The factory
constructs ``cls(config, vllm_config, device, model)``; that signature and the
worker-side method set are the same in vLLM 0.32 and 0.33.

Inside vLLM a round is bracketed by vLLM's layerwise reload, as vLLM's own
checkpoint-format engines do: start readies every layer to buffer incoming tensors,
and a layer is processed and copied into the running kernels once all of its
tensors arrived; finish processes the rest (attention layers, layers that got
nothing) and restores layers that received no tensor.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from weightwire.shared.info import TCPInitInfo, UpdateInfo, WeightwireNCCLInitInfo
from weightwire.shared.ipc_info import IPCInitInfo
from weightwire.torch_side.worker.connect import connect_nccl, connect_tcp
from weightwire.torch_side.worker.core import _ReceiverCore
from weightwire.torch_side.worker.engines import EngineFacade

log = logging.getLogger("weightwire.torch_side.worker")


class LayerwiseReload:
    """``FrameworkHooks`` for vLLM: layerwise reload around each round."""

    def begin(self, model: Any) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload  # noqa: PLC0415

        initialize_layerwise_reload(model)

    def commit(self, model: Any, model_config: Any) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload  # noqa: PLC0415

        finalize_layerwise_reload(model, model_config)

    def abort(self, model: Any, model_config: Any) -> None:
        # vLLM's reload has no rollback: layers that completed already hold new
        # weights. Finalizing puts untouched layers' old tensors back so the model
        # can still serve; the error raised to the trainer says to resend a round.
        log.warning("weight update aborted mid-round: vLLM weights are now partly updated; resend a full round")
        self.commit(model, model_config)

    def receive_context(self) -> AbstractContextManager[Any]:
        try:
            from vllm.model_executor.model_loader.mtp_validation import (  # noqa: PLC0415
                disable_mtp_completeness_check,
            )
        except ImportError:  # older vLLM without MTP completeness checks
            return nullcontext()
        # A round may carry a subset of a draft model's tensors; vLLM's own engines
        # switch the completeness check off while loading them too.
        return disable_mtp_completeness_check()


def worker_rank(parallel_config: Any) -> int:
    """This worker's index across all data-parallel replicas (trainer rank excluded)."""
    dp_index = getattr(parallel_config, "data_parallel_index", None)
    if dp_index is None:
        dp_index = getattr(parallel_config, "data_parallel_rank", 0)
    return int(dp_index) * int(parallel_config.world_size) + int(parallel_config.rank)


class _VllmEngine(EngineFacade, WeightTransferEngine):  # type: ignore[misc]
    _connect: Any

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        WeightTransferEngine.__init__(self, config, vllm_config, device, model)
        self._core = _ReceiverCore(
            backend=self.backend,
            device=torch.device(device),
            target=lambda: (self.model, self.model_config),
            connect=type(self)._connect,
            info_type=self.init_info_cls,
            worker_rank=worker_rank(self.parallel_config),
            framework=LayerwiseReload(),
        )


class VllmWeightwireTCPEngine(_VllmEngine):
    """``--weight-transfer-config '{"backend": "weightwire_tcp"}'``: TCP data plane, CPU or GPU workers."""

    backend = "weightwire_tcp"
    init_info_cls = TCPInitInfo
    update_info_cls = UpdateInfo
    _connect = staticmethod(connect_tcp)


class VllmWeightwireNCCLEngine(_VllmEngine):
    """``--weight-transfer-config '{"backend": "weightwire_nccl"}'``: NCCL via cupy, with timeouts."""

    backend = "weightwire_nccl"
    init_info_cls = WeightwireNCCLInitInfo
    update_info_cls = UpdateInfo
    _connect = staticmethod(connect_nccl)


class VllmWeightwireIPCEngine(_VllmEngine):
    """``--weight-transfer-config '{"backend": "weightwire_ipc"}'``: CUDA IPC from a trainer on this host."""

    backend = "weightwire_ipc"
    init_info_cls = IPCInitInfo  # type: ignore[assignment]
    update_info_cls = UpdateInfo

    @staticmethod
    def _connect(info: Any, *, rank: int, device: torch.device) -> Any:
        from weightwire.torch_side.worker.ipc_link import connect_ipc  # noqa: PLC0415

        return connect_ipc(info, rank=rank, device=device)
