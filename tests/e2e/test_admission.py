"""All-or-nothing admission on a real server, through the `openai` client: a request over
--max-seqs-per-request is a 400 naming `prompt` or `n` and runs nothing; one whose sequences don't all fit the
waiting queue is a 429 and not one of them runs, so the next small request is served; afterwards the KV
cache is back at its baseline."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import running_server
from tests.e2e.helpers import metric, wait_until_idle

# A real server process with the default model: minutes, not seconds.
pytestmark = pytest.mark.slow

CAP = 8  # --max-queue-len and --max-seqs-per-request both
QUERIES = "serval_prefix_cache_queries_total"  # prompt tokens of every engine request ever scheduled
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def small_queue(tmp_path_factory):
    # One sequence runs at a time, so a few requests fill the queue.
    args = ["--log-level", "warning", "--max-num-seqs", "1", "--max-queue-len", str(CAP),
            "--max-seqs-per-request", str(CAP)]  # fmt: skip
    with running_server(args, tmp_path_factory.mktemp("admission") / "server.log") as server:
        server.model = server.served_model()
        yield server


@pytest.fixture(scope="module")
def client(small_queue):
    # max_retries=0: the SDK would retry a 429 by itself. A long timeout: a busy CI machine is slow.
    return openai.OpenAI(base_url=f"{small_queue.base_url}/v1", api_key="unused", max_retries=0, timeout=600)


def num_tokens(server, prompt: str) -> int:
    return httpx.post(f"{server.base_url}/tokenize", json={"prompt": prompt}).json()["count"]


def check_refusal(error: openai.APIStatusError, status: int, param: str | None, code: str) -> None:
    assert error.status_code == status
    assert set(error.body) == {"message", "type", "param", "code"}, error.body
    assert (error.param, error.code) == (param, code)


def test_more_sequences_than_the_cap_is_400_and_nothing_runs(small_queue, client):
    base = small_queue.base_url
    wait_until_idle(base)
    queries, free = metric(base, QUERIES), metric(base, "serval_kv_cache_free_blocks")
    too_many = [
        (client.completions.create, {"prompt": ["Hello"] * (CAP + 1)}, "prompt"),
        (client.completions.create, {"prompt": ["Hello"] * 3, "n": 3, "temperature": 1.0}, "n"),
        (client.chat.completions.create, {"messages": HI, "n": CAP + 1, "temperature": 1.0}, "n"),
    ]
    for create, fields, param in too_many:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                create(model=small_queue.model, max_tokens=4, stream=stream, **fields)
            check_refusal(refused.value, 400, param, "invalid_value")
            assert f"at most {CAP} are allowed per request" in refused.value.body["message"]
    assert metric(base, QUERIES) == queries  # not one sequence was ever scheduled
    assert metric(base, "serval_num_requests_running") == metric(base, "serval_num_requests_waiting") == 0
    assert metric(base, "serval_kv_cache_free_blocks") == free


def test_a_request_that_overflows_the_queue_is_429_and_none_of_it_runs(small_queue, client):
    base = small_queue.base_url
    wait_until_idle(base)
    queries, free = metric(base, QUERIES), metric(base, "serval_kv_cache_free_blocks")
    busy, other = "Count from one to a hundred:", "Name a colour."
    results: list = []

    def fill_the_queue() -> None:
        # Six sequences, one running at a time: five wait, a second or more.
        results.append(
            client.completions.create(
                model=small_queue.model, prompt=[busy] * 6, max_tokens=32, extra_body={"ignore_eos": True}
            )
        )

    background = threading.Thread(target=fill_the_queue)
    background.start()
    deadline = time.monotonic() + 30
    while metric(base, "serval_num_requests_waiting") < 4:
        assert time.monotonic() < deadline and background.is_alive(), "the queue never filled"
        time.sleep(0.02)
    num_waiting = metric(base, "serval_num_requests_waiting")
    with pytest.raises(openai.RateLimitError) as refused:  # CAP sequences into a queue of CAP, half taken
        client.completions.create(model=small_queue.model, prompt=[other] * CAP, max_tokens=4)
    check_refusal(refused.value, 429, None, "queue_full")
    assert refused.value.response.headers["retry-after"] == "1"
    assert metric(base, "serval_num_requests_waiting") <= num_waiting  # none of it was queued
    # The very next request is served: the refused one holds no place in the queue.
    small = client.completions.create(model=small_queue.model, prompt=other, max_tokens=3)
    assert small.usage.completion_tokens >= 1 and small.choices[0].finish_reason in ("stop", "length")
    background.join(timeout=600)
    assert len(results[0].choices) == 6
    assert all(c.finish_reason == "length" for c in results[0].choices)
    wait_until_idle(base)
    # Only the six busy prompts and the small one were ever scheduled, never the refused eight.
    scheduled = metric(base, QUERIES) - queries
    assert scheduled == 6 * num_tokens(small_queue, busy) + num_tokens(small_queue, other)
    assert metric(base, "serval_kv_cache_free_blocks") == free
