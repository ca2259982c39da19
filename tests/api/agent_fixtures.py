"""Shared by the agent-API tests: a scripted engine that records each prompt, and real servers on loopback
(uvicorn, the real app) with the official openai and anthropic clients pointed at them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from serval.api.app import build_app
from serval.server_config import ServerConfig
from serval.serving.frontend import Frontend
from tests.fixtures.inprocess_server import serving
from tests.serving.fakes import ByteTokenizer, FakeEngine

MODEL = "fake-model"
API_KEY = "agent-key"
CALL_TEXT = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}


class RecordingEngine(FakeEngine):
    """FakeEngine that keeps every prompt it was given (as token ids)."""

    def __init__(self, texts: list[str], **kwargs) -> None:
        super().__init__(texts, max_model_len=kwargs.pop("max_model_len", 4096), **kwargs)
        self.prompts: list[list[int]] = []

    def add_requests(self, requests, shared_queue=None):
        streams = super().add_requests(requests, shared_queue)
        self.prompts += [list(r.prompt_token_ids) for r in requests]
        return streams

    @property
    def last_prompt(self) -> str:
        return ByteTokenizer().decode(self.prompts[-1], skip_special_tokens=False)


@contextmanager
def scripted_server(texts: list[str], tokenizer=None, **config) -> Iterator[tuple[int, RecordingEngine]]:
    """A real server over a scripted engine: yields (port, engine)."""
    config.setdefault("served_model_names", (MODEL,))
    engine = RecordingEngine(texts)
    frontend = Frontend(engine, tokenizer or ByteTokenizer())
    with serving(build_app(ServerConfig(**config), frontend)) as port:
        yield port, engine


def openai_client(port: int, api_key: str = "unused"):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0, timeout=60)


def anthropic_client(port: int, api_key: str = "unused"):
    import anthropic

    return anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{port}", api_key=api_key, max_retries=0, timeout=60
    )
