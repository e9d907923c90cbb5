"""The fault table of ``docs/reliability.md``, kept in step with the fault tests.

One row per fault test (per parameter id for parametrized ones), named in its first
column. ``test_fault_table.py`` fails when a test has no row or a row names no test;
this script rewrites the table:

    WEIGHTWIRE_FAULTS_OBSERVE=obs.jsonl pytest tests/faults
    python -m tests.faults.fault_table obs.jsonl          # print the new table
    python -m tests.faults.fault_table obs.jsonl --write  # replace it in the doc

Rows keep their "case" and "expected" text from the doc (a new test starts with its
docstring's first sentence); "observed" is rebuilt from the run's observations where
the run recorded any, else kept.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "reliability.md"
FAULTS = REPO / "tests" / "faults"
NOT_FAULTS = ("test_security.py", "test_fault_table.py")
"""Security checks live in docs/security.md; the table's own check is no fault."""
HEADER = "| test | case | expected | observed |"
_ROW = re.compile(
    r"^\| `(?P<test>[^`]+)` \| (?P<case>.*?) \| (?P<expected>.*?) \| (?P<observed>.*) \|$"
)


def fault_tests() -> list[str]:
    """``module::name`` or ``module::name[id]`` of every fault test, in file order."""
    out: list[str] = []
    for path in sorted(FAULTS.glob("test_*.py")):
        if path.name in NOT_FAULTS:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                ids = _param_ids(node)
                base = f"{path.stem}::{node.name}"
                out += [f"{base}[{i}]" for i in ids] if ids else [base]
    return out


def _param_ids(fn: ast.FunctionDef) -> list[str]:
    for deco in fn.decorator_list:
        if isinstance(deco, ast.Call) and getattr(deco.func, "attr", "") == "parametrize":
            for kw in deco.keywords:
                if kw.arg == "ids" and isinstance(kw.value, ast.List):
                    return [ast.literal_eval(e) for e in kw.value.elts]
    return []


def docstring_case(test: str) -> str:
    module, name = test.split("::")
    name = name.split("[")[0]
    tree = ast.parse((FAULTS / f"{module}.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    doc = ast.get_docstring(fn) or name.replace("_", " ")
    return " ".join(doc.split(". ")[0].split())


def doc_rows(text: str) -> dict[str, dict[str, str]]:
    """The rows of the doc's fault table, by test."""
    rows: dict[str, dict[str, str]] = {}
    for line in _table_lines(text):
        m = _ROW.match(line)
        if m:
            rows[m["test"]] = m.groupdict()
    return rows


def _table_lines(text: str) -> list[str]:
    lines = text.splitlines()
    try:
        start = lines.index(HEADER)
    except ValueError:
        return []
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[start:end]


def observed_cells(path: Path) -> dict[str, str]:
    """One "observed" cell per test from a ``WEIGHTWIRE_FAULTS_OBSERVE`` file."""
    cells: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        test = row.pop("case").removeprefix("tests/faults/").replace(".py::", "::")
        for key, value in row.items():
            text = str(value).replace("|", "/").replace("\n", " ")
            cells.setdefault(test, []).append(f"{key}: {text[:160]}")
    return {t: "; ".join(parts) for t, parts in cells.items()}


def render(observed: dict[str, str], text: str) -> str:
    old = doc_rows(text)
    lines = [HEADER, "| --- | --- | --- | --- |"]
    for test in fault_tests():
        row = old.get(
            test,
            {"case": docstring_case(test), "expected": "see the test's docstring", "observed": "-"},
        )
        cell = observed.get(test, row["observed"])
        lines.append(f"| `{test}` | {row['case']} | {row['expected']} | {cell} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.faults.fault_table")
    p.add_argument("observations", nargs="?", type=Path, help="a WEIGHTWIRE_FAULTS_OBSERVE file")
    p.add_argument("--write", action="store_true", help="replace the table in docs/reliability.md")
    args = p.parse_args(argv)
    text = DOC.read_text()
    table = render(observed_cells(args.observations) if args.observations else {}, text)
    if not args.write:
        print(table)
        return 0
    old = "\n".join(_table_lines(text))
    if not old:
        print(f"no table headed {HEADER!r} in {DOC}", file=sys.stderr)
        return 1
    DOC.write_text(text.replace(old, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
