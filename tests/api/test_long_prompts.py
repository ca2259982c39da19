"""Long prompts are rendered and tokenized off the event loop: while the real app (in process, the default
model's tokenizer and chat template, a scripted engine) tokenizes 3 MiB of text, /health and /v1/models are
answered; short inputs stay on the loop's own thread."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from serval.api.app import build_app
from serval.model_source import resolve_model
from serval.server_config import ServerConfig
from serval.serving.frontend import Frontend
from serval.serving.text_threads import TextThreads
from serval.serving.tokenizer import Tokenizer
from tests.fixtures.prompts import long_text
from tests.serving.fakes import FakeEngine

MODEL = "m"
# Under the 4 MiB cap on messages' text; seconds to tokenize.
LONG_TEXT = long_text(3 << 20)


class SignallingTextThreads(TextThreads):
    """The real TextThreads, which also sets `started` once the work of a long text has begun (in a worker
    thread, unless a regression runs it on the loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()

    async def run(self, num_chars: int, fn, *args, **kwargs):
        if num_chars <= self.inline_chars:
            return await super().run(num_chars, fn, *args, **kwargs)
        loop = asyncio.get_running_loop()

        def signalled():
            loop.call_soon_threadsafe(self.started.set)
            return fn(*args, **kwargs)

        return await super().run(num_chars, signalled)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_source(resolve_model(None))


async def answered_in_order(tokenizer: Tokenizer, path: str, body: dict) -> tuple[list[str], httpx.Response]:
    """POST the long body, then (once it is under way) GET /health and /v1/models; the order they finish."""
    config = ServerConfig(served_model_names=(MODEL,))
    frontend = Frontend(FakeEngine(["ok"]), tokenizer, tokenizer.chat_template)
    frontend.text_threads = text_threads = SignallingTextThreads()
    app = build_app(config, frontend)
    finished: list[str] = []
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=300) as client:

        async def call(name: str, method: str, url: str, **kwargs) -> httpx.Response:
            response = await client.request(method, url, **kwargs)
            finished.append(name)
            return response

        long = asyncio.create_task(call("long", "POST", path, json=body))
        # Until the long request is parsed and being rendered or tokenized (60 s bounds a failure).
        await asyncio.wait_for(text_threads.started.wait(), 60)
        health = await call("health", "GET", "/health")
        models = await call("models", "GET", "/v1/models")
        response = await long
    assert health.status_code == 200 and models.status_code == 200
    return finished, response


def test_health_answers_while_a_long_chat_prompt_is_tokenized(tokenizer):
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG_TEXT}], "max_tokens": 1}
    finished, response = asyncio.run(answered_in_order(tokenizer, "/v1/chat/completions", body))
    assert finished == ["health", "models", "long"]
    # Far past the default model's context: refused once it was counted, after tokenizing.
    assert response.status_code == 400, response.text
    assert "maximum context length" in response.json()["error"]["message"]


def test_health_answers_while_a_long_completion_prompt_is_tokenized(tokenizer):
    body = {"model": MODEL, "prompt": LONG_TEXT, "max_tokens": 1}
    finished, response = asyncio.run(answered_in_order(tokenizer, "/v1/completions", body))
    assert finished == ["health", "models", "long"]
    assert response.status_code == 400, response.text


def test_short_text_stays_on_the_loop_and_long_text_goes_to_a_thread():
    threads = TextThreads(inline_chars=100)

    async def run() -> tuple[int, int, int]:
        short = await threads.run(100, threading.get_ident)
        long = await threads.run(101, threading.get_ident)
        return threading.get_ident(), short, long

    try:
        loop_thread, short, long = asyncio.run(run())
    finally:
        threads.shutdown()
    assert short == loop_thread and long != loop_thread
