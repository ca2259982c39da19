"""PrefixRouter: Ray Serve's request router for the engine replicas, on prompt token ids.

It runs inside the ingress process (Ray Serve routes in the process that holds the deployment handle), so its
table is local: the hash of each block-aligned prompt head (wire.block_hashes) -> the replica last sent a
prompt with that head. A request goes to the replica holding the longest such head, unless that replica has
more than `max_imbalance` requests in flight beyond the least-loaded one; then, or with no match, to the
least loaded. So a shared system prompt or a conversation's next turn lands where its KV blocks are cached,
and a hot prefix spills over to other replicas under load instead of queueing behind one.

"round_robin" ignores prompts (bench/replicas.py's baseline). Calls other than `generate` (the ingress's
report polls, adapter loads) go round robin, so the polls visit every replica in turn.
"""

from __future__ import annotations

from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from serval.cluster.wire import ReplicaBatch


class PrefixRouter(RequestRouter):
    def initialize_state(
        self, policy: str = "prefix", max_imbalance: int = 8, capacity: int = 200_000
    ) -> None:
        self._policy = policy
        self._max_imbalance = max_imbalance
        self._capacity = capacity  # block heads remembered, least recently routed dropped first
        self._owner: OrderedDict[int, ReplicaID] = OrderedDict()
        # Round-robin cursors, requests sent so far: [True] for other calls (the report polls, which must
        # visit every replica in turn whatever generate traffic runs between them), [False] for generate.
        self._cursors = {True: 0, False: 0}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        # Ranks: the first is tried first; Ray Serve skips a replica whose queue is full (max_ongoing_requests)
        # and moves on to the next rank.
        by_load = sorted(candidate_replicas, key=self._load)
        batch = _batch_of(pending_request)
        if batch is None or self._policy == "round_robin":
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            first = ordered[self._cursors[batch is None] % len(ordered)]
            return [[first], [r for r in by_load if r is not first]]
        owner = self._longest_match(batch.block_hashes, candidate_replicas)
        if owner is not None and self._load(owner) - self._load(by_load[0]) <= self._max_imbalance:
            return [[owner], [r for r in by_load if r is not owner]]
        return [[r] for r in by_load]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        # NOTE: a cursor moves here, once per request sent, not in choose_replicas: Ray Serve may ask that
        # more than once for one request, and an even number of asks would send every poll to one replica.
        batch = _batch_of(pending_request)
        self._cursors[batch is None] += 1
        if batch is None:
            return
        for block_hash in batch.block_hashes:
            self._owner[block_hash] = replica_id
            self._owner.move_to_end(block_hash)
        while len(self._owner) > self._capacity:
            self._owner.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        # Its restarted successor has an empty cache: send its prefixes wherever load says.
        for block_hash in [h for h, owner in self._owner.items() if owner == replica_id]:
            del self._owner[block_hash]

    def _longest_match(
        self, hashes: tuple[int, ...], candidates: list[RunningReplica]
    ) -> RunningReplica | None:
        by_id = {r.replica_id: r for r in candidates}
        for block_hash in reversed(hashes):  # the deepest shared head wins
            owner = by_id.get(self._owner.get(block_hash))
            if owner is not None:
                return owner
        return None

    def _load(self, replica: RunningReplica) -> int:
        # Requests in flight on it as this router last heard (updated on every send and reply); unknown: 0.
        return self.replica_queue_len_cache.get(replica.replica_id) or 0


def _batch_of(pending_request: PendingRequest | None) -> ReplicaBatch | None:
    if pending_request is None or not pending_request.args:
        return None
    batch = pending_request.args[0]
    return batch if isinstance(batch, ReplicaBatch) else None
