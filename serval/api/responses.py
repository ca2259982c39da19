"""Response bodies: serving's events and results as OpenAI / MindIE JSON, and SSE framing.

Owns the exact shape of every response field (docs/api.md describes them): chat.completion and
chat.completion.chunk, text_completion, usage with prompt_tokens_details.cached_tokens (and the explicit
cache's cache_creation fields) and MindIE's timing arrays and completion_tokens_details.reasoning_tokens, the
assistant message with reasoning_content and tool_calls, logprobs in the chat form (with `bytes`) and the
legacy completions form.
"""

from __future__ import annotations

import json
from typing import Any

from serval.serving.output import ToolCallDelta
from serval.serving.stream import ChoiceResult, Completion, LogprobEntry, Usage

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage_body(usage: Usage, with_timing: bool = True) -> dict[str, Any]:
    num_media_tokens = usage.num_image_tokens + usage.num_video_tokens + usage.num_audio_tokens
    body: dict[str, Any] = {
        "prompt_tokens": usage.num_prompt_tokens,
        "completion_tokens": usage.num_completion_tokens,
        "total_tokens": usage.num_prompt_tokens + usage.num_completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": usage.num_cached_tokens,
            # Model Studio's breakdown of the prompt by modality.
            "text_tokens": usage.num_prompt_tokens - num_media_tokens,
            "image_tokens": usage.num_image_tokens,
            "video_tokens": usage.num_video_tokens,
            "audio_tokens": usage.num_audio_tokens,
        },
        "completion_tokens_details": {"reasoning_tokens": usage.num_reasoning_tokens},
    }
    if usage.uses_explicit_cache:
        # Model Studio's explicit-cache fields, there only when the request used cache_control.
        details = body["prompt_tokens_details"]
        details["cache_creation"] = {"ephemeral_5m_input_tokens": usage.num_cache_creation_tokens}
        details["cache_creation_input_tokens"] = usage.num_cache_creation_tokens
        details["cache_type"] = "ephemeral"
    if with_timing:
        body["batch_size"] = list(usage.batch_sizes)
        body["queue_wait_time"] = list(usage.queue_wait_us)
    return body


def timing_fields(usage: Usage) -> dict[str, Any]:
    """MindIE's top-level timing: prefill_time (ms) and decode_time_arr (ms per decode step)."""
    return {
        "prefill_time": round(usage.prefill_time_ms, 3),
        "decode_time_arr": [round(t, 3) for t in usage.decode_time_ms],
    }


# ---- chat


def chat_logprobs(entries: list[LogprobEntry] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    content = []
    for entry in entries:
        top = [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)} for t in entry.top]
        content.append(
            {
                "token": entry.token,
                "logprob": entry.logprob,
                "bytes": list(entry.token_bytes),
                "top_logprobs": top,
            }
        )
    return {"content": content}


def tool_call_body(call: ToolCallDelta) -> dict[str, Any]:
    """A tool call (or, in a stream, a piece of one: id and name come only in a call's first piece)."""
    body: dict[str, Any] = {"index": call.index}
    function: dict[str, Any] = {}
    if call.id is not None:
        body.update(id=call.id, type="function")
        function["name"] = call.name
    function["arguments"] = call.arguments
    body["function"] = function
    return body


def chat_message(choice: ChoiceResult, prefix: str = "") -> dict[str, Any]:
    content: str | None = prefix + choice.text
    if choice.tool_calls and not content.strip():
        content = None  # OpenAI: a message of calls only has null content
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if choice.reasoning_text:
        message["reasoning_content"] = choice.reasoning_text
    # null, not [], when there are none: the spec's examples show null, and clients test `is not None`.
    message["tool_calls"] = [tool_call_body(call) for call in choice.tool_calls] or None
    return message


def envelope(
    object_name: str, request_id: str, created: int, model: str, choices: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    """The fields every response and chunk starts with, in the spec's order."""
    return {"id": request_id, "object": object_name, "created": created, "model": model, "choices": choices,
            **extra}  # fmt: skip


def chat_completion(
    request_id: str, created: int, model: str, completion: Completion, prefix: str = ""
) -> dict[str, Any]:
    choices = [
        {
            "index": choice.index,
            "message": chat_message(choice, prefix),
            "logprobs": chat_logprobs(choice.logprobs),
            "finish_reason": choice.finish_reason,
        }
        for choice in completion.choices
    ]
    return envelope(
        "chat.completion", request_id, created, model, choices,
        usage=usage_body(completion.usage), **timing_fields(completion.usage),
    )  # fmt: skip


def chat_chunk(
    request_id: str, created: int, model: str, choices: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    return envelope("chat.completion.chunk", request_id, created, model, choices, **extra)


def chat_chunk_choice(
    index: int, delta: dict[str, Any], logprobs: list[LogprobEntry] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {
        "index": index,
        "delta": delta,
        "logprobs": chat_logprobs(logprobs),
        "finish_reason": finish_reason,
    }


# ---- completions


def legacy_logprobs(entries: list[LogprobEntry] | None, text_offset: int = 0) -> dict[str, Any] | None:
    if entries is None:
        return None
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
    return {
        "tokens": [entry.token for entry in entries],
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [{t.token: t.logprob for t in entry.top} for entry in entries],
        "text_offset": offsets,
    }


def completion_choice(choice: ChoiceResult, prefix: str = "") -> dict[str, Any]:
    return {
        "index": choice.index,
        "text": prefix + choice.text,
        "logprobs": legacy_logprobs(choice.logprobs, len(prefix)),
        "finish_reason": choice.finish_reason,
    }


def text_completion(
    request_id: str, created: int, model: str, completion: Completion, echoes: list[str] | None = None
) -> dict[str, Any]:
    num_per_prompt = max(1, len(completion.choices) // max(1, len(echoes or [""])))
    choices = [
        completion_choice(choice, echoes[choice.index // num_per_prompt] if echoes else "")
        for choice in completion.choices
    ]
    return envelope(
        "text_completion", request_id, created, model, choices,
        usage=usage_body(completion.usage), **timing_fields(completion.usage),
    )  # fmt: skip


def completion_chunk(
    request_id: str, created: int, model: str, choices: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    return envelope("text_completion", request_id, created, model, choices, **extra)
