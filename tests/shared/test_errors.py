"""One exception root: every exception class in ``weightwire/`` derives from
``WeightwireError``, the tree at the top of ``weightwire/shared/errors.py`` is the code's
tree, and the builtin bases callers already catch (``ValueError``, ``TimeoutError``,
``ConnectionError``, ``ImportError``) are kept. (Real raises of each kind:
``test_errors_raised.py``.)"""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import weightwire
from weightwire.shared import errors
from weightwire.shared.errors import (
    ConfigError,
    ControlTimeout,
    PeerLost,
    SourceMismatch,
    TransferError,
    TransferTimeout,
    WeightSyncError,
    WeightwireError,
)

PACKAGE = Path(weightwire.__file__).parent
ERRORS_MODULE = "weightwire.shared.errors"


def _defined_classes() -> set[str]:
    """The exception classes ``shared.errors`` defines (not those it imports)."""
    return {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type)
        and issubclass(value, BaseException)
        and value.__module__ == ERRORS_MODULE
    }


_PROBE = r"""
import importlib, json, pkgutil
import weightwire
from weightwire.shared.errors import WeightwireError

NOT_IMPORTED_HERE = {
    "vllm": "needs vLLM (the GPU / interop lanes have it)",
    "cupy": "needs CuPy and a CUDA device",
}
classes, skipped = {}, {}
for info in pkgutil.walk_packages(weightwire.__path__, "weightwire."):
    if info.name.rsplit(".", 1)[-1] == "__main__":
        skipped[info.name] = "runs a command line on import"
        continue
    try:
        module = importlib.import_module(info.name)
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top not in NOT_IMPORTED_HERE:
            raise
        skipped[info.name] = NOT_IMPORTED_HERE[top]
        continue
    for value in vars(module).values():
        if (
            isinstance(value, type)
            and issubclass(value, BaseException)
            and value.__module__.startswith("weightwire")
        ):
            classes[f"{value.__module__}.{value.__qualname__}"] = issubclass(value, WeightwireError)
print(json.dumps({"classes": classes, "skipped": skipped}))
"""


@cache
def _import_walk() -> dict:
    """Imports every module under ``weightwire/`` in a fresh interpreter (importing them
    here would leave vLLM / the engines in ``sys.modules`` for later tests) and reports
    each exception class found (``True`` when it derives from ``WeightwireError``)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=PACKAGE.parent,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _base_names(node: ast.ClassDef) -> list[str]:
    return [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]


@cache
def _static_exception_classes() -> dict[str, tuple[str, list[str]]]:
    """``name -> (file, base names)`` for every class under ``weightwire/`` whose bases
    reach a builtin exception, read from source (no import needed)."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                classes[f"{path.relative_to(PACKAGE.parent)}:{node.name}"] = (
                    node.name,
                    _base_names(node),
                )
    by_name: dict[str, list[str]] = {}
    for name, bases in classes.values():
        by_name.setdefault(name, []).extend(bases)

    def is_builtin_exception(name: str) -> bool:
        value = getattr(builtins, name, None)
        return isinstance(value, type) and issubclass(value, BaseException)

    exc_names: set[str] = set()
    grew = True
    while grew:
        grew = False
        for name, bases in by_name.items():
            if name not in exc_names and any(
                is_builtin_exception(b) or b in exc_names for b in bases
            ):
                exc_names.add(name)
                grew = True
    return {
        key: (key.split(":")[0], bases)
        for key, (name, bases) in classes.items()
        if name in exc_names
    }


# -- (a) every exception class derives from WeightwireError ----------------------------------


def test_every_importable_exception_class_derives_from_the_root() -> None:
    found = _import_walk()["classes"]
    assert len(found) >= 30, sorted(found)  # the walk really found the library's classes
    outside = sorted(name for name, derives in found.items() if not derives)
    assert not outside, f"exception classes not deriving from WeightwireError: {outside}"


def test_the_import_walk_skips_only_modules_that_need_missing_gpu_packages() -> None:
    for name, reason in _import_walk()["skipped"].items():
        assert name.endswith("__main__") or name == "weightwire.torch_side.worker.vllm_engines", (
            name,
            reason,
        )


