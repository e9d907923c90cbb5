"""A benchmark's child process: ``python -m weightwire.tools.bench.<module>``, importing
the same weightwire as its parent."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PACKAGE_ROOT = Path(__file__).resolve().parents[3]
"""The directory holding the weightwire package (a checkout's root)."""


def spawn_child(
    module: str, args: Sequence[str], *, env: dict[str, str], **popen: Any
) -> subprocess.Popen[str]:
    """Run ``weightwire.tools.bench.<module>`` with ``args`` in text mode: this process's
    environment with ``env`` set on it, the parent's weightwire first on the import path
    (a checkout that is not installed runs too); ``popen``: ``Popen``'s pipes."""
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PACKAGE_ROOT), full.get("PYTHONPATH", "")) if p
    )
    return subprocess.Popen(
        [sys.executable, "-m", f"weightwire.tools.bench.{module}", *args],
        env=full,
        text=True,
        **popen,
    )
