"""SamplingParams: what a caller asks of one generation, validated once at the edge.

A leaf module: every layer may import it. The fields follow vLLM's spelling so that offline users and the
OpenAI front end speak the same language. Text-level fields (stop strings, skip_special_tokens) are carried
here but acted on in `serving`; the engine and runner only read the token-level ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: +100 all but forces a token, -100 all but bans it


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's plus the top k
    # Added to the logits before anything else (logprobs included, as OpenAI reports them): (token id, bias)
    # pairs, sorted; a {token_id: bias} dict is accepted and frozen into them. Ids are checked against the
    # model's vocabulary by the engine.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Beam search (engine/beam_search.py): best_of beams (n when best_of is unset), n returned, best first.
    use_beam_search: bool = False
    length_penalty: float = 1.0  # score = cumulative logprob / generated length ** length_penalty
    early_stopping: bool | str = False  # True, False or "never", as in transformers
    # False: this request decodes a token a step even where the engine speculates (a per-request opt-out).
    speculative: bool = True
    extra: dict = field(default_factory=dict, compare=False, hash=False)  # NOTE: unused by the engine

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples so the params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias or ()
        object.__setattr__(self, "logit_bias", tuple(sorted((_token_id(t), float(b)) for t, b in bias)))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n, got best_of={self.best_of}, n={self.n}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        token_ids = [token_id for token_id, _ in self.logit_bias]
        if any(token_id < 0 for token_id in token_ids):
            raise ValueError(f"logit_bias token ids must be non-negative, got {min(token_ids)}")
        if len(set(token_ids)) != len(token_ids):
            raise ValueError("logit_bias names a token id twice")
        for token_id, bias in self.logit_bias:
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias of token {token_id} must be in [-100, 100], got {bias}")
        if self.logit_bias and self.use_beam_search:
            raise ValueError("logit_bias does not apply to beam search (beams are ranked by raw logprobs)")

    @property
    def beam_width(self) -> int:
        return self.best_of or self.n

    @property
    def is_greedy(self) -> bool:
        # temperature 0 or top_k 1 both mean "always the most likely token".
        return self.temperature == 0.0 or self.top_k == 1


def _token_id(key: int | str) -> int:
    # An int, or its decimal string (a JSON object's key); never a float or bool silently truncated.
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(f"logit_bias keys must be token ids, got {key!r}")
    return int(key)
