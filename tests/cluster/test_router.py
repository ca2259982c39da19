"""PrefixRouter's choices (serval/cluster/router.py) over stand-in replicas: the policy alone, no Ray cluster.
That routed requests really hit the prefix cache is tests/e2e/test_replicas.py's."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

from serval.cluster.router import PrefixRouter
from serval.cluster.wire import ReplicaBatch, block_hashes
from serval.engine.messages import NewRequest
from serval.sampling import SamplingParams

HEAD = list(range(100, 164))  # four full blocks of 16


@dataclass(frozen=True)
class _ReplicaId:
    unique_id: str


class _Loads(dict):
    """The router's queue-length cache: replica id -> requests in flight."""


def _router(policy: str = "prefix", max_imbalance: int = 2) -> tuple[PrefixRouter, _Loads]:
    router = PrefixRouter.__new__(PrefixRouter)  # the policy only: Ray's own state is not needed
    router.initialize_state(policy=policy, max_imbalance=max_imbalance)
    loads = _Loads()
    router._replica_queue_len_cache = loads
    return router, loads


def _replicas(n: int = 2) -> list:
    return [SimpleNamespace(replica_id=_ReplicaId(f"r{i}")) for i in range(n)]


def _request(tokens: list[int]) -> SimpleNamespace:
    batch = ReplicaBatch(
        (NewRequest("x", tokens, SamplingParams()),), block_hashes=block_hashes(tokens, 16, 64)
    )
    return SimpleNamespace(args=(batch,))


def _choose(router, replicas, request):
    return asyncio.run(router.choose_replicas(replicas, request))


def test_a_known_head_goes_back_to_its_replica_while_load_allows():
    router, loads = _router(max_imbalance=2)
    replicas = _replicas()
    first = _request(HEAD + [1, 2, 3])
    loads.update({replicas[0].replica_id: 1, replicas[1].replica_id: 0})
    ranks = _choose(router, replicas, first)
    assert ranks[0] == [replicas[1]]  # nothing known: the least loaded first
    router.on_request_routed(first, replicas[1].replica_id, None)
    loads.update({replicas[0].replica_id: 0, replicas[1].replica_id: 2})
    # Same head, another tail: back to replica 1 although replica 0 is idle (2 more in flight is allowed).
    assert _choose(router, replicas, _request(HEAD + [9]))[0] == [replicas[1]]
    loads[replicas[1].replica_id] = 3  # now 3 more than replica 0: the head spills to it
    assert _choose(router, replicas, _request(HEAD + [9]))[0] == [replicas[0]]
    # A different first block shares nothing, whatever follows.
    loads[replicas[1].replica_id] = 0
    loads[replicas[0].replica_id] = 0
    assert _choose(router, replicas, _request([7] + HEAD[1:]))[0] == [replicas[0]]


def test_the_longest_shared_head_wins():
    router, _ = _router()
    replicas = _replicas()
    router.on_request_routed(_request(HEAD), replicas[1].replica_id, None)  # four blocks on replica 1
    router.on_request_routed(_request(HEAD[:16]), replicas[0].replica_id, None)  # then its first on replica 0
    assert _choose(router, replicas, _request(HEAD + [5]))[0] == [replicas[1]]  # four blocks beat one
    assert _choose(router, replicas, _request(HEAD[:16] + [0] * 16))[0] == [replicas[0]]  # the first block's


def test_a_dead_replica_is_never_chosen_for_its_heads():
    router, _ = _router()
    replicas = _replicas()
    router.on_request_routed(_request(HEAD), replicas[1].replica_id, None)
    assert _choose(router, replicas[:1], _request(HEAD))[0] == [replicas[0]]  # only replica 0 is a candidate


def test_round_robin_ignores_prompts():
    router, _ = _router(policy="round_robin")
    replicas = _replicas()
    router.on_request_routed(_request(HEAD), replicas[1].replica_id, None)
    firsts = []
    for _ in range(4):
        request = _request(HEAD)
        assert _choose(router, replicas, request) == _choose(router, replicas, request)  # asked twice: same
        firsts.append(_choose(router, replicas, request)[0][0])
        router.on_request_routed(request, firsts[-1].replica_id, None)
    assert firsts == [replicas[1], replicas[0], replicas[1], replicas[0]]  # the cursor moved once already


def test_report_polls_visit_every_replica_whatever_runs_between_them():
    router, _ = _router()
    replicas = _replicas()
    poll = SimpleNamespace(args=())  # the ingress's report call: no batch
    seen = []
    for i in range(4):
        seen.append(_choose(router, replicas, poll)[0][0])
        router.on_request_routed(poll, seen[-1].replica_id, None)
        generate = _request([i] * 32)  # one generate call between polls must not lock them onto one replica
        router.on_request_routed(generate, _choose(router, replicas, generate)[0][0].replica_id, None)
    assert seen == [replicas[0], replicas[1], replicas[0], replicas[1]]
