"""The adaptive draft length (Speculator.draft_length): what each sequence asks its proposer for, step after
step, as its drafts are kept or rejected; a fixed config always asks for num_speculative_tokens. Greedy
answers under either are plain decoding's: tests/engine/test_speculative_decoding.py."""

from __future__ import annotations

from serval.config import SpeculativeConfig
from serval.engine.request import Request
from serval.engine.speculation.speculator import Speculator
from serval.sampling import SamplingParams


class RecordingProposer:
    """Proposes a run of 7s as long as asked, and records how many drafts each step asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def prepare(self, candidates: list[tuple[Request, int]]) -> None:
        self.asked += [max_drafts for _, max_drafts in candidates]

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        return [7] * max_drafts

    def forget(self, request: Request) -> None:
        pass


def _decoding_request(request_id: str = "r", max_tokens: int = 1000) -> Request:
    request = Request(request_id, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=max_tokens), ())
    request.append_token(4)  # the prompt computed and a first token sampled: the request decodes
    request.num_computed_tokens = request.num_tokens - 1
    return request


def _lengths(config: SpeculativeConfig, num_kept: list[int]) -> list[int]:
    """The drafts asked for at each step when the step keeps num_kept[i] of them (capped at what it had)."""
    proposer = RecordingProposer()
    speculator = Speculator(config, proposer, max_model_len=4096)
    request = _decoding_request()
    for kept in num_kept:
        speculator.propose([request])
        drafts = request.draft_token_ids
        kept = min(kept, len(drafts))
        # The sampled row after the last kept draft differs from the next draft (or follows the last one).
        sampled = drafts[:kept] + [8] * (len(drafts) + 1 - kept)
        assert speculator.accepted_length(request, sampled) == kept
        request.clear_drafts()
    return proposer.asked


def test_the_length_doubles_while_every_draft_is_kept_and_halves_after_a_rejection():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=15)
    everything = 100
    assert _lengths(config, [everything, everything, everything, 2, 0, 0, 0, everything, everything]) == [
        4, 8, 15, 15, 7, 3, 1, 1, 2,
    ]  # fmt: skip


def test_the_first_length_is_at_most_num_speculative_tokens():
    assert _lengths(SpeculativeConfig(method="ngram", num_speculative_tokens=2), [100, 100, 0]) == [2, 2, 2]


def test_a_fixed_length_asks_for_num_speculative_tokens_every_step():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=6, adaptive_draft_length=False)
    assert _lengths(config, [100, 0, 3, 0]) == [6, 6, 6, 6]


def test_the_budget_caps_the_length_and_a_forgotten_request_starts_again():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=15)
    proposer = RecordingProposer()
    speculator = Speculator(config, proposer, max_model_len=4096)
    request = _decoding_request(max_tokens=4)  # one output so far: 3 to go, the last made by the step itself
    speculator.propose([request])
    assert request.draft_token_ids == [7, 7]
    speculator.accepted_length(request, [7, 7, 8])
    # Doubled from the two drafts it had, not from the four it asked for.
    assert speculator.draft_length(request) == 4
    speculator.forget(request)
    assert speculator.draft_length(request) == 4 and speculator.draft_lengths == {}
