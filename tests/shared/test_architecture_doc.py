"""``docs/architecture.md`` matches the code: every ``file:function`` of the byte path
exists, and every file the tree names is where the tree says it is.

Read statically (``ast``), so a rename or a move in the code fails here until the
architecture document follows it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()
PACKAGE = ROOT / "weightwire"

# `path/file.py:Name.attr` (optionally followed by `-> _other` frames of the same class).
_REF = re.compile(r"`([a-z_/]+\.py):([A-Za-z_][\w.]*)`")


def _byte_path_section() -> str:
    return DOC[DOC.index("## The path of one byte") :]


def _defined(path: Path) -> set[str]:
    """Every ``name`` and ``Class.method`` defined at the top level of ``path``."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {
                f"{node.name}.{item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    return names


REFS = sorted(set(_REF.findall(_byte_path_section())))


def test_the_byte_path_names_enough_frames() -> None:
    assert len(REFS) >= 20, REFS


@pytest.mark.parametrize(("file", "name"), REFS)
def test_every_byte_path_frame_exists(file: str, name: str) -> None:
    path = PACKAGE / file
    assert path.is_file(), f"docs/architecture.md names {file}, which is not under weightwire/"
    assert name in _defined(path), (
        f"docs/architecture.md names {file}:{name}, which {file} does not define"
    )


def _tree_block() -> str:
    start = DOC.index("## The tree")
    block = DOC[start : DOC.index("## Import rules")]
    return block[block.index("```") + 3 : block.rindex("```")]


_PY = re.compile(r"(?<![\w/.`])([a-z_0-9]+\.py)\b")


def _tree_files() -> list[str]:
    """``dir/file.py`` for every ``*.py`` the tree names, under the directory it is listed in.

    A line opening with ``dir/`` starts that directory (files on the same line and on
    deeper-indented lines below belong to it); a line listing several ``dir/`` names is
    a plain listing at its parent's level.
    """
    out: list[str] = []
    stack: list[tuple[int, str]] = []
    for line in _tree_block().splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        words = line.split()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dirs = [w for w in words if len(w) > 1 and w.endswith("/") and not w.startswith("(")]
        opens = words[0].endswith("/") and len(dirs) == 1
        if opens:
            stack.append((indent, words[0]))
        prefix = "".join(d for _, d in stack)
        if not prefix.startswith("weightwire/"):
            continue
        text = line.split("`")[0]  # code spans quote commands, not files
        out += [prefix + name for name in _PY.findall(text)]
    return out


def test_every_file_in_the_tree_exists() -> None:
    files = _tree_files()
    assert len(files) >= 15, files
    missing = [f for f in files if not (ROOT / f).is_file()]
    assert missing == [], f"docs/architecture.md's tree names files that do not exist: {missing}"


def test_every_package_is_in_the_tree() -> None:
    packages = sorted(
        p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.glob("*/__init__.py")
    )
    tree = _tree_block()
    missing = [p for p in packages if f"{p}/" not in tree]
    assert missing == [], f"packages missing from docs/architecture.md's tree: {missing}"


_SIDES = ("### Sending side", "### Receiving side")


def _frames(heading: str) -> list[str]:
    """The numbered frames under ``heading`` (a frame's continuation lines joined to it)."""
    section = _byte_path_section()
    body = section[section.index(heading) :].split("\n", 1)[1]
    frames: list[str] = []
    for line in body.splitlines():
        if line.startswith("### "):
            break
        if re.match(r"\d+\. ", line):
            frames.append(line)
        elif frames and line.startswith("   ") and line.strip():
            frames[-1] += " " + line.strip()
        elif frames and line.strip():
            break  # the paragraph after the list: variants, not frames
    return frames


@pytest.mark.parametrize("heading", _SIDES)
def test_each_side_is_at_most_eight_frames(heading: str) -> None:
    frames = _frames(heading)
    assert 3 <= len(frames) <= 8, f"{heading}: {len(frames)} frames (at most 8): {frames}"


@pytest.mark.parametrize("heading", _SIDES)
def test_the_byte_path_never_returns_to_a_file_it_left(heading: str) -> None:
    files = [file for frame in _frames(heading) for file, _ in _REF.findall(frame)]
    assert files, heading
    left: list[str] = []
    for previous, file in zip(files, files[1:], strict=False):
        if file != previous:
            left.append(previous)
            assert file not in left, (
                f"{heading}: the path returns to {file} after leaving it: {files}"
            )


# -- one trainer round -----------------------------------------------------------------------

_ROUND = PACKAGE / "trainer" / "round.py"
_STEP_ROW = re.compile(r"^\| \d+ \| `([a-z_]+)`", re.MULTILINE)


def _trainer_round_steps_in_doc() -> list[str]:
    section = DOC[DOC.index("## One trainer round") :]
    section = section[: section.index("\n## ")]
    return _STEP_ROW.findall(section)


def _trainer_round_steps_in_code() -> list[str]:
    """The calls in ``lead_round``'s body of functions ``trainer/round.py`` defines, in the
    order they are written (the steps a reader follows top to bottom)."""
    tree = ast.parse(_ROUND.read_text())
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    (lead,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "lead_round"]
    calls = [
        (node.lineno, node.col_offset, node.func.id)
        for node in ast.walk(lead)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in functions
    ]
    return [name for _, _, name in sorted(calls)]


def test_the_trainer_round_section_lists_lead_rounds_steps_in_order() -> None:
    listed = _trainer_round_steps_in_doc()
    assert len(listed) >= 5, listed
    assert listed == _trainer_round_steps_in_code(), (
        "docs/architecture.md's 'One trainer round' table must list trainer/round.py:lead_round's "
        "step calls in the order its body makes them"
    )
