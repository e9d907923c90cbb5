"""The README stays true: its Quick start runs exactly as written after the set-up command, its
commands parse, the extras it names exist, the paths it points to exist, and its set-up section
has exactly two commands."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx

from tests.ranks import free_port
from weightwire.tools import cli
from weightwire.tools.bench import comm
from weightwire.tools.demo.server import ReadyLine
from weightwire.tools.server.serve_args import build_parser as serve_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
RUN_MARK = "<!-- tests/cli/test_readme.py runs this block against a reference server -->"


def _blocks(lang: str, text: str = README) -> list[str]:
    return [body for kind, body in BLOCK.findall(text) if kind == lang]


def _section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def test_set_up_has_exactly_two_commands_and_their_extras_exist() -> None:
    commands = _blocks("bash", _section("Set up (two commands)"))
    assert len(commands) == 2 and all(len(c.strip().splitlines()) == 1 for c in commands), commands
    assert commands[0].strip().endswith(".venv/bin/weightwire demo")
    assert commands[1].strip().endswith(".venv/bin/python -m pytest -q -n 3")
    ci = (ROOT / ".ci" / "run").read_text()
    assert '"$PY" -m pytest -q -n 3\n' in ci, "CI runs the README's test command"
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    named = {
        e
        for group in re.findall(r"weightwire\[([a-z0-9,]+)\]|\.\[([a-z0-9,]+)\]", README)
        for part in group
        if part
        for e in part.split(",")
    }
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
                if (
                    words
                    and words[0].endswith("weightwire")
                    and not words[0].startswith("weightwire[")
                ):
                    lines.append(words[1:])
    assert len(lines) >= 4, lines  # demo (set-up), serve, doctor, demo --server
    for argv in lines:
        _parse(argv)


def test_paths_and_links_in_the_readme_exist() -> None:
    links = re.findall(r"\]\(([^)#]+)\)", README)
    paths = [
        p
        for p in re.findall(r"`([\w./-]+)`", README)
        if p.startswith(("weightwire/", "docs/", "benchmarks/", "tests/", "examples/", ".ci/"))
        or p == "LICENSE"
    ]
    assert "docs/configuration.md" in links and len(paths) > 10
    missing = [p for p in [*links, *paths] if not (ROOT / p).exists()]
    assert missing == []


def _set_up_venv(where: Path) -> None:
    """``where/.venv/bin/{python,weightwire}`` as the set-up command leaves them: this interpreter
    and this checkout (no re-install: the test runs the commands, not pip)."""
    bin_dir = where / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, command in (
        ("python", f'exec {shlex.quote(sys.executable)} "$@"'),
        ("weightwire", f'exec {shlex.quote(sys.executable)} -m weightwire "$@"'),
    ):
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\n{command}\n")
        script.chmod(0o755)


def test_the_quick_start_runs_as_written_after_the_set_up_command(tmp_path: Path) -> None:
    # The Quick start's own lines, in order, from the directory the set-up command ran in: its bash
    # line starts the server, its Python block is saved as trainer.py and run with the line the text
    # names. Only the port differs (a free one instead of 8000: tests run side by side).
    section = _section("Quick start: JAX trainer → vLLM")
    serve_line = _blocks("bash", section)[0].strip()
    assert serve_line.startswith(".venv/bin/weightwire serve --model tiny-llama --port 8000"), (
        serve_line
    )
    marked = section.split(RUN_MARK, 1)
    assert len(marked) == 2, "the runnable block lost its marker"
    code = _blocks("python", marked[1])[0]
    run_line = re.search(r"save it as `trainer\.py` and run `([^`]+)`", " ".join(section.split()))
    assert run_line is not None and run_line[1] == ".venv/bin/python trainer.py", (
        "the Quick start says how to run it"
    )
    assert 'url = "http://127.0.0.1:8000"' in code
    _set_up_venv(tmp_path)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = tmp_path / "server.log"
    with log.open(
        "w"
    ) as err:  # a file, not a pipe nobody reads: the server never blocks on its log
        server = subprocess.Popen(
            ["/bin/sh", "-c", "exec " + serve_line.replace("--port 8000", f"--port {port}")],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
    try:
        ready = ReadyLine(server)
        assert ready.wait(300) and ready.url == f"http://127.0.0.1:{port}", (
            "\n".join(ready.lines) + log.read_text()
        )
        url = ready.url
        before = httpx.post(f"{url}/weight_checker", json={"action": "checksum"}).json()[
            "checksums"
        ]
        (tmp_path / "trainer.py").write_text(
            code.replace('"http://127.0.0.1:8000"', repr(url))
            + '\nimport sys\nassert "torch" not in sys.modules, "the trainer imported torch"\n'
        )
        done = subprocess.run(
            ["/bin/sh", "-c", run_line[1]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        printed = done.stdout.strip().splitlines()
        assert [line.split(":")[0] for line in printed] == ["step 0", "step 1", "step 2"], printed
        after = httpx.post(f"{url}/weight_checker", json={"action": "checksum"}).json()["checksums"]
        assert after.keys() == before.keys() and after != before
        assert httpx.get(f"{url}/weight_info").json()["weight_version"] is not None
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
