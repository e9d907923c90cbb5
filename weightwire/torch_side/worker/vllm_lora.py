"""Adapter rounds inside vLLM: a registered adapter's weights replaced in memory.

vLLM loads an adapter from a directory only. A worker's LoRA manager
(``WorkerLoRAManager``) reads it with ``_load_adapter`` when a request first names it,
and again whenever the adapter left its caches: evicted from the CPU cache, or dropped
by ``reset_lora_state`` (every ``finish_weight_update`` in 0.32 and 0.33 drops them all).
A swap that only rewrote the cached copy would be undone by the next such reload, which
reads the directory, i.e. the adapter's first round.

So the plugin's engine (``install``, once per worker process, when vLLM runs with
``--enable-lora``) wraps two of vLLM's LoRA internals, changing nothing for adapters
weightwire does not replace:

- ``WorkerLoRAManager._load_adapter``: records each adapter vLLM loads (name, integer
  id, absolute path, its shape read from the directory's safetensors header);
- ``LoRAModel.from_local_checkpoint``: for a directory whose adapter a round replaced,
  builds the adapter from the round's tensors (``LoRAModel.from_lora_tensors``, the same
  path vLLM takes after reading the file) instead of reading the file.

``VllmAdapterHost.swap`` makes the round's tensors the directory's content in memory, then
asks vLLM to reload the adapter in place (``add_adapter`` of a ``LoRARequest`` with
``load_inplace=True``): vLLM builds the new adapter first, then drops the old one from
both caches and activates the new one, which copies it into the stacked LoRA buffers
the kernels read. A build that fails restores the previous tensors: the previous adapter
keeps serving. The next request therefore runs on the new adapter whichever cache it
comes from.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from weightwire.shared.lora import LoRASpec, not_registered, wire_name

log = logging.getLogger(__name__)

TESTED = ("0.32.", "0.33.")
"""vLLM releases whose LoRA internals this module was written against."""
UNTESTED_ENV = "WEIGHTWIRE_LORA_UNTESTED_VLLM"
"""Set to 1 to try adapter rounds on another vLLM release that has the same internals."""
_ADAPTER_FILE = "adapter_model.safetensors"


@dataclass
class Registered:
    """An adapter vLLM loaded, as its worker saw the request."""

    name: str
    lora_int_id: int
    path: str
    spec: LoRASpec | None
    """Its shape, read from the directory (None: no safetensors file there)."""


@dataclass
class _Registry:
    by_name: dict[str, Registered] = field(default_factory=dict)
    memory: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Absolute adapter path -> the tensors (saved PEFT names) that replaced its file."""
    lock: threading.Lock = field(default_factory=threading.Lock)


REGISTRY = _Registry()
_INSTALLED: list[str] = []  # why not installed ("" once installed)


def install() -> str | None:
    """Wrap vLLM's two LoRA internals (idempotent); None once installed, else why not."""
    if _INSTALLED:
        return _INSTALLED[0] or None
    why = _install()
    _INSTALLED.append(why or "")
    if why:
        log.debug("weightwire: adapter rounds unavailable: %s", why)
    return why


def _install() -> str | None:
    try:
        import vllm
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.worker_manager import WorkerLoRAManager
    except ImportError as exc:
        return f"vLLM's LoRA modules are not importable ({exc})"
    version = str(getattr(vllm, "__version__", "?"))
    if not version.startswith(TESTED) and os.environ.get(UNTESTED_ENV) != "1":
        return (
            f"vLLM {version} is not a release weightwire's adapter rounds were tested on "
            f"({', '.join(v + 'x' for v in TESTED)}); set {UNTESTED_ENV}=1 to try"
        )
    load = getattr(WorkerLoRAManager, "_load_adapter", None)
    from_dir = inspect.getattr_static(LoRAModel, "from_local_checkpoint", None)
    from_tensors = getattr(LoRAModel, "from_lora_tensors", None)
    if not callable(load) or not isinstance(from_dir, classmethod) or from_tensors is None:
        return (
            f"vLLM {version} lacks the LoRA internals adapter rounds rely on "
            "(WorkerLoRAManager._load_adapter, LoRAModel.from_local_checkpoint / "
            "from_lora_tensors)"
        )
    dir_params = inspect.signature(from_dir.__func__).parameters
    tensor_params = set(inspect.signature(from_tensors).parameters)

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        lora = load(self, lora_request)
        _note(lora_request)
        return lora

    def from_local_checkpoint(cls: Any, lora_dir: str, *args: Any, **kwargs: Any) -> Any:
        with REGISTRY.lock:
            held = REGISTRY.memory.get(os.path.abspath(lora_dir))
        if held is None:
            return from_dir.__func__(cls, lora_dir, *args, **kwargs)
        bound = inspect.Signature(list(dir_params.values())).bind(cls, lora_dir, *args, **kwargs)
        given = {k: v for k, v in bound.arguments.items() if k in tensor_params}
        if given.get("lora_model_id") is None:
            from vllm.lora.utils import get_lora_id

            given["lora_model_id"] = get_lora_id()
        # vLLM scales lora_b in place when it packs an adapter: every load gets its own copy.
        given["tensors"] = {k: v.clone() for k, v in held.items()}
        return cls.from_lora_tensors(**given)

    WorkerLoRAManager._load_adapter = _load_adapter
    LoRAModel.from_local_checkpoint = classmethod(from_local_checkpoint)
    return None


