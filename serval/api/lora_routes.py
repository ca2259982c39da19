"""Run-time LoRA adapters over HTTP: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes,
bodies and answers), and the /v1/models card of an adapter.

Owns those bodies and answers. Who may call the routes is auth.py's (ADMIN_PATHS: an admin key once any key
is configured); where a load may read (only under --lora-root) and the adapter files are checked below
`serving`, and every refusal comes back in the OpenAI error shape: 400 for a bad body, a path outside the root
or a bad adapter, 404 for an unknown name, 409 when every slot is taken or the adapter is still in use. No
answer names an adapter's path on the server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from serval.api.body import parse, read_body
from serval.api.errors import APIError
from serval.api.openai import Schema
from serval.server_config import ServerConfig
from serval.serving.frontend import Frontend

if TYPE_CHECKING:
    from serval.engine.lora import LoraCard

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
ADMIN_PATHS = frozenset({LOAD_PATH, UNLOAD_PATH})

NonEmpty = Annotated[str, Field(min_length=1)]


class LoadLoraAdapterRequest(Schema):
    lora_name: NonEmpty
    lora_path: NonEmpty  # a PEFT directory under the server's --lora-root (absolute, or relative to it)
    base_model_name: str | None = None  # the `parent` /v1/models reports; default: the served model


class UnloadLoraAdapterRequest(Schema):
    lora_name: NonEmpty
    lora_int_id: int | None = None  # vLLM's clients may send it; names alone identify adapters here


def lora_model_card(card: LoraCard, config: ServerConfig, created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "id": card.name,
        "object": "model",
        "created": created,
        "owned_by": "serval",
        # NOTE: vLLM puts the adapter's path here; a client has no use for it and it tells how the server's
        # disk is laid out, so the root of an adapter is its own name.
        "root": card.name,
        "parent": card.base_model_name or config.model_name,
        "max_model_len": max_model_len,
    }


def add_lora_routes(app: FastAPI, config: ServerConfig, frontend: Frontend) -> None:
    @app.post(LOAD_PATH)
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = parse(LoadLoraAdapterRequest, await read_body(request, config.max_request_body_bytes))
        if body.lora_name in config.served_model_names:
            raise APIError(400, f"{body.lora_name!r} is the base model's name", "lora_name", "invalid_value")
        await frontend.loras.load_from_root(
            config.lora_root, body.lora_name, body.lora_path, body.base_model_name
        )
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post(UNLOAD_PATH)
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = parse(UnloadLoraAdapterRequest, await read_body(request, config.max_request_body_bytes))
        await frontend.loras.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
