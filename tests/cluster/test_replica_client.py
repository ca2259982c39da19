"""ReplicaClient over real EngineReplicas (tiny random model), with Ray's deployment handle replaced by an
in-process one: the ingress/replica seam's bookkeeping (streams, aborts, adapters, refusals) without a cluster.
Routing, process death and Ray itself are tests/e2e/test_replicas.py's."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
import torch

from serval.cluster.client import ReplicaClient
from serval.cluster.config import ReplicaConfig
from serval.cluster.replica import EngineReplica
from serval.config import CacheConfig, EngineConfig, LoraConfig, ModelConfig, SchedulerConfig
from serval.engine.client import EngineClient
from serval.engine.lora import UnknownLoraError
from serval.engine.messages import NewRequest, QueueFullError
from serval.sampling import SamplingParams

PROMPT = list(range(3, 60))
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class _Call:
    """A deployment method: .remote(...) runs it on the replica the handle picks."""

    def __init__(self, handle: InProcessHandle, name: str) -> None:
        self.handle, self.name = handle, name

    def remote(self, *args):
        replica = self.handle.pick()
        self.handle.routed.append(replica)
        method = getattr(replica, self.name)
        if self.handle.stream:
            return _Stream(method(*args))
        if asyncio.iscoroutinefunction(method):
            return method(*args)
        return _Result(method, args)


class _Stream:
    def __init__(self, generator) -> None:
        self.generator = generator

    def __aiter__(self):
        return self.generator

    def cancel(self) -> None:
        pass  # the pump task's cancellation reaches the generator in-process


class _Result:
    def __init__(self, method, args) -> None:
        self.method, self.args = method, args

    def result(self, timeout_s=None):
        raise RuntimeError("no Ray here")  # the report poller: ignored, as while replicas restart


class InProcessHandle:
    """Ray Serve's DeploymentHandle, as ReplicaClient uses it, over replicas in this process; `order` says
    which replica each call goes to (round robin by default)."""

    def __init__(self, replicas: list[EngineReplica], stream: bool = False, order=None) -> None:
        self.replicas = replicas
        self.stream = stream
        self.order = order if order is not None else itertools.cycle(range(len(replicas)))
        self.routed: list[EngineReplica] = []

    def options(self, stream: bool = False) -> InProcessHandle:
        handle = InProcessHandle(self.replicas, stream, self.order)
        handle.routed = self.routed
        return handle

    def pick(self) -> EngineReplica:
        return self.replicas[next(self.order)]

    def __getattr__(self, name: str) -> _Call:
        return _Call(self, name)


@pytest.fixture(scope="module")
def replicas(tiny_model_factory, tiny_lora_factory):
    directory, _ = tiny_model_factory("llama", False)
    config = EngineConfig(
        model=ModelConfig(model=directory, dtype="float32"),
        cache=CacheConfig(num_blocks=64, block_size=16),
        scheduler=SchedulerConfig(max_queue_len=4, max_num_seqs=1),  # 3 of a 4-sequence request wait
        lora=LoraConfig(enable_lora=True, max_loras=2),
    )
    made = [EngineReplica(config, torch.get_num_threads()) for _ in range(2)]
    yield made, config
    for replica in made:
        replica.client.shutdown()


def _client(made) -> tuple[ReplicaClient, InProcessHandle]:
    handle = InProcessHandle(made)
    return ReplicaClient(handle, made[0].info(), ReplicaConfig(num_replicas=2, report_period_s=60)), handle


async def _tokens(client, request_id: str, **kwargs) -> list[int]:
    tokens = []
    async for output in client.generate(request_id, PROMPT, GREEDY, **kwargs):
        tokens += output.new_token_ids
    return tokens


def test_outputs_equal_a_local_engine_and_blocks_are_freed_on_both(replicas):
    made, config = replicas
    client, handle = _client(made)
    local = EngineClient.start(config)

    async def run():
        ours = [await _tokens(client, "a"), await _tokens(client, "b")]
        theirs = []
        async for output in local.generate("c", PROMPT, GREEDY):
            theirs += output.new_token_ids
        return ours, theirs

    try:
        ours, theirs = asyncio.run(run())
    finally:
        local.shutdown()
        client.shutdown()
    assert ours == [theirs, theirs] and len(theirs) == 6
    assert set(map(id, handle.routed)) == set(map(id, made))  # both replicas answered
    for replica in made:
        assert replica.client.stats().num_free_blocks == replica.client.stats().num_total_blocks


def test_closing_a_stream_early_aborts_its_request_on_the_replica(replicas):
    made, _ = replicas
    client, _ = _client(made)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    before = sum(r.client.stats().num_generated_tokens for r in made)

    async def run() -> int | None:
        stream = client.generate("long", PROMPT, params)
        await anext(stream)
        await stream.aclose()  # as the Frontend does when its HTTP client goes away
        # A bound on a failure, not a window the abort must land in; how it ended is checked below.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            stats = [r.client.stats() for r in made]
            if all(s.num_running == 0 for s in stats):
                return sum(s.num_generated_tokens for s in stats)
            await asyncio.sleep(0.02)  # a poll interval
        return None

    try:
        num_generated = asyncio.run(run())
        assert num_generated is not None, "the replica kept running the abandoned request"
        # Ended by the abort, not by running to max_tokens while the test waited.
        assert num_generated - before < params.max_tokens, "the replica ran the abandoned request to its end"
    finally:
        client.shutdown()
    for replica in made:
        assert replica.client.stats().num_free_blocks == replica.client.stats().num_total_blocks


def test_a_run_time_adapter_reaches_every_replica_and_its_unload_too(replicas, tiny_lora_factory):
    made, _ = replicas
    client, _ = _client(made)
    path = tiny_lora_factory("full")[0]

    async def run():
        await client.load_lora("full", path)  # checked and loaded on one replica (the first in turn)
        loaded_on = [("full" in r.client.loras) for r in made]
        with_adapter = [await _tokens(client, f"lora-{i}", lora_name="full") for i in range(2)]
        everywhere = all("full" in r.client.loras for r in made)
        await client.unload_lora("full")
        with pytest.raises(UnknownLoraError):
            await _tokens(client, "gone", lora_name="full")
        await _tokens(client, "base-0")
        await _tokens(client, "base-1")  # each replica saw a batch since the unload
        return loaded_on, with_adapter, everywhere

    try:
        loaded_on, with_adapter, everywhere = asyncio.run(run())
    finally:
        client.shutdown()
    assert sorted(loaded_on) == [False, True]
    assert everywhere, "the replica without the adapter did not load it before serving it"
    assert with_adapter[0] == with_adapter[1]  # the same adapter on both replicas
    assert not any("full" in r.client.loras for r in made)


def test_a_full_queue_on_the_replica_is_a_queue_full_error_at_the_ingress(replicas):
    made, _ = replicas
    client, _ = _client(made)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    # Replica 0's queue (max_queue_len=4) holds at least 3 of a 4-sequence request (one runs at a time); two more
    # sent there are refused, and the refusal arrives as the error add_requests raises on one server (a 429).
    client._handle.order = iter([0, 0])

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        first = [NewRequest(f"q{i}", PROMPT, params) for i in range(4)]
        streams = client.add_requests(first, queue)
        second = client.add_requests(
            [NewRequest("over", PROMPT, params), NewRequest("over2", PROMPT, params)]
        )
        with pytest.raises(QueueFullError):
            async for _ in second[0]:
                pass
        for stream in streams:
            stream.close()

    try:
        asyncio.run(run())
    finally:
        client.shutdown()
