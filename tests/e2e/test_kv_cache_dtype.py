"""A real server with an 8-bit KV cache (`--kv-cache-dtype fp8_e5m2`) and the default model, through the
official openai client: it answers, says what its cache holds (/version, the info gauge, vLLM's
cache_config_info), fits the tokens its memory budget holds at one byte a value, answers a greedy request
alike alone and among others, and frees every block afterwards."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from tests.e2e.conftest import running_server
from tests.e2e.helpers import metric, wait_until_idle
from tests.e2e.test_vllm_metrics import scrape

# A real server process with the default model: minutes, not seconds.
pytestmark = pytest.mark.slow

BUDGET = 64 << 20
# SmolLM2-135M: 30 layers, K and V of 3 kv heads of 64 values a token, one byte each.
BYTES_PER_TOKEN = 30 * 2 * 3 * 64


@pytest.fixture(scope="module")
def fp8_server(tmp_path_factory):
    args = ["--log-level", "warning", "--kv-cache-dtype", "fp8_e5m2", "--kv-cache-memory-bytes", str(BUDGET)]
    with running_server(args, tmp_path_factory.mktemp("fp8-cache") / "server.log") as server:
        server.model = server.served_model()
        yield server


def test_the_server_says_what_its_cache_holds(fp8_server):
    version = httpx.get(fp8_server.base_url + "/version", timeout=10).json()
    assert version["kv_cache_dtype"] == "float8_e5m2"
    assert version["kv_cache_tokens"] == BUDGET // (16 * BYTES_PER_TOKEN) * 16  # whole blocks of 16
    samples = scrape(fp8_server.base_url)
    [cache] = [dict(labels) for name, labels in samples if name == "vllm:cache_config_info"]
    assert cache["cache_dtype"] == "float8_e5m2"
    [info] = [dict(labels) for name, labels in samples if name == "serval_model_info"]
    assert info["kv_cache_dtype"] == "float8_e5m2" and info["dtype"] != "float8_e5m2"


def test_greedy_answers_are_the_same_alone_and_among_others(fp8_server):
    client = openai.OpenAI(base_url=f"{fp8_server.base_url}/v1", api_key="unused", max_retries=0, timeout=600)

    def ask(question: str) -> str:
        response = client.chat.completions.create(
            model=fp8_server.model,
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=24,
        )
        assert response.choices[0].finish_reason in ("stop", "length")
        assert response.usage.completion_tokens > 0
        return response.choices[0].message.content

    probe = "What is the capital of France?"
    alone = ask(probe)
    assert alone.strip()
    others = [f"Count from {n} to {n + 5}." for n in range(1, 6)]
    with concurrent.futures.ThreadPoolExecutor(len(others) + 1) as pool:
        answers = list(pool.map(ask, [*others, probe]))
    assert answers[-1] == alone
    wait_until_idle(fp8_server.base_url)
    # Every block back on the free list (the prefix cache's blocks stay findable there until reused).
    total = metric(fp8_server.base_url, "serval_kv_cache_total_blocks")
    assert (
        metric(fp8_server.base_url, "serval_kv_cache_free_blocks")
        == total
        == BUDGET // (16 * BYTES_PER_TOKEN)
    )
