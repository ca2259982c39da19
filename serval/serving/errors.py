"""The ways `serving` refuses or fails a request, as exceptions the HTTP layer maps to status codes.

Plain exceptions with the facts the client needs (which parameter, which numbers), and the translation of
the engine client's own (from_engine); no HTTP here.
"""

from __future__ import annotations

from serval.engine.client import EngineDeadError, QueueFullError
from serval.engine.lora import UnknownLoraError


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (prompt too long, template refused it, ...): a 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ServerBusyError(RuntimeError):
    """The engine's waiting queue is full: a 429; the client should retry later."""


class ShuttingDownError(RuntimeError):
    """The server is shutting down and takes no new work: a 503."""


class EngineError(RuntimeError):
    """The engine failed a request it had accepted (its output carried an error)."""


class ModelNotFoundError(LookupError):
    """No base model or LoRA adapter goes by that name: a 404."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConflictError(RuntimeError):
    """The request conflicts with the server's state (an adapter in use, every adapter slot taken): a 409."""


def from_engine(error: Exception) -> Exception:
    """The serving exception for what the engine client raised."""
    if isinstance(error, UnknownLoraError):  # unloaded after the API checked the name
        return ModelNotFoundError(str(error), "model")
    if isinstance(error, QueueFullError):
        return ServerBusyError(str(error))
    if isinstance(error, EngineDeadError):
        return EngineError(str(error))
    if isinstance(error, ValueError):  # the engine's own prompt checks (context length)
        return InvalidRequestError(str(error))
    return EngineError(f"generation failed: {error}")
