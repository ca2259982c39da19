"""Speculator: the engine's side of speculative decoding, before and after a step.

Before the scheduler runs, each decoding request that may speculate gets drafts (`propose`): tokens that
might follow its context, kept off its token_ids (Request.draft_token_ids). The scheduler gives it a step of
1 + k tokens (its next input and the drafts); the runner samples a token after each of them (k + 1 rows, each
laid out as plain decoding would lay it out once the drafts before it were outputs). `accepted_length` then
keeps the drafts that the sampled tokens confirm. The engine appends the first k' + 1 sampled tokens and forgets
the KV rows of the rejected drafts.

How many drafts a sequence asks for (`draft_length`) follows its own record when the config is adaptive: a
rejected draft costs a row of the forward pass (on the default model on 2 cores, ~0.7 ms beside ~4.4 ms for
the step's first row), a kept one saves a step. So the length starts at up to 4, doubles after a step whose
drafts were all kept (the sequence is copying a long stretch) and halves after one with a rejection, between
1 and num_speculative_tokens. A step in which nothing was proposed leaves it as it was. Greedy answers do not
depend on it: it only decides how many tokens each step checks.

Why that is lossless: a draft is kept exactly when the token sampled at its place equals it, and the token
after the last kept draft is the one sampled there. Sampling each place from the target's distribution and
comparing is the rejection rule of Leviathan et al. for a drafter that proposes one token with certainty
(q one-hot: accept x with probability min(1, p(x) / 1) = p(x); on rejection draw from p without x, which is
what a sample from p that came out other than x is). Greedy rows make it an argmax comparison: the tokens are
those of plain greedy decoding, as the runner's numerics are the same for a token whichever step computes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from serval.config import SpeculativeConfig
from serval.engine.request import Request

# An adaptive draft length's first value (capped by num_speculative_tokens): the fixed default it replaced.
INITIAL_DRAFT_LENGTH = 4


@dataclass
class SpeculationCounters:
    """vLLM's spec_decode counters: steps of a sequence that carried drafts, drafts, those accepted, and the
    accepted ones by draft position (index j: drafts accepted as the (j + 1)-th of their step)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Proposer(Protocol):
    """Where drafts come from (ngram.py, draft_model.py)."""

    def prepare(self, candidates: list[tuple[Request, int]]) -> None:
        """Before a step: the requests that will be asked for drafts, each with the most it will be asked for
        (a draft model runs them all at once)."""
        ...

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Up to max_drafts tokens that may follow the request's token_ids; [] for none."""
        ...

    def forget(self, request: Request) -> None:
        """The request left the engine: whatever is kept for it goes."""
        ...


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int):
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.counters = SpeculationCounters(accepted_per_position=[0] * config.num_speculative_tokens)
        # Adaptive draft lengths, by request id: set after each step that checked drafts, gone with the request.
        self.draft_lengths: dict[str, int] = {}

    def draft_length(self, request: Request) -> int:
        """How many drafts the request asks for this step (before the caps of its budget and context)."""
        if not self.config.adaptive_draft_length:
            return self.config.num_speculative_tokens
        initial = min(INITIAL_DRAFT_LENGTH, self.config.num_speculative_tokens)
        return self.draft_lengths.get(request.request_id, initial)

    def propose(self, running: list[Request]) -> None:
        """Give each decoding request that may speculate this step its drafts; clear everyone else's. Nobody
        speculates in a step with more than config.max_speculating_seqs running: the batch keeps the machine
        busy."""
        speculate = len(running) <= self.config.max_speculating_seqs
        candidates: list[tuple[Request, int]] = []
        for request in running:
            if request.draft_token_ids:  # left by a step that did not schedule it
                request.clear_drafts()
            if speculate and _may_speculate(request):
                max_drafts = min(
                    self.draft_length(request),
                    # What the request may still emit, less the token every step makes anyway.
                    self.max_model_len - request.num_tokens - 1,
                    _remaining_outputs(request) - 1,
                )
                if max_drafts > 0:
                    candidates.append((request, max_drafts))
        if not candidates:
            return
        self.proposer.prepare(candidates)
        for request, max_drafts in candidates:
            drafts = self.proposer.propose(request, max_drafts)
            if drafts and request.constraint is not None:
                drafts, bitmasks = _grammar_checked(request, drafts)
                request.draft_bitmasks = bitmasks
            request.draft_token_ids = list(drafts)

    def accepted_length(self, request: Request, sampled: list[int]) -> int:
        """How many of the request's drafts the sampled tokens (one per row: len(drafts) + 1) confirm; counted."""
        drafts = request.draft_token_ids
        num_accepted = 0
        while num_accepted < len(drafts) and sampled[num_accepted] == drafts[num_accepted]:
            num_accepted += 1
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += len(drafts)
        counters.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            counters.accepted_per_position[position] += 1
        if self.config.adaptive_draft_length:
            # From the drafts this step had (a lookup or a budget may have given fewer than were asked for).
            grown = min(2 * len(drafts), self.config.num_speculative_tokens)
            shrunk = max(len(drafts) // 2, 1)
            self.draft_lengths[request.request_id] = grown if num_accepted == len(drafts) else shrunk
        return num_accepted

    def forget(self, request: Request) -> None:
        """The request left the engine (finished, aborted): any state kept for it goes."""
        self.draft_lengths.pop(request.request_id, None)
        self.proposer.forget(request)


def _may_speculate(request: Request) -> bool:
    # Decoding: its context is computed but for the token sampled last step. A beam's next tokens are its
    # group's choice, and a media prompt's positions are its encoder's: neither speculates.
    return (
        request.num_computed_tokens == request.num_tokens - 1
        and request.num_output_tokens > 0
        and request.params.speculative
        and request.beam_group is None
        and request.media_prompt is None
    )


def _remaining_outputs(request: Request) -> int:
    if request.params.max_tokens is None:
        return 1 << 30
    return request.params.max_tokens - request.num_output_tokens


def _grammar_checked(request: Request, drafts: list[int]) -> tuple[list[int], list[torch.Tensor | None]]:
    """The drafts up to the first the request's grammar refuses (or past its end), and the grammar's mask
    before each kept draft and after the last. The grammar is walked through them and taken back after."""
    constraint = request.constraint
    bitmasks = [_copy(constraint.allowed_token_bitmask())]
    kept: list[int] = []
    try:
        for token_id in drafts:
            if constraint.is_finished or not _allows(bitmasks[-1], token_id):
                break
            constraint.accept_token(token_id)
            kept.append(token_id)
            # A draft that completes the grammar ends the request if kept: the row after it is never used.
            bitmasks.append(None if constraint.is_finished else _copy(constraint.allowed_token_bitmask()))
    finally:
        constraint.rollback(len(kept))
    return kept, bitmasks


def _copy(bitmask: torch.Tensor | None) -> torch.Tensor | None:
    # The constraint may reuse its tensor on the next call.
    return None if bitmask is None else bitmask.clone()


def _allows(bitmask: torch.Tensor | None, token_id: int) -> bool:
    if bitmask is None:
        return True
    word = token_id >> 5
    return word < bitmask.shape[0] and bool((int(bitmask[word]) >> (token_id & 31)) & 1)
