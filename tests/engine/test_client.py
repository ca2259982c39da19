"""EngineClient's seam: typed commands handled on the engine thread in order, typed failures raised by the
request's stream, stats read only from the snapshot the engine thread publishes, and the engine touched by no
other thread once the client runs. The tiny llama is real."""

from __future__ import annotations

import asyncio
import threading

import pytest

from serval.engine.client import EngineClient, EngineDeadError, NewRequest
from serval.engine.engine import Engine
from serval.engine.lora import LoraError, UnknownLoraError
from serval.engine.messages import EngineStats, FailureKind, RequestFailed
from serval.sampling import SamplingParams
from tests.engine.test_admission import _engine

PROMPT = list(range(3, 40))  # 37 tokens: three blocks
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE_THREAD = "serval-engine"


@pytest.fixture
def client(tiny_model_factory):
    client = EngineClient(_engine(tiny_model_factory("llama")[0], max_num_seqs=1, max_queue_len=8))
    yield client
    client.shutdown()


async def _tokens(stream) -> int:
    return sum([len(output.new_token_ids) async for output in stream])


def test_aborting_an_unknown_request_is_harmless(client):
    async def scenario() -> int:
        client.abort("never-added")
        (stream,) = client.add_requests([NewRequest("r", PROMPT, PARAMS)])
        client.abort("never-added")  # between steps of a running request, too
        return await _tokens(stream)

    assert asyncio.run(scenario()) == PARAMS.max_tokens
    stats = client.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_generated_tokens) == (0, 0, PARAMS.max_tokens)


def test_the_snapshot_after_the_last_output_shows_the_blocks_back(client):
    before = client.stats()
    assert isinstance(before, EngineStats) and before.num_free_blocks == before.num_total_blocks
    # One step per output read: a busy machine could otherwise let the engine run to the end (and publish
    # its last snapshot) before the loop reads the one of a running request.
    steps = threading.Semaphore(1)
    engine = client._engine
    real_step = engine.step

    def step():
        if not steps.acquire(timeout=0.01):
            return []  # back to the client's loop, which handles commands between steps
        outputs = real_step()
        if not outputs:
            steps.release()  # a step that delivered nothing (a prefill chunk) does not count
        return outputs

    engine.step = step

    async def scenario() -> EngineStats:
        (stream,) = client.add_requests([NewRequest("r", PROMPT, PARAMS)])
        async for output in stream:
            if not output.finished:
                during = client.stats()  # published before this output was delivered
                assert during.num_running == 1 and during.num_free_blocks < during.num_total_blocks
            steps.release()
        return client.stats()  # no sleep: the step that finished it was published before its output

    after = asyncio.run(scenario())
    assert after.num_free_blocks == after.num_total_blocks
    assert (after.num_running, after.num_waiting) == (0, 0)
    assert after.num_generated_tokens == PARAMS.max_tokens and after.num_steps >= PARAMS.max_tokens


def test_requests_in_the_hand_over_are_counted_as_waiting(client):
    # One runs at a time; until the first finishes, all four are running or waiting in every reading,
    # including those taken between the engine thread absorbing the command and publishing a snapshot.
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def scenario() -> list[EngineStats]:
        streams = client.add_requests([NewRequest(f"r-{i}", PROMPT, long) for i in range(4)])
        head = aiter(streams[0])
        first = asyncio.ensure_future(anext(head))
        readings = []
        while not first.done():
            readings.append(client.stats())
            await asyncio.sleep(0)
        readings.append(client.stats())
        for stream in streams:
            stream.close()
        return readings

    readings = asyncio.run(scenario())
    assert all(s.num_running + s.num_waiting == 4 for s in readings), readings


def test_stop_fails_the_requests_in_flight_and_those_sent_before_it(client):
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def scenario() -> None:
        running = client.add_requests([NewRequest("running", PROMPT, long)])[0]
        outputs = aiter(running)
        await anext(outputs)
        queued = client.add_requests([NewRequest("queued", PROMPT, long)])[0]  # sent just before Stop
        await asyncio.to_thread(client.shutdown)
        for stream in (outputs, queued):
            with pytest.raises(EngineDeadError, match="the engine has stopped"):
                await asyncio.wait_for(_tokens(stream), 10)  # the deltas of steps before Stop, then the error
        with pytest.raises(EngineDeadError):
            client.add_requests([NewRequest("late", PROMPT, PARAMS)])
        with pytest.raises(EngineDeadError):
            await client.unload_lora("any")
        client.abort("running")  # after Stop: queued for nobody, harmless

    asyncio.run(scenario())
    stats = client.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks
    assert not client._thread.is_alive()


def test_a_failure_event_raises_what_add_requests_would_raise():
    assert type(RequestFailed("r", "no", FailureKind.INVALID).error()) is ValueError
    assert type(RequestFailed("r", "no", FailureKind.UNKNOWN_LORA).error()) is UnknownLoraError
    dead = RequestFailed("r", "the engine has stopped", FailureKind.ENGINE_DEAD).error()
    assert isinstance(dead, EngineDeadError) and str(dead) == "the engine has stopped"


def test_the_event_loop_never_touches_the_engine(tiny_model_factory):
    strangers: list[tuple[str, str]] = []  # (thread, attribute) of every read off the engine thread
    armed = threading.Event()  # set once the client has copied what it needs of the engine

    class EngineThreadOnly(Engine):
        # Recorded, not raised: a raise on the event loop's side could be swallowed by what it broke.
        def __getattribute__(self, name: str):
            thread = threading.current_thread().name
            if armed.is_set() and thread != ENGINE_THREAD:
                strangers.append((thread, name))
            return super().__getattribute__(name)

    engine = _engine(tiny_model_factory("llama")[0], max_num_seqs=2)
    engine.__class__ = EngineThreadOnly
    client = EngineClient(engine)
    armed.set()

    async def scenario() -> None:
        streams = client.add_requests([NewRequest(f"r-{i}", PROMPT, PARAMS) for i in range(3)])
        client.stats()
        await anext(aiter(streams[0]))
        streams[0].close()  # an abort
        assert [await _tokens(s) for s in streams[1:]] == [PARAMS.max_tokens] * 2
        with pytest.raises(ValueError, match="maximum context length"):
            client.add_requests([NewRequest("long", list(range(3, 3 + client.max_model_len)), PARAMS)])
        with pytest.raises(LoraError, match="LoRA is not enabled"):
            await client.load_lora("a", "/nonexistent")
        beams = SamplingParams(n=2, use_beam_search=True, max_tokens=4)
        refused = NewRequest("beam", PROMPT, beams, constraint=object())  # only the engine thread refuses it
        with pytest.raises(ValueError, match="beam search"):
            await _tokens(client.add_requests([refused])[0])
        assert client.stats().num_generated_tokens >= 2 * PARAMS.max_tokens

    try:
        asyncio.run(scenario())
    finally:
        client.shutdown()
        armed.clear()
    assert strangers == []
