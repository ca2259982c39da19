"""What the engine hands the event loop is the receiver's own: an output is never changed by later steps, and
serving's usage timings are complete from the outputs it took in, even when it stops reading early."""

from __future__ import annotations

import copy

import pytest

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.engine import Engine
from serval.sampling import SamplingParams
from serval.serving.choices import SequencePlan, usage_of
from serval.serving.stream import ChoiceStream

PROMPT = [7, 99, 250, 13, 5, 42, 17]


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    config = EngineConfig(
        model=ModelConfig(model=tiny_model_factory("llama")[0], dtype="float32"),
        cache=CacheConfig(num_blocks=64),
    )
    return Engine(config)


class XText:
    """Every token reads "x": a stop string of k x's ends a choice at its k-th token."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)

    def token_bytes(self, token_id: int) -> bytes:
        return b"x"


def _drain(engine: Engine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def test_an_output_is_not_changed_by_later_steps(engine):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", PROMPT, params)
    engine.add_request("b", PROMPT[:3], params)
    first = engine.step()
    held = copy.deepcopy(first)
    rest = _drain(engine)
    assert first == held  # the engine kept no handle on anything it gave away
    for request_id in ("a", "b"):
        timings = [o.timing for o in first + rest if o.request_id == request_id]
        # Each output brings its own token's entries; the running scalars are final from the first token on.
        assert [len(t.batch_sizes) for t in timings] == [1] * 6
        assert [len(t.decode_time_ms) for t in timings] == [0] + [1] * 5
        assert timings[0].prefill_time_ms > 0 and {t.prefill_time_ms for t in timings} == {
            timings[0].prefill_time_ms
        }
        assert [t.batch_sizes[0] for t in timings] == [2] * 6  # the two shared every step


def test_usage_after_a_stop_string_counts_only_the_tokens_read(engine):
    # Serving ends a choice at a stop string and aborts its engine request, but the engine may run more
    # steps before the abort reaches it; the usage must describe the tokens the choice took in.
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=("xxx",))
    stream = ChoiceStream(0, XText(), params, return_logprobs=False)
    engine.add_request("s", PROMPT, params)
    while not stream.is_finished:
        for output in engine.step():
            stream.feed(output)
    for _ in range(3):
        engine.step()  # the abort has not landed yet
    engine.abort_request("s")
    usage = usage_of([PROMPT], [SequencePlan(0, 0, PROMPT, params)], [stream])
    assert usage.num_completion_tokens == 3
    assert len(usage.batch_sizes) == len(usage.queue_wait_us) == 3
    assert len(usage.decode_time_ms) == 2 and usage.prefill_time_ms > 0


def test_a_beam_search_output_carries_every_step(engine):
    params = SamplingParams(use_beam_search=True, n=2, max_tokens=4, ignore_eos=True)
    engine.add_request("beam", PROMPT, params)
    [output] = _drain(engine)
    timing = output.timing
    assert len(timing.batch_sizes) == len(timing.queue_wait_us) == 4  # one per generated position
    assert len(timing.decode_time_ms) == 3 and timing.prefill_time_ms > 0
