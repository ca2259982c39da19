"""POST /v1/chat/completions and /v1/completions: parse, hand to serving, frame the answer.

Owns the HTTP side of a generation and nothing else: the body parsed and checked into native values (400 with
the parameter named), the serving request built by `serving.Frontend` (which prepares, runs it and selects the
best of best_of), and the result framed as one JSON body or as SSE chunks (api/sse.py). A client that goes
away cancels its request: the event stream is closed, which aborts its engine requests, whose KV blocks the
engine frees at its next step. A ServingError is left to the app's one handler (api/errors.py); only a stream
whose headers are out reports one in-band.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serval.api import chat_messages
from serval.api import requests as req
from serval.api.body import parse
from serval.api.chat_options import chat_options
from serval.api.context import ServerContext
from serval.api.errors import APIError
from serval.api.media_parts import chat_media_parts
from serval.api.metrics import RequestObserver
from serval.api.openai import ChatCompletionRequest, CompletionRequest
from serval.api.responses import chat_completion, text_completion
from serval.api.sse import StreamFormat, stream_events, usage_mode
from serval.sampling import SamplingParams
from serval.serving.chat import ChatOptions, ChatPrompt
from serval.serving.generation import GenerationRequest
from serval.serving.stream import Completion

T = TypeVar("T")
# A stream's framing: (first event, the rest, on_close=) -> SSE text.
Frame = Callable[..., AsyncIterator[str]]

STATUS_CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, the metrics do
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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


async def respond(
    ctx: ServerContext,
    request: Request,
    generation: GenerationRequest,
    observer: RequestObserver,
    fmt: StreamFormat | Frame,
    is_stream: bool,
    build: Callable[[Completion], dict[str, Any]],
) -> Response:
    """The generation's answer: `build(result)` as JSON, or a stream framed by `fmt` (chat and completions'
    chunks, or a route's own Frame: first event, the rest, on_close -> SSE text)."""
    frontend, timeout = ctx.frontend, ctx.config.request_timeout
    try:
        if not is_stream:
            result = frontend.result(generation, timeout, observer)
            try:
                return JSONResponse(build(await until_disconnected(request, result)))
            except ClientGone:
                observer.abandon()
                raise
        events = frontend.events(generation, timeout, observer)
        try:
            # The first event comes before the headers, so a full queue or a refused prompt is still a
            # proper 4xx and not an error inside a 200 stream.
            first = await until_disconnected(request, anext(events))
        except ClientGone:
            observer.abandon()
            raise  # NOTE: no aclose: the cancelled task may still be inside the generator; it closes it
        except Exception:
            await events.aclose()
            raise
        frame = fmt if callable(fmt) else partial(stream_events, fmt=fmt)
        return StreamingResponse(
            frame(first, events, on_close=observer.abandon),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    except ClientGone:
        # The cancelled task already closed the generation (its engine requests are aborted).
        return Response(status_code=STATUS_CLIENT_GONE)


def chat_parts(
    ctx: ServerContext, chat: ChatCompletionRequest, model: str
) -> tuple[ChatPrompt, ChatOptions, SamplingParams]:
    """A parsed chat request (the model checked) as native values: every check of the chat route, in its
    order. The Responses and Messages routes translate their requests into a chat request and come through
    here, so the three cannot drift apart."""
    frontend = ctx.frontend
    ctx.check_generates()
    req.check_chat_features(chat)
    options = chat_options(chat)
    params = req.chat_sampling_params(chat, bool(chat.stream), ctx.vocab_size)
    frontend.check_num_sequences(1, params, "messages")  # before the messages' checks, as ever
    messages, continue_final = chat_messages.template_messages(
        chat.messages, chat.continue_final_message, ctx.roles
    )
    # Every media part parsed and checked first; a model that cannot read one refuses it before any fetch.
    media = chat_media_parts(chat.messages, frontend.media.config, bool(chat.vl_high_resolution_images))
    frontend.check_media(media, model)
    prompt = ChatPrompt(
        messages,
        add_generation_prompt=chat.add_generation_prompt is not False,
        continue_final_message=continue_final,
        template_kwargs=req.with_template_kwargs(chat),
        cache_spans=chat_messages.cache_spans(chat.messages),
        media=media,
    )
    return prompt, options, params


async def chat_generation(
    ctx: ServerContext, chat: ChatCompletionRequest, model: str, request_id: str
) -> GenerationRequest:
    """chat_parts, rendered and planned by serving: the GenerationRequest to run."""
    prompt, options, params = chat_parts(ctx, chat, model)
    return await ctx.frontend.chat_request(request_id, prompt, options, params, ctx.lora_of(model))


def add_generation_routes(app: FastAPI, ctx: ServerContext) -> None:
    config, frontend = ctx.config, ctx.frontend

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        observer = RequestObserver(ctx.metrics)
        chat = parse(ChatCompletionRequest, await ctx.body(request))
        model = ctx.check_model(chat.model)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        generation = await chat_generation(ctx, chat, model, request_id)
        fmt = StreamFormat(
            request_id, created, model, generation.num_choices, usage_mode(chat.stream_options),
            config.full_text_enabled,
        )  # fmt: skip
        return await respond(
            ctx, request, generation, observer, fmt, bool(chat.stream),
            lambda result: chat_completion(request_id, created, model, result),
        )  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        observer = RequestObserver(ctx.metrics)
        body = parse(CompletionRequest, await ctx.body(request))
        model = ctx.check_model(body.model)
        ctx.check_generates()
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
        params = req.completion_sampling_params(body, is_stream, ctx.vocab_size)
        prompts = req.completion_prompts(body.prompt)
        frontend.check_num_sequences(len(prompts), params, "prompt")  # before tokenizing thousands of prompts
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        generation = await frontend.completion_request(
            request_id, prompts, params, ctx.lora_of(model), echo=bool(body.echo)
        )
        echoes = generation.echoes
        fmt = StreamFormat(
            request_id, created, model, generation.num_choices, usage_mode(body.stream_options),
            config.full_text_enabled, is_chat=False, echoes=echoes,
        )  # fmt: skip
        return await respond(
            ctx, request, generation, observer, fmt, is_stream,
            lambda result: text_completion(request_id, created, model, result, echoes),
        )  # fmt: skip
