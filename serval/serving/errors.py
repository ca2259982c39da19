"""The ways `serving` refuses or fails a request: one typed error family the HTTP layer maps to a status once.

Every error here is a `ServingError` with the facts the client needs (the message, which parameter); the API
turns one into the OpenAI error body in a single place (api/errors.py from_serving). The engine's own refusals
reach serving in two forms, and each is translated exactly once, here: what `EngineClient.add_requests`
raises (from_engine) and a `RequestFailed` event on the request's queue (from_failure). No HTTP here.
"""

from __future__ import annotations

from serval.engine.client import EngineDeadError, QueueFullError
from serval.engine.lora import UnknownLoraError
from serval.engine.messages import FailureKind, RequestFailed


class ServingError(Exception):
    """A request serving refuses or failed. `param`: the request field at fault, when one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidRequestError(ServingError, ValueError):
    """The request cannot be served as asked (prompt too long, template refused it, ...): a 400."""


class ServerBusyError(ServingError):
    """The engine's waiting queue is full: a 429; the client should retry later."""


class ShuttingDownError(ServingError):
    """The server is shutting down and takes no new work: a 503."""


class EngineError(ServingError):
    """The engine failed a request it had accepted (a step failed, or the engine stopped): a 500."""


class ModelNotFoundError(ServingError, LookupError):
    """No base model or LoRA adapter goes by that name: a 404."""


class ConflictError(ServingError):
    """The request conflicts with the server's state (an adapter in use, every adapter slot taken): a 409."""


def from_engine(error: Exception) -> ServingError:
    """The serving error for what `EngineClient.add_requests` (or `Engine.add_request`) raised."""
    if isinstance(error, UnknownLoraError):  # unloaded after the API checked the name
        return ModelNotFoundError(str(error), "model")
    if isinstance(error, QueueFullError):
        return ServerBusyError(str(error))
    if isinstance(error, EngineDeadError):
        return EngineError(str(error))
    if isinstance(error, ValueError):  # the engine's own prompt checks (context length)
        return InvalidRequestError(str(error))
    return EngineError(f"generation failed: {error}")


def from_failure(failed: RequestFailed) -> ServingError:
    """The serving error for a request the engine thread refused or failed after admission: the same one
    from_engine gives for the same cause raised by add_requests."""
    match failed.kind:
        case FailureKind.INVALID:
            return InvalidRequestError(failed.message)
        case FailureKind.UNKNOWN_LORA:
            return ModelNotFoundError(failed.message, "model")
        case FailureKind.QUEUE_FULL:
            return ServerBusyError(failed.message)
        case _:
            return EngineError(failed.message)
