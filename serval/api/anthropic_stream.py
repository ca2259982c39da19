"""The Messages API's message object and its event stream, from serving's events.

Owns the exact shapes (the installed anthropic SDK's types are the reference): the message (`msg_...`,
content blocks `thinking` with a `signature`, `text`, `tool_use` with its input object; stop_reason end_turn,
max_tokens, stop_sequence (with `stop_sequence`) or tool_use; usage with input_tokens (the uncached ones, as
Anthropic counts them), output_tokens, cache_read_input_tokens and cache_creation_input_tokens), and the
stream: message_start, ping, per block content_block_start / content_block_delta (text_delta,
thinking_delta, signature_delta, input_json_delta) / content_block_stop, message_delta (stop_reason, usage),
message_stop; a failure after the headers is an `error` event in Anthropic's error shape. A non-streaming
answer is the same assembler fed the whole choice at once.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from serval.api.errors import APIError, anthropic_error_body, from_serving
from serval.api.output_blocks import Block, BlockEvent, BlockSplitter, assembled_payloads
from serval.serving.stream import ChoiceDelta, Event, Usage


def signature(thinking: str) -> str:
    """A thinking block's signature: a digest of its text. NOTE: not a secret (serval does not check the ones
    clients send back); it exists because clients expect the field and echo it."""
    return base64.b64encode(hashlib.blake2b(thinking.encode(), digest_size=32).digest()).decode()


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    # The arguments a grammar made are a JSON object; an unconstrained model's may not parse (cut short).
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.num_prompt_tokens - usage.num_cached_tokens,
        "output_tokens": usage.num_completion_tokens,
        "cache_read_input_tokens": usage.num_cached_tokens,
        "cache_creation_input_tokens": usage.num_cache_creation_tokens,
    }


def sse_event(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class MessageAssembler:
    def __init__(self, message_id: str, model: str, num_prompt_tokens: int) -> None:
        self.id = message_id
        self.model = model
        self.num_prompt_tokens = num_prompt_tokens
        self.splitter = BlockSplitter()
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: Usage | None = None

    def block(self, block: Block, is_done: bool = True) -> dict[str, Any]:
        if block.kind == "reasoning":
            return {"type": "thinking", "thinking": block.text if is_done else "",
                    "signature": signature(block.text) if is_done else ""}  # fmt: skip
        if block.kind == "text":
            return {"type": "text", "text": block.text if is_done else ""}
        assert block.call_id is not None
        return {"type": "tool_use", "id": tool_use_id(block.call_id), "name": block.name,
                "input": tool_input(block.text) if is_done else {}}  # fmt: skip

    def message(self) -> dict[str, Any]:
        usage = usage_body(self.usage) if self.usage is not None else {
            "input_tokens": self.num_prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0,
        }  # fmt: skip
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [self.block(b) for b in self.splitter.blocks] if self.usage is not None else [],
            "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence, "usage": usage,
        }  # fmt: skip

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": self.message()}, {"type": "ping"}]

    def feed(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        events = [e for block_event in self.splitter.feed(delta) for e in self._block_events(block_event)]
        if delta.finish_reason is not None:
            self._stopped(delta)
            events += [e for block_event in self.splitter.close() for e in self._block_events(block_event)]
        return events

    def _stopped(self, delta: ChoiceDelta) -> None:
        if delta.finish_reason == "tool_calls":
            self.stop_reason = "tool_use"
        elif delta.finish_reason == "length":
            self.stop_reason = "max_tokens"
        elif isinstance(delta.stop_reason, str):  # a stop string matched (a stop token id is a plain end)
            self.stop_reason, self.stop_sequence = "stop_sequence", delta.stop_reason
        else:
            self.stop_reason = "end_turn"

    def finish(self, usage: Usage) -> list[dict[str, Any]]:
        events = [e for block_event in self.splitter.close() for e in self._block_events(block_event)]
        self.usage = usage
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        return [*events, {"type": "message_delta", "delta": delta, "usage": usage_body(usage)},
                {"type": "message_stop"}]  # fmt: skip

    def _block_events(self, event: BlockEvent) -> list[dict[str, Any]]:
        block = event.block
        if event.action == "start":
            return [{"type": "content_block_start", "index": block.index,
                     "content_block": self.block(block, is_done=False)}]  # fmt: skip
        if event.action == "delta":
            if block.kind == "reasoning":
                delta = {"type": "thinking_delta", "thinking": event.delta}
            elif block.kind == "text":
                delta = {"type": "text_delta", "text": event.delta}
            else:
                delta = {"type": "input_json_delta", "partial_json": event.delta}
            return [{"type": "content_block_delta", "index": block.index, "delta": delta}]
        events = []
        if block.kind == "reasoning":
            delta = {"type": "signature_delta", "signature": signature(block.text)}
            events.append({"type": "content_block_delta", "index": block.index, "delta": delta})
        return [*events, {"type": "content_block_stop", "index": block.index}]


async def stream_message(
    assembler: MessageAssembler, first: Event, events: AsyncIterator[Event], on_close: Callable[[], None]
) -> AsyncIterator[str]:
    """The SSE text of one message; a failure once the headers are out is an `error` event."""
    try:
        async for payload in assembled_payloads(assembler, first, events):
            yield sse_event(payload)
    except Exception as e:  # noqa: BLE001 - the headers are out: report in-band
        error = e if isinstance(e, APIError) else from_serving(e)
        yield sse_event(anthropic_error_body(error.status_code, error.message))
    finally:
        on_close()
        await events.aclose()
