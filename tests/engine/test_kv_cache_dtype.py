"""An 8-bit KV cache (`kv_cache_dtype="fp8_e5m2"`) through the whole engine on tiny random-weight models: the
native backend (its fused decode included) gives the SDPA reference backend's greedy tokens, logprobs within
fp32 rounding, over the same rounded cache; a request's tokens are bitwise the same alone or beside others in
chunked, mixed steps; the cache holds twice the tokens in the same memory and frees every block; the rounding
is real (logprobs move off the 32-bit cache's) and bounded; the Triton backend, which reads the cache in the
model's dtype, is refused at start-up."""

from __future__ import annotations

import pytest
import torch

from serval.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from serval.engine.engine import Engine
from serval.runner.attention.cache_dtype import kv_cache_dtype
from serval.sampling import SamplingParams
from tests.fixtures.kernels import require_kernels
from tests.fixtures.triton_interpreter import triton_interpreter  # noqa: F401 (a fixture)

SHARED = [11, 42, 7, 300, 5, 19, 23, 88, 4, 61, 9, 140]  # three whole blocks of 4
PROMPTS = {"a": SHARED + [70, 71, 72], "b": [3, 250, 17, 17, 96], "d": [8] * 23}
LATER = {"c": SHARED + [5, 5]}  # after "a" finished: a prefix-cache hit on SHARED's blocks
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True)


def _engine(directory: str, backend: str, kv_cache_dtype: str, dtype: str = "float32", **cache) -> Engine:
    return Engine(
        EngineConfig(
            model=ModelConfig(model=directory, dtype=dtype, attention_backend=backend),
            cache=CacheConfig(block_size=4, kv_cache_dtype=kv_cache_dtype, **(cache or {"num_blocks": 64})),
            # 9 tokens a step: the longer prompts are chunked, and their chunks share steps with decodes.
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=9),
        )
    )


def _run(engine: Engine, waves: list[dict[str, list[int]]]) -> dict[str, tuple[list[int], list[float]]]:
    answers: dict[str, tuple[list[int], list[float]]] = {}
    for prompts in waves:
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, PARAMS)
            answers[request_id] = ([], [])
        while engine.has_unfinished_requests():
            for output in engine.step():
                answers[output.request_id][0].extend(output.new_token_ids)
                answers[output.request_id][1].extend(lp.logprob for lp in output.new_logprobs or [])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return answers


def _generate(directory: str, backend: str, kv_cache_dtype: str, dtype: str = "float32"):
    engine = _engine(directory, backend, kv_cache_dtype, dtype)
    assert engine.runner.attention_backend.name == backend
    hits = engine.block_manager.num_hit_tokens
    answers = _run(engine, [PROMPTS, LATER])
    assert engine.block_manager.num_hit_tokens - hits == len(SHARED)
    return answers


@pytest.mark.parametrize("architecture", ["llama", "gpt_oss"])  # gpt-oss: sliding windows, sink logits
def test_the_native_backend_matches_the_sdpa_backend_over_an_8bit_cache(tiny_model_factory, architecture):
    require_kernels()
    directory, _ = tiny_model_factory(architecture, False)
    expected = _generate(directory, "sdpa", "fp8_e5m2")
    got = _generate(directory, "native-cpu", "fp8_e5m2")
    for request_id, (tokens, logprobs) in expected.items():
        assert len(tokens) == PARAMS.max_tokens
        assert got[request_id][0] == tokens, request_id
        assert max(abs(a - b) for a, b in zip(got[request_id][1], logprobs)) < 1e-4, request_id


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_request_is_answered_alike_alone_or_batched(tiny_model_factory, dtype):
    require_kernels()
    directory, _ = tiny_model_factory("llama", False)
    engine = _engine(directory, "native-cpu", "fp8_e5m2", dtype)
    together = _run(engine, [PROMPTS])
    for request_id, prompt in PROMPTS.items():
        alone = _run(engine, [{request_id: prompt}])
        assert alone[request_id] == together[request_id], request_id


def test_the_8bit_cache_holds_twice_the_tokens_and_rounds_within_bounds(tiny_model_factory):
    require_kernels()
    directory, _ = tiny_model_factory("llama", False)
    budget = {"kv_cache_memory_bytes": 4 << 20}
    wide = _engine(directory, "native-cpu", "auto", **budget)
    narrow = _engine(directory, "native-cpu", "fp8_e5m2", **budget)
    assert narrow.runner.kv_caches[0][0].dtype == torch.float8_e5m2
    assert wide.runner.kv_caches[0][0].dtype == torch.float32
    assert narrow.runner.info.num_blocks == 4 * wide.runner.info.num_blocks  # 1 byte a value against 4
    assert narrow.runner.info.cache_dtype == "float8_e5m2"
    exact, rounded = _run(wide, [PROMPTS]), _run(narrow, [PROMPTS])
    differences = [abs(a - b) for r in PROMPTS for a, b in zip(exact[r][1], rounded[r][1])]
    # K and V rounded to 2 mantissa bits move the logprobs (a cache that kept the values would not), but
    # not far on this model: a bound that an unrounded read or a wrong widening (a misplaced byte) breaks.
    assert max(differences) > 1e-4
    assert max(differences) < 0.5


def test_the_triton_backend_is_refused_with_an_8bit_cache(tiny_model_factory, triton_interpreter):  # noqa: F811
    directory, _ = tiny_model_factory("llama", False)
    with pytest.raises(ValueError, match="native-cpu and sdpa"):
        _engine(directory, "triton", "fp8_e5m2")


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8", "float16"])
def test_other_cache_dtypes_are_refused(name):
    with pytest.raises(ValueError, match="fp8_e5m2"):
        CacheConfig(kv_cache_dtype=name)


def test_fp8_names_e5m2_as_vllms_cpu_backend_takes_it():
    assert (
        kv_cache_dtype("fp8", torch.bfloat16)
        == kv_cache_dtype("fp8_e5m2", torch.float32)
        == torch.float8_e5m2
    )
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
