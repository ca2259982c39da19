"""How one API request's choices map onto engine requests, and back.

Owns the fan-out: n (or best_of) sampled sequences per prompt, each its own engine request with its own seed,
the later ones forking the first one's prompt blocks (`share_prompt_with`); or one beam search per prompt
whose n beams become n choices. And the fold back: keeping the best n of best_of by cumulative logprob, and
the request's usage over all its choices.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from serval.engine.beam_search import BeamSequence
from serval.engine.outputs import RequestOutput
from serval.sampling import SamplingParams
from serval.serving.errors import InvalidRequestError
from serval.serving.stream import ChoiceStream, Completion, Usage

MAX_SEED = 2**64


@dataclass(frozen=True)
class SequencePlan:
    index: int  # the (first) choice index it produces
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams  # n=1, its own seed, max_tokens resolved (beam search: n and best_of kept)
    num_choices: int = 1  # a beam search yields its n beams as n choices
    leader_index: int | None = None  # the sequence of the same prompt whose prompt blocks this one forks


def check_num_sequences(num_prompts: int, params: SamplingParams, cap: int | None, param: str) -> None:
    """InvalidRequestError if the request asks for more than `cap` sequences (prompts x max(n, best_of); a beam
    search counts its beams), naming what asked for too many: the prompts (`param`) when they alone exceed
    the cap, else `n` (or `best_of`, the larger)."""
    per_prompt = max(params.n, params.best_of or 1)
    if cap is None or num_prompts * per_prompt <= cap:
        return
    if num_prompts > cap:
        culprit = param
    else:
        culprit = "best_of" if (params.best_of or 0) > params.n else "n"
    raise InvalidRequestError(
        f"the request asks for {num_prompts * per_prompt} sequences ({num_prompts} prompt(s) x {per_prompt}); "
        f"at most {cap} are allowed per request",
        culprit,
    )


def plan_sequences(
    prompts: list[list[int]], params: SamplingParams, max_tokens_for: Callable[[list[int]], int]
) -> list[SequencePlan]:
    """The engine requests for the prompts; max_tokens_for resolves a prompt's max_tokens (and may raise)."""
    if params.use_beam_search:
        return [
            SequencePlan(
                i * params.n,
                i,
                prompt,
                replace(params, max_tokens=max_tokens_for(prompt)),
                num_choices=params.n,
            )
            for i, prompt in enumerate(prompts)
        ]
    num_seqs = max(params.n, params.best_of or 1)
    # best_of ranks sequences by cumulative logprob, so the engine must report the chosen tokens' ones.
    logprobs = params.logprobs if params.logprobs is not None or num_seqs == params.n else 0
    sequences = []
    for prompt_index, prompt in enumerate(prompts):
        max_tokens = max_tokens_for(prompt)
        first = prompt_index * num_seqs
        for i in range(num_seqs):
            seed = None if params.seed is None else (params.seed + i) % MAX_SEED
            seq_params = replace(
                params, n=1, best_of=None, seed=seed, max_tokens=max_tokens, logprobs=logprobs
            )
            leader = first if i else None
            sequences.append(SequencePlan(first + i, prompt_index, prompt, seq_params, leader_index=leader))
    return sequences


def beam_choice_output(output: RequestOutput, beam: BeamSequence) -> RequestOutput:
    """A beam search's beam as the finished output of a choice of its own."""
    return replace(
        output,
        new_token_ids=beam.token_ids,
        new_logprobs=beam.logprobs,
        num_output_tokens=len(beam.token_ids),
        finish_reason=beam.finish_reason,
        stop_token_id=beam.stop_token_id,
        beams=None,
    )


def keep_best(completion: Completion, params: SamplingParams) -> Completion:
    """With best_of > n, keep per prompt the n sequences of highest cumulative logprob, re-indexed 0.."""
    num_seqs = max(params.n, params.best_of or 1)
    if num_seqs == params.n or params.use_beam_search:  # beams come ranked, n of them
        return completion
    chosen = []
    for start in range(0, len(completion.choices), num_seqs):
        group = completion.choices[start : start + num_seqs]
        group.sort(
            key=lambda c: -math.inf if c.cumulative_logprob is None else c.cumulative_logprob, reverse=True
        )
        chosen.extend(group[: params.n])
    for index, choice in enumerate(chosen):
        choice.index = index
    return Completion(chosen, completion.usage)


def usage_of(prompts: list[list[int]], sequences: list[SequencePlan], streams: list[ChoiceStream]) -> Usage:
    """One request's usage, from its prompts and the streams of all its choices."""
    # A prompt is counted once however many sequences it has; its cache hits are its first sequence's.
    first_of_prompt: dict[int, ChoiceStream] = {}
    prompt_of_choice = {s.index + k: s.prompt_index for s in sequences for k in range(s.num_choices)}
    for stream in streams:
        first_of_prompt.setdefault(prompt_of_choice[stream.index], stream)
    usage = Usage(
        num_prompt_tokens=sum(len(prompt) for prompt in prompts),
        num_cached_tokens=sum(stream.num_cached_tokens for stream in first_of_prompt.values()),
        # Every sequence asks to pin; the first to get there writes, the rest only refresh (count 0).
        num_cache_creation_tokens=sum(stream.num_newly_pinned_tokens for stream in streams),
        num_completion_tokens=sum(stream.num_output_tokens for stream in streams),
        num_reasoning_tokens=sum(stream.num_reasoning_tokens for stream in streams),
    )
    longest = max(streams, key=lambda stream: stream.num_output_tokens, default=None)
    if longest is not None:
        timing = longest.timing
        usage.batch_sizes = list(timing.batch_sizes)
        usage.queue_wait_us = list(timing.queue_wait_us)
        usage.prefill_time_ms = timing.prefill_time_ms
        usage.decode_time_ms = list(timing.decode_time_ms)
    return usage
