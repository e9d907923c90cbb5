"""The spec of the toy ``toy_files`` backend (data only: ``weightwire.backends.spec``)."""

from __future__ import annotations

from weightwire.backends.spec import BackendSpec

_HERE = "tests.backends.toy_backend"

TOY_FILES = BackendSpec(
    name="toy_files",
    init_info=f"{_HERE}.info:ToyFilesInitInfo",
    trainer=f"{_HERE}.trainer:ToyFilesBackend",
    connect=f"{_HERE}.worker:connect_files",
    worker_engine=f"{_HERE}.engine:ToyFilesEngine",
    vllm_engine=None,  # never runs inside vLLM; the spec has no way to say so apart from "stock"
    needs_cuda=False,
    stock_receiver=False,
    same_host=True,  # one file system
)

SPECS = (TOY_FILES,)
