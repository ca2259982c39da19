"""Admission is all or nothing: EngineClient.add_requests admits every request of a call or none, the engine
thread adds them together (one refused there takes the others back before any step), and the waiting count
behind the queue limit includes the n / best_of followers parked on their leader. The tiny llama is real."""

from __future__ import annotations

import asyncio

import pytest

from serval.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from serval.engine.client import EngineClient, NewRequest, QueueFullError
from serval.engine.engine import Engine
from serval.sampling import SamplingParams

PROMPT = list(range(3, 40))  # 37 tokens: three blocks
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _engine(path: str, **scheduler) -> Engine:
    return Engine(
        EngineConfig(
            model=ModelConfig(model=path, dtype="float32"),
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(**scheduler),
        )
    )


def _group(name: str, size: int, params: SamplingParams = LONG) -> list[NewRequest]:
    return [NewRequest(f"{name}-{i}", PROMPT, params) for i in range(size)]


async def _drain(streams) -> dict[str, int]:
    """Read every stream to its end: {request id: tokens generated}."""

    async def read(stream) -> tuple[str, int]:
        return stream.request_id, sum([len(o.new_token_ids) async for o in stream])

    return dict(await asyncio.gather(*(read(s) for s in streams)))


@pytest.fixture
def client(tiny_model_factory):
    # One request runs at a time and four may wait, so the queue fills with a handful of requests.
    client = EngineClient(_engine(tiny_model_factory("llama")[0], max_num_seqs=1, max_queue_len=4))
    yield client
    client.shutdown()


def test_a_request_that_overflows_the_queue_is_refused_whole(client):
    async def scenario() -> None:
        first = client.add_requests(_group("a", 4))
        head = aiter(first[0])
        await anext(head)  # the engine has taken all four: one runs, three wait
        assert client.stats().num_waiting == 3
        with pytest.raises(QueueFullError, match="3 requests are waiting and this one adds 2"):
            client.add_requests(_group("b", 2))
        assert client.stats().num_waiting == 3  # nothing of it was queued
        assert set(client._streams) == {f"a-{i}" for i in range(4)}
        second = client.add_requests(_group("c", 1))  # the room that is left
        tokens = await _drain(first[1:] + second)
        assert tokens == {"a-1": 40, "a-2": 40, "a-3": 40, "c-0": 40}
        assert 1 + sum([len(o.new_token_ids) async for o in head]) == 40

    asyncio.run(scenario())
    stats = client.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks


def test_more_requests_than_the_queue_can_ever_hold_are_a_value_error(client):
    async def scenario() -> None:
        with pytest.raises(ValueError, match="5 sequences at once can never be admitted"):
            client.add_requests(_group("big", 5))

    asyncio.run(scenario())
    assert client.stats().num_waiting == 0 and client._streams == {}


def test_a_bad_prompt_refuses_the_whole_request_before_queueing(client):
    too_long = NewRequest("long", list(range(3, 3 + client.max_model_len)), LONG)

    async def scenario() -> None:
        with pytest.raises(ValueError, match="maximum context length"):
            client.add_requests([*_group("ok", 2), too_long])
        with pytest.raises(ValueError, match="distinct"):
            client.add_requests([NewRequest("same", PROMPT, LONG), NewRequest("same", PROMPT, LONG)])

    asyncio.run(scenario())
    assert client.stats().num_waiting == 0 and client._streams == {}
    assert client.stats().num_steps == 0


def test_one_request_the_engine_refuses_takes_the_others_back(client):
    # Only the engine thread refuses a beam search that follows a grammar: the check add_requests cannot make.
    beams = NewRequest(
        "beam", PROMPT, SamplingParams(n=2, use_beam_search=True, max_tokens=4), constraint=object()
    )

    async def scenario() -> list[str]:
        streams = client.add_requests([*_group("plain", 2), beams])
        errors = []
        for stream in streams:
            with pytest.raises(ValueError) as refused:
                async for _ in stream:
                    pass
            errors.append(str(refused.value))
        return errors

    errors = asyncio.run(scenario())
    assert all("beam search can't follow a grammar" in e for e in errors)
    stats = client.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_steps) == (0, 0, 0)  # not one step ran
    assert stats.num_free_blocks == stats.num_total_blocks
    assert client._engine.requests == {}  # read once the engine thread is idle


def test_parked_followers_count_as_waiting(tiny_model_factory):
    # A 16-token budget: the leader's 37-token prompt takes three steps, its followers parked meanwhile.
    engine = _engine(tiny_model_factory("llama")[0], max_num_batched_tokens=16)
    params = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"s-{i}", PROMPT, params, share_prompt_with="s-0" if i else None)
    assert engine.num_waiting == 4  # the leader in the queue, three parked on it
    engine.step()
    assert engine.num_waiting == 3 and len(engine.scheduler.running) == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_waiting == 0


def test_a_follower_aborted_before_its_leader_stays_aborted(tiny_model_factory):
    engine = _engine(tiny_model_factory("llama")[0])
    params = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
    engine.add_request("x-0", PROMPT, params)
    engine.add_request("x-1", PROMPT, params, share_prompt_with="x-0")
    engine.abort_request("x-1")
    engine.abort_request("x-0")  # used to put x-1 back in the queue, aborted as it was
    assert not engine.has_unfinished_requests() and engine.num_waiting == 0
    assert engine.step() == []
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
