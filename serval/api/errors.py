"""Error bodies, and the handlers that give every failure one: OpenAI's {"error": {message, type, param, code}}
everywhere but on Anthropic's routes (/v1/messages...), which answer Anthropic's {"type": "error", "error":
{type, message}} (the path decides: `error_payload`).

Owns the mapping from what went wrong to a status: a malformed or invalid request is a 400 (FastAPI's 422 is
turned into 400, as OpenAI answers), an unknown model or adapter 404, a missing key 401 (a non-admin key on an
admin route 403), a LoRA adapter in use or no free adapter slot 409, too large a body 413, a full queue 429
with Retry-After, a server shutting down 503. Nothing reaches the client as a traceback; an unexpected
exception is logged and answered with a plain 500 body.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serval.serving.errors import (
    ConflictError,
    EngineError,
    InvalidRequestError,
    ModelNotFoundError,
    ServerBusyError,
    ServingError,
    ShuttingDownError,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


# Anthropic's error types by status (its "Errors" page); 529 overloaded has no counterpart here.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
}
ANTHROPIC_PREFIX = "/v1/messages"  # the Messages API's routes: /v1/messages and /v1/messages/count_tokens


def speaks_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def shown(text: str, limit: int = 64) -> str:
    """A client's string as an error message quotes it: cut short, as the client may have sent megabytes."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def invalid(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def unsupported(message: str, param: str) -> APIError:
    return APIError(400, message, param, "unsupported_parameter")


def error_body(status_code: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    error_type = _TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def anthropic_error_body(status_code: int, message: str) -> dict:
    error_type = _ANTHROPIC_TYPES.get(
        status_code, "api_error" if status_code >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_payload(
    path: str, status_code: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    """The error body in the dialect of the route at `path`."""
    if speaks_anthropic(path):
        return anthropic_error_body(status_code, message)
    return error_body(status_code, message, param, code)


def error_response(error: APIError, path: str = "") -> JSONResponse:
    body = error_payload(path, error.status_code, error.message, error.param, error.code)
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)


def from_serving(error: Exception) -> APIError:
    """The APIError for an exception raised below the HTTP layer: each ServingError's status, once."""
    # A media problem carries its own code (serving/media/parts.py MediaError).
    if isinstance(error, InvalidRequestError):
        return APIError(400, str(error), error.param, getattr(error, "code", "invalid_value"))
    if isinstance(error, ModelNotFoundError):
        return APIError(404, str(error), error.param, "model_not_found")
    if isinstance(error, ConflictError):
        return APIError(409, str(error), None, "conflict")
    if isinstance(error, ServerBusyError):
        return APIError(
            429,
            f"the server is busy ({error}); retry later",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    if isinstance(error, ShuttingDownError):
        return shutting_down()
    if isinstance(error, EngineError):
        return APIError(500, str(error), code="engine_error")
    logger.error("unexpected error while serving a request", exc_info=error)
    return APIError(500, "internal server error", code="internal_error")


def shutting_down() -> APIError:
    """The 503 of a request that arrives while the server drains (api/shutdown.py); the connection closes."""
    return APIError(503, "the server is shutting down", code="shutting_down", headers={"Connection": "close"})


def param_path(loc: tuple[Any, ...]) -> str | None:
    """('messages', 0, 'content') -> 'messages[0].content' (the spelling OpenAI uses in `param`)."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue  # FastAPI's prefix for body fields
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or None


def from_validation(errors: list[dict[str, Any]]) -> APIError:
    """The 400 for a pydantic/FastAPI validation failure: its first error, with the field named."""
    if not errors:
        return APIError(400, "invalid request", code="invalid_request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = str(first.get("msg", "")).removeprefix("Invalid JSON: ")
        return APIError(400, f"the body is not valid JSON: {detail}", code="invalid_json")
    param = param_path(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    if first.get("type") == "model_type" and param is None:
        return APIError(400, "the body must be a JSON object", code="invalid_request")
    if first.get("type") == "missing":
        return APIError(400, f"{param} is required", param, "missing_required_parameter")
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unknown parameter {param}", param, "unknown_parameter")
    kind = str(first.get("type", ""))
    is_range = kind.startswith(("greater_than", "less_than")) or kind.endswith(("too_short", "too_long"))
    code = "invalid_value" if is_range else "invalid_type"
    return APIError(400, f"{param}: {message}" if param else message, param, code)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, APIError)
        return error_response(error, request.url.path)

    async def on_validation_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, (RequestValidationError, ValidationError))
        return error_response(from_validation(list(error.errors())), request.url.path)

    async def on_http_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, StarletteHTTPException)
        message = error.detail if isinstance(error.detail, str) else "request failed"
        if error.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(APIError(error.status_code, message, headers=error.headers), request.url.path)

    async def on_unexpected(request: Request, error: Exception) -> JSONResponse:  # a ServingError too
        return error_response(from_serving(error), request.url.path)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ServingError, on_unexpected)
    app.add_exception_handler(Exception, on_unexpected)
