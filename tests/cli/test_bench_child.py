"""A benchmark's children import the same weightwire as their parent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import weightwire
from weightwire.tools.bench.child import PACKAGE_ROOT


def test_children_import_the_parents_weightwire(tmp_path: Path) -> None:
    # Before: the package directory itself went on the children's PYTHONPATH (it holds no
    # weightwire), so a child imported whichever weightwire was installed, or none.
    path = subprocess.run(
        [sys.executable, "-c", "import weightwire; print(weightwire.__file__)"],
        env={**os.environ, "PYTHONPATH": str(PACKAGE_ROOT)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert path == weightwire.__file__
