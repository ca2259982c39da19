"""On the real server: while a 3 MiB prompt is rendered and tokenized (seconds), /health and /v1/models are
answered; the prompt itself is then refused as longer than the context."""

from __future__ import annotations

import concurrent.futures
import json
import threading

import httpx
import pytest

from tests.api.invalid_cases import CHAT, check_error
from tests.fixtures.prompts import long_text

pytestmark = pytest.mark.slow


def test_health_is_answered_while_a_long_prompt_is_tokenized(server):
    text = long_text(3 << 20)  # under the 4 MiB cap on messages' text
    body = {"model": server.model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    payload = json.dumps(body, separators=(",", ":")).encode()  # as httpx.post(json=...) would send it
    uploaded = threading.Event()
    finished: list[str] = []

    def upload():
        # In pieces, so the test knows when the last one has left: from then on the server holds the whole
        # prompt and tokenizes it (seconds), and the probes below go in while it does.
        for start in range(0, len(payload), 1 << 16):
            yield payload[start : start + (1 << 16)]
        uploaded.set()

    def long_request() -> httpx.Response:
        headers = {"content-type": "application/json", "content-length": str(len(payload))}
        response = httpx.post(server.base_url + CHAT, content=upload(), headers=headers, timeout=300)
        finished.append("long")
        return response

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(long_request)
        assert uploaded.wait(300), "the long prompt was never uploaded"
        for path in ("/health", "/v1/models"):
            assert httpx.get(server.base_url + path, timeout=300).status_code == 200
            finished.append(path)
        response = long.result()
    assert finished == ["/health", "/v1/models", "long"]
    check_error(response, 400, "messages")
