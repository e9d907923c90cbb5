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
from pathlib import Path
from typing import Any

import pytest

from weightwire import backends
from weightwire.shared.info import TCPInitInfo, encode_secret
from weightwire.shared.init_infos import INIT_INFO_TYPES

ROOT = Path(__file__).resolve().parents[2]
HAS_VLLM = importlib.util.find_spec("vllm") is not None

PARTS = [(name, field) for name in backends.BACKEND_NAMES
         for field in ("init_info", "trainer", "connect", "worker_engine", "vllm_engine")
         if getattr(backends.SPECS[name], field) is not None]


@pytest.mark.parametrize(("name", "field"), PARTS, ids=[f"{n}-{f}" for n, f in PARTS])
def test_every_module_path_imports(name: str, field: str) -> None:
    if field == "vllm_engine" and not HAS_VLLM:
        pytest.skip("vllm_engine paths import vLLM, which is not installed here")
    obj = backends.load(getattr(backends.SPECS[name], field))
    assert callable(obj), f"{name}.{field} -> {obj!r}"


def test_names_agree_with_the_shared_init_infos() -> None:
    # shared cannot import the registry: its ClassVars and the registry's names are
    # written apart, so they are compared here.
    assert set(INIT_INFO_TYPES) == set(backends.BACKEND_NAMES)
    for name, spec in backends.SPECS.items():
        assert spec.name == name
        cls = backends.load(spec.init_info)
        assert cls.backend == name and INIT_INFO_TYPES[name] is cls, (name, cls)


@pytest.mark.parametrize("name", backends.BACKEND_NAMES)
def test_trainer_backend_matches_its_entry(name: str) -> None:
    from weightwire.backends.base import Backend
    from weightwire.trainer.backends import get_backend

    spec = backends.SPECS[name]
    cls = backends.load(spec.trainer)
    assert issubclass(cls, Backend) and cls.name == name
    assert cls.caps.stock_receiver is spec.stock_receiver
    assert cls.caps.on_device is spec.needs_cuda  # packing in device memory is what needs the GPU
    backend = get_backend(name)
    assert type(backend) is cls and get_backend(name) is backend  # one instance, made once


@pytest.mark.parametrize("name", backends.BACKEND_NAMES)
def test_worker_engines_match_their_entry(name: str) -> None:
    spec = backends.SPECS[name]
    info = backends.load(spec.init_info)
    engine = backends.load(spec.worker_engine)
    assert callable(engine.standalone)
    if spec.stock_receiver:
        # Outside vLLM a stock wire is received by an engine whose init info parses a superset of it.
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


class FakeFactory:
    """vLLM 0.32/0.33's factory: lazy registration by module path, ValueError on a duplicate."""

    registry: dict[str, tuple[str, str]] = {}

    @classmethod
    def register_engine(cls, name: str, module: str, class_name: str) -> None:
        if name in cls.registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        cls.registry[name] = (module, class_name)


def test_plugin_registers_exactly_the_entries_with_a_vllm_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightwire.torch_side.worker import plugin

    for mod in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        monkeypatch.setitem(sys.modules, mod, types.ModuleType(mod))
    factory = types.ModuleType("vllm.distributed.weight_transfer.factory")
    factory.WeightTransferEngineFactory = FakeFactory  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.factory", factory)
    monkeypatch.setattr(FakeFactory, "registry", {})
    plugin.register()
    want = {name: tuple(spec.vllm_engine.split(":")) for name, spec in backends.SPECS.items() if spec.vllm_engine}
    assert FakeFactory.registry == want
    assert backends.NCCL not in FakeFactory.registry  # vLLM ships it; registering it would be refused


def test_commands_offer_the_registry_names() -> None:
    from weightwire import _cli
    from weightwire.demo.loop import DEMO_BACKENDS
    from weightwire.torch_side.server import build_parser

    assert _cli.BACKENDS is backends.BACKEND_NAMES
    (action,) = [a for a in build_parser()._actions if "--backend" in a.option_strings]
    assert tuple(action.choices) == backends.PLUGIN_BACKENDS  # the reference server stands in for the plugin
    assert set(DEMO_BACKENDS) == {n for n, s in backends.SPECS.items() if not s.same_host}


