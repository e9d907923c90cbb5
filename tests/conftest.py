"""Shared pytest wiring: the ``gpu`` marker skips cleanly where GPUs are missing."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _cuda_device_count() -> int:
    try:
        import cupy  # optional: only GPU hosts have it

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needed = {item: item.get_closest_marker("gpu") for item in items}
    if not any(needed.values()):
        return
    have = _cuda_device_count()
    for item, marker in needed.items():
        if marker is None:
            continue
        want = int(marker.kwargs.get("count", 1))
        if have < want:
            item.add_marker(pytest.mark.skip(reason=f"needs {want} CUDA GPU(s), found {have}"))
