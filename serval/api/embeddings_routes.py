"""POST /v1/embeddings: OpenAI's embeddings endpoint, for an embedding model (runner/pooling.py says which
checkpoints are: a sentence-transformers modules.json with a Pooling module).

Owns the HTTP side: `input` as a string, a list of strings, a list of token ids or a list of those (each
checked here, so the error names `input`), `encoding_format` float or base64 (the vector's little-endian
float32 bytes, as OpenAI encodes them), `dimensions`, and the body {object: "list", data, model, usage}.
The vectors come from serving (Frontend.embed); a generative model answers 400 naming the reason.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from serval.api.agent_schemas import EmbeddingRequest
from serval.api.body import parse
from serval.api.context import ServerContext
from serval.api.errors import invalid

PATHS = frozenset({"/v1/embeddings"})


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def embedding_inputs(value: Any) -> list[str | list[int]]:
    """The inputs of a request: one string, strings, one token list, or token lists (never mixed). An empty
    string is refused, as OpenAI refuses it (its tokenizer's specials alone would embed as something)."""
    if value == "" or (isinstance(value, list) and "" in value):
        raise invalid("input must not contain an empty string", "input")
    if isinstance(value, str):
        return [value]
    if _is_token_list(value) and value:
        return [value]
    is_list = isinstance(value, list) and bool(value)
    if is_list and (all(isinstance(i, str) for i in value) or all(_is_token_list(i) for i in value)):
        return value
    raise invalid(
        "input must be a string, a list of strings, a list of token ids or a list of those (not empty)",
        "input",
    )


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def add_embeddings_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        body = parse(EmbeddingRequest, await ctx.body(request))
        model = ctx.check_model(body.model)
        encoding_format = body.encoding_format or "float"
        if encoding_format not in ("float", "base64"):
            raise invalid('encoding_format must be "float" or "base64"', "encoding_format")
        inputs = embedding_inputs(body.input)
        vectors, num_tokens = await ctx.frontend.embed(inputs, body.dimensions)
        ctx.metrics.prompt_tokens.inc(num_tokens)
        data = [{"object": "embedding", "index": i, "embedding": encoded(v, encoding_format)}
                for i, v in enumerate(vectors)]  # fmt: skip
        usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
        return JSONResponse({"object": "list", "data": data, "model": model, "usage": usage})
