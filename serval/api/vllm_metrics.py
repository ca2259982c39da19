"""The `vllm:*` metrics: vLLM's names, types and labels for the same measurements, beside serval's own, so a
dashboard built for vLLM (vLLM's Grafana board, Ray Serve's LLM board) reads this server unchanged.

Owns the names and their mapping: the engine's gauges and counters read from the EngineStats snapshot at
scrape time (never stale), the per-request histograms and counters that api/metrics.py's RequestObserver
feeds, and `vllm:cache_config_info`. Every series carries `model_name` (the first served name), as vLLM's do.
docs/api.md ("Metrics") lists them with what each means here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from serval.engine.client import EngineStats, RunnerInfo

MODEL_LABEL = "model_name"

# finish_reason as the API reports it -> vLLM's finished_reason label. vLLM's engine ends a tool call with an
# ordinary stop; "abort" is a request its client left (or that failed) before it finished.
FINISHED_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "abort": "abort"}

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                       0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0)  # fmt: skip


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to the context length: a request's token count lands in a useful bucket
    whatever the model's size."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return buckets
            buckets.append(step * scale)
        scale *= 10


def cache_config_labels(info: RunnerInfo) -> dict[str, str]:
    """vllm:cache_config_info's labels in vLLM's spelling: `num_gpu_blocks` is the KV-cache block count
    whatever the device (as vLLM's CPU backend reports it too)."""
    return {
        "block_size": str(info.block_size),
        "num_gpu_blocks": str(info.num_blocks),
        "cache_dtype": info.cache_dtype,
        "kv_cache_tokens": str(info.kv_cache_tokens),
    }


class VllmEngineCollector(Collector):
    """The engine's state under vLLM's names, read from the latest EngineStats at each scrape."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator:
        stats = self.stats()
        for family, name, documentation, value in (
            (GaugeMetricFamily, "vllm:num_requests_running", "Requests being generated.", stats.num_running),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to start.", stats.num_waiting),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.",
             stats.kv_cache_usage),
            (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.num_prefix_cache_queries),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
             stats.num_prefix_cache_hits),
            (CounterMetricFamily, "vllm:num_preemptions", "Requests preempted (recomputed later).",
             stats.num_preemptions),
        ):  # fmt: skip
            metric = family(name, documentation, labels=[MODEL_LABEL])
            metric.add_metric([self.model_name], value)
            yield metric
        if stats.num_spec_accepted_per_position:  # speculative decoding is on
            yield from self._speculation(stats)

    def _speculation(self, stats: EngineStats) -> Iterator:
        for name, documentation, value in (
            ("vllm:spec_decode_num_drafts", "Steps in which a sequence carried drafts.", stats.num_spec_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.num_spec_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.num_spec_accepted_tokens),
        ):  # fmt: skip
            metric = CounterMetricFamily(name, documentation, labels=[MODEL_LABEL])
            metric.add_metric([self.model_name], value)
            yield metric
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position among their step's drafts (0: the first).",
            labels=[MODEL_LABEL, "position"],
        )
        for position, value in enumerate(stats.num_spec_accepted_per_position):
            per_position.add_metric([self.model_name, str(position)], value)
        yield per_position


class VllmMetrics:
    """The per-request vLLM series of one app, on the app's registry, each bound to the model's name."""

    def __init__(
        self,
        registry: CollectorRegistry,
        stats: Callable[[], EngineStats],
        model_name: str,
        max_model_len: int,
        cache_labels: dict[str, str],
    ) -> None:
        self.model_name = model_name
        labels = [MODEL_LABEL]

        def histogram(name: str, documentation: str, buckets) -> Histogram:
            family = Histogram(name, documentation, labels, buckets=buckets, registry=registry)
            return family.labels(model_name)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, labels, registry=registry).labels(model_name)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated, counted as they come.")
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Time between two tokens of a sequence.", INTER_TOKEN_BUCKETS
        )
        # NOTE: the same observations under the name vLLM used before it was renamed inter_token_latency:
        # the published Grafana board for vLLM still plots this one.
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Time between two tokens of a sequence (the older name).",
            INTER_TOKEN_BUCKETS,
        )
        self.e2e_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS
        )
        token_counts = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of a finished request.", token_counts
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Tokens a finished request generated.", token_counts
        )
        self.request_success = Counter(
            "vllm:request_success", "Sequences finished, by finished_reason (stop, length, abort).",
            [MODEL_LABEL, "finished_reason"], registry=registry,
        )  # fmt: skip
        for reason in sorted(set(FINISHED_REASONS.values())):
            self.request_success.labels(model_name, reason)  # present at 0, so rate() has a first sample
        cache_info = Gauge(
            "vllm:cache_config_info", "The KV cache's configuration (labels); always 1.",
            [MODEL_LABEL, *cache_labels], registry=registry,
        )  # fmt: skip
        cache_info.labels(model_name, *cache_labels.values()).set(1)
        registry.register(VllmEngineCollector(stats, model_name))

    def finished(self, finish_reason: str, count: int = 1) -> None:
        reason = FINISHED_REASONS.get(finish_reason, finish_reason)
        self.request_success.labels(self.model_name, reason).inc(count)

    def token_gap(self, seconds: float, num_tokens: int) -> None:
        """`num_tokens` tokens of one sequence arrived `seconds` after its previous ones: each is one
        inter-token interval of seconds / num_tokens."""
        for _ in range(num_tokens):
            self.inter_token_latency.observe(seconds / num_tokens)
            self.time_per_output_token.observe(seconds / num_tokens)
