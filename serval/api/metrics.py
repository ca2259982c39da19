"""Prometheus metrics of one app, on a registry of its own (never the global one: two apps in one process, as
in tests, must not share or clash).

Owns the counters the HTTP layer observes (requests by status, prompt and generated tokens, time to first token,
end-to-end latency), a collector that reads the engine's gauges (running and waiting requests, KV-cache use,
prefix-cache hits) at scrape time, so they are never stale, and the `serval_model_info` gauge: always 1, its
labels say what is served and how (api/version.py), so a dashboard can join them to any other series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serval.engine.client import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator:
        stats = self.stats()
        yield GaugeMetricFamily("serval_num_requests_running", "Requests being generated.", stats.num_running)
        yield GaugeMetricFamily(
            "serval_num_requests_waiting", "Requests waiting to start.", stats.num_waiting
        )
        yield GaugeMetricFamily(
            "serval_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", stats.kv_cache_usage
        )
        yield GaugeMetricFamily("serval_kv_cache_free_blocks", "KV-cache blocks free.", stats.num_free_blocks)
        yield GaugeMetricFamily(
            "serval_kv_cache_total_blocks", "KV-cache blocks in all.", stats.num_total_blocks
        )
        yield CounterMetricFamily(
            "serval_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.num_prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "serval_prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            stats.num_prefix_cache_hits,
        )
        yield GaugeMetricFamily(
            "serval_kv_cache_pinned_blocks",
            "KV-cache blocks pinned by cache_control.",
            stats.num_pinned_blocks,
        )
        yield CounterMetricFamily(
            "serval_kv_cache_refused_pin_blocks",
            "Blocks cache_control asked to pin past --max-pinned-kv-fraction (left unpinned).",
            stats.num_refused_pin_blocks,
        )
        yield CounterMetricFamily("serval_num_preemptions", "Requests preempted.", stats.num_preemptions)


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats], model_facts: Mapping[str, object]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Info-style (as vLLM's cache_config_info): the facts are fixed at start-up, so set once.
        model_info = Gauge(
            "serval_model_info", "The served model and how it runs (labels); always 1.", list(model_facts),
            registry=self.registry,
        )  # fmt: skip
        model_info.labels(**{name: str(value) for name, value in model_facts.items()}).set(1)
        self.requests = Counter(
            "serval_http_requests", "HTTP requests answered, by route and status.", ["path", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "serval_prompt_tokens", "Prompt tokens processed.", registry=self.registry
        )
        self.generation_tokens = Counter(
            "serval_generation_tokens", "Tokens generated.", registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "serval_time_to_first_token_seconds", "Time from arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.e2e_latency = Histogram(
            "serval_e2e_request_latency_seconds", "Time from arrival to the last token.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.registry.register(EngineCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatusCounter:
    """ASGI middleware counting each response's status; pure ASGI so streams pass through untouched."""

    def __init__(self, app: ASGIApp, metrics: Metrics, known_paths: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.known_paths = known_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Unknown paths are folded into one label so that scanners cannot grow the label set.
        path = scope["path"] if scope["path"] in self.known_paths else "other"

        async def send_counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path=path, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send_counting)
