"""`serval serve --replicas 2 --replica-threads 1`: two engine replicas on Ray Serve behind one endpoint.

One replica server (a local Ray cluster) for the module, compared with the session's single server (same
model, fp32). The fault test kills a replica process mid-load and runs last.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading

import httpx
import pytest

from tests.e2e.conftest import running_server
from tests.e2e.helpers import metric, wait_for, wait_until_idle

pytestmark = pytest.mark.slow

REPLICA_STARTUP_S = 300
PREFIX = "You are a terse assistant. " * 24  # ~150 tokens: several full KV blocks shared by every request


def _health(base_url: str) -> dict:
    return httpx.get(base_url + "/health", timeout=10).json()


def _health_or_none(base_url: str) -> dict:
    try:
        return _health(base_url)
    except httpx.HTTPError:
        return {}


def _wait_for_replicas(base_url: str, num: int, timeout: float, exclude_pids: frozenset[int] = frozenset()):
    def is_up(health: dict) -> bool:
        pids = {r["pid"] for r in health.get("replicas", [])}
        return len(pids) == num and not pids & exclude_pids

    return wait_for(
        lambda: _health_or_none(base_url), is_up, timeout, f"{num} replicas (not {sorted(exclude_pids)})"
    )


def _kill_all(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, server):
    directory = tmp_path_factory.mktemp("replicas")
    args = ["--log-level", "warning", "--dtype", "float32", "--replicas", "2", "--replica-threads", "1",
            "--kv-cache-memory-bytes", "256MiB"]  # fmt: skip
    pids: set[int] = set()  # every replica pid seen, killed at teardown if still alive
    with contextlib.ExitStack() as stack:
        stack.callback(_kill_all, pids)  # after the server stops: Ray stops them with it; this is a backstop
        replica_server = stack.enter_context(
            running_server(args, directory / "replicas.log", timeout_s=REPLICA_STARTUP_S)
        )
        health = _wait_for_replicas(replica_server.base_url, 2, 60)
        pids.update(r["pid"] for r in health["replicas"])
        # --replica-threads 1, as torch counts its threads inside each replica process.
        assert [r["num_threads"] for r in health["replicas"]] == [1, 1], health
        replica_server.model = server.model
        replica_server.pids = pids
        yield replica_server


def _complete(base_url: str, model: str, prompt: str, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0.0, **extra}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_greedy_output_equals_the_single_server(replicas, server):
    from openai import OpenAI

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    for prompt in prompts:
        one = _complete(server.base_url, server.model, prompt)["choices"][0]["text"]
        many = _complete(replicas.base_url, replicas.model, prompt)["choices"][0]["text"]
        assert many == one and many
    # Streamed chat, through the real openai client: the same deltas' text as the single server's answer.
    messages = [{"role": "user", "content": "Name three colours."}]
    texts = []
    for base_url in (server.base_url, replicas.base_url):
        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=24, temperature=0.0, stream=True
        )
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    assert texts[0] == texts[1] and texts[0]


def test_n_and_structured_output_run_on_a_replica(replicas):
    body = {"model": replicas.model, "messages": [{"role": "user", "content": "Give a JSON object."}],
            "max_tokens": 40, "temperature": 0.8, "seed": 1, "n": 2, "response_format": {"type": "json_object"}}  # fmt: skip
    response = httpx.post(replicas.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        if choice["finish_reason"] == "stop":
            json.loads(choice["message"]["content"])  # the grammar held on the replica


def test_shared_prefix_lands_on_the_replica_that_caches_it(replicas):
    before = {r["id"]: r["num_prefix_cache_hits"] for r in _health(replicas.base_url)["replicas"]}
    cached = []
    for i in range(6):
        usage = _complete(replicas.base_url, replicas.model, f"{PREFIX} Question {i}:", max_tokens=2)["usage"]
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    # Every request after the first found the shared head cached: all went where it was computed.
    assert cached[0] == 0 or cached[0] < cached[1]
    assert all(c >= 128 for c in cached[1:]), cached

    def hits() -> dict[str, int]:
        return {r["id"]: r["num_prefix_cache_hits"] for r in _health(replicas.base_url)["replicas"]}

    def gains(after: dict[str, int]) -> list[int]:
        return sorted(after[i] - before.get(i, 0) for i in after)

    # Reports come by polls, one replica at a time: until both replicas' reports are in and one shows the hits.
    after = wait_for(
        hits, lambda after: len(after) == 2 and gains(after)[-1] >= sum(cached[1:]), 60, "the hits reported"
    )
    # The other replica ran none of them: it gained less than any one of them hit. (Not "nothing": `before` is
    # each replica's last polled report, which may predate the previous test's last requests, whose chat
    # template's first block can hit there; a CI run read 16 such tokens.)
    assert gains(after)[0] < min(cached[1:]) and gains(after)[-1] >= sum(cached[1:]), (before, after)
    # /metrics is the sum over the replicas (idle now, so both reads see the same reports).
    assert metric(replicas.base_url, "serval_prefix_cache_hits_total") == sum(after.values())


def test_cache_control_pins_on_a_replica_and_the_next_turn_hits_them(replicas):
    system = "You answer questions about a long book. " * 12

    def ask(question: str) -> dict:
        part = {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}
        body = {"model": replicas.model, "max_tokens": 2, "temperature": 0.0,
                "messages": [{"role": "system", "content": [part]}, {"role": "user", "content": question}]}  # fmt: skip
        response = httpx.post(replicas.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]

    first = ask("What is chapter one about?")
    created = first["cache_creation_input_tokens"]
    assert created >= 16 and created % 16 == 0
    second = ask("And chapter two?")
    # Routed to the replica holding the pin: a hit, and nothing pinned anew (elsewhere it would pin again).
    assert second["cached_tokens"] >= created and second["cache_creation_input_tokens"] == 0
    # Until the pinning replica's report is in (polled, one replica at a time).
    pinned = wait_for(
        lambda: metric(replicas.base_url, "serval_kv_cache_pinned_blocks"),
        lambda pinned: pinned == created // 16,
        60,
        "the pinned blocks reported",
    )
    assert pinned == created // 16


def test_bad_input_is_a_4xx_from_the_ingress(replicas):
    cases = [
        ({"prompt": "hi", "max_tokens": -1}, 400),
        ({"prompt": "hi " * 5000, "max_tokens": 4}, 400),  # past the context
        ({"prompt": [[10**9]], "max_tokens": 4}, 400),  # a token id outside the vocabulary
        ({"prompt": "hi", "model": "no-such-model"}, 404),
    ]
    for extra, status in cases:
        body = {"model": replicas.model, **extra}
        response = httpx.post(replicas.base_url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == status, (extra, response.text)
        assert set(response.json()["error"]) >= {"message", "type", "code"}


def _idle_kv_usage(base_url: str) -> float:
    """The KV cache's usage once both replicas report being idle: nothing running or waiting, and no block in use
    but the pins of earlier tests."""

    def read() -> dict:
        names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_cache_free_blocks",
                 "kv_cache_total_blocks", "kv_cache_pinned_blocks")  # fmt: skip
        return {name: metric(base_url, f"serval_{name}") for name in names}

    def is_idle(m: dict) -> bool:
        return (
            len(_health(base_url)["replicas"]) == 2
            and m["num_requests_running"] == m["num_requests_waiting"] == 0
            and m["kv_cache_total_blocks"] - m["kv_cache_free_blocks"] == m["kv_cache_pinned_blocks"]
        )

    return wait_for(read, is_idle, 60, "both replicas idle")["kv_cache_usage_perc"]


def test_disconnect_aborts_the_request_on_its_replica(replicas):
    before = _idle_kv_usage(replicas.base_url)
    body = {"model": replicas.model, "prompt": "Tell a long story.", "stream": True, "max_tokens": 2000,
            "ignore_eos": True, "n": 2}  # fmt: skip
    with httpx.stream("POST", replicas.base_url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()  # NOTE: kept: a dropped iterator closes the response (a disconnect)
        received = [line for _, line in zip(range(12), lines)]
        assert sum(line.startswith("data: ") for line in received) == 6, received
        # Until a report of the replica running them arrives (reports are polled, one replica at a time, and a
        # busy one-thread replica on a loaded machine answers its poll late).
        wait_for(
            lambda: metric(replicas.base_url, "serval_num_requests_running"),
            lambda num: num == 2,
            60,
            "a replica's report of the two running requests",
        )
    # The replica aborted both and freed their blocks.
    wait_until_idle(replicas.base_url, timeout=60, kv_usage=before)


def _stream_outcome(base_url: str, body: dict, outcomes: list, started: threading.Event) -> None:
    """One streamed request: ("ok"), or ("error", status, error body) for an HTTP error or an SSE error event.
    `started` is set once its first token came (or once it ended without one)."""
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as response:
            if response.status_code != 200:
                outcomes.append(("error", response.status_code, json.loads(response.read())["error"]))
                return
            for line in response.iter_lines():
                if line.startswith("data: {") and '"error"' in line[:20]:
                    outcomes.append(("error", 200, json.loads(line[len("data: ") :])["error"]))
                    return
                started.set()
            outcomes.append(("ok",))
    except httpx.HTTPError as e:
        outcomes.append(("transport", repr(e)))
    finally:
        started.set()


def test_a_killed_replica_fails_only_its_requests_and_comes_back(replicas):
    health = _wait_for_replicas(replicas.base_url, 2, 60)
    old_pids = frozenset(r["pid"] for r in health["replicas"])
    outcomes: list = []
    threads = []
    started = [threading.Event() for _ in range(8)]
    for i in range(8):
        body = {"model": replicas.model, "prompt": f"Story number {i}:", "stream": True, "max_tokens": 48,
                "ignore_eos": True, "temperature": 0.0}  # fmt: skip
        thread = threading.Thread(
            target=_stream_outcome, args=(replicas.base_url, body, outcomes, started[i])
        )
        thread.start()
        threads.append(thread)
    for event in started:  # mid-load: every request has its first token (they run on both replicas)
        assert event.wait(timeout=120), "a request had no token in 120 s"
    victim = min(old_pids)
    os.kill(victim, signal.SIGKILL)
    # The endpoint keeps answering meanwhile (the other replica, or the request sent again).
    _complete(replicas.base_url, replicas.model, "Still there?", max_tokens=4)
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a request hung after its replica died"
    assert len(outcomes) == 8
    for outcome in outcomes:
        assert outcome[0] in ("ok", "error"), outcome
        if outcome[0] == "error":  # the documented error of a request whose replica died
            _, status, error = outcome
            assert status in (200, 500) and error["code"] == "engine_error", outcome
            assert "replica" in error["message"], outcome
    assert any(outcome[0] == "ok" for outcome in outcomes)
    # Ray restarts it: two replicas again, the victim not among them.
    health = _wait_for_replicas(replicas.base_url, 2, 180, exclude_pids=frozenset({victim}))
    replicas.pids.update(r["pid"] for r in health["replicas"])
    _complete(replicas.base_url, replicas.model, "Back again?", max_tokens=4)
