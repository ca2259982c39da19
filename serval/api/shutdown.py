"""Graceful shutdown of the HTTP server: on SIGTERM (or Ctrl+C) stop accepting, drain, exit 0.

Owns the process's life under uvicorn. On the signal: the listening socket closes (new connections are
refused) and a request that still arrives on an open connection is answered 503 `shutting_down` with
`Connection: close` (DrainGate); the requests in flight go on for --shutdown-grace-seconds, after which
serving cuts each generation off with what it has, so every stream still ends with its last chunk, usage and
`data: [DONE]` (serving/drain.py). uvicorn then closes the connections, `run` returns and the CLI stops the
engine. uvicorn's own cancellation of whatever is left is only a backstop, SHUTDOWN_MARGIN_S after the grace.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Callable, Iterator

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from serval.api.errors import error_response, shutting_down
from serval.server_config import ServerConfig
from serval.serving.drain import Drain
from serval.serving.frontend import Frontend

STARTUP_FAILURE = 3  # the exit status uvicorn.run gives a server that could not start

# Seconds after the grace period before uvicorn cancels what has not ended: the cut-off streams need only to
# send their last chunks.
SHUTDOWN_MARGIN_S = 5.0


class DrainGate:
    """ASGI middleware: once draining, every new HTTP request is answered 503 (pure ASGI: streams untouched)."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.drain.is_draining:
            await error_response(shutting_down(), scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, draining the Frontend when it shuts down and exiting normally after a signal."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Drain,
        grace_seconds: float,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.drain = drain
        self.grace_seconds = grace_seconds
        self.on_started = on_started

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:  # listening: the address in a log line is true now
            self.on_started()

    async def shutdown(self, sockets=None) -> None:
        # Called once the main loop has seen the signal; uvicorn then closes the listening sockets and waits
        # for the connections, which the drain ends by the grace period at the latest.
        self.drain.begin(self.grace_seconds)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: replaces uvicorn's, which raises the signal again once the server has shut down, so that the
        # process dies of it (status 143 for SIGTERM). A server that drained as asked has done its job: it
        # returns, the engine stops, and the process exits 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run(
    app: ASGIApp, server: ServerConfig, frontend: Frontend, on_started: Callable[[], None] | None = None
) -> bool:
    """Serve until SIGTERM or SIGINT, then drain (a second Ctrl+C stops at once). False if it never started
    (the port is taken, ...). on_started: called once the port is bound."""
    config = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        ssl_keyfile=server.ssl_keyfile,
        ssl_certfile=server.ssl_certfile,
        log_level=server.log_level,
        timeout_graceful_shutdown=math.ceil(server.shutdown_grace_seconds + SHUTDOWN_MARGIN_S),
        # NOTE: named, not "auto": uvicorn would switch to uvloop and httptools wherever they are installed
        # (ray[serve], the replicas extra, brings both), changing the HTTP parser and loop under every test.
        loop="asyncio",
        http="h11",
    )
    graceful = GracefulServer(config, frontend.drain, server.shutdown_grace_seconds, on_started)
    graceful.run()
    return graceful.started
