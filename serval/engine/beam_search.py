"""Beam search: the choice of which beams live on, one step at a time, as Hugging Face transformers makes it.

Owns the scores and the rules, not the KV cache: the engine runs every live beam as an ordinary Request,
hands each one's top log-probabilities here once all of them have reported for the current length, and
carries out the plan `advance` returns (fork a beam that continues more than once, drop the ones that don't).

The rules are transformers' `_beam_search` (and vLLM's former beam search): from the live beams' top
continuations, take the best 2 x width by cumulative log-probability; those that end the sequence (an EOS id,
or max_tokens / the context reached) and rank within the first `width` become finished hypotheses scored
cumulative_logprob / generated_length ** length_penalty; the best `width` that don't end live on. The search
stops when `width` hypotheses are finished and (early_stopping True) or (the best live beam can no longer beat
the worst of them: early_stopping False uses the current length, "never" the longest possible one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from serval.engine.outputs import TokenLogprob
from serval.engine.request import Request, RequestTiming
from serval.sampling import SamplingParams


@dataclass
class BeamSequence:
    """One finished beam: what the engine returns for a beam search, best score first."""

    token_ids: list[int]  # generated tokens (an ending EOS included)
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (EOS) or "length"
    stop_token_id: int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class _Candidate:
    parent: Request
    token_id: int
    cumulative_logprob: float
    logprob: TokenLogprob
    ends: bool
    finish_reason: str | None


@dataclass
class BeamPlan:
    """What the engine must do after a step: the live beams' continuations, in rank order."""

    continuations: list[tuple[Request, int]]  # (parent beam, its next token), best first; parents may repeat
    dropped: list[Request]  # beams that continue nowhere
    done: bool


