"""``docs/configuration.md`` names every environment variable weightwire reads and every
``Timeouts`` field with its variable and default, and nothing the code no longer reads; the
variables of CI and the interop lane are the maintainers' and live in ``docs/architecture.md``."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from weightwire.shared.timeouts import Timeouts

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "configuration.md").read_text()
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
MAINTAINERS = ARCHITECTURE[ARCHITECTURE.index("## Tests, CI and the interop lane") :]
MAINTAINERS = MAINTAINERS[: MAINTAINERS.index("\n## ")]
_VAR = re.compile(r"\b(?:WEIGHTWIRE|XLA)_[A-Z0-9_]*[A-Z0-9]\b")


def _read_by_code(*, maintainers: bool = False) -> set[str]:
    """The variables weightwire reads, or (``maintainers``) those CI and the interop lane read."""
    sources = (
        [ROOT / ".ci" / "run", ROOT / "tests" / "interop" / "run.sh"]
        + list((ROOT / "tests" / "interop").glob("*.py"))
        if maintainers
        else list((ROOT / "weightwire").rglob("*.py"))
    )
    found: set[str] = set()
    for path in sources:
        found |= set(_VAR.findall(path.read_text()))
    # Timeouts builds WEIGHTWIRE_TIMEOUT_<FIELD> from its field names; the template itself is no
    # variable.
    # WEIGHTWIRE_CHECK is the result-line prefix of tests/interop/check_plugin.py, not a variable;
    # WEIGHTWIRE_NCCL is the backend registry's name constant (weightwire.backends), not a variable.
    # WEIGHTWIRE_LANDING is the result-line prefix of tests/interop/check_landing.py.
    prefixes = ("WEIGHTWIRE_TIMEOUT", "WEIGHTWIRE_CHECK", "WEIGHTWIRE_NCCL", "WEIGHTWIRE_LANDING")
    return {v for v in found if v not in prefixes}


def test_every_variable_the_code_reads_is_documented() -> None:
    documented = set(_VAR.findall(DOC))
    missing = sorted(_read_by_code() - documented)
    assert missing == [], f"read by the code but not in docs/configuration.md: {missing}"


def test_the_page_documents_no_variable_the_code_does_not_read() -> None:
    timeout_vars = {f"WEIGHTWIRE_TIMEOUT_{f.name.upper()}" for f in dataclasses.fields(Timeouts)}
    stale = sorted(set(_VAR.findall(DOC)) - _read_by_code() - timeout_vars - {"WEIGHTWIRE_TIMEOUT"})
    assert stale == [], f"documented but read nowhere: {stale}"


def test_the_maintainers_variables_are_in_the_architecture_notes_only() -> None:
    theirs = _read_by_code(maintainers=True) - _read_by_code()
    assert len(theirs) >= 5, theirs
    documented = set(_VAR.findall(MAINTAINERS))
    assert sorted(theirs - documented) == [], "read by CI / the interop lane, not documented"
    assert sorted(documented - theirs) == [], "documented for maintainers but read nowhere"
    assert sorted(theirs & set(_VAR.findall(DOC))) == [], "maintainers' variables in a user page"


def test_every_timeouts_field_has_its_variable_and_default() -> None:
    rows = {
        m.group(1): m
        for m in re.finditer(
            r"^\| `(\w+)` \| `(WEIGHTWIRE_TIMEOUT_\w+)` \| ([0-9.]+) \|", DOC, re.M
        )
    }
    for f in dataclasses.fields(Timeouts):
        assert f.name in rows, f"Timeouts.{f.name} is not in docs/configuration.md"
        assert rows[f.name].group(2) == f"WEIGHTWIRE_TIMEOUT_{f.name.upper()}"
        assert float(rows[f.name].group(3)) == f.default
    assert set(rows) == {f.name for f in dataclasses.fields(Timeouts)}
