"""The real server answers every invalid request of the table with its 4xx and error body, and the SDK sees
them as its typed errors; every hostile request gets its 4xx (or its 200), and the server serves on after them
with nothing left running, waiting or holding KV blocks."""

from __future__ import annotations

import functools

import httpx
import openai
import pytest

from tests.api import hostile_cases
from tests.api.invalid_cases import CHAT, cases, check_error, encode
from tests.e2e.helpers import metric, wait_for

# A real server process with the default model: minutes, not seconds.
pytestmark = pytest.mark.slow

CASE_IDS = [c[0] for c in cases("m")]
HOSTILE_IDS = [c[0] for c in hostile_cases.cases("m")]


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


@functools.cache
def hostile(model: str) -> dict[str, tuple]:
    return {c[0]: c[1:] for c in hostile_cases.cases(model)}


def idle_kv_usage(base_url: str, timeout: float = 120.0) -> float:
    """KV-cache use once no request runs or waits (the engine frees blocks at its next step)."""
    names = ("serval_num_requests_running", "serval_num_requests_waiting")
    wait_for(
        lambda: [metric(base_url, name) for name in names], lambda counts: not any(counts), timeout,
        "requests still running or waiting",
    )  # fmt: skip
    return metric(base_url, "serval_kv_cache_usage_perc")


@pytest.fixture(scope="module")
def kv_baseline(server) -> float:
    """Taken before the first hostile request of the module."""
    return idle_kv_usage(server.base_url)


@pytest.mark.parametrize("case_id", HOSTILE_IDS)
def test_hostile_request(server, kv_baseline, case_id):
    path, body, status, param = hostile(server.model)[case_id]
    response = httpx.post(
        server.base_url + path, content=encode(body), headers={"content-type": "application/json"}, timeout=60
    )
    hostile_cases.check_answer(response, status, param)
    assert server.process.poll() is None, server.log_tail()


def test_serves_normally_after_hostile_requests(server, kv_baseline):
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    response = httpx.post(server.base_url + CHAT, json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    wait_for(
        lambda: idle_kv_usage(server.base_url), lambda usage: usage == kv_baseline, 120,
        f"KV-cache use back at {kv_baseline}, its level before the hostile requests",
    )  # fmt: skip
