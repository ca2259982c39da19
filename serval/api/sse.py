"""Server-sent events: serving's event stream framed as chat.completion.chunk / text_completion chunks.

Owns the stream-only rules: one id for every chunk, the role in each choice's first delta, exactly one
finish_reason per choice, `data: [DONE]` last, and where usage goes: with stream_options.include_usage a final
chunk with empty choices (OpenAI); with no stream_options on the last chunk (MindIE); with include_usage false
nowhere. With fullTextEnabled each delta carries the choice's whole text so far and its last chunk `full_text`,
as MindIE streams. A failure after the headers are out becomes an error event, never a dropped connection.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from serval.api.errors import APIError, error_body, from_serving
from serval.api.responses import (
    DONE,
    chat_chunk,
    chat_chunk_choice,
    completion_chunk,
    legacy_logprobs,
    sse,
    timing_fields,
    tool_call_body,
    usage_body,
)
from serval.serving.stream import ChoiceDelta, Event, Usage

logger = logging.getLogger(__name__)

USAGE_NONE = "none"  # stream_options.include_usage false
USAGE_FINAL_CHUNK = "final_chunk"  # stream_options.include_usage true: OpenAI's extra chunk
USAGE_LAST_CHUNK = "last_chunk"  # no stream_options: MindIE's usage on the last content chunk


def usage_mode(stream_options: Any) -> str:
    if stream_options is None or stream_options.include_usage is None:
        return USAGE_LAST_CHUNK
    return USAGE_FINAL_CHUNK if stream_options.include_usage else USAGE_NONE


@dataclass
class StreamFormat:
    request_id: str
    created: int
    model: str
    num_choices: int
    usage_mode: str
    full_text_enabled: bool = False
    is_chat: bool = True
    echoes: list[str] | None = None  # completions with echo: per prompt, the prompt text to send first


class _Assembler:
    def __init__(self, fmt: StreamFormat) -> None:
        self.fmt = fmt
        self.texts: dict[int, str] = {}  # per choice, the text so far
        self.num_finished = 0
        self.held: dict[str, Any] | None = None  # the last chunk, waiting for usage (MindIE mode)

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        build = chat_chunk if self.fmt.is_chat else completion_chunk
        return build(self.fmt.request_id, self.fmt.created, self.fmt.model, choices, **extra)

    def on_delta(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        is_first = delta.index not in self.texts
        text = delta.text
        if is_first and self.fmt.echoes is not None:
            per_prompt = max(1, self.fmt.num_choices // len(self.fmt.echoes))
            text = self.fmt.echoes[delta.index // per_prompt] + text
        self.texts[delta.index] = self.texts.get(delta.index, "") + text
        if not (is_first or text or delta.logprobs or delta.finish_reason or delta.reasoning_text
                or delta.tool_calls):  # fmt: skip
            return None  # nothing to show yet (text held back for a stop string or a partial character)
        content = self.texts[delta.index] if self.fmt.full_text_enabled else text
        extra: dict[str, Any] = {}
        if delta.finish_reason is not None:
            self.num_finished += 1
            if self.fmt.full_text_enabled:
                extra["full_text"] = self.texts[delta.index]
        if self.fmt.is_chat:
            message: dict[str, Any] = {"role": "assistant"} if is_first else {}
            if content or is_first or self.fmt.full_text_enabled:
                message["content"] = content
            if delta.reasoning_text:
                message["reasoning_content"] = delta.reasoning_text
            if delta.tool_calls:
                message["tool_calls"] = [tool_call_body(call) for call in delta.tool_calls]
            choice = chat_chunk_choice(delta.index, message, delta.logprobs, delta.finish_reason)
        else:
            choice = {
                "index": delta.index,
                "text": content,
                "logprobs": legacy_logprobs(delta.logprobs),
                "finish_reason": delta.finish_reason,
            }
        return self.chunk([choice], **extra)

    def is_last(self) -> bool:
        return self.num_finished >= self.fmt.num_choices


async def stream_events(
    first: Event,
    events: AsyncIterator[Event],
    fmt: StreamFormat,
    on_close: Callable[[], None] | None = None,
) -> AsyncIterator[str]:
    """SSE text for `first` and the rest of `events`; closes `events` when done or abandoned, then calls
    `on_close` (the metrics count a stream left before its end)."""
    assembler = _Assembler(fmt)
    try:
        event: Event | None = first
        while event is not None:
            if isinstance(event, Usage):
                for text in _usage_chunks(assembler, event):
                    yield text
            else:
                chunk = assembler.on_delta(event)
                if chunk is not None:
                    if assembler.is_last() and fmt.usage_mode == USAGE_LAST_CHUNK:
                        assembler.held = chunk  # sent with usage, which comes right after
                    else:
                        yield sse(chunk)
            event = await anext(events, None)
        if assembler.held is not None:
            yield sse(assembler.held)
    except Exception as e:  # noqa: BLE001 - the headers are out: report in-band
        error = e if isinstance(e, APIError) else from_serving(e)
        yield sse(error_body(error.status_code, error.message, error.param, error.code))
    finally:
        # NOTE: on_close first: under a cancelled scope (a client that went away) the await may be cancelled.
        if on_close is not None:
            on_close()
        await events.aclose()
    yield DONE


def _usage_chunks(assembler: _Assembler, usage: Usage) -> list[str]:
    mode = assembler.fmt.usage_mode
    if mode == USAGE_FINAL_CHUNK:
        return [sse(assembler.chunk([], usage=usage_body(usage), **timing_fields(usage)))]
    if mode == USAGE_LAST_CHUNK:
        held = assembler.held if assembler.held is not None else assembler.chunk([])
        assembler.held = None
        held.update(usage=usage_body(usage), **timing_fields(usage))
        return [sse(held)]
    return []
