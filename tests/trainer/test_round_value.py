"""A round is a value: the ``Session`` keeps only what lives between rounds, and no trainer
module swaps a session's fields for the length of one round (a delta round's source and
update-info fields, an overlapped round's snapshot and stop travel in the round)."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from weightwire.trainer.group import DictGroup
from weightwire.trainer.multi_group import GroupWire
from weightwire.trainer.multi_source import MultiSource
from weightwire.trainer.multi_star import StarWire
from weightwire.trainer.round import Round
from weightwire.trainer.session import Session

TRAINER = Path(__file__).resolve().parents[2] / "weightwire" / "trainer"
_SESSION = {"s", "session", "self._s", "self.session", "self._session"}


def test_the_session_holds_no_per_round_field() -> None:
    held = {f.name for f in fields(Session)}
    assert not held & {"round_fields", "before_commit"}, held
    assert {"fields", "before_commit", "plan", "wire", "version"} <= {f.name for f in fields(Round)}


def _assigned(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        targets = [node.target]
    else:
        return []
    out: list[ast.expr] = []
    while targets:
        t = targets.pop()
        if isinstance(t, ast.Tuple | ast.List):
            targets.extend(t.elts)
        else:
            out.append(t)
    return out


def test_no_trainer_module_swaps_the_sessions_source() -> None:
    swaps = [
        f"{path.name}:{node.lineno}: {ast.unparse(target)}"
        for path in sorted(TRAINER.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        for target in _assigned(node)
        if isinstance(target, ast.Attribute)
        and target.attr == "source"
        and ast.unparse(target.value) in _SESSION
    ]
    assert swaps == [], "a round's source belongs to the round, not to the Session: " + str(swaps)


def test_several_broadcasters_run_over_a_wire_chosen_at_set_up_not_mixins() -> None:
    # "stars" and "group" are two Wire values MultiSource holds (sharing Ranks), not base
    # classes of it: one round's wire is what lead_round is handed.
    for cls in (MultiSource, StarWire, GroupWire):
        assert cls.__bases__ == (object,), cls
    groups = DictGroup.make(2)
    for several, wire in (("group", GroupWire), ("stars", StarWire), (None, StarWire)):
        session: Any = SimpleNamespace(
            info=SimpleNamespace(rank=0),
            backend=SimpleNamespace(caps=SimpleNamespace(several=several)),
        )
        multi = MultiSource(session, groups[0], cast(Any, None))
        assert type(multi.wire) is wire and multi.wire.ranks is multi.ranks
        multi.close()  # its beat thread
