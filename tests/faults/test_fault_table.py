"""The fault table of docs/reliability.md lists exactly the fault tests (one row each)."""

from __future__ import annotations

from tests.faults.fault_table import DOC, doc_rows, fault_tests


def test_every_fault_test_has_a_row_and_every_row_a_test() -> None:
    tests, rows = fault_tests(), doc_rows(DOC.read_text())
    assert len(tests) > 20
    missing = [t for t in tests if t not in rows]
    stale = [r for r in rows if r not in tests]
    assert not missing and not stale, (
        f"docs/reliability.md's fault table is out of date: no row for {missing}, "
        f"rows for no test {stale}; "
        "run python -m tests.faults.fault_table OBS --write"
    )
