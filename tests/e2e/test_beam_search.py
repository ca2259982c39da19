"""Beam search through the real server and the `openai` SDK, on the default model."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.helpers import sse_chunks, wait_until_idle

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name a fruit that is yellow."}]
BEAMS = {"n": 3, "max_tokens": 12, "logprobs": True, "top_logprobs": 2}
BEAM_FIELDS = {"use_beam_search": True, "length_penalty": 0.0}  # score = cumulative logprob


@pytest.fixture(scope="module")
def beams(openai_client, server):
    return openai_client.chat.completions.create(
        model=server.model, messages=QUESTION, extra_body=BEAM_FIELDS, **BEAMS
    )


def _cumulative(choice) -> float:
    return sum(entry.logprob for entry in choice.logprobs.content)


def test_n_distinct_beams_best_first(beams, server):
    choices = beams.choices
    assert [c.index for c in choices] == [0, 1, 2]
    texts = [c.message.content for c in choices]
    assert len(set(texts)) == 3, texts
    scores = [_cumulative(c) for c in choices]
    assert scores == sorted(scores, reverse=True)
    for choice in choices:
        assert choice.finish_reason in ("stop", "length")
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    # Every beam's tokens are counted (an ending EOS among them, which has no text).
    assert beams.usage.completion_tokens >= sum(len(c.logprobs.content) for c in choices) - 3
    wait_until_idle(server.base_url)


def test_best_beam_scores_at_least_the_greedy_answer(openai_client, server, beams):
    greedy = openai_client.chat.completions.create(
        model=server.model, messages=QUESTION, temperature=0, max_tokens=12, logprobs=True
    )
    if greedy.choices[0].finish_reason == beams.choices[0].finish_reason == "length":
        assert _cumulative(beams.choices[0]) >= _cumulative(greedy.choices[0]) - 1e-3


def test_stream_is_pseudo_streaming_with_the_same_beams(server, beams):
    body = {"model": server.model, "messages": QUESTION, "stream": True, **BEAMS, **BEAM_FIELDS}
    chunks = sse_chunks(server.base_url, "/v1/chat/completions", body)
    content: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["delta"].get("content"):
                content.setdefault(choice["index"], []).append(choice["delta"]["content"])
            if choice.get("finish_reason"):
                finish[choice["index"]] = choice["finish_reason"]
    # Each beam arrives whole, in one chunk, once the search is over.
    assert all(len(parts) == 1 for parts in content.values())
    assert {i: parts[0] for i, parts in content.items()} == {
        c.index: c.message.content for c in beams.choices if c.message.content
    }
    assert finish == {c.index: c.finish_reason for c in beams.choices}


def test_completions_endpoint_beam_search(server):
    body = {
        "model": server.model,
        "prompt": "The capital of France is",
        "n": 2,
        "max_tokens": 6,
        **BEAM_FIELDS,
    }
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    texts = [c["text"] for c in response.json()["choices"]]
    assert len(texts) == 2 and texts[0] != texts[1]


def test_a_search_too_big_for_the_cache_is_400(server):
    body = {"model": server.model, "messages": QUESTION, "n": 128, "max_tokens": 8000, **BEAM_FIELDS}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "KV blocks" in response.json()["error"]["message"]
    wait_until_idle(server.base_url)
