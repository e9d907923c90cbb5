"""vLLM's plugin engine class without vLLM: small fakes of the few ``vllm.*`` pieces it imports.

``install_fake_vllm()`` puts into ``sys.modules``: ``WeightTransferEngine`` (the base:
it keeps config, model and the parallel / model config), and a layerwise reload that
behaves like vLLM's for what matters here: ``initialize_layerwise_reload`` wraps every
parameter's ``weight_loader`` so loads are *buffered* (the loaded tensors are kept, not
copied) per layer; once a layer's loaded element count reaches its size, the layer is
*materialized* (fresh device memory the size of the layer), the buffered loads are
replayed into it with the original loaders, and the result is copied into the running
parameters (vLLM keeps its kernels' storage); ``finalize_layerwise_reload`` processes
what is left and unwraps the loaders. So a round's extra memory is vLLM's: the receive
buffers its buffered loads keep alive, plus one layer being materialized.

The worker serves ``fake_llama.FakeLlama`` (vLLM's Llama layout) or one of
``stub_models.MODELS``.

Run as a worker (the trainer drives it with ``LoopbackClient``)::

    python -m tests.torch_side.vllm_stub --backend weightwire_ipc --device cuda:0 --shape llama3-8b

It prints ``weightwire loopback ready on HOST:PORT``. Extra ops: ``memory`` (baseline,
torch peak since the round's start, the IPC receive pool), ``digests`` (per Hugging Face
tensor, read back out of the fused parameters), ``incomplete``, ``floor`` (the physical floor of
a round: one device copy of every Hugging Face tensor into its place in the fused parameters),
``seconds`` (the last round's start / update / finish calls as this worker timed them; the
finish after its device sync), ``gc`` (``gc_probe``: this process's garbage collector, for the
steady-round checks). ``WEIGHTWIRE_STUB_PROFILE=PATH`` profiles those calls;
``WEIGHTWIRE_STUB_PROBE=1`` times the round's steps too (``probe_steps``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import gc
import os
import sys
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.torch_side.fake_llama import (
    SHAPES,
    FakeLlama,
    copy_floor_s,
    digest,
    hf_shapes,
    trainer_tensors,
)

__all__ = [  # the model's names, for the stub's importers (benchmarks, GPU tests)
    "SHAPES",
    "FakeLlama",
    "digest",
    "hf_shapes",
    "install_fake_vllm",
    "install_vllm_sources",
    "trainer_tensors",
]


# ----------------------------------------------------------------------------- fake vLLM
@dataclass
class _LayerInfo:
    kernel: dict[str, torch.nn.Parameter] | None = None
    loaders: dict[str, Any] = field(default_factory=dict)
    loaded_weights: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    load_numel: int = 0
    load_numel_total: int = 0

    def can_load(self) -> bool:
        return self.kernel is not None


_INFO: dict[int, _LayerInfo] = {}


def get_layerwise_info(layer: torch.nn.Module) -> _LayerInfo:
    return _INFO.setdefault(id(layer), _LayerInfo())


def _own_params(layer: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return dict(layer.named_parameters(recurse=False))


def initialize_layerwise_reload(model: torch.nn.Module) -> None:
    seen: set[int] = set()  # a tied parameter is wrapped once, under its first module
    for layer in model.modules():
        params = {n: p for n, p in _own_params(layer).items() if id(p) not in seen}
        seen.update(id(p) for p in params.values())
        info = get_layerwise_info(layer)
        if not params or info.can_load():
            continue
        info.kernel, info.load_numel, info.loaded_weights = params, 0, []
        info.load_numel_total = sum(p.numel() for p in params.values())
        for name, param in params.items():
            info.loaders[name] = param.weight_loader  # type: ignore[attr-defined]
            param.weight_loader = _buffering_loader(layer, name)  # type: ignore[attr-defined]


def _buffering_loader(layer: torch.nn.Module, name: str) -> Any:
    info = get_layerwise_info(layer)

    def load(param: torch.nn.Parameter, loaded: torch.Tensor, *shard: Any) -> None:
        info.loaded_weights.append(
            (name, (loaded, *shard))
        )  # kept, not copied: the receive buffer stays alive
        info.load_numel += loaded.numel()
        if info.load_numel >= info.load_numel_total:
            _process(layer, info)

    return load


def _process(layer: torch.nn.Module, info: _LayerInfo) -> None:
    """Materialize the layer in fresh memory, replay its loads, copy into the kernel tensors."""
    assert info.kernel is not None
    fresh = {n: torch.empty_like(p) for n, p in info.kernel.items()}
    for name, (loaded, *shard) in info.loaded_weights:
        info.loaders[name](fresh[name], loaded, *shard)
    with torch.no_grad():
        for n, p in info.kernel.items():
            p.data.copy_(fresh[n])
    del fresh
    _unwrap(info)


def _unwrap(info: _LayerInfo) -> None:
    assert info.kernel is not None
    for n, p in info.kernel.items():
        p.weight_loader = info.loaders[n]  # type: ignore[attr-defined]
    info.kernel, info.loaded_weights, info.load_numel = None, [], 0


def finalize_layerwise_reload(model: torch.nn.Module, model_config: Any) -> None:
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if not info.can_load():
            continue
        if info.load_numel > 0:  # partly loaded (vLLM: "delayed processing")
            _process(layer, info)
        else:  # untouched: the kernel tensors stay as they are
            _unwrap(info)


class WeightTransferEngine:
    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        self.config, self.vllm_config = config, vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.model_config = vllm_config.model_config
        self.device, self.model = device, model


def install_fake_vllm() -> None:
    """The ``vllm.*`` modules ``weightwire.torch_side.worker.vllm_engines`` imports (idempotent)."""

    def module(name: str, **attrs: Any) -> None:
        mod = sys.modules.get(name) or types.ModuleType(name)
        for k, v in attrs.items():
            setattr(mod, k, v)
        sys.modules[name] = mod

    for name in (
        "vllm",
        "vllm.distributed",
        "vllm.distributed.weight_transfer",
        "vllm.model_executor",
        "vllm.model_executor.model_loader",
    ):
        module(name)
    module("vllm.distributed.weight_transfer.base", WeightTransferEngine=WeightTransferEngine)
    module(
        "vllm.model_executor.model_loader.reload",
        initialize_layerwise_reload=initialize_layerwise_reload,
        finalize_layerwise_reload=finalize_layerwise_reload,
    )
    module(
        "vllm.model_executor.model_loader.reload.layerwise", get_layerwise_info=get_layerwise_info
    )


VLLM_TRANSFER_FILES = ("base", "packed_tensor", "ipc_engine")
"""vLLM's own weight-transfer modules ``install_vllm_sources`` imports (its IPC engines)."""


