"""The real server answers every invalid request of the table with its 4xx and error body, and the SDK sees
them as its typed errors."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.api.invalid_cases import CHAT, cases, check_error, encode

# A real server process with the default model: minutes, not seconds.
pytestmark = pytest.mark.slow

CASE_IDS = [c[0] for c in cases("m")]


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_invalid_request(server, case_id):
    [(_, path, body, status, param)] = [c for c in cases(server.model) if c[0] == case_id]
    response = httpx.post(
        server.base_url + path, content=encode(body), headers={"content-type": "application/json"}, timeout=60
    )
    error = check_error(response, status, param)
    if case_id == "prompt-too-long":
        assert "8192" in error["message"]  # the numbers are in the message


def test_oversized_body_is_413(server):
    content = "x" * (4 * 1024 * 1024 + 1)
    response = httpx.post(
        server.base_url + CHAT,
        json={"model": server.model, "messages": [{"role": "user", "content": content}]},
    )
    check_error(response, 413, None)


def test_sdk_raises_typed_errors(openai_client, server):
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.chat.completions.create(model=server.model, messages=[], max_tokens=2)
    assert bad.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
