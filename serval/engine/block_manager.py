"""BlockManager: the paged KV cache's bookkeeping: block reference counts, free list and prefix cache.

A block holds `block_size` consecutive tokens of one or more requests' contexts. A full block is named by a
hash chained over every token before it (hash(parent_hash, its tokens)), so equal hashes mean equal
prefixes and the block can be shared. A block holding rows of a media item also mixes in the item's content
hash: its placeholder ids say nothing of the image. The chain of a request with a LoRA adapter starts from
the adapter's seed instead of b"": its blocks hold other keys and values, and must never be shared with
another adapter's or the base model's. Freed blocks keep their hash and stay findable until the free list
hands them out again, least recently freed first; that is the prefix cache's LRU eviction.

Forks (beam search, and the n/best_of sequences of one prompt): a child takes a reference on each of its
parent's blocks instead of a copy. The one block a sequence can still write into, its partial last block, is
copied on write: when a sequence is about to write into a block someone else also references, it gets a
fresh block and the engine tells the runner to copy the KV rows over first (`take_copies`).

Speculative decoding computes draft tokens that may be rejected: their blocks stay out of the prefix cache
until they are accepted (`cache_full_blocks`' num_provisional_tokens), and `rollback` forgets the rejected
ones, giving back the blocks they emptied.

Pins (explicit prompt caching): a pinned full block holds one reference of its own until its pin expires, so
it never reaches the free list and survives any eviction pressure. Pins are bounded (`max_num_pinned_blocks`)
so they can't starve running requests; expiry is read from an injected clock and checked once per step.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from serval.engine.request import Request


def hash_block(parent_hash: bytes, token_ids: list[int], media_key: bytes = b"") -> bytes:
    """media_key: the content hashes of the media items whose rows the block holds (Request.block_media_key):
    their placeholder ids are the same whatever the image, their keys and values are not."""
    h = hashlib.blake2b(parent_hash, digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if media_key:
        h.update(media_key)
    return h.digest()


PIN_TTL_S = 300.0  # an explicit cache entry lives five minutes after it was last written or refreshed


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        max_num_pinned_blocks: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached_blocks: dict[bytes, int] = {}  # hash -> block id, for full blocks
        # Blocks with no reference, in eviction order (first = next to hand out). Blocks without a hash go
        # to the front: they hold nothing worth keeping.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Counters for metrics: prompt tokens looked up in and found in the prefix cache.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.max_num_pinned_blocks = max_num_pinned_blocks
        self.clock = clock
        # block id -> when its pin expires (clock time); each pinned block holds one reference for its pin.
        self.pin_expiry: dict[int, float] = {}
        self.num_refused_pin_blocks = 0  # blocks a pin asked for beyond max_num_pinned_blocks (metrics)
        # (source, destination) block copies owed to the runner before this step's forward pass.
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request's context (not yet referenced).

        At least one token is always left to compute: the step that computes it yields the next logits.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids, parent = [], request.block_hash_seed
        for i in range(max_blocks):
            tokens = request.token_ids[i * self.block_size : (i + 1) * self.block_size]
            media_key = request.block_media_key(i, self.block_size) if request.media else b""
            parent = hash_block(parent, tokens, media_key)
            block_id = self.cached_blocks.get(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_cached_blocks: int = 0) -> int:
        total_tokens = request.num_computed_tokens + num_cached_blocks * self.block_size + num_new_tokens
        total_blocks = -(-total_tokens // self.block_size)
        num_copies = 1 if self._shared_write_block(request) is not None else 0
        return max(0, total_blocks - len(request.block_ids) - num_cached_blocks) + num_copies

    def _shared_write_block(self, request: Request) -> int | None:
        """Index (in the request's table) of the block its next token lands in, if another sequence shares it."""
        index = request.num_computed_tokens // self.block_size
        if index < len(request.block_ids) and self.ref_counts[request.block_ids[index]] > 1:
            return index
        return None

    def fits_in_place(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request's next tokens go into blocks it already holds, none shared (allocate would do
        nothing): 15 of 16 decode steps."""
        # One token lands in the block _shared_write_block looks at: held, and by this request alone.
        return (
            num_new_tokens == 1
            and request.num_computed_tokens < len(request.block_ids) * self.block_size
            and self._shared_write_block(request) is None
        )

    def can_allocate(self, request: Request, num_new_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        # Cached blocks that nobody references sit in the free list: taking them shrinks it too.
        num_cached_free = sum(1 for b in cached_block_ids if self.ref_counts[b] == 0)
        needed = self.num_blocks_needed(request, num_new_tokens, len(cached_block_ids))
        return needed + num_cached_free <= self.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int, cached_block_ids: list[int] = ()) -> None:
        """Give the request blocks for `num_new_tokens` more tokens, first taking the cached prefix blocks."""
        # NOTE: the caller has checked can_allocate (the scheduler, every step for every request): checking
        # again here was a tenth of a 64-sequence decode step's host time. Running out anyway is loud: the
        # free list's popitem raises.
        if cached_block_ids:
            assert request.num_computed_tokens == 0 and not request.block_ids
            for block_id in cached_block_ids:
                self._reference(block_id)
                request.block_ids.append(block_id)
                request.block_hashes.append(self.block_hash[block_id])
            num_cached_tokens = len(cached_block_ids) * self.block_size
            request.num_computed_tokens = num_cached_tokens
            self.num_hit_tokens += num_cached_tokens
        shared_index = self._shared_write_block(request)
        if shared_index is not None:
            # Copy on write: the request's next token lands in a block another sequence also holds.
            source = request.block_ids[shared_index]
            copy = self._take_free_block()
            self.pending_copies.append((source, copy))
            self._dereference(source)
            request.block_ids[shared_index] = copy
            mark_blocks_changed(request, shared_index)
        num_needed = self.num_blocks_needed(request, num_new_tokens)
        if num_needed:
            mark_blocks_changed(request, len(request.block_ids))
        for _ in range(num_needed):
            request.block_ids.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        self._forget_hash(block_id)
        self.ref_counts[block_id] = 1
        return block_id

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Give `child` the parent's blocks for its first `num_tokens` computed tokens, by reference.

        The child's context must begin with those tokens; it counts them as computed. Writes past them go
        through copy on write (see `allocate`)."""
        assert not child.block_ids and num_tokens <= parent.num_computed_tokens
        num_blocks = -(-num_tokens // self.block_size)
        for block_id in parent.block_ids[:num_blocks]:
            self._reference(block_id)
        child.block_ids = parent.block_ids[:num_blocks]
        mark_blocks_changed(child, 0)
        child.block_hashes = parent.block_hashes[: num_tokens // self.block_size]
        child.num_computed_tokens = num_tokens

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies the runner must make before this step's forward pass (and forget them)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def cache_full_blocks(self, request: Request, num_provisional_tokens: int = 0) -> None:
        """Name the request's newly completed blocks in the prefix cache (after their tokens are computed).

        num_provisional_tokens: the last computed tokens that may still be rejected (speculative drafts, see
        `rollback`). A block holding any of them stays unnamed; call again once they are accepted."""
        if not self.enable_prefix_caching:
            return
        num_full = (request.num_computed_tokens - num_provisional_tokens) // self.block_size
        for i in range(len(request.block_hashes), num_full):
            parent = request.block_hashes[-1] if request.block_hashes else request.block_hash_seed
            tokens = request.token_ids[i * self.block_size : (i + 1) * self.block_size]
            media_key = request.block_media_key(i, self.block_size) if request.media else b""
            block_hash = hash_block(parent, tokens, media_key)
            request.block_hashes.append(block_hash)
            block_id = request.block_ids[i]
            if block_hash not in self.cached_blocks and self.block_hash[block_id] is None:
                self.block_hash[block_id] = block_hash
                self.cached_blocks[block_hash] = block_id

    def rollback(self, request: Request, num_tokens: int) -> None:
        """Forget the request's last `num_tokens` computed tokens (rejected speculative drafts): it counts
        them as not computed, and gives back the blocks that no longer hold any of its tokens.

        A block that held a rolled-back token and that the request alone references loses its name, so the
        prefix cache never finds those tokens and the request may write others into it. A block someone else
        also references (a fork, a prefix-cache hit, a pin) keeps its name: its holders' tokens are theirs;
        the next write into it is copied first (`allocate`). The request's token ids are its own to drop
        (Request.rollback_tokens)."""
        if not 0 <= num_tokens <= request.num_computed_tokens:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens of a request with {request.num_computed_tokens} computed"
            )
        num_kept = request.num_computed_tokens - num_tokens
        num_kept_blocks = -(-num_kept // self.block_size)
        first_touched = num_kept // self.block_size  # the first block holding a rolled-back token
        # Tail first, as in free(): a shared prefix's head is the last thing evicted.
        for index in range(len(request.block_ids) - 1, first_touched - 1, -1):
            block_id = request.block_ids[index]
            if self.ref_counts[block_id] == 1:
                self._forget_hash(block_id)  # NOTE: before the dereference, which files it as unnamed
            if index >= num_kept_blocks:
                self._dereference(block_id)
        del request.block_ids[num_kept_blocks:]
        # NOTE: nothing for its batch row to copy (rows are not cleared as lists shrink), marked all the same
        # so that every change to the list goes through the one note.
        mark_blocks_changed(request, num_kept_blocks)
        del request.block_hashes[first_touched:]
        request.num_computed_tokens = num_kept

    def free(self, request: Request) -> None:
        # Tail blocks first, so a shared prefix's head is the last thing evicted.
        for block_id in reversed(request.block_ids):
            self._dereference(block_id)
        request.block_ids = []
        request.block_hashes = []
        mark_blocks_changed(request, 0)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self.pin_expiry)

    def pin(self, request: Request, num_tokens: int) -> int:
        """Pin the computed full blocks covering the request's first `num_tokens` tokens for PIN_TTL_S.

        Re-pinning a pinned block refreshes its expiry. Past the bound the rest of the prefix is left
        unpinned (older pins are never pushed out early). Returns the tokens newly pinned, refreshes not
        counted: what the request wrote into the explicit cache.
        """
        num_full = min(num_tokens, request.num_computed_tokens) // self.block_size
        expiry = self.clock() + PIN_TTL_S
        num_new = 0
        for i, block_hash in enumerate(request.block_hashes[:num_full]):
            # NOTE: by hash, not the request's own block: a duplicate block computed alongside the cached
            # one is unnamed, and a later request can only ever find the named one.
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break  # prefix caching is off, or the chain is broken: nothing past here can be found
            if block_id not in self.pin_expiry:
                if self.num_pinned_blocks >= self.max_num_pinned_blocks:
                    self.num_refused_pin_blocks += num_full - i
                    break
                self._reference(block_id)
                num_new += 1
            self.pin_expiry[block_id] = expiry
        return num_new * self.block_size

    def release_expired_pins(self) -> int:
        """Drop the pins whose time is up; their blocks go to the free list's tail (evicted last). Returns
        how many were dropped."""
        now = self.clock()
        expired = [block_id for block_id, expiry in self.pin_expiry.items() if expiry <= now]
        for block_id in expired:
            del self.pin_expiry[block_id]
            self._dereference(block_id)
        return len(expired)

    def record_query(self, num_tokens: int) -> None:
        self.num_queried_tokens += num_tokens

    def _reference(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free_blocks[block_id]
        self.ref_counts[block_id] += 1

    def _dereference(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0
        if self.ref_counts[block_id] == 0:
            self.free_blocks[block_id] = None
            if self.block_hash[block_id] is None:
                self.free_blocks.move_to_end(block_id, last=False)

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            if self.cached_blocks.get(block_hash) == block_id:
                del self.cached_blocks[block_hash]
            self.block_hash[block_id] = None


def mark_blocks_changed(request: Request, index: int) -> None:
    """Note that the request's block list changed from `index` on: its batch row catches up from there."""
    changed_from = request.block_ids_changed_from
    request.block_ids_changed_from = index if changed_from is None else min(changed_from, index)
