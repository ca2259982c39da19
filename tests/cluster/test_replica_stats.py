"""The ingress's /metrics over replicas: every counter of the replicas' latest reports summed, the
speculative decoding counters by draft position too. Stand-in reports, no Ray cluster."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from serval.cluster.client import ReplicaClient
from serval.cluster.wire import ReplicaReport
from serval.engine.messages import EngineStats


def _stats(running: int, accepted_per_position: tuple[int, ...]) -> EngineStats:
    return EngineStats(
        num_running=running, num_waiting=1, num_free_blocks=10, num_total_blocks=20, num_prefix_cache_queries=5,
        num_prefix_cache_hits=2, num_steps=7, num_preemptions=0, num_generated_tokens=30, num_spec_drafts=3,
        num_spec_draft_tokens=12, num_spec_accepted_tokens=sum(accepted_per_position),
        num_spec_accepted_per_position=accepted_per_position,
    )  # fmt: skip


def test_the_replicas_counters_are_summed_position_by_position():
    client = ReplicaClient.__new__(ReplicaClient)  # its report book only
    client._reports_lock = threading.Lock()
    client._config = SimpleNamespace(report_stale_after_s=60.0)
    now = time.monotonic()
    client._reports = {
        "a": (ReplicaReport("a", 1, "node", _stats(2, (3, 2, 1, 0)), 1), now),
        "b": (ReplicaReport("b", 2, "node", _stats(1, (4, 4, 3, 1)), 1), now),
    }
    stats = client.stats()
    assert (stats.num_running, stats.num_total_blocks, stats.num_generated_tokens) == (3, 40, 60)
    assert (stats.num_spec_drafts, stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens) == (6, 24, 18)
    assert stats.num_spec_accepted_per_position == (7, 6, 4, 1)
