"""BlockManager: reference counts, the hash-chained prefix cache and LRU eviction, on token ids alone."""

from __future__ import annotations

from serval.engine.block_manager import BlockManager
from tests.engine.block_helpers import make_request, prefill


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = make_request("a", list(range(10)))
    prefill(bm, r)
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 5
    bm.free(r)
    assert bm.num_free_blocks == 8 and r.block_ids == []


def test_shared_prefix_reuses_full_blocks_only():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(10)))  # blocks [0..3], [4..7] full, [8, 9] partial
    prefill(bm, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    cached = bm.find_cached_prefix(b)
    assert cached == a.block_ids[:2]
    bm.allocate(b, b.num_tokens - 8, cached)
    assert b.num_computed_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert bm.ref_counts[a.block_ids[0]] == 2
    assert bm.num_hit_tokens == 8


def test_one_token_is_always_left_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(8)))
    prefill(bm, a)
    same = make_request("b", list(range(8)))
    # Both blocks are cached, but only the first may be used: the last token must be computed for logits.
    assert bm.find_cached_prefix(same) == a.block_ids[:1]


def test_freed_blocks_stay_cached_until_reused_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    prefill(bm, a)  # 3 blocks, 2 full and cached
    bm.free(a)
    again = make_request("a2", [1, 2, 3, 4, 9])
    assert len(bm.find_cached_prefix(again)) == 2  # still there after free
    # A different request needing all 4 blocks evicts them.
    other = make_request("c", [7, 7, 7, 7, 7, 7, 7, 7])
    prefill(bm, other)
    assert bm.find_cached_prefix(again) == []
    bm.free(other)
    assert bm.num_free_blocks == 4


def test_eviction_prefers_tail_and_unhashed_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])  # blocks: [1,2] [3,4] [5,6] full + [7] partial
    prefill(bm, a)
    bm.free(a)
    # Take two blocks: the unhashed partial one first, then the tail full block ([5, 6]).
    taker = make_request("t", [9, 9, 9])
    bm.allocate(taker, 3)
    probe = make_request("p", [1, 2, 3, 4, 5, 6, 0])
    assert len(bm.find_cached_prefix(probe)) == 2  # [1,2] and [3,4] survived, [5,6] was evicted


def test_can_allocate_counts_cached_free_blocks():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    prefill(bm, a)
    bm.free(a)
    b = make_request("b", [1, 2, 3, 4, 5, 6])
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 2
    assert bm.can_allocate(b, 2, cached)  # 2 cached blocks (free, but cached) + 1 new = all 3 blocks
    assert not bm.can_allocate(b, 3, cached)  # would need a fourth
