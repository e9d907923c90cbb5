"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` on the reference server
(with ``--enable-lora``).

vLLM's routes and bodies (``{"lora_name": ..., "lora_path": ...}``, ``{"lora_name": ...}``):
every replica loads the PEFT directory (``tools.server.lora``), then completions may name the
adapter as their ``model`` and adapter rounds may replace it. A replica that cannot take the
adapter (rank over ``--max-lora-rank``, a module the model has no linear for) answers 400
with why. Unloading drops the adapter from every replica (loaded by the route or replaced by
rounds since, it is the same adapter): 400 without a name, 404 naming an adapter not served,
as vLLM; and, a rule vLLM lacks, 409 while the open round writes that adapter (its finish
swaps it in). A server started without ``--enable-lora`` has neither route (404), as vLLM
without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``.
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
UNLOAD_PATH = "/v1/unload_lora_adapter"


def install_lora_routes(app: FastAPI, state: ServerState) -> None:
    """Add the adapter routes when the server serves adapters."""
    if not state.options.max_lora_rank:
        return

    @app.post(LOAD_PATH)
    async def load_lora_adapter(request: Request) -> Any:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object with lora_name and lora_path")
        path = body.get("lora_path")
        try:
            name = check_adapter_name(body.get("lora_name"))
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

    @app.post(UNLOAD_PATH)
    async def unload_lora_adapter(request: Request) -> Any:
        body = await read_json(request)
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not name:
            raise ApiError(
                400, "'lora_name' needs to be provided to unload a LoRA adapter", param="lora_name"
            )
        if not isinstance(name, str) or name not in state.adapters:
            raise ApiError(
                404,
                f"the LoRA adapter {name!r:.80} cannot be found: it is not loaded on this server "
                "(GET /v1/models lists the adapters it serves)",
                param="lora_name",
            )
        if state.writing_adapter(name):
            raise ApiError(
                409,
                f"adapter {name!r} not unloaded: {state.session.active_round()} writes it (its "
                "finish swaps it in); finish the round (POST /finish_weight_update) or let it "
                "fail first",
                param="lora_name",
            )
        # Not served from here on (completions naming it: 404), before the replicas drop it.
        del state.adapters[name]
        try:
            await state.pool.fan_out(
                "unload_lora", {"name": name}, timeout=state.options.op_timeout_s
            )
        except FanOutError as exc:
            raise ApiError(500, f"adapter {name!r} not unloaded everywhere: {exc}") from None
        return f"Success: LoRA adapter '{name}' removed successfully."
