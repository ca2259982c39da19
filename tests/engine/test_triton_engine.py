"""The Triton attention backend (CUDA's) through the whole engine, on the CPU under Triton's interpreter: a
tiny random-weight model gives the same greedy tokens, and logprobs within fp32 rounding, as with the SDPA
reference backend, over the model's dtype's cache and an int8 one. The steps cover what a GPU run meets: prefills chunked by a small token budget beside
running decodes (mixed steps), decode-only steps, and prompts that hit the prefix cache (a cached prefix
read from the paged cache). gpt-oss's attention adds sliding windows and sink logits."""

from __future__ import annotations

import pytest

from serval.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from serval.engine.engine import Engine
from serval.sampling import SamplingParams
from tests.fixtures.triton_interpreter import triton_interpreter  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("triton_interpreter")

SHARED = [11, 42, 7, 300, 5, 19, 23, 88, 4, 61, 9, 140]  # 12 tokens: three whole blocks of 4
PROMPTS = [
    SHARED + [70, 71, 72],
    [3, 250, 17, 17, 96],
    SHARED + [5, 5],  # the second wave's prefix-cache hit on SHARED's blocks
    [8] * 23,
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True)


def _generate(
    directory: str, backend: str, kv_cache_dtype: str = "auto"
) -> dict[str, tuple[list[int], list[float]]]:
    config = EngineConfig(
        model=ModelConfig(model=directory, dtype="float32", attention_backend=backend),
        cache=CacheConfig(num_blocks=64, block_size=4, kv_cache_dtype=kv_cache_dtype),
        # 9 tokens a step: the longer prompts are chunked, and their chunks share steps with decodes.
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=9),
    )
    engine = Engine(config)
    assert engine.runner.attention_backend.name == backend
    answers: dict[str, tuple[list[int], list[float]]] = {}

    def run(prompts: dict[str, list[int]]) -> None:
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, PARAMS)
            answers[request_id] = ([], [])
        while engine.has_unfinished_requests():
            for output in engine.step():
                answers[output.request_id][0].extend(output.new_token_ids)
                answers[output.request_id][1].extend(lp.logprob for lp in output.new_logprobs or [])

    run({"a": PROMPTS[0], "b": PROMPTS[1], "d": PROMPTS[3]})
    num_hits = engine.block_manager.num_hit_tokens
    run({"c": PROMPTS[2]})  # after "a" finished: its SHARED blocks are in the prefix cache
    assert engine.block_manager.num_hit_tokens - num_hits == len(SHARED)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return answers


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])  # int8: codes times their rows' scales
@pytest.mark.parametrize("architecture", ["llama", "gpt_oss"])
def test_greedy_tokens_match_the_sdpa_backend(tiny_model_factory, monkeypatch, architecture, kv_cache_dtype):
    monkeypatch.setenv("SERVAL_DISABLE_NATIVE_KERNELS", "1")  # neither backend under test needs them
    directory, _ = tiny_model_factory(architecture, False)
    expected = _generate(directory, "sdpa", kv_cache_dtype)
    got = _generate(directory, "triton", kv_cache_dtype)
    assert all(len(tokens) == PARAMS.max_tokens for tokens, _ in expected.values())
    for request_id, (tokens, logprobs) in expected.items():
        assert got[request_id][0] == tokens, request_id
        assert max(abs(a - b) for a, b in zip(got[request_id][1], logprobs)) < 1e-4, request_id