VLLM_SPARSE_FILES = (
    "base",
    "packed_tensor",
    "nccl_common",
    "../../model_executor/model_loader/checkpoint_weight_patch",
    "sparse_nccl_engine",
)
"""What ``install_vllm_sources(src, VLLM_SPARSE_FILES)`` imports: vLLM's ``sparse_nccl`` worker
engine, its NCCL helpers and its checkpoint-patch loader (pure Python over torch)."""


def install_vllm_sources(
    src: str, stems: tuple[str, ...] = VLLM_TRANSFER_FILES
) -> types.SimpleNamespace:
    """Import vLLM's OWN ``distributed/weight_transfer/{base,packed_tensor,ipc_engine}.py``
    (or ``stems``, relative to that folder: ``VLLM_SPARSE_FILES``) from an unpacked vLLM tree
    (``src``: the directory holding the ``vllm`` package, e.g. from ``pip download --no-deps
    vllm==0.33.0`` unzipped), unchanged, with stand-ins for the few other ``vllm.*`` modules
    they import: config classes (only named), ``envs`` (pickled IPC handles allowed, as a
    server started with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), the layerwise reload (the
    fakes above, the same our engine is measured with), the MTP check (a no-op), the NCCL
    wrapper's unique-id size and its env pinning (a no-op). vLLM itself cannot be installed
    beside this torch; its engines are the peer a user would otherwise pick, so benchmarks
    run them as they are."""
    import base64
    import contextlib
    import importlib.util
    import os

    def module(name: str, **attrs: Any) -> types.ModuleType:
        mod = sys.modules.get(name) or types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return mod

    root = os.path.join(src, "vllm", "distributed", "weight_transfer")
    for name in (
        "vllm",
        "vllm.config",
        "vllm.distributed",
        "vllm.distributed.weight_transfer",
        "vllm.model_executor",
        "vllm.model_executor.model_loader",
    ):
        module(name, __path__=[])
    for name in (
        "vllm.distributed.device_communicators",
        "vllm.utils",
    ):
        module(name, __path__=[])
    # The NCCL wrapper is only asked its unique-id size; the env pinning is a no-op here.
    module("vllm.distributed.device_communicators.pynccl_wrapper", NCCL_UNIQUE_ID_BYTES=128)
    module("vllm.utils.nccl", unpinned_nccl_env=contextlib.nullcontext)
    module("vllm.envs", VLLM_ALLOW_INSECURE_SERIALIZATION=True)
    sys.modules["vllm"].envs = sys.modules["vllm.envs"]  # type: ignore[attr-defined]
    module("vllm.config", VllmConfig=object)
    module("vllm.config.parallel", ParallelConfig=object)
    module("vllm.config.weight_transfer", WeightTransferConfig=object)
    module(
        "vllm.model_executor.model_loader.reload",
        initialize_layerwise_reload=initialize_layerwise_reload,
        finalize_layerwise_reload=finalize_layerwise_reload,
    )
    module(
        "vllm.model_executor.model_loader.mtp_validation",
        disable_mtp_completeness_check=contextlib.nullcontext,
    )
    try:
        import pybase64  # noqa: F401  (vLLM's dependency, when present)
    except ImportError:
        module("pybase64", b64encode=base64.b64encode, b64decode=base64.b64decode)
    out = {}
    for stem in stems:
        path = os.path.normpath(os.path.join(root, f"{stem}.py"))
        rel = os.path.relpath(path, src)[: -len(".py")]
        name = rel.replace(os.sep, ".")
        stem = os.path.basename(rel)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, root
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        out[stem] = mod
    return types.SimpleNamespace(**out)


