"""``POST /v1/load_lora_adapter`` on the reference server (with ``--enable-lora``).

vLLM's route and body (``{"lora_name": ..., "lora_path": ...}``): every replica loads the
PEFT directory (``tools.server.lora``), then completions may name the adapter as their
``model`` and adapter rounds may replace it. A replica that cannot take the adapter (rank
over ``--max-lora-rank``, a module the model has no linear for) answers 400 with why; a
server started without ``--enable-lora`` has no such route (404), as vLLM.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from weightwire.shared.errors import ConfigError
from weightwire.shared.lora import check_adapter_name
from weightwire.tools.server.replicas import FanOutError
from weightwire.tools.server.state import ServerState
from weightwire.tools.server.web import ApiError, read_json

LOAD_PATH = "/v1/load_lora_adapter"


def install_lora_routes(app: FastAPI, state: ServerState) -> None:
    """Add the adapter route when the server serves adapters."""
    if not state.options.max_lora_rank:
        return

    @app.post(LOAD_PATH)
    async def load_lora_adapter(request: Request) -> Any:
        body = await read_json(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        try:
            check_adapter_name(name)
        except ConfigError as exc:
            raise ApiError(400, str(exc), param="lora_name") from None
        if not isinstance(path, str) or not path:
            raise ApiError(400, "lora_path must be a directory path", param="lora_path")
        if name == state.options.model_name:
            raise ApiError(400, f"{name!r} is the base model's name", param="lora_name")
        try:
            await state.pool.fan_out(
                "load_lora", {"name": name, "path": path}, timeout=state.options.op_timeout_s
            )
        except FanOutError as exc:
            raise ApiError(400, f"adapter {name!r} not loaded: {exc}") from None
        state.adapters[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."
