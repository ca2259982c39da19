"""The real server with the default model, through the real `openai` SDK: each parameter does what the spec
says."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.helpers import metric, sse_chunks

# A real server process with the default model: minutes, not seconds.
pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "List three colors of the rainbow, one per line."}]
GREEDY = {"temperature": 0, "max_tokens": 24}


@pytest.fixture(scope="module")
def reference(openai_client, server):
    """The greedy answer to QUESTION, non-streamed."""
    response = openai_client.chat.completions.create(model=server.model, messages=QUESTION, **GREEDY)
    text = response.choices[0].message.content
    assert len(text) > 10, text
    return response


def test_response_fields_and_usage(reference, server):
    assert reference.object == "chat.completion" and reference.model == server.model
    assert reference.id.startswith("chatcmpl-")
    choice = reference.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    usage = reference.usage
    prompt = httpx.post(f"{server.base_url}/tokenize", json={"messages": QUESTION}).json()
    assert usage.prompt_tokens == prompt["count"]
    assert 0 < usage.completion_tokens <= GREEDY["max_tokens"]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0
    extra = reference.model_extra
    assert len(usage.model_extra["batch_size"]) == usage.completion_tokens
    assert len(usage.model_extra["queue_wait_time"]) == usage.completion_tokens
    assert extra["prefill_time"] > 0 and len(extra["decode_time_arr"]) == usage.completion_tokens - 1


def test_greedy_stream_text_equals_non_stream_text(openai_client, server, reference):
    stream = openai_client.chat.completions.create(
        model=server.model, messages=QUESTION, stream=True, **GREEDY
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        reference.choices[0].finish_reason
    ]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_cut_and_never_leaked(openai_client, server, reference, stream):
    text = reference.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    response = openai_client.chat.completions.create(
        model=server.model, messages=QUESTION, stop=[stop, "never-there"], stream=stream, **GREEDY
    )
    if stream:
        chunks = list(response)
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        content, finish = response.choices[0].message.content, response.choices[0].finish_reason
    assert (content, finish) == (expected, "stop")
    kept = openai_client.chat.completions.create(
        model=server.model,
        messages=QUESTION,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
        **GREEDY,
    )
    assert kept.choices[0].message.content == expected + stop


def test_max_tokens_ends_with_length(openai_client, server):
    for limit in ({"max_tokens": 3}, {"max_completion_tokens": 3}):
        response = openai_client.chat.completions.create(model=server.model, messages=QUESTION, **limit)
        assert response.choices[0].finish_reason == "length"
        assert response.usage.completion_tokens == 3


def test_n_choices_and_seed_reproducibility(openai_client, server):
    def ask(seed):
        return openai_client.chat.completions.create(
            model=server.model, messages=QUESTION, n=3, seed=seed, temperature=1.0, max_tokens=8
        )

    first, again, other = ask(7), ask(7), ask(8)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert texts != [c.message.content for c in other.choices]
    assert len(set(texts)) > 1  # each choice has its own seed
    assert 3 <= first.usage.completion_tokens <= 24  # all three choices are counted


def test_best_of_returns_n_of_the_sampled(openai_client, server):
    response = openai_client.chat.completions.create(
        model=server.model,
        messages=QUESTION,
        n=1,
        temperature=1.0,
        seed=3,
        max_tokens=6,
        extra_body={"best_of": 3},
    )
    assert len(response.choices) == 1 and response.choices[0].index == 0
    assert response.choices[0].logprobs is None
    assert response.usage.completion_tokens > 6  # the three sequences are all paid for


def test_logprobs_shape(openai_client, server):
    response = openai_client.chat.completions.create(
        model=server.model, messages=QUESTION, logprobs=True, top_logprobs=3, temperature=0, max_tokens=5
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode(errors="replace") == entry.token
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob


def test_sampling_parameters_change_the_output(openai_client, server, reference):
    def ask(**fields):
        return openai_client.chat.completions.create(model=server.model, messages=QUESTION, **fields)

    greedy_text = reference.choices[0].message.content
    # top_k 1 is greedy whatever the temperature.
    assert (
        ask(max_tokens=24, temperature=1.5, extra_body={"top_k": 1}).choices[0].message.content == greedy_text
    )
    penalized = ask(
        max_tokens=24, temperature=0, frequency_penalty=2.0, extra_body={"repetition_penalty": 1.5}
    )
    assert penalized.choices[0].message.content != greedy_text
    # ignore_eos: generation runs to max_tokens; the EOS it passes shows only with skip_special_tokens false.
    short = [{"role": "user", "content": "Say hi."}]
    fields = {"temperature": 0, "max_tokens": 40, "messages": short, "model": server.model}
    natural = openai_client.chat.completions.create(**fields)
    assert natural.choices[0].finish_reason == "stop" and natural.usage.completion_tokens < 40
    shown = openai_client.chat.completions.create(
        **fields, extra_body={"ignore_eos": True, "skip_special_tokens": False}
    )
    assert shown.usage.completion_tokens == 40 and shown.choices[0].finish_reason == "length"
    assert "<|im_end|>" in shown.choices[0].message.content
    hidden = openai_client.chat.completions.create(**fields, extra_body={"ignore_eos": True})
    assert "<|im_end|>" not in hidden.choices[0].message.content


def test_stop_token_ids(openai_client, server, reference):
    text = reference.choices[0].message.content
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": text}).json()["tokens"]
    stop_id = tokens[len(tokens) // 2]
    response = openai_client.chat.completions.create(
        model=server.model, messages=QUESTION, extra_body={"stop_token_ids": [stop_id]}, **GREEDY
    )
    assert response.choices[0].finish_reason == "stop"
    assert len(response.choices[0].message.content) < len(text)
    assert text.startswith(response.choices[0].message.content)


def test_concurrent_greedy_requests_equal_the_same_requests_alone(server):
    from openai import AsyncOpenAI

    prompts = [f"Count from {i} to {i + 5}." for i in range(16)]

    async def ask(client, prompt):
        response = await client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=6
        )
        return response.choices[0].message.content

    async def run():
        client = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        together = await asyncio.gather(*(ask(client, p) for p in prompts))
        alone = [await ask(client, p) for p in prompts]
        await client.close()
        return together, alone

    together, alone = asyncio.run(run())
    assert together == alone


def test_repeated_long_prompt_hits_the_prefix_cache(openai_client, server):
    long_text = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(40))
    messages = [{"role": "user", "content": long_text + " Which fact is first?"}]
    first = openai_client.chat.completions.create(model=server.model, messages=messages, max_tokens=1)
    second = openai_client.chat.completions.create(model=server.model, messages=messages, max_tokens=1)
    assert first.usage.prompt_tokens > 300
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert metric(server.base_url, "serval_prefix_cache_hits_total") > 0


def test_raw_stream_n_choices_and_usage_placement(server):
    body = {"model": server.model, "messages": QUESTION, "n": 2, "temperature": 1.0, "seed": 1, "max_tokens": 5,
            "stream": True}  # fmt: skip
    chunks = sse_chunks(server.base_url, "/v1/chat/completions", body)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert sum(1 for m in mine if m["finish_reason"]) == 1
    # No stream_options: usage rides on the last chunk (MindIE); include_usage: an extra chunk (OpenAI).
    assert "usage" in chunks[-1] and chunks[-1]["choices"] and chunks[-1]["usage"]["completion_tokens"] == 10
    body["stream_options"] = {"include_usage": True}
    chunks = sse_chunks(server.base_url, "/v1/chat/completions", body)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 10


def test_completions_endpoint(openai_client, server):
    response = openai_client.completions.create(
        model=server.model, prompt="The sky is", max_tokens=4, temperature=0
    )
    assert response.object == "text_completion" and response.choices[0].finish_reason == "length"
    echoed = openai_client.completions.create(
        model=server.model, prompt="The sky is", max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "The sky is" + response.choices[0].text
    streamed = openai_client.completions.create(
        model=server.model, prompt="The sky is", max_tokens=4, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == response.choices[0].text


def test_models_and_metrics(openai_client, server):
    assert [m.id for m in openai_client.models.list().data] == [server.model]
    assert metric(server.base_url, "serval_prompt_tokens_total") > 0
    assert metric(server.base_url, "serval_generation_tokens_total") > 0
    assert metric(server.base_url, "serval_time_to_first_token_seconds_count") > 0
    assert metric(server.base_url, "serval_e2e_request_latency_seconds_count") > 0
