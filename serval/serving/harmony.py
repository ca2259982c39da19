"""Harmony: gpt-oss's chat format, read back out of the output text and written as grammars.

Owns what serving knows of harmony beyond the chat template (which renders the prompt): the format's special
tokens and how a vocabulary is recognized as harmony's, the incremental parser of the output (`feed(text) ->
events`, `finish()`; any split of the text gives the one-shot result) and the grammars of forced tool calls
and JSON answers.

The output is a run of messages, the first one opened by the prompt's `<|start|>assistant`:

    <|channel|>analysis<|message|>reasoning...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

A message's channel says what its text is: `analysis` is the reasoning (`reasoning_content`), `final` the
answer (`content`), `commentary` a tool call when the header names a recipient `to=functions.NAME` (it may
also stand before `<|channel|>`), else a preamble, shown as content. `<|return|>` and `<|call|>` are
end-of-generation tokens (serving/tokenizer.py), so the text usually ends without them.

What must hold:
- The text keeps the special tokens (ChoiceStream decodes with them when the plan is harmony): the channel
  markers are the structure.
- Tool-call markup is never content, and nothing of a call is sent before its arguments begin (the rule of
  serving/tool_call_parsers.py). Inside JSON (a call's arguments, a grammar-made JSON answer) a
  terminator's spelling within a string is the string's text: a grammar may write the structure tokens, so
  a sampled `<|end|>` can land there. A model that leaves the format is not an error: text outside any message,
  a header that is no harmony header, and a call whose body is not a JSON object are shown as content.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from serval.serving.reasoning import ReasoningText
from serval.serving.structured import MAX_WHITESPACE
from serval.serving.tool_call_parsers import (
    ContentText,
    StateParser,
    ToolCallArguments,
    ToolCallStart,
    _JsonScanner,
)

if TYPE_CHECKING:
    from serval.serving.client_text import Segment
    from serval.serving.tool_call_format import Tool, ToolChoice

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
# The special tokens a harmony output holds as text (the grammar may write them); RETURN and CALL end it.
STRUCTURE_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN)
END_OF_GENERATION = (RETURN, CALL)
GENERATION_PROMPT = START + "assistant"
FUNCTIONS = "functions."
# Longest header (`<|start|>` up to `<|message|>`) read as one; a longer run of text is content.
MAX_HEADER_CHARS = 256

HarmonyEvent = ReasoningText | ContentText | ToolCallStart | ToolCallArguments

_TERMINATORS = (END, CALL, RETURN, START)  # what ends a message's text (START: a new one, its end left out)
_ROLE = re.compile(r"[^\s<]*")
# After the role: an optional recipient, the channel, an optional recipient, an optional content type.
_HEADER = re.compile(
    r"(?:\s*to=(?P<before>[^\s<]+))?\s*<\|channel\|>(?P<channel>[^\s<]+)(?:\s*to=(?P<after>[^\s<]+))?"
    r"(?:\s*(?:<\|constrain\|>)?\s*[^\s<]+)?\s*"
)


def is_harmony_vocabulary(special_token_texts: frozenset[str]) -> bool:
    """Whether a vocabulary is harmony's (o200k_harmony): it has the message and channel tokens as specials."""
    return {START, END, MESSAGE, CHANNEL} <= special_token_texts


def prompt_message(segments: list[Segment]) -> str:
    """The message the rendered prompt ends in, from its last `<|start|>` written by the template (never one a
    client typed): the generation prompt `<|start|>assistant`, or a final message being continued."""
    for i in range(len(segments) - 1, -1, -1):
        segment = segments[i]
        at = -1 if segment.is_client_text else segment.text.rfind(START)
        if at != -1:
            return segment.text[at:] + "".join(s.text for s in segments[i + 1 :])
    return GENERATION_PROMPT


def _held_tail(text: str) -> int:
    """Length of the longest tail of text that may still become a terminator."""
    for size in range(min(len(text), max(map(len, _TERMINATORS)) - 1), 0, -1):
        if any(marker.startswith(text[-size:]) for marker in _TERMINATORS):
            return size
    return 0


