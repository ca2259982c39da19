"""In-process app fixtures: the real FastAPI app over a scripted engine (no model), driven through httpx."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from serval.api.app import build_app
from serval.server_config import ServerConfig
from serval.serving.frontend import Frontend
from tests.serving.fakes import ByteTokenizer, FakeEngine

MODEL = "fake-model"


class AppClient:
    """A synchronous face on httpx.AsyncClient + ASGITransport, one event loop per client."""

    def __init__(self, config: ServerConfig, engine: FakeEngine) -> None:
        self.engine = engine
        frontend = Frontend(
            engine,
            ByteTokenizer(),
            max_iter_times=config.max_iter_times,
            max_seqs_per_request=config.max_seqs_per_request,
        )
        self.app = build_app(config, frontend)
        self.loop = asyncio.new_event_loop()
        transport = httpx.ASGITransport(app=self.app)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://test")

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        return self.loop.run_until_complete(self.client.request(method, path, **kwargs))

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.request("POST", path, **kwargs)

    def get(self, path: str, **kwargs) -> httpx.Response:
        return self.request("GET", path, **kwargs)

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


@pytest.fixture
def make_client():
    clients = []

    def make(texts: list[str] | None = None, **config) -> AppClient:
        config.setdefault("served_model_names", (MODEL,))
        client = AppClient(ServerConfig(**config), FakeEngine(texts or ["Hello there, friend."]))
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def client(make_client) -> AppClient:
    return make_client()
