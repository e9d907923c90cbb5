"""The weightwire engines as vLLM ``WeightTransferEngine`` subclasses.

Imported only by vLLM's ``WeightTransferEngineFactory`` (registered lazily by
``plugin.register``), i.e. only in processes where vLLM is installed. The factory
constructs ``cls(config, vllm_config, device, model)``; that signature and the
worker-side method set are the same in vLLM 0.32 and 0.33.

Inside vLLM a round within the stage budget is staged (see ``core`` and ``strategy``):
start and update leave the model as it is, and finish applies the whole round inside
vLLM's layerwise reload, as vLLM's own checkpoint-format engines do (a layer is
processed and copied into the running kernels once all of its tensors arrived; the
rest is finalized), then refreshes tied heads. A larger round is applied inside the
same reload as its bytes land, within the one ``update_weights`` call. A worker runs one
call at a time, so no request ever sees a layer on the meta device; a round that fails
after its first in-place write leaves some layers new (``incomplete_round``): the
trainer keeps generation paused in a refusing mode until a complete round commits.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from weightwire.shared.update_info import UpdateInfo
from weightwire.torch_side.worker.connect import connect
from weightwire.torch_side.worker.core import _ReceiverCore
from weightwire.torch_side.worker.engines import EngineFacade, watch_sleep
from weightwire.torch_side.worker.landing import record_loader_map, tied_aliases
from weightwire.torch_side.worker.spec import ModelSpec

if TYPE_CHECKING:  # adapter rounds import it when one comes
    from weightwire.torch_side.worker.vllm_lora import VllmAdapterHost

log = logging.getLogger(__name__)


class LayerwiseReload:
    """``FrameworkHooks`` for vLLM: layerwise reload around each round, tied heads, and
    the worker's own round flag."""

    def __init__(self) -> None:
        self._aliases: dict[str, str] | None = None
        self.worker: Any = None  # weakref.ref to vLLM's worker, once seen (see _VllmEngine)

    def aliases(self, model: Any) -> dict[str, str]:
        if self._aliases is None:
            self._aliases = tied_aliases(model)
        return self._aliases

    def prepare(
        self, model: Any, pairs: list[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        # vLLM's loader skips a tied alias and raises if its canonical tensor is not in
        # the same load_weights call; the values are one tensor, so keep one name.
        aliases = self.aliases(model)
        if not aliases:
            return pairs
        names = {n for n, _ in pairs}
        out = []
        for name, tensor in pairs:
            canonical = aliases.get(name)
            if canonical is None:
                out.append((name, tensor))
            elif canonical not in names:
                out.append((canonical, tensor))
        return out

    def round_dropped(self) -> None:
        # A round dropped by weightwire itself (stale trainer, shutdown) must also clear
        # vLLM's worker flag, or the next trainer's start is refused as "already active".
        worker = self.worker() if self.worker is not None else None
        if worker is not None and getattr(worker, "_weight_update_active", False):
            worker._weight_update_active = False
            engine = getattr(worker, "weight_transfer_engine", None)
            reset = getattr(engine, "reset_weight_update_target", None)
            if callable(reset):
                reset()

    def begin(self, model: Any) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(model)
        repack_cpu_moe_on_reload(model)

    def commit(self, model: Any, model_config: Any) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(model, model_config)
        refresh_tied(model, self.aliases(model))

    def abort(self, model: Any, model_config: Any) -> None:
        # Layers that completed already hold new weights (vLLM's reload has no
        # rollback). A layer still buffering must not be replayed: finalizing would
        # materialize it with the buffered (possibly bad) tensors and uninitialized
        # memory for the rest. Emptying its buffer makes finalize put its untouched
        # original tensors back.
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        for layer in model.modules():
            info = get_layerwise_info(layer)
            if info.can_load() and info.load_numel > 0:
                info.loaded_weights.clear()
                info.load_numel = 0
        log.warning(
            "weight update aborted while applying: incomplete layers keep their previous weights"
        )
        self.commit(model, model_config)

    @contextmanager
    def loaded_layout(self, model: Any) -> Iterator[None]:
        """For the duration, ``model``'s layers hold their parameters as the loader created
        them (vLLM's reload metadata, materialized empty), not the post-processed tensors
        they serve (a CPU build repacks weights and may leave a loaded parameter empty); the
        served tensors are put back exactly afterwards. What the loader reads can then be
        recorded on tracers; nothing is loaded and nothing served changes."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import (
            materialize_layer,
            restore_layer_on_meta,
        )

        own = ("_parameters", "_buffers", "_non_persistent_buffers_set")
        swapped: list[tuple[Any, dict[str, Any], dict[str, Any], dict[str, Any], set[str]]] = []
        try:
            for layer in model.modules():
                info = LAYERWISE_INFO.get(layer)  # never creates one
                if info is None or not any(info.restore_metadata):
                    continue
                swapped.append(
                    (
                        layer,
                        {k: v for k, v in layer.__dict__.items() if k not in own},
                        dict(layer._parameters),
                        dict(layer._buffers),
                        set(layer._non_persistent_buffers_set),
                    )
                )
                restore_layer_on_meta(layer, info)
                materialize_layer(layer, info)
            yield
        finally:
            # the restore may drop plain attributes of the same names: put all back
            for layer, attrs, params, buffers, non_persistent in reversed(swapped):
                for name in [k for k in layer.__dict__ if k not in own and k not in attrs]:
                    del layer.__dict__[name]
                layer.__dict__.update(attrs)
                layer._parameters.clear()
                layer._parameters.update(params)
                layer._buffers.clear()
                layer._buffers.update(buffers)
                layer._non_persistent_buffers_set = non_persistent

    def receive_context(self) -> AbstractContextManager[Any]:
        try:
            from vllm.model_executor.model_loader.mtp_validation import (
                disable_mtp_completeness_check,
            )
        except ImportError:  # older vLLM without MTP completeness checks
            return nullcontext()
        # A round may carry a subset of a draft model's tensors; vLLM's own engines
        # switch the completeness check off while loading them too.
        return disable_mtp_completeness_check()


def refresh_tied(model: Any, aliases: dict[str, str]) -> None:
    """Re-run the post-load processing of modules holding a tied alias.

    vLLM loads a tied tensor once, under its canonical name; on CPU the head's linear
    layer keeps a pre-packed copy of the weight made at startup, which a reload of the
    embedding does not redo (the head keeps the checkpoint's values). On CUDA the
    processing is a no-op: the head reads the shared parameter directly.
    """
    owners = {name.rsplit(".", 1)[0] for name in aliases}
    for prefix, module in model.named_modules(remove_duplicate=False):
        process = getattr(
            getattr(module, "quant_method", None), "process_weights_after_loading", None
        )
        if prefix in owners and callable(process):
            process(module)


def repack_cpu_moe_on_reload(model: Any) -> None:
    """Make a reload of a fused-MoE layer redo the CPU experts' weight prepacking.

    vLLM 0.32's unquantized MoE method prepacks w13/w2 into the CPU grouped-gemm
    layout only on its first ``process_weights_after_loading``; on a weight update it
    copies the new, unpacked weights into the packed parameters and skips the prepack,
    so the CPU kernel reads them in the wrong layout (vLLM's greedy output after a round
    differs from HF's on the same weights; found by the real-vLLM family lane). Each
    such layer's method gets a per-instance wrapper (installed once) that prepacks
    again after a reprocess; it runs only for layers vLLM actually reprocesses, so an
    untouched layer is never packed twice. A no-op off CPU and on other vLLM versions.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
            CPUUnquantizedExperts,
        )
    except ImportError:
        return
    for module in model.modules():
        method: Any = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(
            method, "_weightwire_repacks", False
        ):
            continue
        process = method.process_weights_after_loading

        def reprocess(layer: Any, _process: Any = process, _method: Any = method) -> None:
            _process(layer)
            # Installed after startup: every call here is a weight update.
            _method.moe_kernel.fused_experts.process_weights_after_loading(layer)

        method.process_weights_after_loading = reprocess
        method._weightwire_repacks = True


def checkpoint_spec(model_config: Any, model: Any) -> ModelSpec | None:
    """The served checkpoint's spec (local safetensors + served dtype), or None."""
    model_dir = getattr(model_config, "model", None)
    dtype = getattr(model_config, "dtype", None)
    served = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else None
    if not isinstance(model_dir, str):
        return None
    quant = getattr(getattr(model_config, "hf_config", None), "quantization_config", None)
    spec = ModelSpec.from_checkpoint(
        model_dir,
        served_dtype=served,
        aliases=tied_aliases(model),
        quantization_config=quant if isinstance(quant, dict) else None,
    )
    if spec is None:
        log.warning(
            "no local safetensors under %s: update info is not checked against the model", model_dir
        )
    return spec


def _find_worker(engine: Any) -> Any:
    """vLLM's worker that owns ``engine``: the caller of ``init_transfer_engine``.

    vLLM keeps its own "update active" flag on the worker; weightwire must clear it
    when it drops a stale round, and the engine is given no handle to the worker.
    """
    frame: FrameType | None = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if candidate is not None and getattr(candidate, "weight_transfer_engine", None) is engine:
            return candidate
        frame = frame.f_back
    return None


def worker_rank(parallel_config: Any) -> int:
    """This worker's index across all data-parallel replicas (trainer rank excluded)."""
    dp_index: Any = getattr(parallel_config, "data_parallel_index", None)
    if dp_index is None:
        dp_index = getattr(parallel_config, "data_parallel_rank", 0)
    return int(dp_index) * int(parallel_config.world_size) + int(parallel_config.rank)


class _VllmEngine(EngineFacade, WeightTransferEngine):
    _connect = staticmethod(
        connect
    )  # the backend's connect, found in the registry by the init info

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        WeightTransferEngine.__init__(self, config, vllm_config, device, model)
        self._reload = LayerwiseReload()
        self._core = _ReceiverCore(
            backend=self.backend,
            device=torch.device(device),
            target=lambda: (self.model, self.model_config),
            connect=type(self)._connect,
            info_type=self.init_info_cls,
            worker_rank=worker_rank(self.parallel_config),
            framework=self._reload,
            # The served checkpoint describes the main model only; a draft round is not pre-checked.
            spec=lambda: checkpoint_spec(self.model_config, model) if self.model is model else None,
            adapters=self._adapter_host,
            map_recorder=record_loader_map,
        )
        # vLLM's world of one engine (TP x PP): its ranks' commits together make the model's.
        self._core.model_ranks = int(getattr(self.parallel_config, "world_size", 1) or 1)
        if getattr(vllm_config, "lora_config", None) is not None:
            # Adapter rounds: this worker's LoRA loading learns to serve a replaced adapter
            # from memory. vLLM makes this engine in load_model, before any adapter loads.
            from weightwire.torch_side.worker.vllm_lora import install as install_lora

            install_lora()

    def _adapter_host(self) -> VllmAdapterHost:
        """Where an adapter round goes (asked by the adapter step, the only importer)."""
        from weightwire.torch_side.worker.vllm_lora import VllmAdapterHost

        return VllmAdapterHost(self._reload.worker)

    def init_transfer_engine(self, init_info: Any) -> None:
        if self._reload.worker is None:
            worker = _find_worker(self)
            if worker is not None:
                self._reload.worker = weakref.ref(worker)
                # vLLM's sleep level 2 discards the weights: the delta base goes with them.
                watch_sleep(worker, self)
        super().init_transfer_engine(init_info)


# The engines the plugin registers, one per plugin backend: each one's name and init info come
# from the spec naming it (``vllm_engine``), as vLLM's ``--weight-transfer-config`` spells it.


class VllmWeightwireTCPEngine(_VllmEngine):
    """The TCP data plane, CPU or GPU workers."""

    update_info_cls = UpdateInfo


class VllmWeightwireNCCLEngine(_VllmEngine):
    """NCCL via cupy, with timeouts."""

    update_info_cls = UpdateInfo


class VllmWeightwireIPCEngine(_VllmEngine):
    """CUDA IPC from a trainer on this host."""

    update_info_cls = UpdateInfo
