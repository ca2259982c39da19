"""Embedding an embedding model's prompts on the engine thread, between steps.

Owns the one thing an embedding asks of the engine: KV blocks for its prompts while the runner computes
them (the model's attention writes and reads K/V through blocks, as in any prefill), taken from the same
BlockManager and given back before it returns, so an embedding never holds a block past its own call. Prompts
go to the runner in groups of at most the scheduler's token budget (a longer prompt alone), each group as
large as the free blocks allow.
"""

from __future__ import annotations

from serval.engine.block_manager import BlockManager
from serval.engine.request import Request
from serval.runner.batch import Batch
from serval.runner.runner import ModelRunner
from serval.sampling import SamplingParams


def _groups(prompts: list[list[int]], max_tokens: int, max_blocks: int, block_size: int) -> list[list[int]]:
    """Indices of the prompts, in order, grouped: a group's tokens within max_tokens (or one prompt), its
    blocks within max_blocks. ValueError for a prompt that alone needs more blocks than there are."""
    groups: list[list[int]] = []
    num_tokens = num_blocks = 0
    for i, prompt in enumerate(prompts):
        needed = -(-len(prompt) // block_size)
        if needed > max_blocks:
            raise ValueError(f"a prompt of {len(prompt)} tokens needs more KV blocks than are free")
        if groups and num_tokens + len(prompt) <= max_tokens and num_blocks + needed <= max_blocks:
            groups[-1].append(i)
            num_tokens, num_blocks = num_tokens + len(prompt), num_blocks + needed
        else:
            groups.append([i])
            num_tokens, num_blocks = len(prompt), needed
    return groups


def embed_prompts(
    block_manager: BlockManager, runner: ModelRunner, prompts: list[list[int]], max_batch_tokens: int
) -> list[list[float]]:
    """One vector per prompt (the runner's pooling; engine thread only)."""
    vectors: list[list[float]] = [[] for _ in prompts]
    groups = _groups(prompts, max_batch_tokens, block_manager.num_free_blocks, block_manager.block_size)
    for group in groups:
        requests = [Request(f"embed-{i}", prompts[i], SamplingParams(max_tokens=1), ()) for i in group]
        try:
            for request in requests:
                block_manager.allocate(request, request.num_prompt_tokens)
            batch = Batch(
                token_ids=[t for request in requests for t in request.token_ids],
                num_new_tokens=[request.num_prompt_tokens for request in requests],
                num_computed_tokens=[0] * len(requests),
                block_tables=[list(request.block_ids) for request in requests],
                sample_indices=[],
                sampling=[],
            )
            for i, vector in zip(group, runner.embed(batch)):
                vectors[i] = vector.tolist()
        finally:
            for request in requests:
                block_manager.free(request)
    return vectors