def test_every_exception_class_in_the_source_derives_from_the_root() -> None:
    """Covers modules the import walk skips (vLLM / CuPy ones): a class's bases, by name,
    must lead to ``WeightwireError``."""
    static = _static_exception_classes()
    bases_of = {key.split(":")[1]: bases for key, (_, bases) in static.items()}
    assert len(static) >= 30, sorted(static)

    def reaches_root(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name == "WeightwireError":
            return True
        if name in seen or name not in bases_of:
            return False
        return any(reaches_root(b, seen | {name}) for b in bases_of[name])

    outside = sorted(key for key in static if not reaches_root(key.split(":")[1]))
    assert not outside, f"exception classes whose bases do not lead to WeightwireError: {outside}"
    assert bases_of["WeightwireError"] == ["Exception"]


def test_the_static_walk_sees_every_class_the_import_walk_sees() -> None:
    static_names = {key.split(":")[1] for key in _static_exception_classes()}
    runtime_names = {name.rsplit(".", 1)[1] for name in _import_walk()["classes"]}
    assert runtime_names <= static_names, sorted(runtime_names - static_names)


# -- (b) the tree in the module docstring is the code's tree ----------------------------------

_TREE_LINE = re.compile(
    r"^(?P<indent> *)(?P<name>\w+)(?: \((?P<mixins>[\w, ]+)\))?(?: +\[(?P<module>[\w.]+)\])?$"
)


def _documented_tree() -> list[tuple[int, str, set[str], str]]:
    """``(depth, name, builtin mixins, defining module)`` per line of the docstring's tree."""
    doc = errors.__doc__ or ""
    block = doc.split("::\n\n", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in block.splitlines():
        body = line[4:]  # the literal block's own indent
        match = _TREE_LINE.match(body)
        assert match, f"unparsable tree line {line!r}"
        indent = len(match["indent"])
        assert indent % 2 == 0, line
        mixins = {m.strip() for m in match["mixins"].split(",")} if match["mixins"] else set()
        rows.append((indent // 2, match["name"], mixins, match["module"] or ERRORS_MODULE))
    return rows


def test_the_documented_tree_matches_the_classes() -> None:
    rows = _documented_tree()
    assert rows[0][:2] == (0, "WeightwireError")
    parents: list[type] = []
    for depth, name, mixins, module in rows:
        cls = getattr(importlib.import_module(module), name)
        assert cls.__module__ == module, (
            f"{name} is defined in {cls.__module__}, the tree says {module}"
        )
        del parents[depth:]
        assert len(parents) == depth, f"{name}: indented below no parent"
        if parents:
            assert parents[-1] in cls.__bases__, (
                f"{name}: the tree's parent {parents[-1].__name__} is not a direct base"
            )
        own = {b.__name__ for b in cls.__bases__ if not issubclass(b, WeightwireError)}
        if cls is WeightwireError:
            own = set()  # the root's Exception base is implied
        assert own == mixins, f"{name}: builtin bases {sorted(own)}, the tree says {sorted(mixins)}"
        parents.append(cls)


def test_the_documented_tree_lists_exactly_the_classes_that_exist() -> None:
    documented = [name for _, name, _, _ in _documented_tree()]
    assert len(documented) == len(set(documented)), "a class listed twice"
    existing = {key.split(":")[1] for key in _static_exception_classes()}
    assert set(documented) == existing, {
        "undocumented": sorted(existing - set(documented)),
        "gone": sorted(set(documented) - existing),
    }


def _public_tree(lines: list[str]) -> list[str]:
    """``lines`` of the tree without the ``INTERNAL_BRANCHES`` subtrees."""
    kept, cut_below = [], None
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if cut_below is not None and indent > cut_below:
            continue
        cut_below = None
        if line.split()[0] in errors.INTERNAL_BRANCHES:
            cut_below = indent
            continue
        kept.append(line)
    return kept


def test_docs_errors_md_shows_the_public_tree() -> None:
    # The user's page shows what can reach a user's code: the tree without the internal branches.
    doc = (PACKAGE.parent / "docs" / "errors.md").read_text()
    block = (errors.__doc__ or "").split("::\n\n", 1)[1].split("\n\n", 1)[0]
    lines = [line[4:] for line in block.splitlines()]
    assert {line.split()[0] for line in lines} >= set(errors.INTERNAL_BRANCHES)
    tree = "\n".join(_public_tree(lines))
    assert f"```\n{tree}\n```" in doc, (
        "docs/errors.md's tree differs from weightwire/shared/errors.py's public tree"
    )
    for name in errors.INTERNAL_BRANCHES:
        assert name not in doc, f"docs/errors.md names the internal {name}"


def test_docs_errors_md_names_exactly_the_classes_weightwire_exports() -> None:
    # The page's "also exported by `weightwire` itself" sentence is how a user learns which
    # import to write; an exported class left out of it (or one named there but not exported)
    # sends them to the wrong module.
    doc = (PACKAGE.parent / "docs" / "errors.md").read_text()
    sentence = re.search(r"\n\n(`ConfigError`[^.]*?) are also\s+exported by `weightwire`", doc)
    assert sentence, "docs/errors.md lost its sentence of the classes `weightwire` exports"
    named = set(re.findall(r"`(\w+)`", sentence[1]))
    exported = {
        name
        for name in weightwire.__all__
        if isinstance(getattr(weightwire, name), type)
        and issubclass(getattr(weightwire, name), BaseException)
    } - {"WeightwireError"}  # the page's first line imports it
    assert named == exported | {"RoundHandle"}, {
        "exported, not named": sorted(exported - named),
        "named, not exported": sorted(named - exported - {"RoundHandle"}),
    }


def test_every_class_defined_in_the_errors_module_is_in_the_tree_and_documented() -> None:
    documented = {name for _, name, _, module in _documented_tree() if module == ERRORS_MODULE}
    defined = _defined_classes()
    assert documented == defined
    for name in defined:
        assert (getattr(errors, name).__doc__ or "").strip(), f"{name} has no docstring"


# -- (c) the builtin mixins callers already catch ---------------------------------------------


def test_builtin_mixins_are_kept() -> None:
    from weightwire._extras import MissingExtra
    from weightwire.backends.nccl.stock import StockRefusal
    from weightwire.jax_side.transforms import NamingError
    from weightwire.trainer.engine import EngineBroken
    from weightwire.trainer.group import GroupTimeout

    assert issubclass(PeerLost, TransferError) and issubclass(PeerLost, ConnectionError)
    for timeout in (TransferTimeout, ControlTimeout, GroupTimeout):
        assert issubclass(timeout, TimeoutError), timeout
    assert issubclass(ControlTimeout, WeightSyncError) and issubclass(ControlTimeout, TimeoutError)
    assert not issubclass(
        ControlTimeout, TransferError
    )  # a control-plane failure, not the data plane
    for value_error in (ConfigError, SourceMismatch, StockRefusal, NamingError):
        assert issubclass(value_error, ValueError), value_error
    assert issubclass(MissingExtra, ModuleNotFoundError)
    for runtime in (TransferError, WeightSyncError, EngineBroken):
        assert issubclass(runtime, RuntimeError), runtime


def test_every_export_path_gives_the_same_class() -> None:
    # The packages' export lists name the classes of shared.errors, not copies.
    import weightwire.control
    import weightwire.shared

    for name in (
        "ConfigError",
        "ControlTimeout",
        "PeerLost",
        "SourceMismatch",
        "TransferError",
        "TransferTimeout",
        "WeightSyncError",
        "WeightwireError",
    ):
        assert (
            getattr(weightwire, name) is getattr(weightwire.shared, name) is getattr(errors, name)
        ), name
    assert weightwire.control.WeightSyncError is WeightSyncError


# -- (d) one home per class -------------------------------------------------------------------

# Modules importing an error class through a module that only passes it on (the modules
# being rewritten in parallel); each entry must still hold, so the list only shrinks. Once
# it is empty, the pass-through imports (``shared.communicator``'s, ``control.errors``')
# go too.
KNOWN_INDIRECT: set[tuple[str, str]] = set()


def _indirect_error_imports() -> set[tuple[str, str]]:
    """(file, module) for each import of a ``shared.errors`` class from another weightwire
    module."""
    defined = _defined_classes()
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and node.module
                and node.module.startswith("weightwire.")
                and node.module != ERRORS_MODULE
                and any(alias.name in defined for alias in node.names)
            ):
                found.add((str(path.relative_to(PACKAGE.parent)), node.module))
    return found


def test_error_classes_are_imported_from_shared_errors() -> None:
    # One home per class: an import through another module keeps that module a shim.
    found = _indirect_error_imports()
    assert sorted(found - KNOWN_INDIRECT) == [], "import these from weightwire.shared.errors"
    assert sorted(KNOWN_INDIRECT - found) == [], "remove from KNOWN_INDIRECT"


def test_a_weight_sync_error_keeps_its_pause_word_through_a_copy() -> None:
    """``WeightSyncError.pause`` (a refused start's word on its pause) survives the copy
    concurrent.futures and logging make (pickle), and a ``ControlTimeout`` has none."""
    import pickle

    from weightwire.shared.errors import ControlTimeout, WeightSyncError

    error = WeightSyncError("start_weight_update", 409, "asleep", "http://a:1", pause="held")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.pause, copy.message, str(copy)) == ("held", "asleep", str(error))
    assert WeightSyncError("update_weights", 500, "x", "http://a:1").pause is None
    assert pickle.loads(pickle.dumps(ControlTimeout("late", route="r"))).pause is None


# -- (e) no bare builtin raise where a user's call reaches ------------------------------------

# The packages a trainer's code calls into (the engines, sources, groups, the contract's
# parsers, the control client, the backend registry) and the command lines' arguments: a
# raise of a bare builtin there is an error a user can meet outside the tree. What remains is
# each an internal invariant or wrapped before it leaves (count per file and builtin; the
# count only shrinks).
PUBLIC_MODULES = (
    "weightwire/trainer",
    "weightwire/jax_side",
    "weightwire/torch_side/sender",
    "weightwire/shared",
    "weightwire/control",
    "weightwire/backends/__init__.py",
    "weightwire/backends/tcp/rendezvous.py",
    # the command lines' arguments (`weightwire serve`, the demo) and the models they name
    "weightwire/tools/demo/config.py",
    "weightwire/tools/demo/policy.py",
    "weightwire/tools/models",
    "weightwire/tools/server/serve_args.py",
)
BARE_BUILTINS = ("ValueError", "TypeError", "RuntimeError", "AssertionError", "KeyError")
KNOWN_BARE: dict[tuple[str, str], int] = {
    # the registry's own declarations disagree (a package's spec.py), at import
    ("weightwire/backends/__init__.py", "RuntimeError"): 3,
    # the packer's plan invariants; a GPU missing after the backend's own check refused it
    ("weightwire/jax_side/packer.py", "ValueError"): 1,
    ("weightwire/jax_side/packer.py", "RuntimeError"): 1,
    ("weightwire/jax_side/shard_delta.py", "AssertionError"): 1,
    ("weightwire/torch_side/sender/engine.py", "RuntimeError"): 1,
    ("weightwire/trainer/fp8_cuda.py", "ValueError"): 1,
    # pack / unpack against their own plan
    ("weightwire/shared/framing.py", "ValueError"): 4,
    # an info class's annotations (a developer's, at class definition)
    ("weightwire/shared/info.py", "TypeError"): 1,
    # a served model's reply / checkpoint header: turned into WeightSyncError / ConfigError
    # by control.client and served_checkpoint before any user sees them
    ("weightwire/shared/served.py", "ValueError"): 15,
    ("weightwire/shared/slice_wire.py", "ValueError"): 1,
}


def _bare_builtin_raises() -> dict[tuple[str, str], int]:
    found: dict[tuple[str, str], int] = {}
    root = PACKAGE.parent
    for top in PUBLIC_MODULES:
        path = root / top
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            for node in ast.walk(ast.parse(file.read_text())):
                if not isinstance(node, ast.Raise) or node.exc is None:
                    continue
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in BARE_BUILTINS:
                    key = (str(file.relative_to(root)), exc.id)
                    found[key] = found.get(key, 0) + 1
    return found


def test_the_public_modules_raise_no_bare_builtin_but_the_known_invariants() -> None:
    """A user's call into the engines, sources, groups or parsers raises a ``WeightwireError``
    subclass (``ConfigError`` is still a ``ValueError``, ``WrongType`` a ``TypeError``), so
    ``except WeightwireError`` catches what they report."""
    found = _bare_builtin_raises()
    assert found == KNOWN_BARE, {
        "new bare raises (raise a WeightwireError subclass)": {
            k: v for k, v in found.items() if v > KNOWN_BARE.get(k, 0)
        },
        "fewer than listed (lower KNOWN_BARE)": {
            k: v for k, v in KNOWN_BARE.items() if found.get(k, 0) < v
        },
    }