# ----------------------------------------------------------------------------- the worker
def _engine_class(backend: str, engine: str) -> Any:
    if engine == "vllm-ipc":  # vLLM's own IPC engine, from its sources (the peer in benchmarks)
        import os

        return install_vllm_sources(
            os.environ["WEIGHTWIRE_VLLM_SRC"]
        ).ipc_engine.IPCWeightTransferEngine
    install_fake_vllm()
    from weightwire.torch_side.worker import vllm_engines

    return {
        "weightwire_ipc": vllm_engines.VllmWeightwireIPCEngine,
        "weightwire_tcp": vllm_engines.VllmWeightwireTCPEngine,
    }[backend]


def make_model(kind: str, shape: str, device: torch.device) -> Any:
    """``llama`` / ``llama-tied`` (``FakeLlama``), or one of ``stub_models.MODELS``."""
    if kind in ("llama", "llama-tied"):
        return FakeLlama(shape, torch.bfloat16, device, tied=kind == "llama-tied")
    from tests.torch_side.stub_models import MODELS

    return MODELS[kind](torch.bfloat16, device)


def model_digests(model: Any, kind: str) -> dict[str, list[int]]:
    """Per Hugging Face tensor, the digest of its values as the parameters hold them."""
    if kind in ("llama", "llama-tied"):
        return {name: digest(model.hf_view(name)) for name in hf_shapes(model.shape)}
    from tests.torch_side.stub_models import byte_digest

    return {name: byte_digest(model.hf_view(name)) for name in model.hf_specs()}


