"""Frontend with a scripted engine: n / best_of fan-out, stop strings abort, deadlines, usage, the fold."""

from __future__ import annotations

import asyncio

import pytest

from serval.sampling import SamplingParams
from serval.serving.errors import InvalidRequestError
from serval.serving.frontend import Frontend
from serval.serving.stream import ChoiceDelta, Usage
from tests.serving.fakes import ByteTokenizer, FakeEngine


def make(texts: list[str], **kwargs) -> tuple[Frontend, FakeEngine]:
    engine = FakeEngine(texts, delay=kwargs.pop("delay", 0.0), stall_after=kwargs.pop("stall_after", None))
    return Frontend(engine, ByteTokenizer(), **kwargs), engine


def run(coro):
    return asyncio.run(coro)


def test_fold_of_the_stream_is_the_text_without_eos():
    frontend, engine = make(["héllo wörld"])
    prompt = frontend.render_chat([{"role": "user", "content": "hi"}])
    result = run(frontend.complete("r", [prompt], SamplingParams(max_tokens=100)))
    [choice] = result.choices
    assert (choice.text, choice.finish_reason) == ("héllo wörld", "stop")
    assert result.usage.num_completion_tokens == len("héllo wörld".encode()) + 1  # EOS counts
    assert result.usage.num_prompt_tokens == len(prompt)
    assert result.usage.batch_sizes == [1] * result.usage.num_completion_tokens
    assert engine.aborted == []


def test_stop_string_ends_the_choice_and_aborts_the_engine_request():
    frontend, engine = make(["one, two, three"])
    result = run(frontend.complete("r", [[1, 2]], SamplingParams(max_tokens=100, stop=(", t",))))
    assert result.choices[0].text == "one"
    assert result.choices[0].finish_reason == "stop"
    assert engine.aborted == ["r-0"]


def test_include_stop_str_in_output():
    frontend, _ = make(["one, two"])
    params = SamplingParams(max_tokens=100, stop=(",",), include_stop_str_in_output=True)
    assert run(frontend.complete("r", [[1]], params)).choices[0].text == "one,"


def test_max_tokens_is_length_and_capped_by_the_context():
    frontend, _ = make(["abcdef"])
    result = run(frontend.complete("r", [[1]], SamplingParams(max_tokens=3)))
    assert (result.choices[0].text, result.choices[0].finish_reason) == ("abc", "length")
    assert frontend.resolve_max_tokens(250, 100) == 6  # 256-token context
    with pytest.raises(InvalidRequestError, match="maximum context length is 256"):
        frontend.resolve_max_tokens(256, None)


def test_max_input_tokens_and_max_iter_times():
    frontend, _ = make(["abcdef"], max_input_tokens=10, max_iter_times=4)
    assert frontend.resolve_max_tokens(5, None) == 4
    assert frontend.resolve_max_tokens(5, 2) == 2
    with pytest.raises(InvalidRequestError, match="11 tokens, more than the 10"):
        frontend.resolve_max_tokens(11, None)


def test_n_choices_interleave_and_seed_offsets_make_them_differ():
    frontend, _ = make(["aaaa", "bbbb", "cccc"])

    async def collect():
        events = [e async for e in frontend.generate("r", [[1]], SamplingParams(n=3, seed=0, max_tokens=50))]
        return events

    events = run(collect())
    deltas = [e for e in events if isinstance(e, ChoiceDelta)]
    assert isinstance(events[-1], Usage)
    assert [d.index for d in deltas[:3]] == [0, 1, 2]  # one token each per step, interleaved
    texts = {i: "".join(d.text for d in deltas if d.index == i) for i in range(3)}
    assert texts == {0: "aaaa", 1: "bbbb", 2: "cccc"}
    assert sum(1 for d in deltas if d.finish_reason) == 3
    assert events[-1].num_completion_tokens == 15


def test_best_of_keeps_the_highest_cumulative_logprob():
    # The fake's logprob per token is -0.1 * (seed + 1): seed 0 is the most likely sequence.
    frontend, _ = make(["low", "mid", "top"])
    result = run(frontend.complete("r", [[1]], SamplingParams(n=1, best_of=3, seed=0, max_tokens=50)))
    assert [c.text for c in result.choices] == ["low"]
    assert result.choices[0].index == 0
    assert result.choices[0].logprobs is None  # asked for internally, not returned
    assert result.usage.num_completion_tokens == 12


def test_logprobs_carry_token_text_and_bytes():
    frontend, _ = make(["é"])
    result = run(
        frontend.complete("r", [[1]], SamplingParams(max_tokens=50, logprobs=1), return_logprobs=True)
    )
    entries = result.choices[0].logprobs
    assert [e.token_bytes for e in entries] == [b"\xc3", b"\xa9", b"<|im_end|>"]
    assert all(len(e.top) == 1 for e in entries)


def test_deadline_cuts_off_with_length():
    # The engine stalls after 5 tokens: nothing but the deadline can end the request.
    frontend, engine = make(["x" * 100], stall_after=5)
    result = run(frontend.complete("r", [[1]], SamplingParams(max_tokens=200), timeout=0.5))
    assert result.choices[0].finish_reason == "length"
    assert 0 < len(result.choices[0].text) < 100
    assert engine.aborted == ["r-0"]


def test_closing_the_stream_aborts_every_engine_request():
    frontend, engine = make(["x" * 100], stall_after=5)  # neither choice can end before the close

    async def read_some():
        events = frontend.generate("r", [[1]], SamplingParams(n=2, seed=1, max_tokens=200))
        async for event in events:
            if isinstance(event, ChoiceDelta):
                break
        await events.aclose()  # the engine requests are aborted before aclose returns

    run(read_some())
    assert sorted(engine.aborted) == ["r-0", "r-1"]