def _header_fields(header: str, has_role: bool) -> tuple[str, str | None] | None:
    """(channel, recipient) of a header (the text between `<|start|>` and `<|message|>`), or None when it is
    no harmony header."""
    rest = header[_ROLE.match(header).end() :] if has_role else header
    match = _HEADER.fullmatch(rest) if len(header) <= MAX_HEADER_CHARS else None
    if match is None:
        return None
    return match["channel"], match["before"] or match["after"]


def _may_become_header(header: str, has_role: bool) -> bool:
    """Whether more text could make `header` one `_header_fields` reads. Monotone: once False, False for
    every longer text, which is what makes the streamed parse equal the one-shot one."""
    if len(header) > MAX_HEADER_CHARS or any(marker in header for marker in _TERMINATORS):
        return False
    rest = (header[_ROLE.match(header).end() :] if has_role else header).lstrip()
    return rest.startswith(("to=", CHANNEL)) or "to=".startswith(rest) or CHANNEL.startswith(rest)


class HarmonyParser(StateParser):
    """One choice's harmony text -> reasoning, content and tool-call events.

    parses_tool_calls: tools are offered, so a message to `functions.NAME` is a call (otherwise its text is
    content). prefix: the message the prompt ends in (prompt_message); the output continues it.
    is_json_answer: a final message is JSON (the grammar made it: response_format)."""

    def __init__(
        self, parses_tool_calls: bool, prefix: str = GENERATION_PROMPT, is_json_answer: bool = False
    ) -> None:
        self.parses_tool_calls = parses_tool_calls
        self.is_json_answer = is_json_answer
        self.scanner: _JsonScanner | None = None  # the message's text is JSON: where its strings are
        self.state = "between"  # between messages | header | body
        self.buffer = ""
        self.has_role = True  # the header still starts with its role (after <|start|>)
        self.kind = "content"  # of the message being read: reasoning | content | call
        self.name = ""  # the function a call message calls
        self.num_calls = 0
        self.has_arguments = False  # the call's arguments have begun
        self.held_space = ""  # whitespace after the arguments so far: sent only if more text follows
        self.has_shown = False  # the message being read has shown text
        self.kinds_shown: set[str] = set()  # a later message of a kind shown before is set off by a newline
        self.is_cut = False  # the text ended before the model did (set by finish)
        self.feed(prefix)  # the prompt's part of the message: its events are the prompt's, not the answer's
        self.kinds_shown.clear()
        if self.state == "header" and self.has_role and _ROLE.fullmatch(self.buffer):
            self.buffer, self.has_role = "", False  # the prompt wrote the whole role ("assistant")

    @property
    def is_reasoning(self) -> bool:
        """Inside an analysis message's text (from its `<|message|>` until its end)."""
        return self.state == "body" and self.kind == "reasoning"

    def _on_between(self, events: list[HarmonyEvent], final: bool) -> bool:
        stripped = self.buffer.lstrip()  # whitespace between messages is nobody's text
        if stripped.startswith(START):
            self.buffer, self.state, self.has_role = stripped[len(START) :], "header", True
            return True
        if not stripped or (START.startswith(stripped) and (not final or self.is_cut)):
            self.buffer = "" if final else self.buffer
            return False
        # Text outside any message: the model left the format; show it.
        self.buffer = stripped
        self._open(None, None)
        return True

    def _on_header(self, events: list[HarmonyEvent], final: bool) -> bool:
        at = self.buffer.find(MESSAGE)
        if at != -1:
            fields = _header_fields(self.buffer[:at], self.has_role)
            if fields is not None:
                self.buffer = self.buffer[at + len(MESSAGE) :]
                self._open(*fields)
                return True
        elif _may_become_header(self.buffer, self.has_role):
            if not final:
                return False
            header = self.buffer.strip()
            if self.is_cut or self.has_role or not header or "<|" in header or "to=" in header:
                self.buffer = ""  # a header cut short: markup, neither content nor a call
                return False
        # Not a harmony header: the text is content, as it stands.
        self._open(None, None)
        return True

    def _open(self, channel: str | None, recipient: str | None) -> None:
        self.state, self.has_shown, self.has_arguments, self.held_space = "body", False, False, ""
        self.scanner = None
        if self.parses_tool_calls and recipient is not None and recipient.startswith(FUNCTIONS):
            self.kind, self.name = "call", recipient[len(FUNCTIONS) :]
        else:
            # NOTE: built-in tools (to=python, to=browser.*) are called from the analysis channel: reasoning.
            self.kind = "reasoning" if channel == "analysis" else "content"
            if self.is_json_answer and channel == "final":
                self.scanner = _JsonScanner()

    def _on_body(self, events: list[HarmonyEvent], final: bool) -> bool:
        if self.kind == "call" and not self.has_arguments:
            self._begin_arguments(events)
        at, marker = self._plain_end() if self.scanner is None else self._json_end()
        if marker is not None:
            self._show(self.buffer[:at], events)
            self._close(events)
            self.buffer = self.buffer[at + len(marker) :]
            self.state, self.has_role = ("header", True) if marker == START else ("between", True)
            return True
        if final:
            # A terminator cut short is markup; an uncut text's stray "<|" is text.
            self._show(self.buffer[:at] if self.is_cut else self.buffer, events)
            self.buffer = ""
            if not self.is_cut:
                self._close(events)
            return False
        self._show(self.buffer[:at], events)
        self.buffer = self.buffer[at:]
        return False

    def _plain_end(self) -> tuple[int, str | None]:
        """(where the message's text ends in the buffer, the terminator there), or (where the text that may
        still begin one starts, None)."""
        ends = [(at, marker) for marker in _TERMINATORS if (at := self.buffer.find(marker)) != -1]
        return min(ends) if ends else (len(self.buffer) - _held_tail(self.buffer), None)

    def _json_end(self) -> tuple[int, str | None]:
        """_plain_end for JSON text: a terminator inside a string is text. Moves the scanner over the text
        before the returned offset (which the caller then consumes)."""
        buffer, scanner = self.buffer, self.scanner
        assert scanner is not None
        for i, char in enumerate(buffer):
            if not scanner.in_string and char == "<":
                marker = next((m for m in _TERMINATORS if buffer.startswith(m, i)), None)
                if marker is not None or any(m.startswith(buffer[i:]) for m in _TERMINATORS):
                    return i, marker
            scanner.scan(char)
        return len(buffer), None

    def _begin_arguments(self, events: list[HarmonyEvent]) -> None:
        # A call starts with its arguments' "{"; a body that is something else is the model's text.
        stripped = self.buffer.lstrip()
        if stripped.startswith("{"):
            events.append(ToolCallStart(self.num_calls, self.name))
            self.num_calls += 1
            self.buffer, self.has_arguments, self.scanner = stripped, True, _JsonScanner()
        elif stripped and not stripped.startswith(_TERMINATORS) and _held_tail(stripped) < len(stripped):
            self.buffer, self.kind = stripped, "content"

    def _show(self, text: str, events: list[HarmonyEvent]) -> None:
        if self.kind == "call":
            if self.has_arguments:
                self._arguments(text, events)
            return
        if not text:
            return
        if not self.has_shown and self.kind in self.kinds_shown:
            text = "\n" + text
        self.has_shown = True
        self.kinds_shown.add(self.kind)
        events.append(ReasoningText(text) if self.kind == "reasoning" else ContentText(text))

    def _arguments(self, text: str, events: list[HarmonyEvent]) -> None:
        text = self.held_space + text
        arguments = text.rstrip()
        self.held_space = text[len(arguments) :]
        if arguments:
            events.append(ToolCallArguments(self.num_calls - 1, arguments))

    def _close(self, events: list[HarmonyEvent]) -> None:
        # A call message that ended before any arguments is a call without them (`<|call|>` right away).
        if self.kind == "call" and not self.has_arguments:
            events.append(ToolCallStart(self.num_calls, self.name))
            self.num_calls += 1
        self.kind, self.held_space, self.scanner = "content", "", None