def serve(
    backend: str,
    device_name: str,
    shape: str,
    engine_kind: str = "weightwire",
    kind: str = "llama",
) -> None:
    from weightwire.testing.loopback import LOOPBACK_VERSION, serve_ops

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cls = _engine_class(backend, engine_kind)
    model = make_model(kind, shape, device)
    cfg = types.SimpleNamespace(
        model_config=types.SimpleNamespace(model=None, dtype=torch.bfloat16),
        parallel_config=types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
    )
    engine = cls(None, cfg, device, model)
    lock, done = threading.Lock(), threading.Event()
    memory: dict[str, int] = {}
    seconds: dict[str, float] = {}  # the last round's weight calls, as this worker timed them
    profile = _Profile.of_env()
    if os.environ.get("WEIGHTWIRE_STUB_PROBE"):
        probe_steps(seconds, device)

    def pool_bytes() -> int:
        held = getattr(getattr(getattr(engine, "_core", None), "_link", None), "held_bytes", None)
        return int(held()) if callable(held) else 0

    def run(op: str, body: dict[str, Any]) -> Any:
        if op == "version":
            return {"version": LOOPBACK_VERSION}
        if op == "get_world_size":
            return {"world_size": 1}
        if op in ("pause", "resume"):
            return {"status": op}
        if op == "exit":
            done.set()
            return None
        if op == "incomplete":
            incomplete = getattr(engine, "incomplete_round", None)
            return None if incomplete is None else incomplete.describe()
        with lock, profile.on(op in _TIMED), _timed(op, seconds):
            if op == "init_weight_transfer_engine":
                engine.init_transfer_engine(engine.parse_init_info(body["init_info"]))
            elif op == "start_weight_update":
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    memory.update(
                        baseline=torch.cuda.memory_allocated(device), pool_before=pool_bytes()
                    )
                engine.start_weight_update()
            elif op == "update_weights":
                engine.update_weights(body["update_info"])
            elif op == "finish_weight_update":
                engine.finish_weight_update()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    memory.update(peak=torch.cuda.max_memory_allocated(device), pool=pool_bytes())
            elif op == "shutdown_weight_transfer_engine":
                engine.shutdown()
            elif op == "memory":
                return dict(memory)
            elif op == "seconds":
                return dict(seconds)
            elif op == "gc":
                return gc_probe(body)
            elif op == "digests":
                return model_digests(model, kind)
            elif op == "floor":
                reps, batched = int(body.get("reps", 5)), bool(body.get("batched"))
                return copy_floor_s(model, shape, device, reps, batched)
            else:
                raise ValueError(f"unknown op {op!r}")
        return None

    serve_ops(run, done)
    engine.shutdown()
    profile.dump()


_TIMED = ("start_weight_update", "update_weights", "finish_weight_update")


PEAK_STEP = 100
"""Net allocations between the young collections that count a round's objects alive."""


def tracked(*generations: int) -> int:
    """The GC-tracked objects of ``generations``, counted in C: a list of them held across
    a bytecode would let another thread run while it holds a reference to every young
    object (a ``tuple()`` being built there then fails to resize: ``SystemError``)."""
    return sum(map(len, map(gc.get_objects, generations)))


class RoundPeak:
    """The most GC-tracked objects alive at once outside the frozen heap, while it counts
    (``start``, ``stop``): the collector runs a young collection every ``PEAK_STEP`` net
    allocations (none older: nothing is promoted meanwhile), and this ``gc.callbacks`` hook
    counts after each (the tuples of atoms it untracked are no longer counted). A round's
    objects alive at its worst moment: what a generation-1 collection landing then promotes
    into generation 2, towards a full collection (#49)."""

    def __init__(self) -> None:
        self.most = 0
        self._was: tuple[bool, tuple[int, int, int]] | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "stop":
            self.most = max(self.most, tracked(0, 1, 2))

    def start(self) -> None:
        self._was = (gc.isenabled(), gc.get_threshold())
        gc.disable()
        gc.collect()
        gc.freeze()
        gc.set_threshold(PEAK_STEP, 10**6, 10**6)
        gc.callbacks.append(self)
        gc.enable()

    def stop(self) -> int:
        assert self._was is not None
        enabled, thresholds = self._was
        gc.disable()
        gc.callbacks.remove(self)
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        (gc.enable if enabled else gc.disable)()
        return self.most


