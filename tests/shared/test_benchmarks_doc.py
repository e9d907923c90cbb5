"""The benchmarks summary stays true to its sections: every number in a summary row's result
appears in the section the row names (§ column), rounded to the digits the summary gives (0.87
is a 0.869 there; 318 a 318.2), so a number measured again is changed in both places."""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text()
NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?")


def _summary_rows() -> list[tuple[str, str]]:
    """(result, section id) of each summary row."""
    summary = BENCHMARKS.split("\n## Summary\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in summary.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[2] not in ("§", "---"):
            rows.append((cells[1], cells[2]))
    return rows


def _section(sid: str) -> str:
    """The text under ``## SID.`` (or ``### SID.``) up to the next heading of its level or above."""
    head = re.search(rf"^(#{{2,3}}) {re.escape(sid)}\. .*$", BENCHMARKS, re.M)
    assert head is not None, f"the summary cites § {sid}, which benchmarks.md lacks"
    end = re.compile(rf"^#{{2,{len(head[1])}}} ", re.M).search(BENCHMARKS, head.end())
    return BENCHMARKS[head.end() : end.start() if end else None]


def _places(number: str) -> int:
    return len(number.split(".")[1]) if "." in number else 0


def _value(number: str) -> Decimal:
    return Decimal(number.replace(",", ""))


def _found(number: str, section_numbers: list[str]) -> bool:
    want, places = _value(number), _places(number)
    step = Decimal(1).scaleb(-places)
    return any(
        _value(n).quantize(step, rounding=ROUND_HALF_UP) == want
        for n in section_numbers
        if _places(n) >= places
    )


def test_every_summary_number_is_in_the_section_it_cites() -> None:
    rows = _summary_rows()
    assert len(rows) >= 15, rows
    missing = []
    for result, sid in rows:
        in_section = NUMBER.findall(_section(sid))
        missing += [f"§ {sid}: {n}" for n in NUMBER.findall(result) if not _found(n, in_section)]
    assert missing == [], f"summary numbers absent from their sections: {missing}"


def test_the_check_catches_a_number_not_in_its_section() -> None:
    assert _found("0.87", ["0.869"]) and _found("318", ["318.2"]) and _found("18,867", ["18867"])
    assert not _found("0.87", ["0.86", "0.9"]) and not _found("4.1", ["4111"])
