"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat pipeline.

Owns the route: the body parsed (agent_schemas.py), translated into a chat request (responses_request.py) and
served by the chat route's own path (generation_routes.chat_generation, respond), the answer framed as a
response object or its event stream (responses_stream.py), and the store (responses_store.py). The store is
off unless --responses-store-size is given; then `store` (absent: true, as OpenAI) keeps a response for GET
and previous_response_id. With the store off, `store: true` and previous_response_id are refused with a 400
that names the flag: never silently dropped.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from serval.api.agent_schemas import ResponsesRequest
from serval.api.body import parse
from serval.api.context import ServerContext
from serval.api.errors import APIError, from_serving, shown
from serval.api.generation_routes import chat_generation, respond
from serval.api.metrics import RequestObserver
from serval.api.output_blocks import new_id, whole_choice
from serval.api.responses_request import chat_request, renamed
from serval.api.responses_store import ResponseStore
from serval.api.responses_stream import ResponseAssembler, stream_response
from serval.serving.errors import ServingError
from serval.serving.stream import Completion

PATHS = frozenset({"/v1/responses"})
STORE_FLAG = "--responses-store-size"


def _store_off(param: str) -> APIError:
    return APIError(
        400,
        f"{param}: this server keeps no responses (start it with {STORE_FLAG} N to keep the last N)",
        param,
        "store_disabled",
    )


def _wants_store(store: ResponseStore, body: ResponsesRequest) -> bool:
    if not store.is_enabled:
        if body.store:
            raise _store_off("store")
        return (
            False  # NOTE: absent means "don't" here: OpenAI's default (true) needs a store to mean anything
        )
    return body.store is not False


def _history(store: ResponseStore, body: ResponsesRequest) -> list[dict[str, Any]]:
    if body.previous_response_id is None:
        return []
    if not store.is_enabled:
        raise _store_off("previous_response_id")
    stored = store.get(body.previous_response_id)
    if stored is None:
        raise APIError(
            404,
            f"previous_response_id {shown(body.previous_response_id)}: no such response is stored (it may have "
            "expired)",
            "previous_response_id",
            "response_not_found",
        )
    return stored.conversation


def answer_message(response: dict[str, Any]) -> dict[str, Any]:
    """A response's output as the assistant message a later turn's history holds."""
    text, reasoning, calls = "", "", []
    for item in response["output"]:
        if item["type"] == "message":
            text += "".join(part["text"] for part in item["content"])
        elif item["type"] == "reasoning":
            reasoning += "".join(part["text"] for part in item["content"])
        else:
            function = {"name": item["name"], "arguments": item["arguments"]}
            calls.append({"id": item["call_id"], "type": "function", "function": function})
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def add_responses_routes(app: FastAPI, ctx: ServerContext) -> None:
    store = ResponseStore(ctx.config.responses_store_size, ctx.config.responses_store_max_age)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        observer = RequestObserver(ctx.metrics)
        body = parse(ResponsesRequest, await ctx.body(request))
        model = ctx.check_model(body.model)
        keeps = _wants_store(store, body)
        chat, conversation = chat_request(body, _history(store, body), ctx.roles)
        response_id = new_id("resp")
        try:
            generation = await chat_generation(ctx, chat, model, response_id)
        except APIError as e:
            raise renamed(e) from e
        except ServingError as e:
            raise renamed(from_serving(e)) from e
        assembler = ResponseAssembler(body, response_id, int(time.time()), model, keeps)

        def keep(response: dict[str, Any]) -> None:
            if keeps:
                store.put(response, [*conversation, answer_message(response)])

        def build(result: Completion) -> dict[str, Any]:
            assembler.feed(whole_choice(result.choices[0]))
            assembler.finish(result.usage)
            response = assembler.response()
            keep(response)
            return response

        def frame(first, events, on_close):
            return stream_response(assembler, first, events, keep, on_close)

        return await respond(ctx, request, generation, observer, frame, bool(body.stream), build)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(_stored(store, response_id).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        _stored(store, response_id)
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _stored(store: ResponseStore, response_id: str):
    stored = store.get(response_id) if store.is_enabled else None
    if stored is None:
        why = "" if store.is_enabled else f" (this server keeps no responses: see {STORE_FLAG})"
        raise APIError(404, f"no response {shown(response_id)} is stored{why}", None, "response_not_found")
    return stored
