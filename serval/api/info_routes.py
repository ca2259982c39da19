"""The routes around generation: /v1/models, /health, /tokenize, /detokenize, /metrics and /version.

Owns their bodies: a model card per served name and loaded LoRA adapter, token counts for a prompt or chat,
text for token ids, the Prometheus text, and the package and model facts.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from serval.api import chat_messages
from serval.api.body import parse
from serval.api.context import ServerContext
from serval.api.errors import APIError, shown
from serval.api.lora_routes import lora_model_card
from serval.api.media_parts import chat_media_parts
from serval.api.metrics import CONTENT_TYPE
from serval.api.openai import DetokenizeRequest, TokenizeRequest
from serval.api.version import package_version


def add_info_routes(app: FastAPI, ctx: ServerContext) -> None:
    _add_model_routes(app, ctx)
    _add_token_routes(app, ctx)
    frontend = ctx.frontend

    @app.get("/health")
    async def health() -> Response:
        # One engine: {"status": "ok"}. Replicas (serval/cluster/): each live one listed, "degraded" while
        # some are down (still 200: the others answer), 503 "unavailable" while none is up.
        report = frontend.health()
        status_code = 503 if report["status"] == "unavailable" else 200
        return JSONResponse(report, status_code=status_code)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    version_body = {"version": package_version(), **ctx.facts}

    @app.get("/version")
    async def version() -> dict[str, Any]:
        # As vLLM's /version, plus what /metrics labels serval_model_info with; needs a key as /metrics does.
        return version_body


def _add_model_routes(app: FastAPI, ctx: ServerContext) -> None:
    """/v1/models and /v1/models/{name}: the served names, then the LoRA adapters."""
    config, frontend = ctx.config, ctx.frontend

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": ctx.started,
            "owned_by": "serval",
            "root": config.model_name,
            "parent": None,
            "max_model_len": frontend.max_model_len,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        cards = [model_card(name) for name in config.served_model_names]
        cards += [
            lora_model_card(c, config, ctx.started, frontend.max_model_len) for c in frontend.loras.cards()
        ]
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict[str, Any]:
        if ctx.lora_of(name) is None:
            return model_card(name)
        card = frontend.loras.get(name)
        if card is None:
            raise APIError(404, f"the model {shown(name)} does not exist here", "model", "model_not_found")
        return lora_model_card(card, config, ctx.started, frontend.max_model_len)


def _add_token_routes(app: FastAPI, ctx: ServerContext) -> None:
    """/tokenize (a prompt or chat messages, media runs counted) and /detokenize, as vLLM's."""
    frontend = ctx.frontend

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = parse(TokenizeRequest, await ctx.body(request))
        model = ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            messages, continue_final = chat_messages.template_messages(
                body.messages, body.continue_final_message, ctx.roles
            )
            media = chat_media_parts(body.messages, frontend.media.config)
            frontend.check_media(media, model)
            tokens = await frontend.tokenize_chat(
                messages,
                media,
                add_generation_prompt=body.add_generation_prompt is not False,
                continue_final_message=continue_final,
                template_kwargs=body.chat_template_kwargs,
            )
        else:
            [tokens] = await frontend.encode_prompts(
                [body.prompt or ""], body.add_special_tokens is not False
            )
        return {"count": len(tokens), "max_model_len": frontend.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = parse(DetokenizeRequest, await ctx.body(request))
        ctx.check_model(body.model)
        return {"prompt": frontend.decode(body.tokens)}
