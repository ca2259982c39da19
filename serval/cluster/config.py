"""ReplicaConfig: how many engine replicas to run on Ray Serve, where, and how requests are routed to them.

A leaf of the cluster package: no Ray import, so the CLI builds and validates it before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass

ROUTING_POLICIES = ("prefix", "round_robin")


@dataclass(frozen=True)
class ReplicaConfig:
    num_replicas: int = 1
    # torch (and OpenMP) threads of each replica process; the replica's Ray actor reserves as many CPUs.
    threads_per_replica: int = 1
    # An existing Ray cluster to join ("auto", "ray://host:port", "host:port"); None: start a local one.
    ray_address: str | None = None
    # "prefix": a request whose prompt shares its block-aligned head with an earlier one goes to the replica
    # that served it while load allows, else to the least-loaded replica; "round_robin": the baseline that
    # bench/replicas.py compares against.
    routing: str = "prefix"
    # How much more in-flight work (requests, as Ray Serve counts them) the prefix's replica may have than the
    # least-loaded one and still be chosen for the prefix.
    max_imbalance: int = 8
    # How often the ingress asks a replica for its counters (/metrics, /health); each ask goes to the next
    # replica in turn, so each is heard from every num_replicas * report_period_s.
    report_period_s: float = 0.5

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.num_replicas}")
        if self.threads_per_replica < 1:
            raise ValueError(f"replica_threads must be >= 1, got {self.threads_per_replica}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"replica routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {self.max_imbalance}")

    @property
    def report_stale_after_s(self) -> float:
        """A replica not heard from for this long counts as down (/health) and its counters leave /metrics."""
        return max(10.0, 4 * self.num_replicas * self.report_period_s)
