"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat pipeline.

Owns the routes: the body parsed (agent_schemas.py), translated into a chat request (anthropic_request.py),
served by the chat route's own path (generation_routes.chat_parts, chat_generation, respond) and framed as
a message or its event stream (anthropic_stream.py). Errors on these paths are answered in Anthropic's
shape (errors.error_payload decides by path; auth.py and cors.py too), and `x-api-key` authenticates as a
bearer token does (auth.py).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from serval.api.agent_schemas import CountTokensRequest, MessagesRequest
from serval.api.anthropic_request import chat_request
from serval.api.anthropic_stream import MessageAssembler, stream_message
from serval.api.body import parse
from serval.api.context import ServerContext
from serval.api.generation_routes import chat_generation, chat_parts, respond
from serval.api.metrics import RequestObserver
from serval.api.output_blocks import new_id, whole_choice
from serval.serving.stream import Completion

PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


def add_anthropic_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/messages")
    async def create_message(request: Request) -> Response:
        observer = RequestObserver(ctx.metrics)
        body = parse(MessagesRequest, await ctx.body(request))
        model = ctx.check_model(body.model)
        message_id = new_id("msg")
        generation = await chat_generation(ctx, chat_request(body), model, message_id)
        assembler = MessageAssembler(message_id, model, len(generation.prompts[0]))

        def build(result: Completion) -> dict:
            assembler.feed(whole_choice(result.choices[0]))
            assembler.finish(result.usage)
            return assembler.message()

        def frame(first, events, on_close):
            return stream_message(assembler, first, events, on_close)

        return await respond(ctx, request, generation, observer, frame, bool(body.stream), build)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> JSONResponse:
        body = parse(CountTokensRequest, await ctx.body(request))
        model = ctx.check_model(body.model)
        prompt, options, _ = chat_parts(ctx, chat_request(body), model)
        return JSONResponse({"input_tokens": await ctx.frontend.count_chat_tokens(prompt, options)})
