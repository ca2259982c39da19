"""The ways `serving` refuses or fails a request, as exceptions the HTTP layer maps to status codes.

Plain exceptions with the facts the client needs (which parameter, which numbers); no HTTP here.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (prompt too long, template refused it, ...): a 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ServerBusyError(RuntimeError):
    """The engine's waiting queue is full: a 429; the client should retry later."""


class EngineError(RuntimeError):
    """The engine failed a request it had accepted (its output carried an error)."""


class ModelNotFoundError(LookupError):
    """No base model or LoRA adapter goes by that name: a 404."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConflictError(RuntimeError):
    """The request conflicts with the server's state (an adapter in use, every adapter slot taken): a 409."""