class HarmonyReasoningCounter:
    """Counts the tokens inside analysis messages' text (their `<|message|>` to their `<|end|>`), fed one
    token's text at a time: what the thinking budget (serving/reasoning.py ThinkingBudget) counts."""

    def __init__(self, prefix: str = GENERATION_PROMPT) -> None:
        self.parser = HarmonyParser(parses_tool_calls=False, prefix=prefix)
        self.num_reasoning_tokens = 0

    @property
    def is_reasoning(self) -> bool:
        return self.parser.is_reasoning

    def feed(self, text: str, num_tokens: int = 1) -> None:
        was_reasoning = self.parser.is_reasoning
        self.parser.feed(text)
        if was_reasoning or self.parser.is_reasoning:
            self.num_reasoning_tokens += num_tokens


def budget_end(has_grammar: bool) -> str:
    """What a thinking budget forces to end the analysis: the next message's header, and with no grammar to
    choose the channel, the final answer's."""
    return f"{END}{GENERATION_PROMPT}" if has_grammar else f"{END}{GENERATION_PROMPT}{CHANNEL}final{MESSAGE}"


# ---- grammars


def _analysis() -> dict[str, Any]:
    # The reasoning the model may write first: one analysis message, then the next message's header.
    return {"type": "optional", "content": {"type": "tag", "begin": f"{CHANNEL}analysis{MESSAGE}",
            "content": {"type": "any_text"}, "end": f"{END}{GENERATION_PROMPT}"}}  # fmt: skip


