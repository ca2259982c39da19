"""BlockManager.rollback and provisional tokens, the KV seam of speculative decoding, on token ids alone:
rejected drafts give back the blocks they emptied, shared blocks stay with their other holders, and the
prefix cache never finds a token that was not accepted."""

from __future__ import annotations

import pytest

from serval.engine.block_manager import BlockManager, hash_block
from serval.engine.request import Request
from tests.engine.block_helpers import make_request, prefill


def speculate(bm: BlockManager, request: Request, draft: list[int]) -> None:
    """Append draft tokens and compute them as one step would, naming no block that holds one of them."""
    for token_id in draft:
        request.append_token(token_id)
    bm.allocate(request, request.num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = request.num_tokens
    bm.cache_full_blocks(request, num_provisional_tokens=len(draft))


def reject(bm: BlockManager, request: Request, num_tokens: int) -> None:
    bm.rollback(request, num_tokens)
    request.rollback_tokens(num_tokens)


def chain(token_ids: list[int], block_size: int) -> list[bytes]:
    """The hash chain of the full blocks of token_ids."""
    hashes, parent = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def test_rollback_across_a_block_boundary_frees_the_emptied_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = make_request("r", [1, 2, 3, 4, 5, 6])  # [1..4] full, [5, 6] partial
    prefill(bm, r)
    speculate(bm, r, [7, 8, 9, 10])  # [5..8] full (all but two provisional), [9, 10] in a third block
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 5
    kept = r.block_ids[:2]
    reject(bm, r, 3)  # 8, 9, 10 rejected: the third block is empty, the second partial again
    assert r.block_ids == kept and bm.num_free_blocks == 6
    assert r.num_computed_tokens == 7 and r.token_ids == [1, 2, 3, 4, 5, 6, 7]
    bm.rollback(r, 3)  # the KV alone, back to the block boundary: the second block holds nothing now
    assert r.block_ids == kept[:1] and bm.num_free_blocks == 7 and r.num_computed_tokens == 4
    bm.free(r)
    assert bm.num_free_blocks == 8


def test_provisional_blocks_are_named_only_once_accepted():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = make_request("r", [1, 2, 3, 4, 5, 6])
    prefill(bm, r)
    speculate(bm, r, [7, 8, 9])
    assert r.block_hashes == chain([1, 2, 3, 4], 4) and bm.block_hash[r.block_ids[1]] is None
    probe = make_request("p", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert bm.find_cached_prefix(probe) == r.block_ids[:1]  # the block of drafts is not found
    bm.cache_full_blocks(r)  # the drafts are accepted: their full block is named now
    assert r.block_hashes == chain([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert bm.find_cached_prefix(probe) == r.block_ids[:2]


def test_the_prefix_cache_never_finds_rolled_back_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = make_request("r", [1, 2, 3, 4, 5, 6])
    prefill(bm, r)
    speculate(bm, r, [7, 8, 9, 10, 11, 12])  # two blocks of drafts: [5..8] and [9..12]
    reject(bm, r, 6)
    bm.free(r)
    probe = make_request("p", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0])
    assert len(bm.find_cached_prefix(probe)) == 1  # only [1..4], whose tokens were accepted


def test_rolling_back_named_tokens_unnames_the_block():
    # The caller named a block whose tokens it later rolls back (it told cache_full_blocks nothing was
    # provisional): rollback still takes the block out of the prefix cache, since it now writes others there.
    bm = BlockManager(num_blocks=8, block_size=4)
    r = make_request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(bm, r)
    named = r.block_ids[1]
    assert bm.block_hash[named] is not None
    bm.rollback(r, 3)  # 7, 8, 9: the second block is partial again
    assert bm.block_hash[named] is None and r.block_hashes == chain([1, 2, 3, 4], 4)
    assert len(bm.find_cached_prefix(make_request("p", [1, 2, 3, 4, 5, 6, 7, 8, 0]))) == 1


def test_after_rollback_new_tokens_are_named_by_their_own_hash():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = make_request("r", [1, 2, 3, 4, 5, 6])
    prefill(bm, r)
    speculate(bm, r, [7, 8, 9])
    reject(bm, r, 3)
    speculate(bm, r, [17, 18, 19])  # different drafts, into the same second block
    bm.cache_full_blocks(r)  # all accepted
    assert r.block_hashes == chain([1, 2, 3, 4, 5, 6, 17, 18], 4)
    assert bm.block_hash[r.block_ids[1]] == r.block_hashes[1]
    probe = make_request("p", [1, 2, 3, 4, 5, 6, 17, 18, 0])
    assert bm.find_cached_prefix(probe) == r.block_ids[:2]
    assert len(bm.find_cached_prefix(make_request("q", [1, 2, 3, 4, 5, 6, 7, 8, 0]))) == 1


def test_a_forked_block_stays_with_the_parent_and_is_copied_before_a_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    prefill(bm, parent)
    child = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    bm.fork(parent, child, 8)
    first, second = parent.block_ids
    num_free = bm.num_free_blocks
    bm.rollback(child, 6)  # into the first shared block, past the second
    assert child.block_ids == [first] and child.num_computed_tokens == 2
    assert bm.ref_counts[first] == 2 and bm.ref_counts[second] == 1  # the parent still holds both
    assert bm.num_free_blocks == num_free  # nothing freed while referenced
    assert bm.find_cached_prefix(make_request("p", [1, 2, 3, 4, 5, 6, 7, 8, 0])) == [first, second]
    # The child's next token lands in the shared block: it gets a copy, the parent's block is untouched.
    bm.allocate(child, 1)
    assert child.block_ids[0] != first and bm.take_copies() == [(first, child.block_ids[0])]
    assert bm.ref_counts[first] == 1 and bm.block_hash[first] is not None


def test_a_prefix_cache_hit_is_not_freed_while_its_first_holder_runs():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(bm, a)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 20])
    prefill(bm, b)  # takes a's two full blocks from the prefix cache
    assert b.block_ids[:2] == a.block_ids[:2]
    num_free = bm.num_free_blocks
    bm.rollback(b, 6)  # b holds 3 tokens now: its third block is freed, the second still a's
    assert bm.num_free_blocks == num_free + 1
    assert bm.ref_counts[a.block_ids[1]] == 1 and bm.ref_counts[a.block_ids[0]] == 2
    assert len(bm.find_cached_prefix(make_request("p", [1, 2, 3, 4, 5, 6, 7, 8, 0]))) == 2


def test_rollback_refuses_more_than_computed():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = make_request("r", [1, 2, 3])
    prefill(bm, r)
    with pytest.raises(ValueError, match="roll back 4 tokens"):
        bm.rollback(r, 4)
    assert r.num_computed_tokens == 3 and len(r.block_ids) == 1


def test_request_drops_only_output_tokens_and_only_once_uncomputed():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = make_request("r", [1, 2, 3])
    prefill(bm, r)
    r.append_token(4)
    r.append_token(5)  # sampled, not yet computed
    with pytest.raises(ValueError, match="output tokens"):
        r.rollback_tokens(3)  # would drop a prompt token
    speculate(bm, r, [6])
    with pytest.raises(ValueError, match="BlockManager.rollback"):
        r.rollback_tokens(2)  # 5 and 6 are still computed
    reject(bm, r, 2)
    assert r.token_ids == [1, 2, 3, 4] and r.num_computed_tokens == 4 and r.output_token_ids == [4]
