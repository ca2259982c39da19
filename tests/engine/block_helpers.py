"""Helpers for BlockManager tests: requests on token ids alone, and a prefill without a model."""

from __future__ import annotations

from serval.engine.block_manager import BlockManager
from serval.engine.request import Request
from serval.sampling import SamplingParams


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=4), eos_token_ids=())


def prefill(bm: BlockManager, request: Request) -> None:
    """Allocate the request's context (taking cached blocks first) and mark it computed, as a step would."""
    cached = bm.find_cached_prefix(request)
    bm.allocate(request, request.num_tokens - len(cached) * bm.block_size, cached)
    request.num_computed_tokens = request.num_tokens
    bm.cache_full_blocks(request)
