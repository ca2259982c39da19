"""A server configured from a MindIE config.json plus --api-key flags: keys, the file's model name and limits,
fullTextEnabled streams, the queue limit (429) and the request timeout."""

from __future__ import annotations

import itertools
import threading
import time

import httpx
import pytest

from tests.api.invalid_cases import check_error
from tests.e2e.conftest import API_KEYS, DEPLOY_TIMEOUT_S
from tests.e2e.helpers import metric, sse_chunks, wait_until_idle

# A real server process with the default model: minutes, not seconds.
pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Say hi."}]


def auth(key: str = API_KEYS[0]) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEYS[0]}])
def test_every_route_but_health_needs_a_key(deploy_server, headers):
    base = deploy_server.base_url
    body = {"model": deploy_server.model, "messages": HI, "max_tokens": 2}
    for response in (
        httpx.get(base + "/v1/models", headers=headers),
        httpx.post(base + "/v1/chat/completions", json=body, headers=headers),
        httpx.post(
            base + "/v1/completions", json={"model": deploy_server.model, "prompt": "x"}, headers=headers
        ),
        httpx.get(base + "/metrics", headers=headers),
        httpx.post(base + "/tokenize", json={"prompt": "x"}, headers=headers),
    ):
        assert check_error(response, 401, None)["code"] == "invalid_api_key"
    assert httpx.get(base + "/health").status_code == 200


def test_sdk_with_either_key_and_the_configured_name(deploy_server):
    from openai import NotFoundError, OpenAI

    for key in API_KEYS:
        client = OpenAI(base_url=f"{deploy_server.base_url}/v1", api_key=key, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["smol"]
        response = client.chat.completions.create(model="smol", messages=HI, max_tokens=3)
        assert response.usage.completion_tokens <= 3
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=HI, max_tokens=3)


def test_full_text_stream(deploy_server):
    body = {"model": "smol", "messages": HI, "max_tokens": 8, "temperature": 0, "stream": True}
    chunks = sse_chunks(deploy_server.base_url, "/v1/chat/completions", body, headers=auth())
    contents = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    for earlier, later in itertools.pairwise(contents):
        assert later.startswith(earlier)  # each delta is the whole text so far
    assert chunks[-1]["full_text"] == contents[-1] and "usage" in chunks[-1]


def test_max_input_token_len(deploy_server):
    body = {"model": "smol", "messages": [{"role": "user", "content": "word " * 1200}], "max_tokens": 2}
    response = httpx.post(
        deploy_server.base_url + "/v1/chat/completions", json=body, headers=auth(), timeout=60
    )
    assert "maxInputTokenLen" in check_error(response, 400, "messages")["message"]


def test_full_queue_is_429_then_recovers(deploy_server):
    # One request runs (maxBatchSize 1), one waits (maxQueueLen 1): a third is refused.
    base = deploy_server.base_url
    long_body = {"model": "smol", "messages": HI, "max_tokens": 500, "ignore_eos": True, "stream": True}
    waiting_status: list[int] = []

    def wait_in_queue():
        with httpx.stream(
            "POST", base + "/v1/chat/completions", json=long_body, headers=auth(), timeout=60
        ) as r:
            waiting_status.append(r.status_code)

    with httpx.stream(
        "POST", base + "/v1/chat/completions", json=long_body, headers=auth(), timeout=60
    ) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # NOTE: kept: a dropped iterator closes the response (a disconnect)
        next(lines)
        waiter = threading.Thread(target=wait_in_queue)
        waiter.start()
        deadline = time.monotonic() + 10
        while metric(base, "serval_num_requests_waiting", auth()) < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.05)
        refused = httpx.post(base + "/v1/chat/completions", json=long_body, headers=auth(), timeout=60)
        check_error(refused, 429, None)
        assert refused.headers["retry-after"] == "1"
    waiter.join(timeout=60)
    assert waiting_status == [200]
    wait_until_idle(base, headers=auth())


def test_request_timeout_cuts_off_with_length(deploy_server):
    body = {"model": "smol", "messages": HI, "max_tokens": 1000, "ignore_eos": True}
    started = time.monotonic()
    response = httpx.post(
        deploy_server.base_url + "/v1/chat/completions", json=body, headers=auth(), timeout=60
    )
    elapsed = time.monotonic() - started
    assert response.status_code == 200
    data = response.json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert 0 < data["usage"]["completion_tokens"] < 1000
    assert DEPLOY_TIMEOUT_S - 0.5 < elapsed < DEPLOY_TIMEOUT_S + 5
