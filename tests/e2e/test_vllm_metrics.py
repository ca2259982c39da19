"""The vllm:* metrics of a real server, scraped as Prometheus parses them, move exactly as the requests that
were answered say they should: token counts equal the usage the responses reported, one latency observation
per request, one inter-token gap per token after a sequence's first, finished sequences by reason (an
abandoned stream counted as abort), and the engine's gauges back at rest."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.helpers import wait_until_idle

# A real server process with the default model: minutes, not seconds.
pytestmark = pytest.mark.slow

QUESTION = "Name three colours of the rainbow."


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of every sample; a malformed exposition raises here."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_metrics_move_as_the_responses_say(server, openai_client):
    wait_until_idle(server.base_url)
    model = {"model_name": server.model}
    before = scrape(server.base_url)
    messages = [{"role": "user", "content": QUESTION}]
    plain = openai_client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=12, temperature=0
    )
    # The same prompt again: its prefix is served from the cache this time.
    stream = openai_client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    streamed_usage = chunks[-1].usage
    [streamed_finish] = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    two = openai_client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=6, n=2)
    after = scrape(server.base_url)

    usages = [plain.usage, streamed_usage, two.usage]
    assert moved(before, after, "vllm:prompt_tokens_total", **model) == sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    assert moved(before, after, "vllm:generation_tokens_total", **model) == generated
    # serval's own counters agree with vLLM's names.
    assert moved(before, after, "serval_generation_tokens_total") == generated
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count",
                 "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count"):  # fmt: skip
        assert moved(before, after, name, **model) == 3, name
    assert moved(before, after, "vllm:request_generation_tokens_sum", **model) == generated
    # One gap per token after each sequence's first: 1 + 1 + 2 sequences.
    gaps = generated - 4
    assert moved(before, after, "vllm:inter_token_latency_seconds_count", **model) == gaps
    assert moved(before, after, "vllm:time_per_output_token_seconds_count", **model) == gaps
    assert moved(before, after, "vllm:inter_token_latency_seconds_sum", **model) > 0

    reasons = [plain.choices[0].finish_reason, streamed_finish, *(c.finish_reason for c in two.choices)]
    for reason in ("stop", "length"):
        assert moved(before, after, "vllm:request_success_total", finished_reason=reason, **model) == (
            reasons.count(reason)
        ), reason
    assert moved(before, after, "vllm:request_success_total", finished_reason="abort", **model) == 0

    cached = streamed_usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    hits = moved(before, after, "vllm:prefix_cache_hits_total", **model)
    assert (
        hits
        == cached
        + plain.usage.prompt_tokens_details.cached_tokens
        + two.usage.prompt_tokens_details.cached_tokens
    )
    assert moved(before, after, "vllm:prefix_cache_queries_total", **model) >= hits

    wait_until_idle(server.base_url)
    rest = scrape(server.base_url)
    assert value(rest, "vllm:num_requests_running", **model) == 0
    assert value(rest, "vllm:num_requests_waiting", **model) == 0
    assert value(rest, "vllm:kv_cache_usage_perc", **model) == 0


def test_an_abandoned_stream_counts_as_abort(server):
    wait_until_idle(server.base_url)
    labels = {"model_name": server.model, "finished_reason": "abort"}
    before = scrape(server.base_url)
    body = {"model": server.model, "messages": [{"role": "user", "content": "Tell a long story."}],
            "stream": True, "max_tokens": 2000, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as response:
        # NOTE: the iterator is kept: once collected it would close the response, which is the disconnect.
        lines = response.iter_lines()
        assert [line for _, line in zip(range(6), lines) if line.startswith("data: ")]
        assert value(scrape(server.base_url), "vllm:num_requests_running", model_name=server.model) == 1
    wait_until_idle(server.base_url)
    after = scrape(server.base_url)
    assert moved(before, after, "vllm:request_success_total", **labels) == 1
    assert moved(before, after, "vllm:e2e_request_latency_seconds_count", model_name=server.model) == 0


def test_cache_config_info_matches_the_model_info(server):
    samples = scrape(server.base_url)
    [(name, labels)] = [key for key in samples if key[0] == "vllm:cache_config_info"]
    cache = dict(labels)
    [(_, info_labels)] = [key for key in samples if key[0] == "serval_model_info"]
    info = dict(info_labels)
    assert cache["model_name"] == info["model"] == server.model
    assert int(cache["block_size"]) * int(cache["num_gpu_blocks"]) == int(info["kv_cache_tokens"])
    assert (
        cache["cache_dtype"] == info["kv_cache_dtype"] == info["dtype"]
    )  # an "auto" cache: the compute dtype
    assert samples[(name, labels)] == 1.0