class BeamSearchGroup:
    def __init__(
        self,
        request_id: str,
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        num_prompt_tokens: int,
        max_new_tokens: int,
    ):
        self.request_id = request_id
        self.params = params
        self.width = params.beam_width
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.num_prompt_tokens = num_prompt_tokens
        self.max_new_tokens = max_new_tokens
        # Enough candidates per beam that width of them survive even if one is an EOS (transformers keeps
        # max(2, 1 + number of EOS ids) x width candidates overall).
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * self.width
        self.running: list[Request] = []
        self.cumulative_logprobs: dict[str, float] = {}
        self.token_logprobs: dict[str, list[TokenLogprob]] = {}
        self.reports: dict[str, tuple[int, list[tuple[int, float]]]] = {}
        self.finished: list[BeamSequence] = []
        self.can_improve = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.num_generated = 0  # tokens each live beam has generated
        self.num_forks = 0
        self.root: Request | None = None  # the first beam (its prefix-cache hits are the group's)
        self._pending: list[tuple[_Candidate, list[TokenLogprob]]] = []  # advance's continuations, to adopt
        # Timing of the group as a whole (usage's per-token arrays), in the shape request.record_timing fills.
        now = time.monotonic()
        self.timing = RequestTiming(arrival_time=now)
        self.last_token_time = now

    @property
    def num_output_tokens(self) -> int:
        return self.num_generated

    def add_root(self, beam: Request) -> None:
        """The first beam: the prompt alone. Its prefill timings and prefix-cache hits are the group's."""
        self.root = beam
        self.timing = beam.timing
        beam.beam_group = self
        self.running.append(beam)
        self.cumulative_logprobs[beam.request_id] = 0.0
        self.token_logprobs[beam.request_id] = []

    def next_beam_id(self) -> str:
        self.num_forks += 1
        return f"{self.request_id}/beam-{self.num_forks}"

    def report(self, beam: Request, top_logprobs: list[tuple[int, float]]) -> None:
        """A beam's most likely next tokens for its current context (after a recompute, reported again)."""
        self.reports[beam.request_id] = (beam.num_tokens, top_logprobs)

    @property
    def all_reported(self) -> bool:
        return all(self.reports.get(beam.request_id, (None,))[0] == beam.num_tokens for beam in self.running)

    def advance(self) -> BeamPlan:
        """Choose the next live beams from every live beam's report; finished hypotheses are kept here."""
        candidates = self._top_candidates()
        self.reports.clear()
        self.num_generated += 1
        continuations = [c for c in candidates if not c.ends][: self.width]
        if self.can_improve and not (self._is_full and self.params.early_stopping is True):
            self._add_finished([c for c in candidates[: self.width] if c.ends])
        survivors = {c.parent.request_id for c in continuations}
        dropped = [beam for beam in self.running if beam.request_id not in survivors]
        self._pending = [(c, self.token_logprobs[c.parent.request_id] + [c.logprob]) for c in continuations]
        self.running, self.cumulative_logprobs, self.token_logprobs = [], {}, {}
        self._update_can_improve(continuations)
        done = (
            not continuations
            or not self.can_improve
            or (self._is_full and self.params.early_stopping is True)
        )
        return BeamPlan([(c.parent, c.token_id) for c in continuations], dropped, done)

    def adopt(self, beams: list[Request]) -> None:
        """Take the engine's beams for the last plan's continuations, in the same order (parents or forks)."""
        for beam, (candidate, logprobs) in zip(beams, self._pending, strict=True):
            beam.beam_group = self
            self.running.append(beam)
            self.cumulative_logprobs[beam.request_id] = candidate.cumulative_logprob
            self.token_logprobs[beam.request_id] = logprobs
        self._pending = []

    def results(self) -> list[BeamSequence]:
        """The best n finished hypotheses, best first."""
        return sorted(self.finished, key=lambda h: h.score, reverse=True)[: self.params.n]

    # ---- transformers' rules

    @property
    def _is_full(self) -> bool:
        return len(self.finished) >= self.width

    def _top_candidates(self) -> list[_Candidate]:
        generated = self.num_generated + 1  # the length each candidate would have
        at_limit = generated >= self.max_new_tokens
        banned_eos = generated <= self.params.min_tokens
        num_top = self.params.logprobs or 0
        candidates = []
        for beam in self.running:
            _, top = self.reports[beam.request_id]
            base = self.cumulative_logprobs[beam.request_id]
            for token_id, logprob in top:
                is_eos = token_id in self.eos_token_ids
                if is_eos and banned_eos:
                    continue  # min_tokens: EOS may not end the sequence yet
                ends = is_eos or at_limit
                reason = ("stop" if is_eos else "length") if ends else None
                record = TokenLogprob(token_id, logprob, top[:num_top])
                candidates.append(_Candidate(beam, token_id, base + logprob, record, ends, reason))
        # Stable sort: among equal scores the earlier beam and the likelier token first, as a flat top-k would.
        candidates.sort(key=lambda c: c.cumulative_logprob, reverse=True)
        return candidates[: self.num_candidates]

    def _add_finished(self, ending: list[_Candidate]) -> None:
        if not ending:
            return
        length = self.num_generated
        penalty = length**self.params.length_penalty
        previous_logprobs = self.token_logprobs
        for c in ending:
            output = c.parent.output_token_ids + [c.token_id]
            self.finished.append(
                BeamSequence(
                    token_ids=output,
                    cumulative_logprob=c.cumulative_logprob,
                    score=c.cumulative_logprob / penalty,
                    finish_reason=c.finish_reason,
                    stop_token_id=c.token_id if c.finish_reason == "stop" else None,
                    logprobs=previous_logprobs[c.parent.request_id] + [c.logprob],
                )
            )
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.width :]

    def _update_can_improve(self, continuations: list[_Candidate]) -> None:
        if not self.can_improve or not self._is_full:
            return  # an unfilled slot scores -inf: any live beam beats it
        if not continuations:
            self.can_improve = False
            return
        p = self.params
        length = (
            self.max_new_tokens
            if p.early_stopping == "never" and p.length_penalty > 0
            else self.num_generated
        )
        best_possible = continuations[0].cumulative_logprob / length**p.length_penalty
        self.can_improve = best_possible > self.finished[-1].score
