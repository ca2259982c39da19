"""API-key authentication: `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on every route but the open ones (/health, and the
playground's page and assets, given by build_app), and admin keys on the admin routes (run-time LoRA
loading). Open paths are exact: nothing below one is open.

An admin key is also accepted wherever an API key is. Admin routes are open only when no key of either kind
is configured (a server without keys trusts its network); once any key is, they need an admin key: 401
without a valid key, 403 with an API key that is not an admin's. Owns the comparison: every configured key is compared with hmac.compare_digest (constant time, and all keys
always, so timing does not tell which key nearly matched). A pure ASGI middleware so that it runs before the
body is read and leaves streamed responses alone.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from serval.api.errors import error_payload

OPEN_PATHS = frozenset({"/health"})


def presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key a request presents: the bearer token, else x-api-key (what Anthropic's SDK sends)."""
    if authorization is not None:
        scheme, _, token = authorization.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None
    return None if x_api_key is None else x_api_key.strip()


def is_authorized(key: str | None, api_keys: tuple[str, ...]) -> bool:
    if key is None:
        return False
    presented = key.encode()
    matched = False
    for api_key in api_keys:
        matched |= hmac.compare_digest(presented, api_key.encode())
    return matched


class APIKeyAuth:
    def __init__(
        self,
        app: ASGIApp,
        api_keys: tuple[str, ...],
        admin_keys: tuple[str, ...] = (),
        admin_paths: frozenset[str] = frozenset(),
        open_paths: frozenset[str] = OPEN_PATHS,
    ) -> None:
        self.app = app
        self.api_keys = api_keys
        self.admin_keys = admin_keys
        self.admin_paths = admin_paths
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        found: dict[bytes, str] = {}
        for name, value in scope["headers"]:
            if name in (b"authorization", b"x-api-key") and name not in found:
                found[name] = value.decode("latin-1")
        header = presented_key(found.get(b"authorization"), found.get(b"x-api-key"))
        path = scope["path"]
        if scope["path"] in self.admin_paths:
            if not (self.api_keys or self.admin_keys) or is_authorized(header, self.admin_keys):
                await self.app(scope, receive, send)
            elif is_authorized(header, self.api_keys):
                await _refuse(
                    send, path, 403, "this route needs an admin key (--admin-api-key)", "admin_key_required"
                )
            else:
                await _refuse(send, path, 401, _why(header), "invalid_api_key")
        elif not self.api_keys or is_authorized(header, self.api_keys + self.admin_keys):
            await self.app(scope, receive, send)
        else:
            await _refuse(send, path, 401, _why(header), "invalid_api_key")


def _why(key: str | None) -> str:
    return (
        "missing API key: send Authorization: Bearer <key> (or x-api-key)"
        if key is None
        else "invalid API key"
    )


async def _refuse(send: Send, path: str, status: int, message: str, code: str) -> None:
    body = json.dumps(error_payload(path, status, message, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
