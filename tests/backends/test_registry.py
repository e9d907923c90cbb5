"""The backend registry (``weightwire.backends``): every entry resolves, agrees with the
classes it names, and is what the trainer, the worker engines, the plugin and the
commands read. A backend added in one place and forgotten in another fails here."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
import types
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from tests.shared.import_graph import docstring_ids
from weightwire import backends
from weightwire.backends.nccl.spec import NCCL
from weightwire.backends.tcp.info import TCPInitInfo
from weightwire.backends.tcp.spec import TCP
from weightwire.shared.info import encode_secret
from weightwire.shared.timeouts import Timeouts

ROOT = Path(__file__).resolve().parents[2]
HAS_VLLM = importlib.util.find_spec("vllm") is not None

PARTS = [
    (name, field)
    for name in backends.BACKEND_NAMES
    for field in ("init_info", "trainer", "connect", "worker_engine", "vllm_engine")
    if getattr(backends.SPECS[name], field) is not None
]


@pytest.mark.parametrize(("name", "field"), PARTS, ids=[f"{n}-{f}" for n, f in PARTS])
def test_every_module_path_imports(name: str, field: str) -> None:
    if field == "vllm_engine" and not HAS_VLLM:
        pytest.skip("vllm_engine paths import vLLM, which is not installed here")
    obj = backends.load(getattr(backends.SPECS[name], field))
    assert callable(obj), f"{name}.{field} -> {obj!r}"


def test_init_info_types_by_backend() -> None:
    from weightwire import IPCInitInfo, NCCLInitInfo, TCPInitInfo, WeightwireNCCLInitInfo
    from weightwire.backends.nccl.info import M2NInitInfo

    want = {
        "nccl": NCCLInitInfo,
        "sparse_nccl": NCCLInitInfo,  # vLLM's sparse worker parses the dense one's
        "weightwire_nccl": WeightwireNCCLInitInfo,
        "weightwire_tcp": TCPInitInfo,
        "weightwire_ipc": IPCInitInfo,
        "nccl_m2n": M2NInitInfo,
    }
    assert {name: backends.init_info_type(name) for name in backends.BACKEND_NAMES} == want
    for name, cls in want.items():
        # Exact types: WeightwireNCCLInitInfo is an NCCLInitInfo, and still another backend's.
        # sparse_nccl shares nccl's, and the type names nccl (neither has a weightwire connect).
        owner = "nccl" if name == "sparse_nccl" else name
        assert backends.spec_of_init_info(cls) is backends.SPECS[owner]
    with pytest.raises(ValueError, match="dict is no backend's init info"):
        backends.spec_of_init_info(dict)


def test_each_package_declares_its_own_backends() -> None:
    # The registry lists packages; each package's spec module says what its backends are.
    declared = [
        spec
        for package in backends.PACKAGES
        for spec in importlib.import_module(f"{package}.spec").SPECS
    ]
    assert [spec.name for spec in declared] == list(backends.BACKEND_NAMES)
    assert all(backends.SPECS[spec.name] is spec for spec in declared)
    for spec in declared:
        # A package's parts live in that package (the engines that receive outside vLLM excepted).
        package = next(
            p for p in backends.PACKAGES if spec in importlib.import_module(f"{p}.spec").SPECS
        )
        assert spec.trainer.startswith(f"{package}."), spec
        assert spec.connect is None or spec.connect.startswith(f"{package}."), spec


@pytest.mark.parametrize("name", backends.BACKEND_NAMES)
def test_trainer_backend_matches_its_entry(name: str) -> None:
    from weightwire.backends import get_backend
    from weightwire.backends.base import Backend

    spec = backends.SPECS[name]
    cls = backends.load(spec.trainer)
    assert issubclass(cls, Backend) and cls.name == name
    assert cls.caps.stock_receiver is spec.stock_receiver
    # packing in device memory, or sending each device's own shard, is what needs the GPU
    assert (cls.caps.on_device or cls.caps.local_shards) is spec.needs_cuda
    backend = get_backend(name)
    assert type(backend) is cls and get_backend(name) is backend  # one instance, made once


@pytest.mark.parametrize("name", backends.BACKEND_NAMES)
def test_worker_engines_match_their_entry(name: str) -> None:
    spec = backends.SPECS[name]
    info = backends.load(spec.init_info)
    if spec.worker_engine is None:  # vLLM's own worker only (nccl_m2n)
        assert spec.stock_receiver and spec.vllm_engine is None
        with pytest.raises(ValueError, match=f"{name!r} is received only by vLLM's own worker"):
            backends.worker_engine(name)
        return
    engine = backends.load(spec.worker_engine)
    assert callable(engine.standalone)
    if spec.stock_receiver:
        # Outside vLLM a stock wire is received by an engine whose init info parses a
        # superset of it.
        assert issubclass(engine.init_info_cls, info) and engine.backend != name
    else:
        assert engine.backend == name and engine.init_info_cls is info
    if spec.vllm_engine is not None and HAS_VLLM:
        vllm_engine = backends.load(spec.vllm_engine)
        assert vllm_engine.backend == name and vllm_engine.init_info_cls is info


def test_flags_are_consistent() -> None:
    for spec in backends.SPECS.values():
        assert spec.needs_plugin is (spec.vllm_engine is not None)
        # Only vLLM's own backend lacks a weightwire connect function, and it needs no plugin.
        assert (spec.connect is None) is spec.stock_receiver is (not spec.needs_plugin)
    assert tuple(n for n, s in backends.SPECS.items() if s.vllm_engine) == backends.PLUGIN_BACKENDS
    assert all(backends.canonical(alias) in backends.SPECS for alias in backends.ALIASES)


def test_the_default_backend_is_the_one_spec_saying_so() -> None:
    from weightwire.trainer.config import TrainerInitInfo

    # vLLM's own NCCL, as before the default became a spec flag.
    assert [n for n, s in backends.SPECS.items() if s.default] == ["nccl"]
    assert backends.DEFAULT_BACKEND == TrainerInitInfo().backend == "nccl"
    two = {n: replace(s, default=True) for n, s in backends.SPECS.items()}
    with pytest.raises(RuntimeError, match="exactly one backend spec must say default=True"):
        backends._the_default(two)


@dataclass(frozen=True)
class _GenericSettings:
    """Settings with ``SenderSettings``' generic fields only: no backend's own options."""

    packed: bool = True
    packed_buffer_size_bytes: int = 1 << 20
    packed_num_buffers: int = 2
    timeouts: Timeouts = field(default_factory=Timeouts)
    device: int | None = None
    stage_budget_bytes: int = 1 << 30


def test_a_backend_reads_its_own_options_or_names_what_is_missing() -> None:
    from weightwire.backends.ipc.options import IPCOptions
    from weightwire.backends.tcp.options import TCPOptions
    from weightwire.shared.errors import ConfigError
    from weightwire.trainer.config import TrainerInitInfo

    info = TrainerInitInfo(backend="weightwire_tcp")
    assert isinstance(info, TCPOptions) and isinstance(info, IPCOptions)  # the user's record
    tcp = backends.get_backend("weightwire_tcp")
    with pytest.raises(ConfigError, match="'weightwire_tcp' reads TCPOptions .* _GenericSettings"):
        tcp.open(_GenericSettings(), world_size=2)
    ipc = backends.get_backend("weightwire_ipc")
    with pytest.raises(ConfigError, match="'weightwire_ipc' reads IPCOptions"):
        ipc.check_config(_GenericSettings(), delta="auto")
    # The IPC refusal is the backend's own, at TrainerInitInfo's construction.
    with pytest.raises(ConfigError, match="delta rounds over weightwire_ipc go through its pull"):
        TrainerInitInfo(backend="weightwire_ipc", delta="auto", ipc_mode="write_through")
    tcp.check_config(_GenericSettings(), delta="auto")  # most backends run every configuration


class FakeFactory:
    """vLLM 0.32/0.33's factory: lazy registration by module path, ValueError on a duplicate."""

    registry: dict[str, tuple[str, str]] = {}

    @classmethod
    def register_engine(cls, name: str, module: str, class_name: str) -> None:
        if name in cls.registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        cls.registry[name] = (module, class_name)


