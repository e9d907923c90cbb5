"""A model directory's cheap checks, before any worker starts (no torch, no transformers).

A broken directory would otherwise surface as a worker's traceback from deep inside
transformers or safetensors. Read here: ``config.json`` (valid JSON, an object, naming
an architecture) and every ``*.safetensors`` header (its length, its JSON, every
tensor's byte range inside the file). What needs the model's code (a config whose
shapes disagree with the weights, an architecture transformers does not know) is left
to the worker, which reports it in one line (``shape_mismatch``: the worker's
explanation when the weights do not fit the architecture the config describes).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

MAX_HEADER_BYTES = 100 << 20
"""safetensors' own cap on a header (its Rust reader refuses larger ones)."""


def model_dir_problem(path: Path, shown: str) -> str | None:
    """One line naming what is wrong with the model directory ``path`` (``shown`` is how
    the user wrote it), or ``None``."""
    problem = _config_problem(path / "config.json")
    if problem is not None:
        return f"--model {shown!r}: config.json {problem}"
    for file in sorted(path.glob("*.safetensors")):
        problem = _safetensors_problem(file)
        if problem is not None:
            return f"--model {shown!r}: {file.name} is damaged: {problem}"
    return None


def _config_problem(file: Path) -> str | None:
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot be read ({type(exc).__name__})"
    if not text.strip():
        return "is empty"
    try:
        config: Any = json.loads(text)
    except ValueError as exc:
        return f"is not valid JSON ({exc})"
    if not isinstance(config, dict):
        return f"is a JSON {type(config).__name__}, not an object"
    if not isinstance(config.get("model_type"), str) and not isinstance(
        config.get("architectures"), list
    ):
        return "names no architecture (neither 'model_type' nor 'architectures')"
    return None


def shape_mismatch(model_dir: str) -> str | None:
    """Where the weights disagree with the shapes ``config.json`` implies (built on the meta
    device: no memory), as one line; ``None`` if they agree. Worker side: imports torch."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    expected = {name: list(t.shape) for name, t in model.state_dict().items()}
    stored: dict[str, Any] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        stored |= {
            name: entry.get("shape")
            for name, entry in _header(file).items()
            if name != "__metadata__" and isinstance(entry, dict)
        }
    differ = [name for name in stored if name in expected and stored[name] != expected[name]]
    if not differ:
        return None
    first = differ[0]
    return (
        f"config.json does not describe these weights: {first} is {stored[first]} in the "
        f"safetensors but {expected[first]} by config.json ({len(differ)} tensor(s) differ; is "
        "config.json from another model?)"
    )


def _header(file: Path) -> dict[str, Any]:
    with file.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(min(n, MAX_HEADER_BYTES)))
    return header if isinstance(header, dict) else {}


def _safetensors_problem(file: Path) -> str | None:
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than the 8-byte header length"
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            return (
                f"its header claims {n} bytes, over the {MAX_HEADER_BYTES >> 20} MiB a header "
                "may have"
            )
        if 8 + n > size:
            return f"its header claims {n} bytes but the file has {size} (truncated?)"
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return "its header is not valid JSON"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    data = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data
        ):
            return (
                f"tensor {str(name)[:80]!r} lies outside the file's {data} data bytes (truncated?)"
            )
    return None
