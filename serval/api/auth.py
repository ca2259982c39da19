"""API-key authentication: `Authorization: Bearer <key>` on every route but /health.

Owns the comparison: every configured key is compared with hmac.compare_digest (constant time, and all keys
always, so timing does not tell which key nearly matched). A pure ASGI middleware so that it runs before the
body is read and leaves streamed responses alone.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from serval.api.errors import error_body

OPEN_PATHS = frozenset({"/health"})


def is_authorized(header: str | None, api_keys: tuple[str, ...]) -> bool:
    if header is None:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    presented = token.strip().encode()
    matched = False
    for key in api_keys:
        matched |= hmac.compare_digest(presented, key.encode())
    return matched


class APIKeyAuth:
    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.api_keys = api_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.api_keys or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        if is_authorized(header, self.api_keys):
            await self.app(scope, receive, send)
            return
        message = "missing API key: send Authorization: Bearer <key>" if header is None else "invalid API key"
        body = json.dumps(error_body(401, message, None, "invalid_api_key")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
