"""From a validated request to native values: template messages, SamplingParams, prompts.

Owns the cross-field rules of the spec (tool messages need tool_call_id, best_of >= n and equal to n in a
stream, n > 1 needs temperature > 0, ...; tools, tool_choice and response_format are in chat_options.py),
the rules that need the served model (a message role its template accepts, logit_bias ids inside its
vocabulary), and the refusal, by name, of what this deployment cannot honour (web search, code interpreter,
audio output; beam search's own rules are in beam_rules.py; media parts are parsed by media_parts.py and
refused, for a model that cannot read them, by serving). Every refusal is an APIError
naming the parameter. The messages themselves (roles, content, tool calls, cache_control spans) are
chat_messages.py's.
Single-field ranges are in openai.py's schemas; docs/api.md lists each with the spec it comes from.
"""

from __future__ import annotations

import math
import re
from typing import Any

from serval.api.beam_rules import beam_search_fields, check_not_beam_only
from serval.api.errors import invalid, unsupported
from serval.api.openai import (
    INT32_MAX,
    MAX_STOP_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from serval.sampling import MAX_LOGIT_BIAS, SamplingParams

# A logit_bias key: a token id in decimal, one spelling per id (no sign, no leading zeros), at most ten digits
# so that no key is ever turned into a huge int.
TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")
# ---- refusals


def check_chat_features(request: ChatCompletionRequest) -> None:
    if request.enable_search:
        raise unsupported("enable_search: web search is not available on this deployment", "enable_search")
    if request.enable_code_interpreter:
        raise unsupported(
            "enable_code_interpreter: code execution is not available on this deployment",
            "enable_code_interpreter",
        )
    if request.modalities and any(m != "text" for m in request.modalities):
        raise unsupported("modalities: the served model produces text only", "modalities")
    if request.audio is not None:
        raise unsupported("audio: the served model produces text only", "audio")


# ---- tools and structured output


# ---- sampling


def stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        if not value:
            raise invalid("stop must not be an empty string", "stop")
        strings = [value]
    elif isinstance(value, list) and all(isinstance(s, str) for s in value):
        strings = value
        if any(not s for s in strings):
            raise invalid("stop: every stop string must have at least one character", "stop")
    else:
        raise invalid("stop must be a string or a list of strings", "stop")
    if sum(len(s) for s in strings) > MAX_STOP_CHARS:
        raise invalid(f"stop: the stop strings may hold at most {MAX_STOP_CHARS} characters in all", "stop")
    return tuple(strings)


def stop_token_ids(value: list[Any] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if any(item is None for item in value):
        raise invalid("stop_token_ids must not contain null", "stop_token_ids")
    # MindIE: elements that are not int32 are ignored.
    return tuple(
        item
        for item in value
        if isinstance(item, int) and not isinstance(item, bool) and 0 <= item <= INT32_MAX
    )


def logit_bias(value: dict[str, Any] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, {"token id": bias}: each id below vocab_size, each bias a number in [-100, 100].
    A bad entry is a 400 on `logit_bias` whose message names the key."""
    entries = []
    for key, bias in (value or {}).items():
        shown = repr(key[:32]) + ("..." if len(key) > 32 else "")
        if not TOKEN_ID_KEY.fullmatch(key):
            raise invalid(
                f'logit_bias key {shown} is not a token id (digits without sign or leading zeros, e.g. "1234")',
                "logit_bias",
            )
        if int(key) >= vocab_size:
            raise invalid(
                f"logit_bias key {shown} is outside the model's vocabulary: token ids are in [0, {vocab_size})",
                "logit_bias",
            )
        # NOTE: the value is not echoed: a 5,000-digit integer would not even print.
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise invalid(f"logit_bias[{shown}] must be a number, not {type(bias).__name__}", "logit_bias")
        # The range first: a huge int compares fine but does not convert to a float.
        if not (-MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS and math.isfinite(bias)):
            raise invalid(
                f"logit_bias[{shown}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", "logit_bias"
            )
        entries.append((int(key), float(bias)))
    return tuple(sorted(entries))


def sampling_params(
    request: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    is_stream: bool,
    vocab_size: int,
    constrained_by: str | None = None,
) -> SamplingParams:
    """vocab_size: token ids below it exist (logit_bias keys are checked against it).
    constrained_by: the chat parameter that puts a grammar on the output (tools, response_format)."""
    if request.use_beam_search:
        fields = beam_search_fields(request, constrained_by)
        return _build(request, max_tokens, logprobs, vocab_size, **fields)
    check_not_beam_only(request)
    n = request.n or 1
    best_of = request.best_of
    temperature = 1.0 if request.temperature is None else request.temperature
    if best_of is not None and best_of < n:
        raise invalid(f"best_of ({best_of}) must be at least n ({n})", "best_of")
    if is_stream and best_of is not None and best_of != n:
        raise invalid(
            "in a stream best_of must equal n (the best sequences are only known at the end)", "best_of"
        )
    if max(n, best_of or 1) > 1 and temperature == 0.0:
        raise invalid(
            "n and best_of above 1 need temperature > 0 (greedy choices would be identical)", "temperature"
        )
    return _build(request, max_tokens, logprobs, vocab_size, n=n, best_of=best_of, temperature=temperature)


def _build(
    request: SamplingFields, max_tokens: int | None, logprobs: int | None, vocab_size: int, **fields
) -> SamplingParams:
    bias = logit_bias(request.logit_bias, vocab_size)
    try:
        return SamplingParams(
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            min_p=request.min_p or 0.0,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens or 0,
            stop=stop_strings(request.stop),
            stop_token_ids=stop_token_ids(request.stop_token_ids),
            include_stop_str_in_output=bool(request.include_stop_str_in_output),
            ignore_eos=bool(request.ignore_eos),
            skip_special_tokens=request.skip_special_tokens is not False,
            logprobs=logprobs,
            logit_bias=bias,
            speculative=request.speculative_decoding is not False,
            **fields,
        )
    except ValueError as e:
        raise invalid(str(e), None) from e


def chat_sampling_params(request: ChatCompletionRequest, is_stream: bool, vocab_size: int) -> SamplingParams:
    # max_completion_tokens (Alibaba, OpenAI) and max_tokens (MindIE) both cap the answer; the smaller wins.
    caps = [c for c in (request.max_tokens, request.max_completion_tokens) if c is not None]
    logprobs = None
    if request.logprobs or request.top_logprobs is not None:
        # MindIE: top_logprobs given without logprobs turns logprobs on.
        if request.logprobs is False and request.top_logprobs:
            raise invalid("top_logprobs needs logprobs to be true", "top_logprobs")
        logprobs = request.top_logprobs or 0
    constrained_by = None
    if request.tools and request.tool_choice != "none":
        constrained_by = "tools"
    elif request.response_format and request.response_format.get("type") != "text":
        constrained_by = "response_format"
    return sampling_params(
        request, min(caps) if caps else None, logprobs, is_stream, vocab_size, constrained_by
    )


def completion_sampling_params(
    request: CompletionRequest, is_stream: bool, vocab_size: int
) -> SamplingParams:
    # The legacy endpoint's default is OpenAI's: 16 tokens.
    max_tokens = 16 if request.max_tokens is None else request.max_tokens
    return sampling_params(request, max_tokens, request.logprobs, is_stream, vocab_size)


def with_template_kwargs(request: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(request.chat_template_kwargs or {})
    for key in ("enable_thinking", "thinking_budget", "reasoning_effort", "preserve_thinking"):
        value = getattr(request, key)
        if value is not None:
            kwargs.setdefault(key, value)
    # ModelArts says `thinking`, Model Studio and Qwen templates `enable_thinking`: each template gets both.
    if "thinking" in kwargs:
        kwargs.setdefault("enable_thinking", kwargs["thinking"])
    elif "enable_thinking" in kwargs:
        kwargs.setdefault("thinking", kwargs["enable_thinking"])
    return kwargs


def completion_prompts(value: Any) -> list[str | list[int]]:
    """The prompts of a /v1/completions request: a string, a token list, or a list of either."""

    def is_token_list(item: Any) -> bool:
        return isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)

    if isinstance(value, str):
        prompts: list[Any] = [value]
    elif is_token_list(value) and value:
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) or is_token_list(p) for p in value):
        prompts = value
    else:
        raise invalid("prompt must be a string, a list of token ids, or a non-empty list of those", "prompt")
    if any(len(p) == 0 for p in prompts):
        raise invalid("prompt must not be empty", "prompt")
    return prompts
