"""Every invalid request of the table gets its 4xx and an OpenAI error body (in process, scripted engine)."""

from __future__ import annotations

import pytest

from tests.api.conftest import MODEL
from tests.api.invalid_cases import cases, check_error, encode

CASES = cases(MODEL)


@pytest.mark.parametrize("path, body, status, param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_request(client, path, body, status, param):
    response = client.post(path, content=encode(body), headers={"content-type": "application/json"})
    check_error(response, status, param)


def test_wrong_method_and_unknown_route_have_error_bodies(client):
    check_error(client.get("/v1/chat/completions"), 405, None)
    check_error(client.get("/v1/nothing"), 404, None)


def test_body_over_the_limit_is_413(make_client):
    client = make_client(max_request_body_bytes=1000)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 2000}]}
    error = check_error(client.post("/v1/chat/completions", json=body), 413, None)
    assert "1000" in error["message"]


def test_full_queue_is_429_with_retry_after(client):
    client.engine.is_queue_full = True
    for stream in (False, True):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        response = client.post("/v1/chat/completions", json=body)
        check_error(response, 429, None)
        assert response.headers["retry-after"] == "1"
