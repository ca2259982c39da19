"""Draining for a graceful shutdown (scripted engine): generations in flight go on through the grace period,
then every choice still running ends with what it has (finish_reason "length") and the usage follows; after
that moment nothing new starts (the HTTP side: tests/api/test_admission.py)."""

from __future__ import annotations

import asyncio

import pytest

from serval.sampling import SamplingParams
from serval.serving.errors import ShuttingDownError
from serval.serving.frontend import Frontend
from serval.serving.stream import ChoiceDelta, Usage
from tests.serving.fakes import ByteTokenizer, FakeEngine

TEXT = "word " * 40  # 200 tokens
GRACE_S = 0.3
STALL_AFTER = 20  # tokens of each request before the engine stalls: only the cut-off can end it


def make() -> tuple[Frontend, FakeEngine]:
    engine = FakeEngine([TEXT, TEXT.upper()], max_model_len=1024, stall_after=STALL_AFTER)
    return Frontend(engine, ByteTokenizer()), engine


def run(scenario):
    """Run the scenario; 60 s bounds a failure (a generation nothing ended), no window anything must fit."""
    return asyncio.run(asyncio.wait_for(scenario, 60))


def test_in_flight_generations_are_cut_off_after_the_grace_period():
    frontend, engine = make()
    params = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=500)

    async def scenario():
        events = frontend.generate("r", [[1, 2]], params)
        first = await anext(events)
        loop = asyncio.get_running_loop()
        started = loop.time()
        frontend.drain.begin(GRACE_S)
        # Still inside the grace period: a new generation is taken, and runs to its end (3 < STALL_AFTER).
        short = [e async for e in frontend.generate("s", [[1]], SamplingParams(max_tokens=3))]
        rest = [e async for e in events]  # the engine has stalled: it ends only when the drain cuts it off
        return [first, *rest], short, loop.time() - started

    events, short, elapsed = run(scenario())
    assert frontend.drain.is_cut_off and elapsed > GRACE_S - 0.05  # cut at the end of the grace period
    deltas = [e for e in events if isinstance(e, ChoiceDelta)]
    assert isinstance(events[-1], Usage)
    for index in (0, 1):
        mine = [d for d in deltas if d.index == index]
        assert [d.finish_reason for d in mine if d.finish_reason] == ["length"]  # exactly one, at the end
        assert mine[-1].finish_reason == "length"
        assert 0 < len("".join(d.text for d in mine)) < len(TEXT)
    assert events[-1].num_completion_tokens < 2 * len(TEXT)
    assert sorted(engine.aborted) == ["r-0", "r-1"]  # their engine requests were ended too
    assert [d.finish_reason for d in short if isinstance(d, ChoiceDelta) and d.finish_reason] == ["length"]
    assert "s-0" in engine.finished


def test_nothing_starts_once_the_grace_period_is_over():
    frontend, engine = make()

    async def scenario():
        frontend.drain.begin(0.0)
        while not frontend.drain.is_cut_off:  # the cut-off runs on the loop, at one of its next turns
            await asyncio.sleep(0)
        with pytest.raises(ShuttingDownError):
            await anext(frontend.generate("late", [[1]], SamplingParams(max_tokens=3)))

    run(scenario())
    assert engine.num_added == 0 and frontend.drain.num_in_flight == 0
