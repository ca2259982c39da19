"""Reading a request body: the size limit (413 beyond it) and parsing into a schema (400 naming the field).

Shared by every route module (app.py, lora_routes.py).
"""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from serval.api.errors import APIError, from_validation

Schema = TypeVar("Schema", bound=BaseModel)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(
            413, f"the request body is {declared} bytes; the limit is {limit}", None, "request_too_large"
        )
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(
                413, f"the request body exceeds the limit of {limit} bytes", None, "request_too_large"
            )
        chunks.append(chunk)
    return b"".join(chunks)


def parse(schema: type[Schema], body: bytes) -> Schema:
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        raise from_validation(list(e.errors())) from e
