"""Starting the replica set: Ray (a local cluster, or an existing one joined), Ray Serve without its HTTP
proxy (serval's own app is the ingress), and the EngineReplica deployment; and tearing it all down.

Ray never reaches the internet from here: usage stats are off (RAY_USAGE_STATS_ENABLED=0, inherited by every
Ray process this one starts), the dashboard is not started, and the replicas need no runtime_env download
(they import serval from the same environment: on a joined cluster it must be installed on every node).
"""

from __future__ import annotations

import logging
import os

from serval.cluster.client import ReplicaClient
from serval.cluster.config import ReplicaConfig
from serval.config import EngineConfig

logger = logging.getLogger(__name__)

APP_NAME = "serval"
DEPLOYMENT_NAME = "serval-engine"


def start_replicas(engine: EngineConfig, replicas: ReplicaConfig) -> ReplicaClient:
    """Deploy `replicas.num_replicas` engines (each loads the model) and return the ingress's client once all
    are up. Raises what Ray raises when the deployment can't start."""
    # Before Ray is imported: its start-up reads these, and the processes it starts inherit them.
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from serval.cluster.replica import EngineReplica
    from serval.cluster.router import PrefixRouter

    threads = replicas.threads_per_replica
    if replicas.ray_address is None:
        # A local cluster with a CPU slot for each replica thread, even past the cores (an oversubscribed
        # test is the caller's choice), and none of Ray's optional services.
        num_cpus = max(os.cpu_count() or 1, replicas.num_replicas * threads)
        ray.init(
            num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True
        )
    else:
        ray.init(address=replicas.ray_address, logging_level=logging.WARNING)
    serve.start(proxy_location="Disabled")
    # The engine's own queue admits or refuses (429) requests; Ray Serve's limit only has to stay above it.
    max_ongoing = engine.scheduler.max_queue_len + engine.scheduler.max_num_seqs + 16
    deployment = serve.deployment(
        EngineReplica,
        name=DEPLOYMENT_NAME,
        num_replicas=replicas.num_replicas,
        max_ongoing_requests=max_ongoing,
        ray_actor_options={
            "num_cpus": threads,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}},
        },
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixRouter,
            request_router_kwargs={"policy": replicas.routing, "max_imbalance": replicas.max_imbalance},
        ),
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0,
        # Ray Serve logs every call at INFO (the ingress's report polls too); serval logs what matters.
        logging_config={"log_level": "WARNING", "enable_access_log": False},
    )
    handle = serve.run(deployment.bind(engine, threads), name=APP_NAME, route_prefix=None)
    info = handle.info.remote().result()
    logger.info(
        "%d engine replicas of %d thread%s each on Ray Serve, %s routing",
        replicas.num_replicas, threads, "" if threads == 1 else "s", replicas.routing,
    )  # fmt: skip
    client = ReplicaClient(handle, info, replicas)
    return client


def stop_replicas(client: ReplicaClient) -> None:
    """Stop polling, delete the deployment and leave Ray (a local cluster this process started stops)."""
    import ray
    from ray import serve

    client.shutdown()
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
