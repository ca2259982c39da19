"""A draft model: a smaller model with the target's vocabulary, run in the same process, proposes each
speculating sequence's next k tokens greedily.

The draft has its own runner and its own paged KV cache (blocks handed out here, no prefix cache: what it
holds is cheap to recompute). Per sequence it remembers which tokens its cache holds; before drafting it
catches up with the sequence (after a step, the target kept some of its drafts and added a token of its own:
the draft's cache stays valid up to the first token where the two differ), then decodes k tokens, all the
speculating sequences of the step batched together. Its drafts are its argmax tokens, so the target's check
(speculator.py) is the rejection rule for a drafter that proposes with certainty.
"""

from __future__ import annotations

import dataclasses

from serval.config import CacheConfig, EngineConfig, LoraConfig, ParallelConfig
from serval.engine.request import Request
from serval.model_source import resolve_model
from serval.runner.batch import Batch, SamplingRow
from serval.runner.parallel.runner import make_runner

GREEDY = SamplingRow()


@dataclasses.dataclass
class _DraftSequence:
    token_ids: list[int]  # the tokens whose KV rows the draft's cache holds, in order
    block_ids: list[int]


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target_vocab_size: int):
        spec = config.speculative
        # The draft runs beside the target, on its device and dtype, with a cache a quarter of the target's.
        draft_model = dataclasses.replace(config.model, model=spec.model)
        draft_cache = CacheConfig(
            block_size=config.cache.block_size,
            kv_cache_memory_bytes=max(config.cache.kv_cache_memory_bytes // 4, 64 << 20),
            enable_prefix_caching=False,
        )
        self.runner = make_runner(
            draft_model, draft_cache, resolve_model(spec.model), LoraConfig(), ParallelConfig()
        )
        info = self.runner.info
        if info.vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({info.vocab_size} tokens) is not the target's ({target_vocab_size})"
            )
        self.block_size = info.block_size
        self.max_model_len = info.max_model_len
        self.free_block_ids = list(range(info.num_blocks - 1, -1, -1))
        self.sequences: dict[str, _DraftSequence] = {}
        self.drafts: dict[
            str, list[int]
        ] = {}  # this step's, by request id (prepare fills, propose hands out)
        self.num_speculative_tokens = spec.num_speculative_tokens

    def prepare(self, candidates: list[tuple[Request, int]]) -> None:
        """Draft for every request of the step at once: catch each up with its context, then decode, each
        request up to its own number of drafts (a draft forward a position: none past what is asked for)."""
        self.drafts = {}
        wanted = {r.request_id: max_drafts for r, max_drafts in candidates}
        active = [r for r, _ in candidates if self._catch_up_room(r)]
        if not active:
            return
        inputs = [r.token_ids[len(self.sequences[r.request_id].token_ids) :] for r in active]
        for position in range(max(wanted.values())):
            if position > 0:  # each sequence's newest draft is the next input: a block for it, or it stops
                room = [
                    (r, i)
                    for r, i in zip(active, inputs)
                    if position < wanted[r.request_id] and self._reserve(self.sequences[r.request_id], 1)
                ]
                if not room:
                    break
                active, inputs = (list(column) for column in zip(*room))
            sampled = self._step(active, inputs)
            for request, token_id in zip(active, sampled):
                self.drafts.setdefault(request.request_id, []).append(token_id)
            inputs = [[token_id] for token_id in sampled]

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        return self.drafts.get(request.request_id, [])[:max_drafts]

    def forget(self, request: Request) -> None:
        sequence = self.sequences.pop(request.request_id, None)
        if sequence is not None:
            self.free_block_ids.extend(reversed(sequence.block_ids))

    def _catch_up_room(self, request: Request) -> bool:
        """Keep what the draft's cache holds of the request's context, and find room for the rest."""
        sequence = self.sequences.setdefault(request.request_id, _DraftSequence([], []))
        num_kept = 0
        for held, token_id in zip(sequence.token_ids, request.token_ids):
            if held != token_id:
                break
            num_kept += 1
        num_kept = min(num_kept, request.num_tokens - 1)  # the last token is always an input: it drafts
        del sequence.token_ids[num_kept:]
        if request.num_tokens + self.num_speculative_tokens > self.max_model_len:
            return False
        return self._reserve(sequence, request.num_tokens - num_kept)

    def _reserve(self, sequence: _DraftSequence, num_new_tokens: int) -> bool:
        num_needed = -(-(len(sequence.token_ids) + num_new_tokens) // self.block_size) - len(
            sequence.block_ids
        )
        if num_needed > len(self.free_block_ids):
            return False
        for _ in range(num_needed):
            sequence.block_ids.append(self.free_block_ids.pop())
        return True

    def _step(self, requests: list[Request], inputs: list[list[int]]) -> list[int]:
        """One draft forward over each request's inputs; the argmax after each one's last input."""
        sequences = [self.sequences[r.request_id] for r in requests]
        batch = Batch(
            token_ids=[t for tokens in inputs for t in tokens],
            num_new_tokens=[len(tokens) for tokens in inputs],
            num_computed_tokens=[len(s.token_ids) for s in sequences],
            block_tables=[list(s.block_ids) for s in sequences],
            sample_indices=list(range(len(requests))),
            sampling=[GREEDY] * len(requests),
        )
        sampled = self.runner.execute(batch).token_ids
        for sequence, tokens in zip(sequences, inputs):
            sequence.token_ids.extend(tokens)
        return sampled
