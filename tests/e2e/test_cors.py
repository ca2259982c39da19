"""CORS on a real server: a browser's preflight and its real request, from the allowed origin and another,
and the refusal at start-up of the wildcard origin with credentials."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.e2e.conftest import KEYED_API_KEY, KEYED_ORIGIN

# A real server process with the default model.
pytestmark = pytest.mark.slow


def test_preflight_then_request_from_the_allowed_origin(keyed_server):
    url = keyed_server.base_url + "/v1/chat/completions"
    asked = {"origin": KEYED_ORIGIN, "access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type"}  # fmt: skip
    preflight = httpx.options(url, headers=asked, timeout=10)
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == KEYED_ORIGIN
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert "authorization" in preflight.headers["access-control-allow-headers"]
    body = {"model": keyed_server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    auth = {"authorization": f"Bearer {KEYED_API_KEY}"}
    response = httpx.post(url, json=body, headers={"origin": KEYED_ORIGIN, **auth}, timeout=60)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == KEYED_ORIGIN


def test_another_origin_gets_no_grant(keyed_server):
    url = keyed_server.base_url + "/v1/models"
    other = "http://other.example"
    preflight = httpx.options(
        url, headers={"origin": other, "access-control-request-method": "GET"}, timeout=10
    )
    assert preflight.status_code == 403
    assert preflight.json()["error"]["code"] == "cors_not_allowed"
    assert "access-control-allow-origin" not in preflight.headers
    response = httpx.get(
        url, headers={"origin": other, "authorization": f"Bearer {KEYED_API_KEY}"}, timeout=10
    )
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


def test_the_wildcard_origin_with_credentials_is_refused_at_start():
    command = [sys.executable, "-m", "serval.entrypoints.cli", "serve", "--port", "1", "--allowed-origins", '["*"]',
               "--allow-credentials"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert 'allow_credentials with the origin "*"' in result.stderr and "Traceback" not in result.stderr