class Promotions:
    """While it counts (``start``, ``stop``), with the collector as a process runs it: the
    collections per generation, and the objects generation-1 collections moved into
    generation 2 (its size before and after each: the tuples of atoms a collection
    untracks are not counted). ``long_lived``: generation 2 after a full collection at
    the start; a full collection waits until the promotions since the last one exceed a
    quarter of it (Python 3.11)."""

    def __init__(self) -> None:
        self.promoted = self._before = self.long_lived = 0
        self._stats: list[int] = []

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 1:
            return
        if phase == "start":
            self._before = tracked(2)
        else:
            self.promoted += tracked(2) - self._before

    def start(self) -> None:
        gc.collect()
        self.long_lived = tracked(2)
        self._stats = [s["collections"] for s in gc.get_stats()]
        gc.callbacks.append(self)

    def stop(self) -> dict[str, Any]:
        gc.callbacks.remove(self)
        after = [s["collections"] for s in gc.get_stats()]
        return {
            "collections": [a - b for a, b in zip(after, self._stats, strict=True)],
            "promoted": self.promoted,
            "long_lived": self.long_lived,
        }


_PEAK: list[RoundPeak] = []
_PROMOTIONS: list[Promotions] = []


def gc_probe(body: dict[str, Any]) -> dict[str, Any]:
    """The ``gc`` op: ``{"peak": true}`` starts a ``RoundPeak`` (and returns); ``{"peak":
    false}`` ends it: ``{"peak": the most objects}``; ``{"promotions": true / false}`` the
    same for a ``Promotions`` (its ``stop``'s answer). Else ``{"enabled": bool}`` switches
    the collector (a test disables it so that what cycles a round left are counted, not
    collected behind its back), then a full collection: what only cycles kept
    (``unreachable``) and the tracked objects left outside the frozen heap (``objects``);
    then ``{"freeze": bool}`` freezes what is left (the next probe's ``objects`` are what
    was made since and survived; ``kinds``: their commonest types) or thaws it."""
    if body.get("peak") is True:
        _PEAK.append(RoundPeak())
        _PEAK[-1].start()
        return {}
    if body.get("peak") is False:
        return {"peak": _PEAK.pop().stop()}
    if body.get("promotions") is True:
        _PROMOTIONS.append(Promotions())
        _PROMOTIONS[-1].start()
        return {}
    if body.get("promotions") is False:
        return _PROMOTIONS.pop().stop()
    if "enabled" in body:
        (gc.enable if body["enabled"] else gc.disable)()
    unreachable = gc.collect()
    objects = gc.get_objects()
    kinds = collections.Counter(type(o).__qualname__ for o in objects)
    out = {"unreachable": unreachable, "objects": len(objects), "kinds": dict(kinds.most_common(8))}
    del objects
    if "freeze" in body:
        (gc.freeze if body["freeze"] else gc.unfreeze)()
    return out


@contextlib.contextmanager
def _timed(op: str, seconds: dict[str, float]) -> Iterator[None]:
    """A round's weight call's wall time in this worker (the finish's includes the device
    sync the stub runs after it: the patches applied), under ``seconds[op]``; the start
    clears the previous round's."""
    if op not in _TIMED:
        yield
        return
    if op == "start_weight_update":
        seconds.clear()
    from weightwire._trace import dump_trace, trace

    trace(f"w.{op}>")  # WEIGHTWIRE_IPC_TRACE: the calls on benchmarks/ipc_timeline.py's timeline
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[op] = seconds.get(op, 0.0) + time.perf_counter() - start
        trace(f"w.{op}<")
        if op == "finish_weight_update":
            dump_trace("worker")