def _note(lora_request: Any) -> None:
    name, path = str(lora_request.lora_name), os.path.abspath(str(lora_request.lora_path))
    with REGISTRY.lock:
        known = REGISTRY.by_name.get(name)
        if (
            known is not None
            and known.path == path
            and known.lora_int_id == lora_request.lora_int_id
        ):
            return
        if known is not None and known.path != path:
            REGISTRY.memory.pop(known.path, None)  # registered anew from another directory
    spec = _spec_of_dir(name, path)
    with REGISTRY.lock:
        REGISTRY.by_name[name] = Registered(name, int(lora_request.lora_int_id), path, spec)


def _spec_of_dir(name: str, path: str) -> LoRASpec | None:
    """The adapter's shape from its safetensors header (no tensor is read)."""
    file = os.path.join(path, _ADAPTER_FILE)
    if not os.path.isfile(file):
        return None
    from safetensors import safe_open

    from weightwire.shared.lora import PREFIX
    from weightwire.shared.meta import ParamMeta

    metas = []
    with safe_open(file, framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (a safe_open handle is no dict)
            if not key.startswith(PREFIX) or not key.endswith(".weight"):
                return None
            module, _, ab = key[len(PREFIX) : -len(".weight")].rpartition(".lora_")
            if ab not in ("A", "B"):
                return None
            shape = tuple(f.get_slice(key).get_shape())
            metas.append(ParamMeta(wire_name(module, ab, name), "float32", shape))
    try:
        return LoRASpec.from_metas(metas)
    except ValueError:
        return None


class VllmAdapterHost:
    """``AdapterHost`` over one vLLM worker's LoRA manager."""

    def __init__(self, worker: weakref.ref[Any] | None) -> None:
        self._worker = worker

    def _manager(self) -> Any:
        worker = self._worker() if self._worker is not None else None
        if worker is None:
            raise ValueError("the vLLM worker of this engine is unknown: adapter rounds need it")
        config: Any = getattr(worker, "vllm_config", None)
        if getattr(config, "lora_config", None) is None:
            raise ValueError("this vLLM was started without --enable-lora: it serves no adapters")
        why = install()
        if why is not None:
            raise ValueError(f"adapter rounds are not supported here: {why}")
        manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
        if manager is None or not callable(getattr(manager, "add_adapter", None)):
            raise ValueError("this vLLM worker has no LoRA manager (model_runner.lora_manager)")
        return manager, config.lora_config

    def check(self, spec: LoRASpec) -> None:
        _, lora_config = self._manager()
        max_rank = int(getattr(lora_config, "max_lora_rank", spec.rank))
        if spec.rank > max_rank:
            raise ValueError(
                f"adapter {spec.adapter!r}: rank {spec.rank} is over this vLLM's "
                f"--max-lora-rank {max_rank}"
            )
        with REGISTRY.lock:
            known = REGISTRY.by_name.get(spec.adapter)
        if known is None:
            raise ValueError(
                f"{not_registered(spec.adapter)} with this vLLM: register it first "
                f"(POST /v1/load_lora_adapter, or --lora-modules {spec.adapter}=DIR; "
                "weightwire's AdapterSync does it at its first send)"
            )
        if known.spec is None:
            raise ValueError(
                f"adapter {spec.adapter!r} was registered from {known.path}, which holds no "
                f"{_ADAPTER_FILE} of PEFT's names: its shape cannot be checked"
            )
        why = known.spec.same_shape(spec)
        if why is not None:
            raise ValueError(
                f"adapter {spec.adapter!r}: {why}; a round replaces an adapter of the same "
                "shape (register a new name for another rank or module set)"
            )

    def swap(self, spec: LoRASpec, tensors: dict[str, torch.Tensor]) -> None:
        from vllm.lora.request import LoRARequest

        manager, _ = self._manager()
        with REGISTRY.lock:
            known = REGISTRY.by_name[spec.adapter]
            previous = REGISTRY.memory.get(known.path)
            REGISTRY.memory[known.path] = tensors
        request = LoRARequest(
            lora_name=known.name,
            lora_int_id=known.lora_int_id,
            lora_path=known.path,
            load_inplace=True,
        )
        try:
            manager.add_adapter(request)
        except BaseException:
            with REGISTRY.lock:
                if previous is None:
                    REGISTRY.memory.pop(known.path, None)
                else:
                    REGISTRY.memory[known.path] = previous
            raise
