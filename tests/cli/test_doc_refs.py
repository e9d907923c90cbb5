"""What the pages name exists: every link between pages resolves (its anchor too), every path
in the repository and every ``weightwire.module.Name`` they name is there, every ``--flag`` a
page gives a ``weightwire`` command is one of that command's options, and every exception class
a user page names is in the tree of ``weightwire/shared/errors.py`` (or is one of the named
outside classes a user may meet). Read from the pages' text alone: fast, nothing run. (Python
blocks run in ``test_doc_blocks.py``; the README's commands parse in ``test_readme.py``.)
"""

from __future__ import annotations

import argparse
import ast
import builtins
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

import weightwire
from weightwire.shared import errors
from weightwire.tools import cli
from weightwire.tools.bench import comm, sync
from weightwire.tools.server.serve_args import build_parser as serve_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The maintainers' pages: their own checks (test_architecture_doc.py, the benchmarks' records).
USER_PAGES = [p for p in PAGES if p.name not in ("architecture.md", "benchmarks.md")]
FENCED = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
COMMANDS = ("serve", "demo", "doctor", "bench")
# Exceptions of the systems weightwire talks to, which a page names for what the user sees.
OUTSIDE_CLASSES = {
    "ActorDiedError": "Ray",
    "EngineDeadError": "vLLM",
    "ConnectError": "httpx",
    "ReadTimeout": "httpx",
    "RemoteProtocolError": "httpx",
    "ServiceUnavailableError": "httpx's caller (a 503)",
}
ERROR_LIKE = re.compile(
    r"\b([A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)*"
    r"(?:Error|Timeout|Refused|Failed|Mismatch|Unloaded|NotReady|Unavailable|Broken|Lost|"
    r"Aborted|Unknown|Refusal))\b"
)


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _prose(text: str) -> str:
    """``text`` without its fenced blocks (their ``# comment`` is no heading, ``](`` no link)."""
    return FENCED.sub(lambda m: "\n" * m[0].count("\n"), text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


@cache
def _anchors(page: Path) -> frozenset[str]:
    text = page.read_text()
    found: set[str] = set()
    seen: dict[str, int] = {}
    for m in HEADING.finditer(_prose(text)):
        slug = _slug(m[1])
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    found.update(re.findall(r'<a (?:name|id)="([^"]+)"', text))
    return frozenset(found)


def test_the_slug_is_githubs() -> None:
    assert _slug("12. LoRA adapter rounds") == "12-lora-adapter-rounds"
    assert _slug("vLLM 0.33's `nccl_m2n`") == "vllm-033s-nccl_m2n"
    assert _slug("Rounds over the stage budget") == "rounds-over-the-stage-budget"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_link_between_pages_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            broken.append(f"{target}: no heading there has the anchor #{anchor}")
    assert broken == [], f"{_rel(page)}: {broken}"


def _parsers() -> dict[str, argparse.ArgumentParser]:
    subs = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {
        "serve": serve_parser(),
        "demo": subs.choices["demo"],
        "doctor": subs.choices["doctor"],
        "bench": comm.build_parser(),
        "bench --sync": sync.build_parser(),
    }


def _is_the_program(word: str) -> bool:
    """``weightwire`` or ``.venv/bin/weightwire``, not ``weightwire[jax]`` (a pip extra)."""
    return word.endswith("weightwire") and "[" not in word


def _commands(text: str) -> list[list[str]]:
    """Each ``weightwire COMMAND ...`` a page gives: the shell lines of its fenced blocks, and its
    inline code spans (``weightwire serve --x`` or ``serve --x``), as words from COMMAND on."""
    lines = []
    for lang, body in FENCED.findall(text):
        if lang in ("", "bash", "sh", "shell", "console"):
            lines += [ln.split(" #", 1)[0] for ln in body.replace("\\\n", " ").splitlines()]
    lines += re.findall(r"`([^`\n]+)`", _prose(text))
    found = []
    for line in lines:
        for part in re.split(r"&&|\|\||[|;&]", line):
            try:
                words = shlex.split(part)
            except ValueError:
                continue
            at = next(
                (
                    i
                    for i, w in enumerate(words)
                    if w in COMMANDS
                    and (
                        i == 0 or (words[i - 1].endswith("weightwire") and "[" not in words[i - 1])
                    )
                ),
                None,
            )
            if at is not None:
                found.append(words[at:])
    return found


def test_every_flag_a_page_gives_a_command_is_one_of_its_options() -> None:
    parsers = _parsers()
    unknown, seen = [], 0
    for page in PAGES:
        for words in _commands(page.read_text()):
            command = "bench --sync" if words[:2] == ["bench", "--sync"] else words[0]
            options = parsers[command]._option_string_actions
            for word in words[1:]:
                flag = word.lstrip("[").split("=", 1)[0].rstrip("]),.")
                if not re.fullmatch(r"--[a-z][a-z0-9-]*", flag) or flag == "--sync":
                    continue
                seen += 1
                if flag not in options:
                    unknown.append(f"{_rel(page)}: weightwire {command} {flag}")
    assert seen >= 20  # the pages' commands were read (about 50 flags today)
    assert unknown == [], unknown


def _documented_classes() -> set[str]:
    block = (errors.__doc__ or "").split("::\n\n", 1)[1].split("\n\n", 1)[0]
    return {line.split()[0] for line in block.splitlines()}


@pytest.mark.parametrize("page", USER_PAGES, ids=_rel)
def test_every_exception_a_page_names_exists(page: Path) -> None:
    known = _documented_classes() | set(OUTSIDE_CLASSES)
    builtin = {n for n, v in vars(builtins).items() if isinstance(v, type)}
    named = set(ERROR_LIKE.findall(page.read_text()))
    assert sorted(named - known - builtin) == [], (
        f"{_rel(page)} names exception classes that do not exist (the tree: "
        "weightwire/shared/errors.py's docstring)"
    )


REPO_PATH = re.compile(
    r"`((?:weightwire|docs|benchmarks|tests|examples|\.ci)/[\w./-]*?)(?:::\w+)?`"
)
PROTOCOL_LABEL = re.compile(r"weightwire/[\w/]+/v\d+")  # a handshake's label, no file


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_repository_path_a_page_names_exists(page: Path) -> None:
    named = {p.rstrip("/.") for p in REPO_PATH.findall(page.read_text())}
    gone = sorted(p for p in named if not PROTOCOL_LABEL.fullmatch(p) and not (ROOT / p).exists())
    assert gone == [], f"{_rel(page)} names paths that do not exist: {gone}"


DOTTED = re.compile(r"`(weightwire(?:\.\w+)+)")


def _top_level_names(source: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _names_a_real_thing(dotted: str) -> bool:
    """``weightwire.a.b.C`` is module ``weightwire/a/b`` defining ``C`` (read, not imported:
    a module may need vLLM or a GPU); ``weightwire.X`` is a name ``weightwire`` exports."""
    parts = dotted.split(".")
    if len(parts) == 2 and hasattr(weightwire, parts[1]):
        return True
    for cut in range(len(parts), 1, -1):
        base = ROOT.joinpath(*parts[:cut])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.exists():
            rest = parts[cut:]
            return not rest or (len(rest) <= 2 and rest[0] in _top_level_names(module))
    return False


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_dotted_weightwire_name_a_page_gives_exists(page: Path) -> None:
    gone = sorted({d for d in DOTTED.findall(page.read_text()) if not _names_a_real_thing(d)})
    assert gone == [], f"{_rel(page)} names modules or objects that do not exist: {gone}"
