"""A draft model: a smaller model with the target's vocabulary, run in the same process, proposes each
speculating sequence's next k tokens greedily.

The draft has its own runner and its own paged KV cache, kept by a BlockManager of its own, with a prefix cache
like the target's: a sequence's full blocks are named by their tokens and stay findable after it ends, so a new
request that repeats a cached prefix (a system prompt, a chat's earlier turns, a document asked about again)
computes only the rest on the draft too. Without it the draft worked through every prompt whole on its first
drafting step, inside the answer's decoding time: on a 1,200-token document, 0.5-0.8 s of a 2 s answer.

Per sequence the draft cache holds the tokens it has computed; before drafting it catches up with the sequence
(after a step, the target kept some of its drafts and added a token of its own: the draft's cache stays valid
up to the first token where the two differ, and BlockManager.rollback forgets the rest), then decodes k
tokens, all the speculating sequences of the step batched together. A few tokens to catch up go as one-token
decode rows at consecutive positions over the sequence's blocks, as the target checks drafts (the fused decode
path: a 2-token prefill chunk cost 1.7x as much); more go as a prefill chunk. Its drafts are its argmax
tokens, so the target's check (speculator.py) is the rejection rule for a drafter that proposes with
certainty. The draft's own drafts stay unnamed in its prefix cache until the target keeps them.
"""

from __future__ import annotations

import dataclasses

from serval.config import CacheConfig, EngineConfig, LoraConfig, ParallelConfig
from serval.engine.block_manager import BlockManager
from serval.engine.request import Request
from serval.model_source import resolve_model
from serval.runner.batch import Batch, SamplingRow
from serval.runner.parallel.runner import make_runner

GREEDY = SamplingRow()

# Up to this many tokens to catch up go as decode rows (a check's k + 1 rows at most, as the target's).
MAX_CATCH_UP_ROWS = 16


