"""The spec of ``weightwire_ipc`` (data only: ``weightwire.backends.spec``)."""

from __future__ import annotations

from weightwire.backends.spec import BackendSpec

IPC = BackendSpec(
    name="weightwire_ipc",
    init_info="weightwire.backends.ipc.info:IPCInitInfo",
    trainer="weightwire.backends.ipc.trainer:IPCBackend",
    connect="weightwire.backends.ipc.through.worker:connect_ipc",
    worker_engine="weightwire.torch_side.worker.engines:WeightwireIPCEngine",
    vllm_engine="weightwire.torch_side.worker.vllm_engines:VllmWeightwireIPCEngine",
    needs_cuda=True,
    stock_receiver=False,
    same_host=True,
)
"""CUDA IPC: trainer and workers on one host (same GPU or peer GPUs); needs the plugin."""

SPECS = (IPC,)
