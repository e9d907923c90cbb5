"""docs/gpu-vllm.md stays followable: its steps are in order, the extras and files it names
exist, its `weightwire` commands parse, the vLLM it installs is the one the serve step runs
and the compatibility page covers, the NCCL pin reads the vLLM venv's NCCL package, and
the README links to it. (The page itself needs a GPU and vLLM; the GPU lane runs its example.)"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

from tests.cli.test_readme import _parse

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "gpu-vllm.md").read_text()
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def _commands() -> list[list[str]]:
    lines = []
    for block in BLOCK.findall(PAGE):
        for line in block.replace("\\\n", " ").splitlines():
            code = line.split(" # ", 1)[0].strip()
            for part in code.split("&&"):
                words = shlex.split(part)
                while words and "=" in words[0] and not words[0].startswith("-"):
                    words = words[1:]  # VAR=value prefixes
                if words:
                    lines.append(words)
    return lines


def test_the_steps_are_numbered_in_order() -> None:
    steps = [int(n) for n in re.findall(r"^## (\d+)\. ", PAGE, re.M)]
    assert steps == list(range(1, 8)), steps


def test_extras_files_and_weightwire_commands_exist() -> None:
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    named = {e for group in re.findall(r'"\.\[([a-z0-9,]+)\]"', PAGE) for e in group.split(",")}
    assert {"jax", "cuda12"} <= named <= extras
    commands = _commands()
    ours = [c[1:] for c in commands if c[0].endswith("bin/weightwire")]
    assert [c[0] for c in ours] == ["doctor"]
    for argv in ours:
        _parse(argv)
    example = next(c for c in commands if any(w.startswith("examples/") for w in c))
    script = next(w for w in example if w.startswith("examples/"))
    assert (ROOT / script).exists() and {"--server", "--model-dir"} <= set(example)
    links = re.findall(r"\]\(([\w./-]+\.md)", PAGE)
    assert links and all((ROOT / "docs" / link).exists() for link in links)


def test_one_vllm_version_and_its_nccl_pinned_on_the_trainer() -> None:
    commands = _commands()
    pinned = {w.split("==")[1] for c in commands for w in c if w.startswith("vllm==")}
    assert pinned == {"0.33.0"}
    assert any(c[:2] == ["vllm-venv/bin/vllm", "serve"] for c in commands)
    assert "0.33" in (ROOT / "docs" / "vllm-compat.md").read_text()
    # The trainer's NCCL wheel is pinned to the version read from the vLLM venv.
    assert "vllm-venv/bin/pip show nvidia-nccl-cu12" in PAGE
    assert any("nvidia-nccl-cu12==$NCCL" in " ".join(c) for c in commands)


def test_the_readme_links_the_page_from_its_gpu_section() -> None:
    readme = (ROOT / "README.md").read_text()
    gpu = readme[readme.index("### The GPU path") :]
    assert "(docs/gpu-vllm.md)" in gpu[: gpu.index("```")]
