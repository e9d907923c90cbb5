"""The README stays true: its CPU code block runs, its commands parse, the extras it names
exist, the paths it points to exist, and its set-up section has exactly two commands."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import httpx

from weightwire import cli
from weightwire.bench import comm
from weightwire.torch_side.server import build_parser as serve_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
RUN_MARK = "<!-- tests/cli/test_readme.py runs this block against a reference server -->"


def _blocks(lang: str, text: str = README) -> list[str]:
    return [body for kind, body in BLOCK.findall(text) if kind == lang]


def _section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def test_set_up_has_exactly_two_commands_and_their_extras_exist() -> None:
    commands = _blocks("bash", _section("Set up (two commands)"))
    assert len(commands) == 2 and all(len(c.strip().splitlines()) == 1 for c in commands), commands
    assert commands[0].strip().endswith(".venv/bin/weightwire demo")
    assert commands[1].strip().endswith(".venv/bin/python -m pytest -q")
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {e for group in re.findall(r"weightwire\[([a-z0-9,]+)\]|\.\[([a-z0-9,]+)\]", README)
             for part in group if part for e in part.split(",")}
    named |= set(re.findall(r"`\[(cuda\d+)\]`", README))
    assert {"jax", "torch", "test", "cuda12", "cuda13"} <= named
    assert named <= extras, f"README names extras pyproject lacks: {sorted(named - extras)}"


def _parse(argv: list[str]) -> None:
    """Parse a README ``weightwire ...`` line with the parser that would read it (runs nothing)."""
    if argv[0] == "serve":
        serve_parser().parse_args(argv[1:])
    elif argv[0] == "bench":
        comm.build_parser().parse_args(argv[1:])
    else:
        cli.build_parser().parse_args(argv)


def test_every_weightwire_command_in_the_readme_parses() -> None:
    lines = []
    for block in _blocks("bash"):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            code = line.split("#", 1)[0].strip()
            for part in code.split("&&"):
                words = shlex.split(part)
                while words and "=" in words[0]:  # VAR=value prefixes
                    words = words[1:]
                if words and words[0].endswith("weightwire") and not words[0].startswith("weightwire["):
                    lines.append(words[1:])
    assert len(lines) >= 4, lines  # demo (set-up), serve, doctor, demo --server
    for argv in lines:
        _parse(argv)


def test_paths_and_links_in_the_readme_exist() -> None:
    links = re.findall(r"\]\(([^)#]+)\)", README)
    paths = [p for p in re.findall(r"`([\w./-]+)`", README)
             if p.startswith(("weightwire/", "docs/", "benchmarks/", "tests/", "examples/", ".ci/")) or p == "LICENSE"]
    assert "docs/configuration.md" in links and len(paths) > 10
    missing = [p for p in [*links, *paths] if not (ROOT / p).exists()]
    assert missing == []


def test_the_quick_start_block_runs_on_cpu_without_torch(launch_server: Any) -> None:
    marked = README.split(RUN_MARK, 1)
    assert len(marked) == 2, "the runnable block lost its marker"
    code = _blocks("python", marked[1])[0]
    assert 'url = "http://127.0.0.1:8000"' in code
    assert "weightwire serve --model tiny-llama --port 8000" in README  # the server the block talks to
    url = launch_server("tiny-llama").wait_ready()
    before = httpx.post(f"{url}/weight_checker", json={"action": "checksum"}).json()["checksums"]
    script = code.replace('"http://127.0.0.1:8000"', repr(url))
    script += '\nimport sys\nassert "torch" not in sys.modules, "the README trainer imported torch"\n'
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    printed = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in printed] == ["step 0", "step 1", "step 2"], printed
    after = httpx.post(f"{url}/weight_checker", json={"action": "checksum"}).json()["checksums"]
    assert after.keys() == before.keys() and after != before
    assert httpx.get(f"{url}/weight_info").json()["weight_version"] is not None
