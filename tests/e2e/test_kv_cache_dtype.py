"""A real server with a narrower KV cache (`--kv-cache-dtype fp8_e5m2`, `int8`, then `bfloat16`) and the default
model, through the official openai client: it answers, says what its cache holds (/version, the info gauge,
vLLM's cache_config_info), fits the tokens its memory budget holds at one byte a value (two for bf16), answers
a greedy request alike alone and among others, and frees every block afterwards."""

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
# SmolLM2-135M: 30 layers, K and V of 3 kv heads of 64 values a token, one byte each (bf16: two); an int8 row
# also has its 4-byte scale.
ROW_BYTES = {"fp8_e5m2": 64, "int8": 68, "bfloat16": 128}
DTYPE_NAMES = {"fp8_e5m2": "float8_e5m2", "int8": "int8", "bfloat16": "bfloat16"}


@pytest.fixture(scope="module", params=list(ROW_BYTES))
def eight_bit_server(request, tmp_path_factory):
    kind = request.param
    args = ["--log-level", "warning", "--kv-cache-dtype", kind, "--kv-cache-memory-bytes", str(BUDGET)]
    with running_server(args, tmp_path_factory.mktemp(f"{kind}-cache") / "server.log") as server:
        server.model = server.served_model()
        server.kind = kind
        yield server


def blocks_in_budget(kind: str) -> int:
    return BUDGET // (16 * 30 * 2 * 3 * ROW_BYTES[kind])


def test_the_server_says_what_its_cache_holds(eight_bit_server):
    version = httpx.get(eight_bit_server.base_url + "/version", timeout=10).json()
    name = DTYPE_NAMES[eight_bit_server.kind]
    assert version["kv_cache_dtype"] == name
    assert version["kv_cache_tokens"] == blocks_in_budget(eight_bit_server.kind) * 16  # whole blocks of 16
    samples = scrape(eight_bit_server.base_url)
    [cache] = [dict(labels) for sample, labels in samples if sample == "vllm:cache_config_info"]
    assert cache["cache_dtype"] == name
    [info] = [dict(labels) for sample, labels in samples if sample == "serval_model_info"]
    assert info["kv_cache_dtype"] == name
    # The compute dtype: fp32 where the CPU has no bf16 arithmetic, where a bf16 cache is half the bytes of
    # "auto"'s; else bf16, which "bfloat16" then names.
    assert info["dtype"] != name or name == "bfloat16"


def test_greedy_answers_are_the_same_alone_and_among_others(eight_bit_server):
    client = openai.OpenAI(
        base_url=f"{eight_bit_server.base_url}/v1", api_key="unused", max_retries=0, timeout=600
    )

    def ask(question: str) -> str:
        response = client.chat.completions.create(
            model=eight_bit_server.model,
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
    wait_until_idle(eight_bit_server.base_url)
    # Every block back on the free list (the prefix cache's blocks stay findable there until reused).
    total = metric(eight_bit_server.base_url, "serval_kv_cache_total_blocks")
    assert (
        metric(eight_bit_server.base_url, "serval_kv_cache_free_blocks")
        == total
        == blocks_in_budget(eight_bit_server.kind)
    )
