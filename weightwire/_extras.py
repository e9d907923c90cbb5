"""Optional dependencies: which extra (``[jax]``, ``[torch]``, ...) provides each one, and the
``pip`` command that installs it for the install the user has (``install_command``).

Why: the base install is light (numpy, httpx, rich) and each role adds an extra (a
JAX trainer host ``[jax]``, a worker or the reference server ``[torch]``). A bare
``ModuleNotFoundError: No module named 'safetensors'`` deep in a call stack does not
tell a user which extra they skipped; ``require`` and ``missing_extra`` turn that into
one line that does, in the library and on the CLI.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shlex
import sys
import urllib.parse
from pathlib import Path

from weightwire.shared.errors import UnavailableError

EXTRA_OF: dict[str, str] = {
    "jax": "jax",
    "jaxlib": "jax",
    "flax": "jax",
    "optax": "jax",
    "safetensors": "jax",
    "tokenizers": "jax",
    "torch": "torch",
    "fastapi": "torch",
    "starlette": "torch",
    "uvicorn": "torch",
    "transformers": "torch",
    "cupy": "cuda12",
    "cupy_backends": "cuda12",
    "ray": "ray",
    "pytest": "test",
    "hypothesis": "test",
}
"""Top-level module -> the extra that installs it (``cupy``: ``[cuda12]`` or ``[cuda13]``)."""


class MissingExtra(UnavailableError, ModuleNotFoundError):
    """An optional dependency is not installed; the message names the extra that installs it.

    A ``ModuleNotFoundError`` so existing ``except ImportError`` handlers keep working.
    """

    def __init__(self, module: str, purpose: str | None = None) -> None:
        top = module.split(".")[0]
        extra = EXTRA_OF.get(top)
        what = f"{purpose} needs {top!r}" if purpose else f"{top!r} is not installed"
        if extra == "cuda12":
            fix = f"{install_command('cuda12')} (or [cuda13], matching your CUDA)"
        elif extra is not None:
            fix = install_command(extra)
        else:
            fix = f"{_pip()} install {top}"
        super().__init__(f"{what}: {fix}", name=top)
        self.module, self.extra = top, extra


def _pip() -> str:
    """``pip`` of the interpreter running weightwire: the venv's even when it is not activated."""
    exe = sys.executable or "python3"
    pip = Path(sys.prefix, "bin", "pip")
    if (
        Path(exe).parent.resolve() == pip.parent.resolve()
        and sys.prefix != sys.base_prefix
        and pip.exists()
    ):
        return shlex.quote(_shown(pip))
    return f"{shlex.quote(_shown(Path(exe)))} -m pip"


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is below it (``.venv/bin/pip``), else
    absolute."""
    try:
        return str(path.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path.absolute())


def _checkout() -> Path | None:
    """The source checkout this weightwire is imported from (a clone, editable or on the path), if
    any."""
    root = Path(__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    try:
        return (
            root if pyproject.is_file() and 'name = "weightwire"' in pyproject.read_text() else None
        )
    except OSError:
        return None


def _installed_from() -> str | None:
    """The local wheel, sdist or directory pip installed weightwire from (its
    ``direct_url.json``)."""
    try:
        text = importlib.metadata.distribution("weightwire").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        url = json.loads(text or "null")["url"]
    except (ValueError, TypeError, KeyError):
        return None
    if isinstance(url, str) and url.startswith("file://"):
        return urllib.parse.unquote(url.removeprefix("file://"))
    return None


def install_command(extra: str) -> str:
    """The command that adds ``extra`` to this install, as the user can paste it.

    A package index only knows weightwire if it was published there; a clone or a wheel file
    does not put it on one. So: a checkout -> ``pip install -e "CHECKOUT[extra]"``; installed
    from a local wheel or directory -> ``pip install "THAT[extra]"``; else the index name.
    ``pip`` is this interpreter's (a venv's even when the venv is not activated).
    """
    root = _checkout()
    if root is not None:
        where = "." if root == Path.cwd().resolve() else _shown(root)
        return f'{_pip()} install -e "{where}[{extra}]"'
    local = _installed_from()
    if local is not None and os.path.exists(local):
        return f'{_pip()} install "{_shown(Path(local))}[{extra}]"'
    return f'{_pip()} install "weightwire[{extra}]"'


def available(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (no framework start-up cost)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(*modules: str, purpose: str | None = None) -> None:
    """Raise ``MissingExtra`` for the first of ``modules`` that is not installed."""
    for module in modules:
        if not available(module):
            raise MissingExtra(module, purpose)


def missing_extra(exc: BaseException) -> MissingExtra | None:
    """``exc`` as a ``MissingExtra`` when it is (or wraps) a missing optional module we know."""
    while exc is not None:
        if isinstance(exc, MissingExtra):
            return exc
        if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] in EXTRA_OF:
            return MissingExtra(exc.name)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None
