"""Every Python block of README.md and docs/*.md runs as written.

Each ```python block is saved as a file and run in a fresh interpreter, from an empty
directory, against one reference server (`weightwire serve --model tiny-llama --enable-lora`)
shared by the module: a block's ``http://127.0.0.1:8000`` is that server's URL, nothing else is
changed. Every block pushes rounds: the server counts more committed rounds after it, and no
failed one.

The one marker: a block whose first line is ``# needs: WHAT`` cannot run on a CPU host with the
reference server alone (a GPU, vLLM, a Ray cluster); it is not run, and says so to its reader.
The JAX Quick start (under the marker comment `tests/cli/test_readme.py` reads) is run there,
after the README's set-up command, and is left out here.
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from weightwire.tools.demo.server import EmbeddedServer

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
NEEDS = re.compile(r"# needs: \S")
QUICK_START_MARK = "<!-- tests/cli/test_readme.py runs this block against a reference server -->"
URL = "http://127.0.0.1:8000"
PYTHON_ALIASES = {"py", "python3", "Python", "pycon"}
MOST_NOT_RUN = 4  # the blocks that truly need a GPU or vLLM; everything else runs


class Block(NamedTuple):
    where: str  # "docs/lora.md:12", the line of the opening fence
    code: str
    after_quick_start_mark: bool


def _blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in BLOCK.finditer(text):
            if m[1] == "python":
                line = text.count("\n", 0, m.start()) + 1
                marked = text[: m.start()].rstrip().endswith(QUICK_START_MARK)
                found.append(Block(f"{doc.relative_to(ROOT)}:{line}", m[2], marked))
    return found


BLOCKS = _blocks()
NOT_RUN = [b for b in BLOCKS if NEEDS.match(b.code)]
TO_RUN = [b for b in BLOCKS if not NEEDS.match(b.code) and not b.after_quick_start_mark]


def test_every_block_runs_or_says_what_it_needs() -> None:
    # A "# needs:" line anywhere but the first would hide from this test and from the reader.
    assert [b.where for b in BLOCKS if "# needs:" in b.code and not NEEDS.match(b.code)] == []
    assert len(NOT_RUN) <= MOST_NOT_RUN, [b.where for b in NOT_RUN]
    assert sum(b.after_quick_start_mark for b in BLOCKS) == 1
    assert len(TO_RUN) >= 5, [b.where for b in TO_RUN]  # torch Quick start, LoRA x2, ...


def _free_names(code: str) -> set[str]:
    """Names ``code`` reads that it never binds (imports, assignments, defs, loop targets,
    parameters) and that are no builtins: what its reader must bring."""
    tree = ast.parse(code)
    bound = set(vars(builtins))
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound


def test_a_block_not_run_names_what_it_needs_and_imports_the_rest() -> None:
    # Not run, such a block is checked here only: every name it reads is imported or
    # defined in it, or is something its "# needs:" line tells the reader to bring.
    unnamed: dict[str, list[str]] = {}
    for block in NOT_RUN:
        needs = set(re.findall(r"\w+", block.code.splitlines()[0]))
        missing = sorted(_free_names(block.code) - needs)
        if missing:
            unnamed[block.where] = missing
    assert unnamed == {}, f"import these, or name them on the block's # needs: line: {unnamed}"


def test_python_blocks_are_fenced_as_python() -> None:
    # A ```py block is Python this module never sees: neither run nor counted as not run.
    others = [
        f"{doc.relative_to(ROOT)}:{doc.read_text().count(chr(10), 0, m.start()) + 1}"
        for doc in DOCS
        for m in BLOCK.finditer(doc.read_text())
        if m[1] in PYTHON_ALIASES
    ]
    assert others == [], f"fence these as ```python: {others}"


@pytest.fixture(scope="module")
def doc_server(launch_server: Callable[..., EmbeddedServer]) -> Iterator[str]:
    server = launch_server("tiny-llama", extra_args=["--enable-lora"])
    yield server.wait_ready()


def _rounds(url: str) -> tuple[int, int]:
    """(committed, failed) rounds over the server's life."""
    session = httpx.get(f"{url}/weight_info", timeout=30).json()["session"]
    return session["rounds_committed"], session["rounds_failed"]


@pytest.mark.slow  # about 2 minutes on 2 cores: a fresh interpreter and a round per block
@pytest.mark.parametrize("block", TO_RUN, ids=[b.where for b in TO_RUN])
def test_the_block_runs_as_written(block: Block, doc_server: str, tmp_path: Path) -> None:
    committed, failed = _rounds(doc_server)
    script = tmp_path / "block.py"
    script.write_text(block.code.replace(URL, doc_server))
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,  # adapter directories and the like land here
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"{block.where}:\n{done.stdout}\n{done.stderr[-3000:]}"
    now_committed, now_failed = _rounds(doc_server)
    assert now_committed > committed and now_failed == failed, (
        f"{block.where}: rounds {now_committed - committed} committed, {now_failed - failed} failed"
    )
