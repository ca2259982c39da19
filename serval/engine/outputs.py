"""What the engine hands up per request per step: token-id deltas, logprobs, finish state and timings.

The engine owns this contract; `serving` folds the deltas into text. Plain values only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float  # log-probability of the chosen token under the model's raw distribution
    top: list[
        tuple[int, float]
    ]  # the k most likely (token_id, logprob), most likely first; k = params.logprobs


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() when the engine accepted the request
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Per generated token (MindIE's usage fields): how many requests shared the step that produced it, and
    # how long (µs) the request waited since its previous token was produced before that step ran.
    batch_sizes: list[int] = field(default_factory=list)
    queue_wait_us: list[int] = field(default_factory=list)
    prefill_time_ms: float = 0.0  # wall time of the steps that computed the prompt
    decode_time_ms: list[float] = field(default_factory=list)  # wall time of each step after the first token


@dataclass
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
    metrics: RequestMetrics | None = None
    # A beam search's result (engine/beam_search.py BeamSequence), best first; None for other requests.
    beams: list | None = None
