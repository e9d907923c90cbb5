"""CuPy's NCCL binding, loaded lazily (any CuPy wheel name): what this machine has, the
``nccl.h`` values the communicator passes, and a fresh unique id.

Importing this module imports no CuPy; ``load_nccl`` does, on first use.
"""

from __future__ import annotations

from typing import Any

from weightwire._extras import install_command
from weightwire.backends.nccl.join import unique_id_to_bytes
from weightwire.shared.errors import UnavailableError

# ncclDataType_t / ncclRedOp_t values from nccl.h (stable ABI).
NCCL_UINT8, NCCL_FLOAT32, NCCL_SUM = 1, 7, 0
NCCL_ITEMSIZE: dict[int, int] = {
    0: 1,
    1: 1,
    2: 4,
    3: 4,
    4: 8,
    5: 8,
    6: 2,
    7: 4,
    8: 8,
    9: 2,
    10: 1,
    11: 1,
}


class NCCLUnavailable(UnavailableError, RuntimeError):
    """CuPy (with its NCCL binding) or a CUDA device is missing on this machine."""


def load_nccl() -> tuple[Any, Any]:
    """``(cupy, cupy.cuda.nccl)`` or ``NCCLUnavailable`` saying how to get them."""
    try:
        import cupy  # optional dependency, GPU hosts only
        from cupy.cuda import nccl
    except Exception as exc:  # ImportError, or OSError/RuntimeError from CUDA libraries
        raise NCCLUnavailable(
            "the NCCL transport needs CuPy with NCCL: "
            f"{install_command('cuda13')} (cupy-cuda13x) or "
            f"[cuda12] (cupy-cuda12x), matching your CUDA, on a CUDA machine; import failed: {exc}"
        ) from exc
    if not getattr(nccl, "available", False):
        raise NCCLUnavailable(
            "CuPy is installed but its NCCL library could not be loaded (libnccl.so.2 missing?)"
        )
    return cupy, nccl


def nccl_unavailable(backend: str, needs: str) -> NCCLUnavailable:
    """Why ``backend`` cannot run here (``nccl_available()`` said no), ``needs`` what it
    needs where: CuPy's NCCL that does not load (its install command), or no CUDA device."""
    try:
        cp, _ = load_nccl()
        why = f"CuPy sees {int(cp.cuda.runtime.getDeviceCount())} CUDA devices"
    except NCCLUnavailable as exc:
        why = str(exc)
    except Exception as exc:  # the CUDA runtime itself failed (no driver)
        why = f"CuPy could not count CUDA devices ({type(exc).__name__}: {exc})"
    return NCCLUnavailable(
        f"backend {backend!r} {needs}: {why}. On a host without a GPU use "
        "backend='weightwire_tcp' (the plugin's TCP data plane)"
    )


def nccl_available() -> bool:
    """True when CuPy's NCCL binding loads and at least one CUDA device is visible."""
    try:
        cp, _ = load_nccl()
        return int(cp.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


def format_nccl_version(code: int) -> str:
    """``ncclGetVersion`` code -> ``"2.28.9"`` (codes below 2.9 used ``x*1000 + y*100 + z``)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def nccl_version() -> str:
    """The runtime NCCL version CuPy loaded, e.g. ``"2.28.9"``; keep it equal to the workers'."""
    _, nccl = load_nccl()
    return format_nccl_version(int(nccl.get_version()))


def mint_unique_id() -> bytes:
    """A fresh 128-byte ``ncclUniqueId`` (a secret: whoever holds it can join the group)."""
    _, nccl = load_nccl()
    return unique_id_to_bytes(nccl.get_unique_id())