def test_plugin_registers_exactly_the_entries_with_a_vllm_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from weightwire.torch_side.worker import plugin

    for mod in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        monkeypatch.setitem(sys.modules, mod, types.ModuleType(mod))
    factory = types.ModuleType("vllm.distributed.weight_transfer.factory")
    factory.WeightTransferEngineFactory = FakeFactory  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.factory", factory)
    monkeypatch.setattr(FakeFactory, "registry", {})
    plugin.register()
    want = {
        name: tuple(spec.vllm_engine.split(":"))
        for name, spec in backends.SPECS.items()
        if spec.vllm_engine
    }
    assert FakeFactory.registry == want
    assert NCCL.name not in FakeFactory.registry  # vLLM ships it; registering it would be refused


def test_commands_offer_the_registry_names() -> None:
    from weightwire.tools import _cli
    from weightwire.tools.demo.config import DEMO_BACKENDS
    from weightwire.tools.server.serve_args import build_parser

    assert _cli.BACKENDS is backends.BACKEND_NAMES
    (action,) = [a for a in build_parser()._actions if "--backend" in a.option_strings]
    assert (
        tuple(action.choices) == backends.PLUGIN_BACKENDS
    )  # the reference server stands in for the plugin
    assert set(DEMO_BACKENDS) == {
        n
        for n, s in backends.SPECS.items()
        if not s.same_host and s.dense_rounds and s.worker_engine is not None
    }
    assert "nccl_m2n" not in DEMO_BACKENDS  # only vLLM's own workers receive it


