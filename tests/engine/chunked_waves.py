"""A tiny model's engine under a 9-token step budget, and waves of greedy requests through it: what the
attention-backend engine tests (test_triton_engine.py, test_kv_cache_dtype.py) compare between backends and
caches. Prompts are chunked and their chunks share steps with decodes (mixed steps), later steps are
decode-only, and the second wave hits the first's prefix-cache blocks."""

from __future__ import annotations

from serval.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from serval.engine.engine import Engine
from serval.sampling import SamplingParams

SHARED = [11, 42, 7, 300, 5, 19, 23, 88, 4, 61, 9, 140]  # 12 tokens: three whole blocks of 4
FIRST_WAVE = {"a": SHARED + [70, 71, 72], "b": [3, 250, 17, 17, 96], "d": [8] * 23}
LATER = {"c": SHARED + [5, 5]}  # after "a" finished: a prefix-cache hit on SHARED's blocks
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True)

Answers = dict[str, tuple[list[int], list[float]]]  # request id: (tokens, their logprobs)


def chunking_engine(
    directory: str, backend: str, kv_cache_dtype: str = "auto", dtype: str = "float32", **cache
) -> Engine:
    """cache: CacheConfig's budget fields (default 64 blocks of 4 tokens)."""
    return Engine(
        EngineConfig(
            model=ModelConfig(model=directory, dtype=dtype, attention_backend=backend),
            cache=CacheConfig(block_size=4, kv_cache_dtype=kv_cache_dtype, **(cache or {"num_blocks": 64})),
            # 9 tokens a step: the longer prompts are chunked, and their chunks share steps with decodes.
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=9),
        )
    )


def run_waves(engine: Engine, waves: list[dict[str, list[int]]]) -> Answers:
    """Each wave's prompts added together and run to the end; every KV block is free afterwards."""
    answers: Answers = {}
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


def generate_with_prefix_hit(directory: str, backend: str, kv_cache_dtype: str = "auto") -> Answers:
    """FIRST_WAVE, then LATER, which finds SHARED's blocks in the prefix cache, on `backend` (fp32)."""
    engine = chunking_engine(directory, backend, kv_cache_dtype)
    assert engine.runner.attention_backend.name == backend
    hits = engine.block_manager.num_hit_tokens
    answers = run_waves(engine, [FIRST_WAVE, LATER])
    assert engine.block_manager.num_hit_tokens - hits == len(SHARED)
    return answers
