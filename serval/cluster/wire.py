"""What crosses between the ingress and a replica: plain picklable values (Ray serializes them).

The ingress sends one `ReplicaBatch` per `add_requests` call (every sequence of one API request, so n /
best_of / beam search forks stay on one engine); the replica streams back lists of the engine's own events
(RequestOutput, RequestFailed), and answers the ingress's polls with a `ReplicaReport`.
"""

from __future__ import annotations

from dataclasses import dataclass

from serval.engine.lora import LoraCard
from serval.engine.messages import EngineStats, NewRequest
from serval.runner.info import RunnerInfo


@dataclass(frozen=True)
class LoraSource:
    """A run-time adapter the ingress knows of: a replica that lacks it loads it before the batch using it."""

    name: str
    path: str
    base_model_name: str | None


@dataclass(frozen=True)
class ReplicaBatch:
    requests: tuple[NewRequest, ...]  # added together on one replica, or refused together
    # Adapters of these requests that were loaded at run time (start-up ones are on every replica already).
    loras: tuple[LoraSource, ...] = ()
    # Every run-time adapter the ingress still serves: a replica unloads the others it holds once idle.
    lora_names: frozenset[str] = frozenset()
    # The hash chain of the first prompt's leading full blocks (block_hashes below), what the router matches:
    # computed once by the ingress, not at every routing attempt.
    block_hashes: tuple[int, ...] = ()

    @property
    def lora_name(self) -> str | None:
        return self.requests[0].lora_name


@dataclass(frozen=True)
class ReplicaInfo:
    """The fixed facts of the served model, read once from the first replica up (all load the same)."""

    max_model_len: int
    vocab_size: int
    runner_info: RunnerInfo
    max_queue_len: int
    loras: dict[str, LoraCard]  # the adapters every replica loaded at start-up (--lora-modules)


@dataclass(frozen=True)
class ReplicaReport:
    replica_id: str  # Ray Serve's id of the replica (changes when Ray restarts it)
    pid: int  # the replica's process, for operators (and the fault test, which kills it)
    node_id: str
    stats: EngineStats
    num_threads: int  # torch's intra-op threads in the replica process, as measured there (--replica-threads)


def block_hashes(
    token_ids: list[int], block_size: int, max_blocks: int, seed: object = None
) -> tuple[int, ...]:
    """A hash per full block of the prompt's head, each covering every token before it too (as the engine's
    BlockManager names blocks), so equal i-th hashes mean equal first i + 1 blocks. `seed`: the adapter,
    whose requests never share KV blocks with the base model's. Python's hash: only this process compares
    them, and it is ~50x cheaper than the engine's blake2b."""
    hashes = []
    parent = hash(("serval-block", seed))
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return tuple(hashes)
