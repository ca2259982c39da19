"""What the real server says it runs: the start-up line, the serval_model_info gauge and /version agree with
each other and with the runner (its own describe() line in the server's log)."""

from __future__ import annotations

import importlib.metadata
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serval.runner.kernels import runnable_variants

# A real server process with the default model: minutes, not seconds.
pytestmark = pytest.mark.slow


def model_info(base_url: str) -> dict[str, str]:
    """serval_model_info's labels, parsed as Prometheus parses a scrape (a malformed exposition raises)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    [sample] = families["serval_model_info"].samples
    assert sample.value == 1.0
    return sample.labels


def startup_lines(server) -> list[str]:
    with open(server.log_path, errors="replace") as f:
        return [line for line in f if f" INFO serval: model {server.model}: " in line]


def test_startup_line_says_what_runs(server):
    [line] = startup_lines(server)  # exactly one
    labels = model_info(server.base_url)
    assert f": model {server.model}: {labels['architecture']}, weights {labels['weight_format']}," in line
    # --dtype float32: dense fp32 matmuls, so no int8 batches whatever the default (test_weight_formats.py
    # checks the packed default's words).
    assert labels["batch_activations"] == "float32" and "packed" not in line
    assert (
        f"compute dtype {labels['dtype']} on {labels['device']}, CPU kernels {labels['kernel_variant']},"
        in line
    )
    assert f" {labels['num_threads']} threads, KV cache {labels['kv_cache_tokens']} tokens (" in line


def test_model_info_gauge(server):
    labels = model_info(server.base_url)
    assert labels["model"] == server.model
    assert labels["architecture"] == "LlamaForCausalLM"  # SmolLM2
    assert labels["weight_format"] != ""
    assert labels["dtype"] == "float32" and labels["device"] == "cpu"  # the fixture's --dtype float32
    # The variant the runner reported in its own start-up words, and one this CPU can run (or none).
    [line] = startup_lines(server)
    assert labels["kernel_variant"] == re.search(r"CPU kernels (\S+),", line).group(1)
    assert labels["kernel_variant"] in {"none", *(v.name for v in runnable_variants())}
    assert int(labels["num_threads"]) >= 1 and int(labels["kv_cache_tokens"]) > 0
    [card] = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"]
    assert labels["max_model_len"] == str(card["max_model_len"])


def test_version(server):
    response = httpx.get(server.base_url + "/version", timeout=10)
    assert response.status_code == 200
    body = response.json()
    assert body.pop("version") == importlib.metadata.version("serval")
    assert isinstance(body["num_threads"], int) and isinstance(body["kv_cache_tokens"], int)
    assert {name: str(value) for name, value in body.items()} == model_info(server.base_url)