def test_import_pulls_no_framework_and_nothing_else() -> None:
    # Beyond the package itself (whatever ``import weightwire`` loads), the registry loads
    # only itself: no framework, not even numpy or weightwire.shared.
    probe = ("import json, sys; import weightwire; before = set(sys.modules); import weightwire.backends; "
             "new = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('weightwire', 'numpy')); "
             "fw = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'jax', 'jaxlib', 'cupy', 'vllm')); "
             "print(json.dumps([new, fw]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    new, frameworks = json.loads(out.stdout.strip().splitlines()[-1])
    assert frameworks == [] and new == ["weightwire.backends"], (new, frameworks)


def test_unknown_names_are_refused_naming_the_known_ones() -> None:
    from weightwire.trainer.backends import get_backend
    from weightwire.trainer.config import TrainerInitInfo

    known = ", ".join(backends.BACKEND_NAMES)
    for call in (lambda: backends.get("weightwire_udp"), lambda: get_backend("weightwire_udp"),
                 lambda: TrainerInitInfo(backend="weightwire_udp")):
        with pytest.raises(ValueError) as err:
            call()
        assert "unknown backend 'weightwire_udp'" in str(err.value) and known in str(err.value)
    assert backends.get("tcp") is backends.SPECS[backends.TCP]  # an alias is not unknown
    with pytest.raises(ValueError, match="must be 'module:attr'"):
        backends.load("weightwire.backends.tcp.worker")


def test_every_alias_the_cli_takes_the_library_takes() -> None:
    # One alias table (backends.ALIASES) for the command line and TrainerInitInfo alike.
    from weightwire._cli import backend_name
    from weightwire.trainer.config import TrainerInitInfo

    assert backends.ALIASES  # tcp, at least
    for alias, name in backends.ALIASES.items():
        assert backend_name(alias) == name
        assert TrainerInitInfo(backend=alias).backend == name
    with pytest.raises(ValueError, match=r"\(aliases: tcp = weightwire_tcp\)"):
        TrainerInitInfo(backend="udp")


def test_worker_connect_dispatches_through_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from weightwire.backends.tcp import worker as tcp_worker
    from weightwire.shared.info import NCCLInitInfo
    from weightwire.torch_side.worker.connect import connect
    from weightwire.torch_side.worker.engines import WeightwireTCPEngine

    calls: list[tuple[Any, int]] = []
    monkeypatch.setattr(tcp_worker, "connect_tcp", lambda info, *, rank, device: calls.append((info, rank)) or "link")
    info = TCPInitInfo(host="127.0.0.1", port=9, secret_b64=encode_secret(bytes(128)), rank_offset=1, world_size=2)
    assert WeightwireTCPEngine._connect is connect
    assert connect(info, rank=1, device=torch.device("cpu")) == "link" and calls == [(info, 1)]
    stock = NCCLInitInfo(nccl_unique_id_b64=encode_secret(bytes(128)), rank_offset=1, world_size=2)
    with pytest.raises(ValueError, match="received by vLLM's own engine only"):
        connect(stock, rank=1, device=torch.device("cpu"))


def _code_strings(path: Path) -> set[str]:
    """String constants of a module, docstrings left out."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs}


def test_plugin_backend_names_are_written_once_in_code() -> None:
    # "nccl" is also a word of other vocabularies (transport, result keys); the weightwire_*
    # names mean only a backend, so code outside the registry and shared's ClassVars uses
    # the registry's constants.
    names = set(backends.PLUGIN_BACKENDS)
    allowed = {ROOT / "weightwire/backends/__init__.py", ROOT / "weightwire/shared/info.py",
               ROOT / "weightwire/shared/ipc_info.py"}
    found = {str(p.relative_to(ROOT)): sorted(_code_strings(p) & names)
             for p in sorted((ROOT / "weightwire").rglob("*.py")) if p not in allowed}
    assert {p: n for p, n in found.items() if n} == {}


def test_the_nccl_store_rendezvous_keeps_its_public_path() -> None:
    pytest.importorskip("torch")
    from weightwire.backends.nccl import worker as nccl_worker
    from weightwire.torch_side import worker
    from weightwire.torch_side.worker import connect

    assert worker.publish_unique_id is connect.publish_unique_id is nccl_worker.publish_unique_id
    assert worker.fetch_unique_id is connect.fetch_unique_id is nccl_worker.fetch_unique_id
    with pytest.raises(AttributeError, match="no attribute 'connect_tcp'"):
        _ = connect.connect_tcp  # the per-backend functions live in their packages only
