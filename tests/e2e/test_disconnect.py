"""A client that goes away cancels its request: every KV block is free again right after."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.helpers import metric, wait_until_idle

# A real server process with the default model: minutes, not seconds.
pytestmark = pytest.mark.slow

LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0.8}


def test_disconnect_mid_stream_frees_every_block(server):
    wait_until_idle(server.base_url)
    body = {"model": server.model, "messages": [{"role": "user", "content": "Tell a long story."}], "stream": True,
            "n": 2, **LONG}  # fmt: skip
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        received = [line for _, line in zip(range(12), lines)]
        assert any(line.startswith("data: ") for line in received)
        assert metric(server.base_url, "serval_kv_cache_usage_perc") > 0
        assert metric(server.base_url, "serval_num_requests_running") == 2
    wait_until_idle(server.base_url, timeout=10)


def test_disconnect_while_waiting_for_a_non_stream_answer(server):
    wait_until_idle(server.base_url)
    body = {"model": server.model, "messages": [{"role": "user", "content": "Tell a long story."}], **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=1.5)
    wait_until_idle(server.base_url, timeout=10)
