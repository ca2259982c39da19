"""From a validated request to native values: template messages, SamplingParams, prompts.

Owns the cross-field rules of the spec (tool messages need tool_call_id, best_of >= n and equal to n in a
stream, n > 1 needs temperature > 0, ...; tools, tool_choice and response_format are in chat_options.py),
the rules that need the served model (a message role its template accepts, logit_bias ids inside its
vocabulary), and the refusal, by name, of what this deployment cannot honour (web search, code interpreter,
audio output; beam search's own rules are in beam_rules.py; media parts are parsed by media_parts.py and
refused, for a model that cannot read them, by serving). Every refusal is an APIError
naming the parameter. Also the cache_control spans (explicit prompt caching): which stretches of message text to pin.
Single-field ranges are in openai.py's schemas; docs/api.md lists each with the spec it comes from.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from serval.api.beam_rules import beam_search_fields, check_not_beam_only
from serval.api.errors import invalid, unsupported
from serval.api.media_parts import is_media_part
from serval.api.openai import (
    INT32_MAX,
    MAX_MESSAGES_CHARS,
    MAX_STOP_CHARS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from serval.sampling import MAX_LOGIT_BIAS, SamplingParams
from serval.serving.client_text import MEDIA_OFFSETS_KEY, CacheSpan
from serval.serving.template_roles import STANDARD_ROLES

# A logit_bias key: a token id in decimal, one spelling per id (no sign, no leading zeros), at most ten digits
# so that no key is ever turned into a huge int.
TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")
# Tool-call arguments (a JSON string) may nest this deep: far beyond any real call, far below the recursion
# limit that rendering them (tojson) runs into.
MAX_ARGUMENTS_DEPTH = 128


# ---- messages


def _content_text(message: ChatMessage, where: str) -> tuple[str | None, tuple[int, ...]]:
    """The message's text, and where each of its media parts sits in it (characters from its start; the
    parts themselves are parsed by api/media_parts.py)."""
    content = message.content
    if content is None or isinstance(content, str):
        return content, ()
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content parts", f"{where}.content")
    if not content:
        raise invalid(f"{where}.content must not be an empty list", f"{where}.content")
    text = ""
    media_offsets: list[int] = []
    follows_text = False
    for j, part in enumerate(content):
        part_where = f"{where}.content[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(f"{part_where} must be an object with a string type", part_where)
        if is_media_part(part):
            media_offsets.append(len(text))
            follows_text = False
            continue
        if part["type"] != "text":
            raise invalid(
                f"{part_where}.type {part['type']!r} is not a known content part type", f"{part_where}.type"
            )
        part_text = part.get("text")
        if not isinstance(part_text, str) or not part_text:
            raise invalid(f"{part_where}.text must be a non-empty string", f"{part_where}.text")
        # NOTE: adjacent text parts join with a newline, vLLM's rendering of list content for string-only
        # templates; a media part sits between the texts around it with nothing added, as Qwen's templates
        # write a list's items one after another.
        text += ("\n" if follows_text else "") + part_text
        follows_text = True
    return text, tuple(media_offsets)


def cache_spans(messages: list[ChatMessage]) -> tuple[CacheSpan, ...]:
    """The stretches of message text (in the template text _content_text makes) marked cache_control.

    Model Studio's explicit cache: `cache_control: {"type": "ephemeral"}` on a content part caches the
    prompt up to and including that part (earlier marks are prefixes of the last one).
    """
    spans = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        end = 0
        follows_text = False
        for j, part in enumerate(message.content):
            if not isinstance(part, dict):
                continue  # _content_text names it
            # The text _content_text makes: adjacent text parts joined with a newline, a media part an empty
            # span where it sits.
            start = span_end = end
            follows_text = follows_text and part.get("type") == "text"
            if part.get("type") == "text":
                start = end + (1 if follows_text else 0)
                end = span_end = start + len(part.get("text") or "")
                follows_text = True
            if "cache_control" not in part:
                continue
            control = part["cache_control"]
            param = f"messages[{i}].content[{j}].cache_control"
            if not isinstance(control, dict) or control.get("type") != "ephemeral":
                raise invalid(f'{param} must be {{"type": "ephemeral"}}', param)
            spans.append(CacheSpan(i, start, span_end, control["type"]))
    return tuple(spans)


def _arguments_problem(value: Any) -> str | None:
    """What makes parsed tool-call arguments unrenderable, or None. Python's json.loads, unlike the body's
    parser, admits any depth up to the recursion limit and lone surrogates (which no tokenizer can encode)."""
    pending = [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, str) and not item.isascii():
            try:
                item.encode()
            except UnicodeEncodeError:
                return "holds a lone surrogate"
        elif isinstance(item, (list, dict)):
            if level > MAX_ARGUMENTS_DEPTH:
                return f"nests lists and objects deeper than {MAX_ARGUMENTS_DEPTH} levels"
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            pending.extend((child, level + 1) for child in children)
    return None


def _tool_call_dict(call: Any, where: str) -> dict[str, Any]:
    # Templates (Qwen2.5, Llama 3.1, ...) expect the arguments as an object; a non-JSON string stays a string.
    # What would fail later (a RecursionError here or in the template's tojson, a surrogate in the tokenizer)
    # and be a 500 is refused by name.
    param = f"{where}.function.arguments"
    try:
        arguments: Any = json.loads(call.function.arguments)
    except RecursionError:
        raise invalid(
            f"{param} nests lists and objects deeper than {MAX_ARGUMENTS_DEPTH} levels", param
        ) from None
    except ValueError:
        arguments = call.function.arguments
    problem = _arguments_problem(arguments)
    if problem is not None:
        raise invalid(f"{param} {problem}", param)
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": call.type, "function": function}


def template_messages(
    messages: list[ChatMessage],
    continue_final_message: bool | None = None,
    roles: frozenset[str] = STANDARD_ROLES,
) -> tuple[list[dict[str, Any]], bool]:
    """The messages as the chat template sees them, and whether the final one is to be continued.
    roles: the roles the served template accepts (serving/template_roles.py); any other is a 400."""
    if not messages:
        raise invalid("messages must not be empty", "messages")
    num_chars = 0
    result = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.role not in roles:
            raise invalid(
                f"{where}.role {message.role[:64]!r} is not a role this model accepts "
                f"(one of {', '.join(sorted(roles))})",
                f"{where}.role",
            )
        text, media_offsets = _content_text(message, where)
        num_chars += len(text or "")
        if num_chars > MAX_MESSAGES_CHARS:
            raise invalid(
                f"messages hold more than {MAX_MESSAGES_CHARS} characters of content (MindIE: at most 4 MB)",
                "messages",
            )
        has_tool_calls = bool(message.tool_calls)
        if message.role == "assistant" and has_tool_calls:
            text = text or ""
        elif text is None:
            raise invalid(f"{where}.content is required for role {message.role!r}", f"{where}.content")
        elif not text and not media_offsets:
            raise invalid(f"{where}.content must not be empty", f"{where}.content")
        if message.role == "tool" and not message.tool_call_id:
            raise invalid(f"{where}.tool_call_id is required on a tool message", f"{where}.tool_call_id")
        if has_tool_calls and message.role != "assistant":
            raise invalid(f"{where}.tool_calls is only allowed on assistant messages", f"{where}.tool_calls")
        item: dict[str, Any] = {"role": message.role, "content": text}
        if media_offsets:
            item[MEDIA_OFFSETS_KEY] = media_offsets  # the template's ClientTexts places them in the text
        for key in ("name", "tool_call_id", "reasoning_content"):
            value = getattr(message, key)
            if value is not None:
                item[key] = value
        if has_tool_calls:
            calls = message.tool_calls or ()
            item["tool_calls"] = [
                _tool_call_dict(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)
            ]
        result.append(item)
    last = messages[-1]
    wants_continue = bool(continue_final_message or last.prefix or last.partial)
    for i, message in enumerate(messages[:-1]):
        if message.prefix or message.partial:
            raise invalid("only the final message can be a prefix to continue", f"messages[{i}].prefix")
    if wants_continue and last.role != "assistant":
        raise invalid("only an assistant message can be continued (prefix/partial)", "messages")
    return result, wants_continue


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
