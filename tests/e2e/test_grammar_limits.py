"""On the real server with its default grammar limits (10 s, 1 GiB, two worker processes): a schema that
cannot compile in time is a 400 naming response_format, a structured request sent while it compiles is
answered first, and the server serves structured requests normally afterwards."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from tests.api.invalid_cases import CHAT, check_error
from tests.e2e.helpers import cpu_seconds_below, wait_for, wait_until_idle

# SLOW compiles well past the server's 10 s deadline on any CPU here, in little memory.
from tests.serving.test_grammar_limits import SLOW

pytestmark = pytest.mark.slow

COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}


def structured(server, schema: dict) -> httpx.Response:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Pick a color."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": True},
        },
        "max_tokens": 24,
        "temperature": 0,
    }
    return httpx.post(server.base_url + CHAT, json=body, timeout=120)


def test_a_slow_schema_is_a_400_and_holds_up_no_one(server):
    # The first structured request starts the worker processes (seconds); here it is not the one measured.
    assert structured(server, {"type": "object"}).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # The slow schema is in a worker once a process below the server spends CPU time (no endpoint says so).
        before = cpu_seconds_below(server.process.pid)
        slow = pool.submit(structured, server, SLOW)
        wait_for(
            lambda: cpu_seconds_below(server.process.pid),
            lambda now: any(seconds - before.get(pid, 0.0) >= 0.2 for pid, seconds in now.items()),
            60,
            "a grammar worker process at work on the slow schema",
        )
        normal = structured(server, COLOR)
        assert not slow.done()  # answered while the slow schema was still compiling
        refused = slow.result()
    assert normal.status_code == 200, normal.text
    assert (
        json.loads(normal.json()["choices"][0]["message"]["content"])["color"]
        in COLOR["properties"]["color"]["enum"]
    )
    error = check_error(refused, 400, "response_format")
    assert "did not compile within 10 s" in error["message"]
    # The killed worker's replacement serves the next new schema.
    again = structured(server, {**COLOR, "properties": {"color": {"enum": ["cyan", "magenta"]}}})
    assert again.status_code == 200, again.text
    wait_until_idle(server.base_url)