def _json(schema: dict[str, Any] | bool) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


def call_begin(name: str, recipient_first: bool = False) -> str:
    """A call's header up to its arguments, as the model writes it (recipient_first: the form gpt-oss's
    template renders earlier calls in, the recipient on the role line)."""
    if recipient_first:
        return f" to={FUNCTIONS}{name}{CHANNEL}commentary {CONSTRAIN}json{MESSAGE}"
    return f"{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"


def grammar_format(
    tools: list[Tool], choice: ToolChoice, answer_schema: dict[str, Any] | bool | None
) -> dict[str, Any] | None:
    """The structural tag the output follows, or None for free text. tools: those offered (empty when no call
    may be made), their schemas as they are to be enforced; answer_schema: the JSON the final answer must be.

    A forced choice ("required", a named function) is one call, after an optional analysis message: the call
    ends the output (`<|call|>` is end-of-generation), so `parallel_tool_calls` changes nothing. "auto" is
    free text until the model opens a call (either header form), which is then checked, and ends the output.
    A JSON answer is a final message holding it, after an optional analysis message."""
    offered = [t for t in tools if choice.mode != "function" or t.name == choice.name]
    final = {"type": "tag", "begin": f"{CHANNEL}final{MESSAGE}", "content": _json(answer_schema), "end": ""}
    if not offered:
        return None if answer_schema is None else {"type": "sequence", "elements": [_analysis(), final]}
    calls = [{"type": "tag", "begin": call_begin(t.name), "content": _json(t.parameters or {"type": "object"}),
              "end": ""} for t in offered]  # fmt: skip
    forced = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    if choice.mode in ("required", "function"):
        return {"type": "sequence", "elements": [_analysis(), forced]}
    if answer_schema is not None:  # auto with a JSON answer: a call or the answer
        return {"type": "sequence", "elements": [_analysis(), {"type": "or", "elements": [forced, final]}]}
    either_form = calls + [
        {**tag, "begin": call_begin(t.name, recipient_first=True)} for t, tag in zip(offered, calls)
    ]
    return {"type": "triggered_tags", "triggers": [f"{CHANNEL}commentary to=", f" to={FUNCTIONS}"],
            "tags": either_form, "stop_after_first": True}  # fmt: skip
