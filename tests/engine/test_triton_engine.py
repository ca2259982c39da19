"""The Triton attention backend (CUDA's) through the whole engine, on the CPU under Triton's interpreter: a
tiny random-weight model gives the same greedy tokens, and logprobs within fp32 rounding, as with the SDPA
reference backend, over the model's dtype's cache and an int8 one. The steps cover what a GPU run meets
(tests/engine/chunked_waves.py): prefills chunked by a small token budget beside running decodes (mixed
steps), decode-only steps, and prompts that hit the prefix cache (a cached prefix read from the paged cache). gpt-oss's attention adds sliding windows and sink logits."""

from __future__ import annotations

import pytest

from tests.engine.chunked_waves import PARAMS, generate_with_prefix_hit
from tests.fixtures.triton_interpreter import triton_interpreter  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("triton_interpreter")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])  # int8: codes times their rows' scales
@pytest.mark.parametrize("architecture", ["llama", "gpt_oss"])
def test_greedy_tokens_match_the_sdpa_backend(tiny_model_factory, monkeypatch, architecture, kv_cache_dtype):
    monkeypatch.setenv("SERVAL_DISABLE_NATIVE_KERNELS", "1")  # neither backend under test needs them
    directory, _ = tiny_model_factory(architecture, False)
    expected = generate_with_prefix_hit(directory, "sdpa", kv_cache_dtype)
    got = generate_with_prefix_hit(directory, "triton", kv_cache_dtype)
    assert all(len(tokens) == PARAMS.max_tokens for tokens, _ in expected.values())
    for request_id, (tokens, logprobs) in expected.items():
        assert got[request_id][0] == tokens, request_id
        assert max(abs(a - b) for a, b in zip(got[request_id][1], logprobs)) < 1e-4, request_id