PROBED = (
    # (module, class, method, key): a worker round's steps, outermost first
    ("weightwire.torch_side.worker.core", "_ReceiverCore", "_resolve", "plan"),
    ("weightwire.torch_side.worker.core", "_ReceiverCore", "_check_spec", "spec"),
    ("weightwire.torch_side.worker.core", "_ReceiverCore", "_patch_step", "sink"),
    ("weightwire.torch_side.worker.core", "_ReceiverCore", "_admit_patches", "admit"),
    ("weightwire.torch_side.worker.strategy", "StagedRound", "receive", "receive"),
    ("weightwire.torch_side.worker.strategy", "StreamingRound", "receive", "receive"),
    ("weightwire.torch_side.worker.delta", None, "check_indices", "check"),
    ("weightwire.torch_side.worker.strategy", "StagedRound", "commit", "commit"),
    ("weightwire.torch_side.worker.strategy", "StreamingRound", "commit", "commit"),
    ("weightwire.torch_side.worker.landing", "LoaderMap", "patch_all", "apply"),
)
"""The steps ``WEIGHTWIRE_STUB_PROBE=1`` times (``probe_steps``)."""


def probe_steps(seconds: dict[str, float], device: torch.device) -> None:
    """Time each of ``PROBED``'s steps of every round into ``seconds["w.<key>"]`` (summed
    over the round; nested steps are counted in their callers too). On a GPU the device is
    synchronized before and after each step, so a step's device work is its own (the round
    runs slower: a probe, not a benchmark). With ``WEIGHTWIRE_IPC_TRACE`` each step also
    leaves ``w.<key>>`` / ``w.<key><`` marks for ``benchmarks/ipc_timeline.py``."""
    import importlib

    from weightwire._trace import trace

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def timed(fn: Any, key: str) -> Any:
        def probe(*args: Any, **kwargs: Any) -> Any:
            sync()
            trace(f"w.{key}>")
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                seconds[f"w.{key}"] = seconds.get(f"w.{key}", 0.0) + time.perf_counter() - start
                trace(f"w.{key}<")

        return probe

    for module_name, cls_name, method, key in PROBED:
        module = importlib.import_module(module_name)
        owner = module if cls_name is None else getattr(module, cls_name)
        # a module function is looked up in its module at each call (``PatchSplitter``)
        setattr(owner, method, timed(getattr(owner, method), key))


class _Profile:
    """``WEIGHTWIRE_STUB_PROFILE=PATH``: cProfile the round's weight calls (they run on the
    loopback's connection threads, which a ``python -m cProfile`` of the worker misses) and
    dump the stats to PATH at exit."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._prof = cProfile.Profile() if path else None

    @classmethod
    def of_env(cls) -> _Profile:
        return cls(os.environ.get("WEIGHTWIRE_STUB_PROFILE") or None)

    @contextlib.contextmanager
    def on(self, wanted: bool) -> Iterator[None]:
        if self._prof is None or not wanted:
            yield
            return
        self._prof.enable()
        try:
            yield
        finally:
            self._prof.disable()

    def dump(self) -> None:
        if self._prof is not None and self.path:
            self._prof.dump_stats(self.path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="vLLM's weightwire engine over fake vLLM reload hooks"
    )
    parser.add_argument("--backend", choices=("weightwire_ipc", "weightwire_tcp"), required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument(
        "--engine",
        choices=("weightwire", "vllm-ipc"),
        default="weightwire",
        help="vllm-ipc: vLLM's own IPC engine from $WEIGHTWIRE_VLLM_SRC (CUDA only)",
    )
    parser.add_argument(
        "--model", default="llama", choices=("llama", "llama-tied", "moe", "dtypes")
    )
    args = parser.parse_args(argv)
    serve(args.backend, args.device, args.shape, args.engine, args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
