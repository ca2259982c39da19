"""The Responses API's response object and its stream of named events, from serving's events.

Owns the exact shapes (the installed openai SDK's `types/responses` is the reference): the `response` object
(`resp_...`, status, output items, usage with cached and reasoning tokens, incomplete_details when
max_output_tokens cut it), output items (`reasoning` with reasoning_text content, `message` with one
output_text part, `function_call` with call_id/name/arguments), and the events, each with a sequence_number
from 0: response.created, response.in_progress, then per item output_item.added, content_part.added,
*.delta, *.done, content_part.done, output_item.done, and response.completed (or response.incomplete). A
non-streaming answer is the same assembler fed the whole choice at once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from serval.api.agent_schemas import ResponsesRequest
from serval.api.errors import APIError, from_serving
from serval.api.output_blocks import Block, BlockEvent, BlockSplitter, assembled_payloads, new_id
from serval.serving.stream import ChoiceDelta, Event, Usage

_PREFIXES = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.num_cached_tokens},
        "output_tokens": usage.num_completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.num_reasoning_tokens},
        "total_tokens": usage.num_prompt_tokens + usage.num_completion_tokens,
    }


def sse_event(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ResponseAssembler:
    """One response: serving's events in, the Responses events out, and the response object at any point."""

    def __init__(
        self, request: ResponsesRequest, response_id: str, created_at: int, model: str, is_stored: bool
    ) -> None:
        self.request = request
        self.is_stored = is_stored  # the store keeps it once done
        self.id = response_id
        self.created_at = created_at
        self.model = model
        self.splitter = BlockSplitter()
        self.item_ids: dict[int, str] = {}  # block index -> its item's id
        self.num_events = 0
        self.status = "in_progress"
        self.finish_reason: str | None = None
        self.usage: Usage | None = None

    # ---- the response object

    def item(self, block: Block, status: str) -> dict[str, Any]:
        item_id = self.item_ids[block.index]
        if block.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": block.text}] if status != "in_progress" else []
            return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}
        if block.kind == "text":
            content = [_text_part(block.text)] if status != "in_progress" else []
            return {
                "id": item_id,
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": content,
            }
        arguments = block.text if status != "in_progress" else ""
        return {"id": item_id, "type": "function_call", "call_id": block.call_id, "name": block.name,
                "arguments": arguments, "status": status}  # fmt: skip

    def response(self) -> dict[str, Any]:
        request = self.request
        done = "in_progress" if self.status == "in_progress" else "completed"
        open_block = self.splitter.open
        output = [self.item(b, "in_progress" if b is open_block and done == "in_progress" else done)
                  for b in self.splitter.blocks]  # fmt: skip
        text_format = (request.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": self.model, "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": (request.reasoning or {}).get("effort"), "summary": None},
            "store": self.is_stored, "temperature": request.temperature, "text": {"format": text_format},
            "tool_choice": request.tool_choice or "auto", "tools": request.tools or [], "top_p": request.top_p,
            "truncation": "disabled", "usage": usage_body(self.usage) if self.usage is not None else None,
            "user": request.user, "metadata": request.metadata or {},
        }  # fmt: skip

    # ---- events

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response())]  # fmt: skip

    def feed(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        events = [e for block_event in self.splitter.feed(delta) for e in self._block_events(block_event)]
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            events += [e for block_event in self.splitter.close() for e in self._block_events(block_event)]
        return events

    def finish(self, usage: Usage) -> list[dict[str, Any]]:
        events = [e for block_event in self.splitter.close() for e in self._block_events(block_event)]
        self.usage = usage
        self.status = "incomplete" if self.finish_reason == "length" else "completed"
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return [*events, self.event(kind, response=self.response())]

    def _block_events(self, event: BlockEvent) -> list[dict[str, Any]]:
        block = event.block
        if event.action == "start":
            self.item_ids[block.index] = new_id(_PREFIXES[block.kind])
        where = {"item_id": self.item_ids[block.index], "output_index": block.index}
        if block.kind == "tool_call":
            return self._call_events(event, where)
        part_kind = "reasoning_text" if block.kind == "reasoning" else "output_text"
        delta_kind = "response.reasoning_text" if block.kind == "reasoning" else "response.output_text"
        extra = {"logprobs": []} if block.kind == "text" else {}
        if event.action == "start":
            empty = {"type": part_kind, "text": ""} if block.kind == "reasoning" else _text_part("")
            return [self.event("response.output_item.added", output_index=block.index,
                                item=self.item(block, "in_progress")),
                    self.event("response.content_part.added", **where, content_index=0, part=empty)]  # fmt: skip
        if event.action == "delta":
            return [self.event(f"{delta_kind}.delta", **where, content_index=0, delta=event.delta, **extra)]
        part = (
            {"type": part_kind, "text": block.text} if block.kind == "reasoning" else _text_part(block.text)
        )
        return [
            self.event(f"{delta_kind}.done", **where, content_index=0, text=block.text, **extra),
            self.event("response.content_part.done", **where, content_index=0, part=part),
            self.event(
                "response.output_item.done", output_index=block.index, item=self.item(block, "completed")
            ),
        ]

    def _call_events(self, event: BlockEvent, where: dict[str, Any]) -> list[dict[str, Any]]:
        block = event.block
        if event.action == "start":
            return [self.event("response.output_item.added", output_index=block.index,
                                item=self.item(block, "in_progress"))]  # fmt: skip
        if event.action == "delta":
            return [self.event("response.function_call_arguments.delta", **where, delta=event.delta)]
        return [
            self.event(
                "response.function_call_arguments.done", **where, name=block.name, arguments=block.text
            ),
            self.event(
                "response.output_item.done", output_index=block.index, item=self.item(block, "completed")
            ),
        ]


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def stream_response(
    assembler: ResponseAssembler,
    first: Event,
    events: AsyncIterator[Event],
    on_done: Callable[[dict[str, Any]], None],
    on_close: Callable[[], None],
) -> AsyncIterator[str]:
    """The SSE text of one response; `on_done(response)` once it completed (the store keeps it). A failure
    once the headers are out is an `error` event, never a dropped connection."""
    try:
        async for payload in assembled_payloads(assembler, first, events):
            yield sse_event(payload)
        on_done(assembler.response())
    except Exception as e:  # noqa: BLE001 - the headers are out: report in-band
        error = e if isinstance(e, APIError) else from_serving(e)
        yield sse_event(assembler.event("error", code=error.code, message=error.message, param=error.param))
    finally:
        on_close()
        await events.aclose()
