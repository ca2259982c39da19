"""CORS: which web pages on other origins may call this server from a browser (opt-in, --allowed-origins).

Owns the two answers of the protocol. A preflight (OPTIONS with Origin and Access-Control-Request-Method) is
answered here, before authentication (a browser never sends credentials on one): 204 with the grant when
the origin, the method and every requested header are allowed, else 403 in the OpenAI error shape and no
grant, so the browser refuses the real request. Any other request with an allowed Origin passes through and
its response (a 401 included, so a page can show why) gets Access-Control-Allow-Origin: the origin itself,
or `*` when every origin is allowed, which CorsConfig forbids together with credentials. A pure ASGI
middleware so streamed responses pass through untouched. Without a CorsConfig the app has no such layer.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serval.api.errors import error_payload
from serval.server_config import SAFELISTED_HEADERS, CorsConfig

PREFLIGHT_MAX_AGE_S = 600  # browsers cache a grant this long (Chromium caps it at 7200)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


class CORS:
    def __init__(self, app: ASGIApp, config: CorsConfig) -> None:
        self.app = app
        self.config = config
        self.origins = frozenset(config.allowed_origins)
        self.methods = frozenset(m.upper() for m in config.allowed_methods)
        self.headers = frozenset(h.lower() for h in config.allowed_headers) | SAFELISTED_HEADERS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origin = _header(scope, b"origin") if scope["type"] == "http" else None
        if origin is None:
            await self.app(scope, receive, send)
            return
        requested_method = _header(scope, b"access-control-request-method")
        if scope["method"] == "OPTIONS" and requested_method is not None:
            await self._preflight(scope, send, origin, requested_method)
            return
        if not self._allows_origin(origin):
            await self.app(scope, receive, send)  # answered without a grant: the page cannot read it
            return
        grant = self._grant(origin)

        async def send_with_grant(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *grant]}
            await send(message)

        await self.app(scope, receive, send_with_grant)

    def _allows_origin(self, origin: str) -> bool:
        return self.config.allows_any_origin or origin in self.origins

    def _grant(self, origin: str) -> list[tuple[bytes, bytes]]:
        if self.config.allows_any_origin:  # never with credentials (CorsConfig)
            return [(b"access-control-allow-origin", b"*")]
        grant = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        if self.config.allow_credentials:
            grant.append((b"access-control-allow-credentials", b"true"))
        return grant

    async def _preflight(self, scope: Scope, send: Send, origin: str, method: str) -> None:
        requested = [
            h.strip().lower() for h in (_header(scope, b"access-control-request-headers") or "").split(",")
        ]
        requested = [h for h in requested if h]
        if not self._allows_origin(origin):
            refusal = f"the origin {origin!r} may not call this server (--allowed-origins)"
        elif "*" not in self.methods and method.upper() not in self.methods:
            refusal = f"the method {method!r} is not allowed across origins (--allowed-methods)"
        elif "*" not in self.headers and (denied := [h for h in requested if h not in self.headers]):
            refusal = f"the header {denied[0]!r} is not allowed across origins (--allowed-headers)"
        else:
            # NOTE: the requested method and headers are named back rather than answered with "*": a browser
            # reads "*" literally in a request with credentials, where Authorization is never covered by it.
            headers = [
                *self._grant(origin),
                (b"access-control-allow-methods", method.upper().encode("latin-1")),
                (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode()),
            ]
            if requested:
                headers.append((b"access-control-allow-headers", ", ".join(requested).encode("latin-1")))
            await send({"type": "http.response.start", "status": 204, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        body = json.dumps(error_payload(scope["path"], 403, refusal, None, "cors_not_allowed")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 403,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