@dataclasses.dataclass
class _DraftSequence:
    """A request as the draft's BlockManager keeps it: the tokens whose K/V rows its blocks hold (all of them
    computed), its blocks and their names. The draft runs without adapters or media: its chains start at b""."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    block_ids: list[int] = dataclasses.field(default_factory=list)
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_provisional_tokens: int = 0  # the last computed tokens that are its own drafts, not yet kept
    block_ids_changed_from: int | None = None
    media = None
    block_hash_seed = b""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target_vocab_size: int):
        spec = config.speculative
        # The draft runs beside the target, on its device and dtype, with a cache a quarter of the target's.
        draft_model = dataclasses.replace(config.model, model=spec.model)
        draft_cache = CacheConfig(
            block_size=config.cache.block_size,
            kv_cache_memory_bytes=max(config.cache.kv_cache_memory_bytes // 4, 64 << 20),
            enable_prefix_caching=config.cache.enable_prefix_caching,
        )
        self.runner = make_runner(
            draft_model, draft_cache, resolve_model(spec.model), LoraConfig(), ParallelConfig()
        )
        info = self.runner.info
        if info.vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({info.vocab_size} tokens) is not the target's ({target_vocab_size})"
            )
        self.max_model_len = info.max_model_len
        self.blocks = BlockManager(info.num_blocks, info.block_size, draft_cache.enable_prefix_caching)
        self.sequences: dict[str, _DraftSequence] = {}
        # This step's drafts, by request id (prepare fills them, propose hands them out).
        self.drafts: dict[str, list[int]] = {}
        self.num_speculative_tokens = spec.num_speculative_tokens

    def prepare(self, candidates: list[tuple[Request, int]]) -> None:
        """Draft for every request of the step at once: catch each up with its context, then decode, each
        request up to its own number of drafts (a draft forward a position: none past what is asked for)."""
        self.drafts = {}
        wanted = {r.request_id: max_drafts for r, max_drafts in candidates}
        active = [r for r, _ in candidates if self._catch_up_room(r)]
        if not active:
            return
        inputs = [r.token_ids[self.sequences[r.request_id].num_computed_tokens :] for r in active]
        for position in range(max(wanted.values())):
            if position > 0:  # each sequence's newest draft is the next input: a block for it, or it stops
                room = [
                    (r, i)
                    for r, i in zip(active, inputs)
                    if position < wanted[r.request_id] and self._room(r)
                ]
                if not room:
                    break
                active, inputs = (list(column) for column in zip(*room))
            sampled = self._step(active, inputs, drafts=position > 0)
            for request, token_id in zip(active, sampled):
                self.drafts.setdefault(request.request_id, []).append(token_id)
            inputs = [[token_id] for token_id in sampled]

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        return self.drafts.get(request.request_id, [])[:max_drafts]

    def forget(self, request: Request) -> None:
        """Its blocks go back, those of kept tokens still named (findable by a later request's prefix)."""
        sequence = self.sequences.pop(request.request_id, None)
        if sequence is not None:
            self.blocks.free(sequence)  # blocks holding unkept drafts were never named

    def _catch_up_room(self, request: Request) -> bool:
        """Keep what the draft's cache holds of the request's context (or find it in the prefix cache), and
        find room for the rest. The draft takes up a request only near its answer's start: taken up later (a
        stream left alone at the end of a busy spell), catching up its whole context costs more than the few
        tokens left to draft can save."""
        if request.request_id not in self.sequences and request.num_output_tokens > MAX_CATCH_UP_ROWS:
            return False
        sequence = self.sequences.setdefault(request.request_id, _DraftSequence())
        num_kept = 0
        for held, token_id in zip(sequence.token_ids, request.token_ids):
            if held != token_id:
                break
            num_kept += 1
        num_kept = min(num_kept, request.num_tokens - 1)  # the last token is always an input: it drafts
        if num_kept < sequence.num_computed_tokens:
            self.blocks.rollback(sequence, sequence.num_computed_tokens - num_kept)
        del sequence.token_ids[num_kept:]
        sequence.num_provisional_tokens = 0  # what is left equals the request's tokens: kept
        self.blocks.cache_full_blocks(sequence)
        if request.num_tokens + self.num_speculative_tokens > self.max_model_len:
            return False
        cached = []
        if not sequence.block_ids:
            cached = self.blocks.find_cached_prefix(_DraftSequence(token_ids=request.token_ids))
            self.blocks.record_query(request.num_tokens)
        num_new = request.num_tokens - len(cached) * self.blocks.block_size - sequence.num_computed_tokens
        if not self.blocks.can_allocate(sequence, num_new, cached):
            return False
        self.blocks.allocate(sequence, num_new, cached)
        sequence.token_ids = list(request.token_ids[: sequence.num_computed_tokens])
        return True

    def _room(self, request: Request) -> bool:
        sequence = self.sequences[request.request_id]
        if not self.blocks.can_allocate(sequence, 1):
            return False
        self.blocks.allocate(sequence, 1)
        return True

    def _step(self, requests: list[Request], inputs: list[list[int]], drafts: bool) -> list[int]:
        """One draft forward over each request's inputs (`drafts`: its own drafts, else the request's tokens);
        the argmax after each one's last input. A request's few inputs go as decode rows, many as a chunk."""
        sequences = [self.sequences[r.request_id] for r in requests]
        as_rows = all(len(tokens) <= MAX_CATCH_UP_ROWS for tokens in inputs)
        token_ids, num_new, num_computed, tables, sample_indices = [], [], [], [], []
        for sequence, tokens in zip(sequences, inputs):
            position = sequence.num_computed_tokens
            for piece in [[t] for t in tokens] if as_rows else [tokens]:
                token_ids.extend(piece)
                num_new.append(len(piece))
                num_computed.append(position)
                tables.append(list(sequence.block_ids))
                position += len(piece)
            sample_indices.append(len(num_new) - 1)
        batch = Batch(
            token_ids=token_ids,
            num_new_tokens=num_new,
            num_computed_tokens=num_computed,
            block_tables=tables,
            sample_indices=sample_indices,
            sampling=[GREEDY] * len(requests),
            block_copies=self.blocks.take_copies(),
        )
        sampled = self.runner.execute(batch).token_ids
        for sequence, tokens in zip(sequences, inputs):
            sequence.token_ids.extend(tokens)
            sequence.num_computed_tokens += len(tokens)
            if drafts:
                sequence.num_provisional_tokens += len(tokens)
            self.blocks.cache_full_blocks(sequence, sequence.num_provisional_tokens)
        return sampled
