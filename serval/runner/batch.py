"""Batch: what the engine asks the runner to compute in one step, and what comes back.

The runner owns this contract. Plain lists of ints and floats: no Request objects cross into the runner.
Sequences appear in one order throughout; each contributes `num_new_tokens[i]` consecutive tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from serval.runner.attention.backend import padded_block_tables

if TYPE_CHECKING:
    from serval.runner.media import MediaPrompt


@dataclass(kw_only=True)
class SamplingRow:
    """How to pick the next token of one sequence that completes its context this step. Built by keyword
    only; every default means "off", so `SamplingRow()` is plain greedy decoding with no logprobs."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # 0: off
    frequency_penalty: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    num_logprobs: int | None = None  # None: none; k: the chosen token's logprob and the top k
    generator: torch.Generator | None = None  # the request's own generator when it has a seed
    output_token_ids: list[int] = field(default_factory=list)  # for presence/frequency penalties
    prompt_token_ids: list[int] = field(default_factory=list)  # with the outputs, for repetition_penalty
    banned_token_ids: list[int] = field(default_factory=list)  # EOS/stop ids while under min_tokens
    # The request's logit_bias, (token id, bias) pairs with ids below the vocab size: added to the raw logits
    # before anything else, so logprobs include it (as OpenAI's do).
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    # The engine fills it from the request's constraint (a grammar): (ceil(V / 32),) int32, bit j of word i
    # allows token 32 * i + j; None allows every token. Ids past its width (a model vocab wider than the
    # tokenizer's) are not allowed.
    allowed_token_bitmask: torch.Tensor | None = None


@dataclass
class Batch:
    token_ids: list[int]  # the new tokens of every sequence, concatenated
    num_new_tokens: list[int]  # per sequence
    num_computed_tokens: list[
        int
    ]  # per sequence: tokens already in the KV cache (position of its first new one)
    # Per sequence, its KV blocks in order: the engine's (num_seqs, max_blocks) int64 tensor, gathered from its
    # persistent rows (engine/batch_rows.py; entries past a sequence's blocks are never read), or lists from
    # one-shot callers (embeddings, tests).
    block_tables: torch.Tensor | list[list[int]]
    sample_indices: list[int]  # which sequences produce a token this step (their context is complete)
    sampling: list[SamplingRow]  # one per logit row (logit_row_counts(): one per entry of sample_indices)
    # KV blocks to copy (source, destination) before the forward pass: copy on write of forked sequences.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Per sequence: the LoRA adapter slot it runs with, -1 for the base model (the engine fills it from the
    # request's adapter). Empty: every sequence runs on the base model.
    lora_slots: list[int] = field(default_factory=list)
    # Per sequence: its prompt's media state (runner/media.py; ModelRunner.prepare_media made it), None for
    # text. Empty: no sequence of the step has media (every text-only model's steps).
    media: list[MediaPrompt | None] = field(default_factory=list)
    # Per entry of sample_indices: how many of the sequence's last new tokens want logits, each the
    # distribution of the token after it. A speculative step computes the last accepted token and k draft
    # tokens and samples after each of the k + 1 (engine/speculation/). Empty: one each, the last, as every
    # step that does not speculate.
    num_logit_rows: list[int] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.num_new_tokens)

    def block_table_tensor(self) -> torch.Tensor:
        """(num_seqs, max_blocks) int64, whichever form the tables came in."""
        if isinstance(self.block_tables, torch.Tensor):
            return self.block_tables
        return padded_block_tables(self.block_tables)

    def logit_row_counts(self) -> list[int]:
        """How many logit rows each sampled sequence gets, in sample_indices order."""
        return self.num_logit_rows or [1] * len(self.sample_indices)

    def logit_rows(self) -> torch.Tensor:
        """(sum of logit_row_counts(),) int64: the rows of the flat batch whose logits are wanted, sampled
        sequence by sequence in sample_indices order, each sequence's in position order."""
        ends = torch.tensor(self.num_new_tokens).cumsum(0)  # one past each sequence's last token row
        if not self.num_logit_rows:  # the common step: only each sampled sequence's last row
            return ends[self.sample_indices] - 1
        if len(self.num_logit_rows) != len(self.sample_indices):
            raise ValueError("num_logit_rows needs one count per entry of sample_indices")
        rows: list[int] = []
        for seq_index, count in zip(self.sample_indices, self.num_logit_rows):
            if not 1 <= count <= self.num_new_tokens[seq_index]:
                raise ValueError(
                    f"sequence {seq_index} asks for {count} logit rows of its "
                    f"{self.num_new_tokens[seq_index]} new tokens"
                )
            end = int(ends[seq_index])
            rows.extend(range(end - count, end))
        return torch.tensor(rows, dtype=torch.long)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per sampled sequence, in sample_indices order
    logprobs: list[float] | None  # log-probability of each chosen token (when any row asked)
    top_logprobs: list[list[tuple[int, float]]] | None  # per row, its top k (token_id, logprob)
