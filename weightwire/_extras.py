"""Optional dependencies: which ``pip install "weightwire[EXTRA]"`` provides each one.

Why: the base install is light (numpy, httpx, rich) and each role adds an extra (a
JAX trainer host ``[jax]``, a worker or the reference server ``[torch]``). A bare
``ModuleNotFoundError: No module named 'safetensors'`` deep in a call stack does not
tell a user which extra they skipped; ``require`` and ``missing_extra`` turn that into
one line that does, in the library and on the CLI.
"""

from __future__ import annotations

import importlib.util

from weightwire.shared.errors import UnavailableError

EXTRA_OF: dict[str, str] = {
    "jax": "jax", "jaxlib": "jax", "flax": "jax", "optax": "jax", "safetensors": "jax", "tokenizers": "jax",
    "torch": "torch", "fastapi": "torch", "starlette": "torch", "uvicorn": "torch", "transformers": "torch",
    "cupy": "cuda12", "cupy_backends": "cuda12", "ray": "ray",
    "pytest": "test", "hypothesis": "test",
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
            fix = 'pip install "weightwire[cuda12]" (or "weightwire[cuda13]", matching your CUDA)'
        elif extra is not None:
            fix = f'pip install "weightwire[{extra}]"'
        else:
            fix = f"pip install {top}"
        super().__init__(f"{what}: {fix}", name=top)
        self.module, self.extra = top, extra


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
