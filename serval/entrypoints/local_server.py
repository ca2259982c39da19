"""An in-process server for the terminal tools' `--model PATH`: the model loaded here and served on a free
loopback port by a uvicorn thread, so `serval chat` and `serval complete` talk to it exactly as to a remote
one (the same streaming, parsers and timing fields).

Owns its life: `LocalServer.start` loads the model and returns once the port listens; `stop` ends the HTTP
thread and the engine. Nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from serval.config import EngineConfig, ModelConfig
from serval.model_source import resolve_model
from serval.server_config import ServerConfig

STARTUP_TIMEOUT_S = 60.0  # from the loaded model to a listening port


@dataclass
class LocalServer:
    url: str
    http: Any  # uvicorn.Server
    thread: threading.Thread
    client: Any  # EngineClient

    @classmethod
    def start(cls, model: str | None, dtype: str = "auto") -> LocalServer:
        import uvicorn

        from serval.entrypoints.wiring import build_frontend_app, start_engine

        engine = EngineConfig(model=ModelConfig(model=model, dtype=dtype))
        source = resolve_model(model)
        tokenizer, client, media_processor = start_engine(engine, source)
        try:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))  # a free port, held from here on: no race with another process
            port = sock.getsockname()[1]
            server = ServerConfig(host="127.0.0.1", port=port, served_model_names=(model or source.name,))
            _, app = build_frontend_app(server, tokenizer, client, media_processor)
            http = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
            # NOTE: uvicorn installs no signal handlers off the main thread: Ctrl+C stays the chat's.
            thread = threading.Thread(
                target=http.run, kwargs={"sockets": [sock]}, name="serval-http", daemon=True
            )
            thread.start()
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not http.started:
                if not thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError("the in-process server did not start")
                time.sleep(0.02)
        except BaseException:
            client.shutdown()
            raise
        return cls(f"http://127.0.0.1:{port}", http, thread, client)

    def stop(self) -> None:
        self.http.should_exit = True
        self.thread.join(timeout=10)
        self.client.shutdown()
