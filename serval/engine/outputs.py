"""What the engine hands up per request per step: token-id deltas, logprobs, finish state and timings.

The engine owns this contract; `serving` folds the deltas into text. Plain values only, and nothing the
engine thread goes on changing once the output is handed to the event loop (StepTiming carries per-step
entries, not the engine's growing lists).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # log-probability of the chosen token under the model's raw distribution
    top: list[
        tuple[int, float]
    ]  # the k most likely (token_id, logprob), most likely first; k = params.logprobs


@dataclass(frozen=True)
class StepTiming:
    """A request's timings as of one output. The scalars are the values so far; the per-token tuples hold
    only the entries of the tokens this output brings (the engine's Request.timing hands them over and forgets
    them), so the receiver sums them up itself: it never shares a list the engine thread still appends to,
    and a long generation costs O(1) per output instead of a copy of every entry so far."""

    arrival_time: float  # time.monotonic() when the engine accepted the request
    first_scheduled_time: float | None
    first_token_time: float | None
    prefill_time_ms: float  # wall time of the steps that computed the prompt (final from the first token on)
    # Per new token (MindIE's usage fields): how many requests shared the step that produced it, and how
    # long (µs) the request waited since its previous token was produced before that step ran.
    batch_sizes: tuple[int, ...] = ()
    queue_wait_us: tuple[int, ...] = ()
    decode_time_ms: tuple[float, ...] = ()  # wall time of each new token's step, the first token's excepted


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # tokens sampled this step (usually 0 or 1); includes a final EOS/stop token
    new_logprobs: list[TokenLogprob] | None  # one per new token when params.logprobs is set
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int  # all output tokens so far
    # Prompt tokens this request newly pinned in the explicit cache (cache_control), the API's
    # cache_creation_input_tokens; blocks it found already pinned are refreshed, not counted.
    num_newly_pinned_tokens: int = 0
    finished: bool = False
    # "stop" (EOS or a stop token), "length" (max_tokens or the context), "abort" (cancelled). A request the
    # engine refused or failed gets no output but a RequestFailed (engine/messages.py).
    finish_reason: str | None = None
    stop_token_id: int | None = None  # the EOS / stop_token_ids entry that finished it, if any
    timing: StepTiming | None = None  # the engine always fills it; None: a producer without timings
    # A beam search's result (engine/beam_search.py BeamSequence), best first; None for other requests.
    beams: list | None = None
