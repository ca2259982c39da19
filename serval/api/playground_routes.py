"""The web playground at `/`: a chat page served from files shipped in the package (api/playground/: HTML,
CSS and plain JavaScript; no build step, nothing fetched from elsewhere).

Owns the page's routes and what they may do. Each asset is a fixed path mapped to one file read at start-up;
these paths, and nothing under them, are open without an API key (the page asks for the key and its API
calls carry it; APIKeyAuth takes PATHS as open). The Content-Security-Policy lets the page load its own
files and call this origin only.
"""

from __future__ import annotations

import os

from fastapi import FastAPI
from fastapi.responses import Response

_DIRECTORY = os.path.join(os.path.dirname(__file__), "playground")
_ASSETS = {  # path -> (file, media type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/playground/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
    "/playground/stream.js": ("stream.js", "text/javascript; charset=utf-8"),
    "/playground/playground.css": ("playground.css", "text/css; charset=utf-8"),
}
PATHS = frozenset(_ASSETS)

HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a new version of serval serves its new page at once
}


def add_playground_routes(app: FastAPI) -> None:
    for path, (name, media_type) in _ASSETS.items():
        with open(os.path.join(_DIRECTORY, name), "rb") as f:
            body = f.read()

        def serve(body: bytes = body, media_type: str = media_type) -> Response:
            return Response(body, media_type=media_type, headers=HEADERS)

        app.add_api_route(path, serve, methods=["GET"], include_in_schema=False)
