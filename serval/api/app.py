"""The FastAPI app: routes, body limits, client disconnects, and the wiring of auth, errors and metrics.

Owns the HTTP edge of a request: read the body (413 beyond the limit), validate it (400 with the parameter
named), hand native values to `serving.Frontend`, and frame the result as JSON or SSE. A client that goes away
cancels its request: the generation is closed, which aborts its engine requests, whose KV blocks the engine
frees at its next step. Everything the app needs comes in through build_app; there is no module state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serval.api import requests as req
from serval.api.auth import APIKeyAuth
from serval.api.body import parse, read_body
from serval.api.chat_options import chat_options
from serval.api.errors import APIError, from_serving, install_error_handlers, shown
from serval.api.lora_routes import ADMIN_PATHS, add_lora_routes, lora_model_card
from serval.api.metrics import CONTENT_TYPE, Metrics, StatusCounter
from serval.api.openai import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from serval.api.responses import chat_completion, text_completion
from serval.api.shutdown import DrainGate
from serval.api.sse import StreamFormat, stream_events, usage_mode
from serval.api.version import model_facts, package_version
from serval.server_config import ServerConfig
from serval.serving.choices import keep_best
from serval.serving.errors import (
    EngineError,
    InvalidRequestError,
    ModelNotFoundError,
    ServerBusyError,
    ShuttingDownError,
)
from serval.serving.frontend import Frontend
from serval.serving.stream import ChoiceDelta, Completion, Event, Usage, fold
from serval.serving.template_roles import accepted_roles

T = TypeVar("T")

# What serving raises for a request it refuses or fails: each has its status (api/errors.py from_serving).
SERVING_ERRORS = (InvalidRequestError, ModelNotFoundError, ServerBusyError, ShuttingDownError, EngineError)
STATUS_CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, the metrics do
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/health",
        "/tokenize",
        "/detokenize",
        "/metrics",
        "/version",
        *ADMIN_PATHS,
    }
)


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (then raise ClientGone)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone
    finally:
        watcher.cancel()
        task.cancel()


def build_app(config: ServerConfig, frontend: Frontend) -> FastAPI:
    app = FastAPI(title="serval", docs_url=None, redoc_url=None, openapi_url=None)
    facts = model_facts(config.model_name, frontend.runner_info, frontend.max_model_len)
    metrics = Metrics(frontend.stats, facts)
    started = int(time.time())
    # What a request may name: the roles the chat template accepts, and token ids (logit_bias) that both the
    # tokenizer can decode and the model's logits hold.
    roles = accepted_roles(frontend.template_source)
    vocab_size = min(frontend.tokenizer.vocab_size, frontend.runner_info.vocab_size)
    install_error_handlers(app)

    def check_model(name: str | None) -> str:
        """The model a request names (the base model's or a loaded LoRA adapter's), or 404."""
        if name is not None and name not in config.served_model_names and name not in frontend.loras:
            raise APIError(404, f"the model {shown(name)} does not exist here", "model", "model_not_found")
        return name or config.model_name

    def lora_of(model: str) -> str | None:
        return None if model in config.served_model_names else model

    async def observed(events: AsyncIterator[Event], arrival: float) -> AsyncIterator[Event]:
        is_first = True
        async with contextlib.aclosing(events):
            async for event in events:
                if is_first and isinstance(event, ChoiceDelta) and event.token_ids:
                    metrics.time_to_first_token.observe(time.monotonic() - arrival)
                    is_first = False
                elif isinstance(event, Usage):
                    metrics.prompt_tokens.inc(event.num_prompt_tokens)
                    metrics.generation_tokens.inc(event.num_completion_tokens)
                    metrics.e2e_latency.observe(time.monotonic() - arrival)
                yield event

    async def respond(
        request: Request,
        events: AsyncIterator[Event],
        fmt: StreamFormat,
        is_stream: bool,
        build: Callable[[Completion], dict[str, Any]],
    ) -> Response:
        try:
            if is_stream:
                # The first event comes before the headers, so a full queue or a refused prompt is still a
                # proper 4xx and not an error inside a 200 stream.
                first = await until_disconnected(request, anext(events))
                return StreamingResponse(
                    stream_events(first, events, fmt), media_type="text/event-stream", headers=SSE_HEADERS
                )
            return JSONResponse(build(await until_disconnected(request, fold(events))))
        except ClientGone:
            # The cancelled task already closed the generation (its engine requests are aborted).
            return Response(status_code=STATUS_CLIENT_GONE)
        except SERVING_ERRORS as e:
            await events.aclose()
            raise from_serving(e) from e

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        chat = parse(ChatCompletionRequest, await read_body(request, config.max_request_body_bytes))
        model = check_model(chat.model)
        req.check_chat_features(chat)
        options = chat_options(chat)
        is_stream = bool(chat.stream)
        params = req.chat_sampling_params(chat, is_stream, vocab_size)
        frontend.check_num_sequences(1, params, "messages")  # before the template and a grammar compile
        messages, continue_final = req.template_messages(chat.messages, chat.continue_final_message, roles)
        prompt, output, num_pinned = await frontend.prepare_chat(
            messages,
            options,
            add_generation_prompt=chat.add_generation_prompt is not False,
            continue_final_message=continue_final,
            template_kwargs=req.with_template_kwargs(chat),
            cache_point=req.cache_point(chat.messages),
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        events = frontend.generate(
            request_id,
            [prompt],
            params,
            params.logprobs is not None,
            config.request_timeout,
            output_plan=output,
            num_pinned_prompt_tokens=num_pinned,
            lora_name=lora_of(model),
        )
        fmt = StreamFormat(
            request_id, created, model, params.n, usage_mode(chat.stream_options), config.full_text_enabled
        )
        return await respond(
            request,
            observed(events, arrival),
            fmt,
            is_stream,
            lambda result: chat_completion(request_id, created, model, keep_best(result, params)),
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        body = parse(CompletionRequest, await read_body(request, config.max_request_body_bytes))
        model = check_model(body.model)
        if body.suffix:
            raise APIError(
                400,
                "suffix: insertion (fill in the middle) is not supported",
                "suffix",
                "unsupported_parameter",
            )
        if body.echo and body.logprobs is not None:
            raise APIError(
                400, "echo with logprobs would need prompt logprobs, which are not computed", "echo"
            )
        is_stream = bool(body.stream)
        params = req.completion_sampling_params(body, is_stream, vocab_size)
        given = req.completion_prompts(body.prompt)
        frontend.check_num_sequences(len(given), params, "prompt")  # before tokenizing thousands of prompts
        for prompt in given:
            if not isinstance(prompt, str):
                frontend.check_token_ids(prompt, "prompt")
        encoded = iter(await frontend.encode_prompts([p for p in given if isinstance(p, str)]))
        prompts = [next(encoded) if isinstance(p, str) else list(p) for p in given]
        echoes = [frontend.decode(p) if not isinstance(p, str) else p for p in given]
        echoes = echoes if body.echo else None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        events = frontend.generate(
            request_id, prompts, params, params.logprobs is not None, config.request_timeout, "prompt",
            lora_name=lora_of(model),
        )  # fmt: skip
        fmt = StreamFormat(
            request_id, created, model, params.n * len(prompts), usage_mode(body.stream_options),
            config.full_text_enabled, is_chat=False, echoes=echoes,
        )  # fmt: skip
        return await respond(
            request,
            observed(events, arrival),
            fmt,
            is_stream,
            lambda result: text_completion(request_id, created, model, keep_best(result, params), echoes),
        )

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        cards = [model_card(name) for name in config.served_model_names]
        cards += [lora_model_card(c, config, started, frontend.max_model_len) for c in frontend.loras.cards()]
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict[str, Any]:
        if lora_of(name) is None:
            return model_card(name)
        card = frontend.loras.get(name)
        if card is None:
            raise APIError(404, f"the model {shown(name)} does not exist here", "model", "model_not_found")
        return lora_model_card(card, config, started, frontend.max_model_len)

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": started,
            "owned_by": "serval",
            "root": config.model_name,
            "parent": None,
            "max_model_len": frontend.max_model_len,
        }

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = parse(TokenizeRequest, await read_body(request, config.max_request_body_bytes))
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            messages, continue_final = req.template_messages(
                body.messages, body.continue_final_message, roles
            )
            tokens = await frontend.tokenize_chat(
                messages,
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
        body = parse(DetokenizeRequest, await read_body(request, config.max_request_body_bytes))
        check_model(body.model)
        try:
            return {"prompt": frontend.decode(body.tokens)}
        except InvalidRequestError as e:
            raise from_serving(e) from e

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    version_body = {"version": package_version(), **facts}

    @app.get("/version")
    async def version() -> dict[str, Any]:
        # As vLLM's /version, plus what /metrics labels serval_model_info with; needs a key as /metrics does.
        return version_body

    add_lora_routes(app, config, frontend)
    app.state.metrics = metrics
    app.state.frontend = frontend
    # Outermost first: count every status (401s included), authenticate, then refuse while shutting down.
    app.add_middleware(DrainGate, drain=frontend.drain)
    app.add_middleware(
        APIKeyAuth, api_keys=config.api_keys, admin_keys=config.admin_api_keys, admin_paths=ADMIN_PATHS
    )
    app.add_middleware(StatusCounter, metrics=metrics, known_paths=ROUTES)
    return app
