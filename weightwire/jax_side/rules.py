"""``Rule``: one line of a ``Naming``: a pattern over pytree leaf paths, the HF name(s) the
matched leaves become, and the transforms between the two, checked when the rule is built.

Pattern syntax: ``{name}`` captures one path component, ``{name:regex}`` captures a regex
(no braces inside), ``*`` any run inside one component, ``**`` anything; the rest is
literal. Target templates are ``str.format`` strings over the captured names, plus
each ``Stacked`` part's field (``{layer}`` by default; ``{expert}`` for stacked experts).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

from weightwire.jax_side.transforms import (
    Cast,
    Concat,
    NamingError,
    Op,
    RulePart,
    Slice,
    Split,
    Stacked,
)

__all__ = ["Rule", "compile_pattern", "drop"]


@dataclass(frozen=True, init=False)
class Rule:
    """``Rule(pattern, target, *parts, optional=False)``.

    ``target``: a template, a tuple of templates (with ``Split``), or ``None`` to drop the
    matched leaves (e.g. rotary caches the server does not take). A rule that matches no
    leaf is an error unless ``optional``. The first rule matching a path claims it.
    """

    pattern: str
    target: str | tuple[str, ...] | None
    parts: tuple[RulePart, ...]
    optional: bool
    regex: re.Pattern[str]

    def __init__(
        self,
        pattern: str,
        target: str | tuple[str, ...] | None,
        *parts: RulePart,
        optional: bool = False,
    ) -> None:
        for attr, value in (
            ("pattern", pattern),
            ("target", target),
            ("parts", tuple(parts)),
            ("optional", optional),
            ("regex", compile_pattern(pattern)),
        ):
            object.__setattr__(self, attr, value)
        self._validate()

    def _validate(self) -> None:
        where = f"rule {self.pattern!r}"
        for i, part in enumerate(self.parts):
            if not isinstance(part, RulePart):
                raise NamingError(
                    f"{where}: {part!r} is not a transform (Op, Stacked, Split, Concat or Cast)"
                )
            if isinstance(part, Stacked) and not all(
                isinstance(p, Stacked) for p in self.parts[:i]
            ):
                raise NamingError(f"{where}: Stacked must be the first part(s)")
        fields = [s.field for s in self.stacks]
        if len(set(fields)) != len(fields):
            raise NamingError(f"{where}: Stacked parts need distinct fields, got {fields}")
        kinds = [type(p) for p in self.parts]
        for kind in (Split, Concat, Cast):
            if kinds.count(kind) > 1:
                raise NamingError(f"{where}: at most one {kind.__name__}")
        if Split in kinds and Concat in kinds:
            raise NamingError(f"{where}: Split and Concat cannot share a rule")
        if Concat in kinds and kinds[-1] not in (Concat, Cast):
            raise NamingError(f"{where}: Concat must be the last transform")
        split = self.split
        if self.target is None:
            if self.parts:
                raise NamingError(f"{where}: a drop rule (target None) takes no transforms")
            return
        templates = (self.target,) if isinstance(self.target, str) else tuple(self.target)
        if split is None and len(templates) != 1:
            raise NamingError(f"{where}: several targets need a Split")
        if split is not None and (
            len(templates) != len(split.sizes) or any(s <= 0 for s in split.sizes)
        ):
            raise NamingError(
                f"{where}: Split sizes {list(split.sizes)} must be positive, one per target "
                f"({len(templates)} given)"
            )
        concat = self.concat
        if concat is not None and not 0 <= concat.index < concat.count:
            raise NamingError(f"{where}: Concat index {concat.index} outside 0..{concat.count - 1}")
        clash = set(fields) & set(self.regex.groupindex)
        if clash:
            raise NamingError(
                f"{where}: {sorted(clash)} is both a pattern capture and a Stacked field"
            )
        allowed = set(self.regex.groupindex) | set(fields)
        for tpl in templates:
            used = {f for _, f, _, _ in string.Formatter().parse(tpl) if f is not None}
            unknown = used - allowed
            if unknown or "" in used:
                raise NamingError(
                    f"{where}: target {tpl!r} uses {sorted(unknown) or ['{}']}, "
                    f"not captured by the pattern (captures: {sorted(allowed)})"
                )

    @property
    def templates(self) -> tuple[str, ...]:
        if self.target is None:
            return ()
        return (self.target,) if isinstance(self.target, str) else tuple(self.target)

    @property
    def stacks(self) -> tuple[Stacked, ...]:
        return tuple(p for p in self.parts if isinstance(p, Stacked))

    @property
    def split(self) -> Split | None:
        return next((p for p in self.parts if isinstance(p, Split)), None)

    @property
    def concat(self) -> Concat | None:
        return next((p for p in self.parts if isinstance(p, Concat)), None)

    @property
    def cast(self) -> str | None:
        c = next((p for p in self.parts if isinstance(p, Cast)), None)
        return None if c is None else c.dtype

    def op_chains(self) -> list[tuple[Op, ...]]:
        """One chain of ``Op`` per target (a ``Split`` becomes one ``Slice`` per piece)."""
        split = self.split
        if split is None:
            return [tuple(p for p in self.parts if isinstance(p, Op))]
        at = self.parts.index(split)  # a rule has at most one Split (checked at construction)
        before = tuple(p for p in self.parts[:at] if isinstance(p, Op))
        after = tuple(p for p in self.parts[at + 1 :] if isinstance(p, Op))
        chains: list[tuple[Op, ...]] = []
        start = 0
        for size in split.sizes:
            chains.append((*before, Slice(split.axis, start, start + size), *after))
            start += size
        return chains


def drop(pattern: str, *, optional: bool = True) -> Rule:
    """A rule that drops the leaves it matches (optional by default)."""
    return Rule(pattern, None, optional=optional)


_TOKEN = re.compile(r"\{(\w+)(?::([^{}]*))?\}|\*\*|\*")


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """Compile the pattern syntax described in the module docstring into a regex."""
    if not isinstance(pattern, str) or not pattern:
        raise NamingError(f"pattern must be a non-empty string, got {pattern!r}")
    out, pos = [], 0
    for m in _TOKEN.finditer(pattern):
        out.append(re.escape(pattern[pos : m.start()]))
        if m.group(0) == "**":
            out.append(".*")
        elif m.group(0) == "*":
            out.append("[^/]*")
        else:
            out.append(f"(?P<{m.group(1)}>{m.group(2) if m.group(2) is not None else '[^/]+'})")
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    try:
        return re.compile("".join(out))
    except re.error as exc:
        raise NamingError(f"bad pattern {pattern!r}: {exc}") from exc