def test_import_pulls_no_framework_and_nothing_else() -> None:
    # Beyond the package itself (whatever ``import weightwire`` loads), the registry loads
    # only itself and the packages' spec modules: no framework, not even numpy or weightwire.shared.
    probe = (
        "import json, sys; import weightwire; before = set(sys.modules); "
        "import weightwire.backends; "
        "new = sorted(m for m in set(sys.modules) - before "
        "if m.split('.')[0] in ('weightwire', 'numpy')); "
        "fw = sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('torch', 'jax', 'jaxlib', 'cupy', 'vllm')); "
        "print(json.dumps([new, fw]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    new, frameworks = json.loads(out.stdout.strip().splitlines()[-1])
    specs = sorted(
        [
            "weightwire.backends",
            "weightwire.backends.spec",
            *backends.PACKAGES,
            *(f"{package}.spec" for package in backends.PACKAGES),
        ]
    )
    assert frameworks == [] and new == specs, (new, frameworks)


def test_unknown_names_are_refused_naming_the_known_ones() -> None:
    from weightwire.backends import get_backend
    from weightwire.trainer.config import TrainerInitInfo

    known = ", ".join(backends.BACKEND_NAMES)
    for call in (
        lambda: backends.get("weightwire_udp"),
        lambda: get_backend("weightwire_udp"),
        lambda: TrainerInitInfo(backend="weightwire_udp"),
    ):
        with pytest.raises(ValueError) as err:
            call()
        assert "unknown backend 'weightwire_udp'" in str(err.value) and known in str(err.value)
    assert backends.get("tcp") is backends.SPECS[TCP.name]  # an alias is not unknown
    with pytest.raises(ValueError, match="must be 'module:attr'"):
        backends.load("weightwire.backends.tcp.worker")


def test_every_alias_the_cli_takes_the_library_takes() -> None:
    # One alias table (backends.ALIASES) for the command line and TrainerInitInfo alike.
    from weightwire.tools._cli import backend_name
    from weightwire.trainer.config import TrainerInitInfo

    assert backends.ALIASES  # tcp, at least
    for alias, name in backends.ALIASES.items():
        assert backend_name(alias) == name
        assert TrainerInitInfo(backend=alias).backend == name
    with pytest.raises(ValueError, match=r"\(aliases: tcp = weightwire_tcp\)"):
        TrainerInitInfo(backend="udp")


def test_worker_connect_dispatches_through_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from weightwire.backends.nccl.info import NCCLInitInfo
    from weightwire.backends.tcp import worker as tcp_worker
    from weightwire.torch_side.worker.connect import connect
    from weightwire.torch_side.worker.engines import WeightwireTCPEngine

    calls: list[tuple[Any, int]] = []
    monkeypatch.setattr(
        tcp_worker,
        "connect_tcp",
        lambda info, *, rank, device: calls.append((info, rank)) or "link",
    )
    info = TCPInitInfo(
        host="127.0.0.1", port=9, secret_b64=encode_secret(bytes(128)), rank_offset=1, world_size=2
    )
    assert WeightwireTCPEngine._connect is connect
    assert connect(info, rank=1, device=torch.device("cpu")) == "link" and calls == [(info, 1)]
    stock = NCCLInitInfo(nccl_unique_id_b64=encode_secret(bytes(128)), rank_offset=1, world_size=2)
    with pytest.raises(ValueError, match="received by vLLM's own engine only"):
        connect(stock, rank=1, device=torch.device("cpu"))


def _code_strings(path: Path) -> set[str]:
    """String constants of a module, docstrings left out."""
    tree = ast.parse(path.read_text())
    docs = docstring_ids(tree)
    return {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    }


def test_backend_names_are_written_once_in_code() -> None:
    # A name is a string literal in its package's spec module only; everything else reads
    # the registry. ("nccl" is also a word of other vocabularies, transport and result keys,
    # so only the weightwire_* names are searched for.)
    names = set(backends.PLUGIN_BACKENDS)
    specs = {ROOT / (package.replace(".", "/") + "/spec.py") for package in backends.PACKAGES}
    found = {
        str(p.relative_to(ROOT)): sorted(_code_strings(p) & names)
        for p in sorted((ROOT / "weightwire").rglob("*.py"))
    }
    assert {p: n for p, n in found.items() if n} == {
        str(p.relative_to(ROOT)): sorted(_code_strings(p) & names) for p in sorted(specs)
    }
    assert all(found[str(p.relative_to(ROOT))] for p in specs)


def test_the_worker_package_names_no_backend_function() -> None:
    pytest.importorskip("torch")
    from weightwire.torch_side import worker
    from weightwire.torch_side.worker import connect

    for name in ("publish_unique_id", "fetch_unique_id", "connect_tcp"):
        with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
            getattr(connect, name)  # the per-backend functions live in their packages only
        with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
            getattr(worker, name)
