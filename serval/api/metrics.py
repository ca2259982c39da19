"""Prometheus metrics of one app, on a registry of its own (never the global one: two apps in one process, as
in tests, must not share or clash).

Owns the counters the HTTP layer observes (requests by status, prompt and generated tokens, time to first token,
end-to-end latency), a collector that reads the engine's gauges (running and waiting requests, KV-cache use,
prefix-cache hits) at scrape time, so they are never stale, and the `serval_model_info` gauge: always 1, its
labels say what is served and how (api/version.py), so a dashboard can join them to any other series. The
same measurements under vLLM's names live beside them on the same registry (api/vllm_metrics.py); one
RequestObserver per request feeds both from the request's events.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serval.api.vllm_metrics import VllmMetrics
from serval.engine.client import EngineStats
from serval.serving.stream import ChoiceDelta, Event

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
    def __init__(
        self,
        stats: Callable[[], EngineStats],
        model_facts: Mapping[str, object],
        cache_labels: Mapping[str, str] | None = None,
    ) -> None:
        """model_facts: api/version.py's (its `model` and `max_model_len` also name and size the vLLM series);
        cache_labels: vllm:cache_config_info's labels (vllm_metrics.cache_config_labels)."""
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
            "serval_prompt_tokens",
            "Prompt tokens of finished requests (their usage).",
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "serval_generation_tokens",
            "Completion tokens of finished requests (their usage); vllm:generation_tokens counts them as they come.",
            registry=self.registry,
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
        self.vllm = VllmMetrics(
            self.registry,
            stats,
            str(model_facts["model"]),
            int(model_facts["max_model_len"]),  # type: ignore[call-overload]
            dict(cache_labels or {}),
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestObserver:
    """Feeds one generation request's events into both sets of metrics: time to first token, the gaps between
    a sequence's tokens, token counts, finished sequences by reason, latency. `abandon` counts the sequences
    still unfinished when the request ends without its usage (the client left, or it failed mid-way)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.is_first = True
        self.last_token_time: dict[int, float] = {}  # per choice index: when its latest tokens came
        self.unfinished: set[int] = set()  # choices seen and not finished
        self.num_finished = 0
        self.num_generated = 0  # tokens already counted into vllm:generation_tokens
        self.is_done = False  # the usage came, or abandon() counted what was left

    def __call__(self, event: Event) -> None:
        now = time.monotonic()
        if isinstance(event, ChoiceDelta):
            self._delta(event, now)
            return
        metrics, vllm = self.metrics, self.metrics.vllm
        metrics.prompt_tokens.inc(event.num_prompt_tokens)
        metrics.generation_tokens.inc(event.num_completion_tokens)
        metrics.e2e_latency.observe(now - self.arrival)
        vllm.prompt_tokens.inc(event.num_prompt_tokens)
        # Counted as they came; the usage is the last word (a beam search reports its beams only at the end).
        vllm.generation_tokens.inc(max(0, event.num_completion_tokens - self.num_generated))
        vllm.e2e_latency.observe(now - self.arrival)
        vllm.request_prompt_tokens.observe(event.num_prompt_tokens)
        vllm.request_generation_tokens.observe(event.num_completion_tokens)
        self.is_done = True

    def _delta(self, delta: ChoiceDelta, now: float) -> None:
        vllm = self.metrics.vllm
        num_tokens = len(delta.token_ids)
        if num_tokens:
            if self.is_first:
                self.metrics.time_to_first_token.observe(now - self.arrival)
                vllm.time_to_first_token.observe(now - self.arrival)
                self.is_first = False
            previous = self.last_token_time.get(delta.index)
            if previous is not None:
                vllm.token_gap(now - previous, num_tokens)
            self.last_token_time[delta.index] = now
            vllm.generation_tokens.inc(num_tokens)
            self.num_generated += num_tokens
        if delta.finish_reason is None:
            self.unfinished.add(delta.index)
        else:
            self.unfinished.discard(delta.index)
            self.num_finished += 1
            vllm.finished(delta.finish_reason)

    def abandon(self) -> None:
        """The request ended without its usage: each choice still unfinished was aborted (one, when none had
        begun)."""
        if self.is_done:
            return
        self.is_done = True
        num_aborted = len(self.unfinished) or (0 if self.num_finished else 1)
        if num_aborted:
            self.metrics.vllm.finished("abort", num_aborted)


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
