"""One choice's stream of deltas as a sequence of output blocks: reasoning, text, tool calls, in the order the
model wrote them. The Responses API frames the blocks as output items, the Messages API as content blocks.

Owns the split only: a block opens when a delta of a new kind arrives (or a new tool call begins), takes the
deltas of its kind, and closes when the next one opens or the choice ends. A non-streaming answer is the same
blocks from one delta holding the whole choice (`whole_choice`), so the two shapes cannot drift apart.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from serval.serving.stream import ChoiceDelta, ChoiceResult, Event, Usage

BlockKind = Literal["reasoning", "text", "tool_call"]


@dataclass
class Block:
    kind: BlockKind
    index: int  # its position among the answer's blocks
    text: str = ""  # the reasoning, the text or the call's arguments so far
    call_id: str | None = None  # tool calls: the call's id (serving's "call_...")
    name: str | None = None  # tool calls: the function
    tool_index: int | None = None  # tool calls: the call's position among the calls


@dataclass(frozen=True)
class BlockEvent:
    action: Literal["start", "delta", "stop"]
    block: Block
    delta: str = ""  # "delta": the new text


class BlockSplitter:
    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.open: Block | None = None
        # Blank text that would open a text block of its own (the newline between two calls, or after the
        # reasoning), held until text worth a block follows; dropped if none does.
        self.held = ""

    def _append(self, kind: BlockKind, text: str, events: list[BlockEvent]) -> None:
        if not text:
            return
        if kind == "text" and (self.open is None or self.open.kind != kind):
            if not text.strip():
                self.held += text
                return
            text, self.held = self.held + text, ""
        if self.open is None or self.open.kind != kind:
            self._start(Block(kind, len(self.blocks)), events)
        assert self.open is not None
        self.open.text += text
        events.append(BlockEvent("delta", self.open, text))

    def _start(self, block: Block, events: list[BlockEvent]) -> None:
        events.extend(self.close())
        self.blocks.append(block)
        self.open = block
        events.append(BlockEvent("start", block))

    def feed(self, delta: ChoiceDelta) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        self._append("reasoning", delta.reasoning_text, events)
        self._append("text", delta.text, events)
        for piece in delta.tool_calls:
            if piece.id is not None:
                block = Block("tool_call", len(self.blocks), call_id=piece.id, name=piece.name,
                              tool_index=piece.index)  # fmt: skip
                self._start(block, events)
            open_call = self.open
            if piece.arguments and open_call is not None and open_call.tool_index == piece.index:
                open_call.text += piece.arguments
                events.append(BlockEvent("delta", open_call, piece.arguments))
        return events

    def close(self) -> list[BlockEvent]:
        """Close the open block (at the end of the choice, or before another opens)."""
        if self.open is None:
            return []
        block, self.open = self.open, None
        return [BlockEvent("stop", block)]


def new_id(prefix: str) -> str:
    """An object's id in both vendors' style: resp_..., msg_..., fc_..."""
    return f"{prefix}_{secrets.token_hex(16)}"


def whole_choice(choice: ChoiceResult) -> ChoiceDelta:
    """A non-streaming choice as one delta: the blocks it holds are its reasoning, its text, then its calls."""
    return ChoiceDelta(
        choice.index, choice.text, choice.token_ids, None, choice.finish_reason,
        reasoning_text=choice.reasoning_text, tool_calls=choice.tool_calls, stop_reason=choice.stop_reason,
    )  # fmt: skip


class StreamAssembler(Protocol):
    """A route's stream framing (responses_stream.ResponseAssembler, anthropic_stream.MessageAssembler)."""

    def start(self) -> list[dict[str, Any]]: ...
    def feed(self, delta: ChoiceDelta) -> list[dict[str, Any]]: ...
    def finish(self, usage: Usage) -> list[dict[str, Any]]: ...


async def assembled_payloads(
    assembler: StreamAssembler, first: Event, events: AsyncIterator[Event]
) -> AsyncIterator[dict[str, Any]]:
    """Every payload of a streamed answer in order: the assembler's opening ones, then those of each serving
    event (the first already taken, to learn early whether the request was refused), its usage last."""
    for payload in assembler.start():
        yield payload
    event: Event | None = first
    while event is not None:
        for payload in assembler.finish(event) if isinstance(event, Usage) else assembler.feed(event):
            yield payload
        event = await anext(events, None)
