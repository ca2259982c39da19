"""Incremental parsers of tool-call text and the events they emit (the half of `tool_calls.py` that reads).

`JsonCallParser` reads JSON calls between markers (Hermes `<tool_call>`, Llama 3 JSON with an optional
`<|python_tag|>`); `NameLineCallParser` reads a function name on its own line followed by its arguments
(GLM-4 JSON, ChatGLM3's ```python tool_call(...)``` block). Both follow the streaming rule:
`feed(text) -> events`, `finish() -> events`; whatever the split of the text, the events merge to the
one-shot parse. They stay lenient (whitespace, key order): a generation cut off by max_tokens, or continued
from a client's prefix, is not grammar-made.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass


@dataclass
class ContentText:
    text: str


@dataclass
class ToolCallStart:
    index: int  # position of the call in the message, from 0
    name: str
    call_id: str | None = None  # the id the model wrote for the call (Kimi-K2's functions.NAME:IDX), if any


@dataclass
class ToolCallArguments:
    index: int
    text: str  # the next piece of the arguments' JSON text


ToolEvent = ContentText | ToolCallStart | ToolCallArguments


def merge_events(events: list) -> list:
    """Adjacent pieces of the same kind joined (text events of one type: content, harmony's reasoning; one
    call's arguments), empty texts dropped: the canonical form two parses are compared in."""
    merged: list = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, ToolCallArguments):
            if isinstance(last, ToolCallArguments) and last.index == event.index:
                last.text += event.text
            else:
                merged.append(ToolCallArguments(event.index, event.text))
        elif isinstance(event, ToolCallStart):
            merged.append(ToolCallStart(event.index, event.name, event.call_id))
        elif type(last) is type(event):
            last.text += event.text
        elif event.text:
            merged.append(type(event)(event.text))
    return merged


# ---- JSON scanning


@dataclass
class _JsonScanner:
    """Finds where a JSON value ends in text that arrives in pieces (strings and nesting tracked)."""

    depth: int = 0
    in_string: bool = False
    is_escaped: bool = False
    has_started: bool = False

    def scan(self, text: str) -> int | None:
        """Feed text; return the offset just past the value's end if it ends in it, else None. A bare
        scalar ends before the first character that cannot continue it (`,`, `}`, `]`, whitespace)."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.is_escaped:
                    self.is_escaped = False
                elif char == "\\":
                    self.is_escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
                continue
            if not self.has_started:
                if char.isspace():
                    continue
                self.has_started = True
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                if self.depth == 0:
                    return i
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif self.depth == 0 and (char in "," or char.isspace()):
                return i
        return None


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker (it may yet become marker)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


# ---- the parser of JSON-object calls (Hermes, Llama 3)

_NAME_HEADER = r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
MAX_HEADER_CHARS = 4096  # a would-be call whose name has not shown up by then is text


def _literal(text: str) -> tuple[str, str]:
    return re.escape(text), _prefixes([(re.escape(char), "") for char in text])


def _prefixes(parts: list[tuple[str, str]]) -> str:
    """A regex matching every prefix of the texts the parts match in turn. A part is (full, partial): a
    regex for its whole text and one for any beginning of it (a prefix may stop inside the last part)."""
    pattern = ""
    for full, partial in reversed(parts):
        pattern = f"(?:{full}{pattern}|{partial})"
    return pattern


def _header_prefix(open: str) -> re.Pattern[str]:
    """What a call header (_NAME_HEADER after `open`) can look like before its arguments begin."""
    space = (r"\s*", "")
    name = (r'(?:[^"\\]|\\.)*', r'(?:[^"\\]|\\.)*\\?')  # a name may be cut after a backslash
    keys = [_literal(f'"{key}"') for key in ("arguments", "parameters")]
    key = ("(?:" + "|".join(k for k, _ in keys) + ")", "(?:" + "|".join(p for _, p in keys) + ")")
    quote, colon = _literal('"'), _literal(":")
    parts = [_literal(open), space, _literal("{"), space, _literal('"name"'), space, colon, space]
    parts += [quote, name, quote, space, _literal(","), space, key, space, colon, space]
    return re.compile(_prefixes(parts))


class StateParser:
    """The streaming driver of the text parsers (tool calls here and in tool_call_markup.py, harmony.py):
    text is buffered, and the handler of the current state, `_on_<state>(events, final)`, consumes what it
    can of the buffer, returning True when the state changed and there may be more to do, False when it
    needs more text (or, when final, has consumed everything). Subclasses set `state`, `buffer` and `is_cut`."""

    state: str
    buffer: str
    is_cut: bool

    def feed(self, text: str) -> list:
        self.buffer += text
        return self._run(final=False)

    def finish(self, is_cut: bool = False) -> list:
        """The rest. is_cut: the text was cut short (max_tokens), so unfinished markup is dropped."""
        self.is_cut = is_cut
        return self._run(final=True)

    def _run(self, final: bool) -> list:
        events: list = []
        while getattr(self, f"_on_{self.state}")(events, final):
            pass
        return events


class JsonCallParser(StateParser):
    """Calls of the form OPEN {"name": NAME, "arguments": ARGS} CLOSE.

    With an `open` marker ("<tool_call>") calls may appear anywhere in the text; without one (Llama 3 writes
    bare JSON) a message that starts with `{` (after `lead`, if it has one) is calls, separated by `;`, and
    anything else is text. Text that is only whitespace between or after calls is dropped.

    Tool-call markup is never content: text that began a call but ended before the call's arguments began
    (`<tool_call>\n{"na`) is dropped, and so is, when the text was cut short (`finish(is_cut=True)`:
    max_tokens), an unfinished opening marker (`<tool_c`) at its end. A call whose arguments had begun keeps
    them as they are (its deltas may already have been streamed)."""

    def __init__(self, open: str, close: str, lead: str = "") -> None:
        self.open = open
        self.close = close
        self.lead = lead  # a marker that may precede bare calls (Llama 3's <|python_tag|>): dropped
        self.header = re.compile(re.escape(open) + _NAME_HEADER)
        self.header_prefix = _header_prefix(open)
        self.close_pattern = re.compile(r"\s*\}" + (r"\s*" + re.escape(close) if close else ""))
        self.state = "text" if open else "start"
        self.buffer = ""
        self.num_calls = 0
        self.scanner = _JsonScanner()
        self.is_cut = False  # the text ended before the model did (set by finish)

    def _on_start(self, events: list[ToolEvent], final: bool) -> bool:
        stripped = self.buffer.lstrip()
        if self.lead and stripped.startswith(self.lead):
            self.buffer = stripped[len(self.lead) :]
            return True
        if (not stripped or self.lead.startswith(stripped)) and not final:
            return False  # nothing yet, or what may still become the lead
        if stripped and self.lead.startswith(stripped) and self.is_cut:
            self.buffer = ""  # the lead, cut short
            return False
        self.state = "header" if stripped.startswith("{") else "text"
        return True

    def _on_text(self, events: list[ToolEvent], final: bool) -> bool:
        buffer = self.buffer
        index = buffer.find(self.open) if self.open else -1
        if index != -1:
            cut = index
        else:
            shows_held = final and not self.is_cut  # a cut text's unfinished marker is dropped with it
            cut = len(buffer) - (0 if shows_held or not self.open else _held_prefix(buffer, self.open))
        piece = buffer[:cut]
        if self.num_calls and not piece.strip():
            if index == -1 and not final:
                return False  # whitespace after a call: shown only if text follows it
            piece = ""
        if piece:
            events.append(ContentText(piece))
        self.buffer = "" if final and index == -1 else buffer[cut:]
        if index == -1:
            return False
        self.state = "header"
        return True

    def _on_header(self, events: list[ToolEvent], final: bool) -> bool:
        match = self.header.match(self.buffer)
        if match is not None:
            events.append(ToolCallStart(self.num_calls, json.loads(f'"{match.group(1)}"')))
            self.num_calls += 1
            self.buffer = self.buffer[match.end() :]
            self.scanner = _JsonScanner()
            self.state = "args"
            return True
        close_at = self.buffer.find(self.close) if self.close else -1
        if not (final or close_at != -1 or len(self.buffer) > MAX_HEADER_CHARS):
            return False
        if final and close_at == -1 and self.header_prefix.fullmatch(self.buffer):
            self.buffer = ""  # a call that ended before its arguments began: markup, neither content nor call
            return False
        # Not a call after all: its text is content (up to its close marker, if it has one).
        cut = len(self.buffer) if close_at == -1 else close_at + len(self.close)
        events.append(ContentText(self.buffer[:cut]))
        self.buffer = self.buffer[cut:]
        self.state = "text" if self.open or self.num_calls == 0 else "plain"
        return True

    def _on_args(self, events: list[ToolEvent], final: bool) -> bool:
        end = self.scanner.scan(self.buffer)
        piece = self.buffer if end is None else self.buffer[:end]
        if piece:
            events.append(ToolCallArguments(self.num_calls - 1, piece))
        self.buffer = "" if end is None else self.buffer[end:]
        if end is None:
            return False
        self.state = "close"
        return True

    def _on_close(self, events: list[ToolEvent], final: bool) -> bool:
        match = self.close_pattern.match(self.buffer)
        if match is None:
            if final:
                self.buffer = ""  # a call cut off before its close: the close is all that is missing
            return False
        self.buffer = self.buffer[match.end() :]
        self.state = "text" if self.open else "separator"
        return True

    def _on_separator(self, events: list[ToolEvent], final: bool) -> bool:
        stripped = self.buffer.lstrip()
        if not stripped:
            if final:
                self.buffer = ""
            return False
        if stripped.startswith(";"):
            self.buffer, self.state = stripped[1:], "start"
        elif stripped.startswith("{"):
            self.buffer, self.state = stripped, "header"
        else:
            self.state = "plain"
        return True

    def _on_plain(self, events: list[ToolEvent], final: bool) -> bool:
        if self.buffer:
            events.append(ContentText(self.buffer))
            self.buffer = ""
        return False


class NameLineCallParser:
    """GLM-4 / ChatGLM: a call is the whole message, the function's name on the first line and its
    arguments (a JSON object) after it. A first line that names no tool makes the message plain text.

    With `accepts_python_call` (ChatGLM3) the arguments may instead be a ```python block holding
    `tool_call(key=value, ...)`: it is read whole (a Python call cannot be checked piece by piece) and its
    arguments are given as one JSON piece; a block that is not such a call makes the message plain text.

    When the text was cut short (`finish(is_cut=True)`), what may still have become a call is dropped rather
    than shown as text: a first line that begins a tool's name, a name line with no arguments after it, an
    unclosed python block."""

    def __init__(self, tool_names: frozenset[str], accepts_python_call: bool = False) -> None:
        self.tool_names = tool_names
        self.accepts_python_call = accepts_python_call
        self.state = "start"
        self.buffer = ""
        self.name_line = ""  # the first line, kept in case a python block turns out not to be a call
        self.scanner = _JsonScanner()
        self.is_cut = False  # the text ended before the model did (set by finish)

    def feed(self, text: str) -> list[ToolEvent]:
        return self._advance(text, final=False)

    def finish(self, is_cut: bool = False) -> list[ToolEvent]:
        self.is_cut = is_cut
        return self._advance("", final=True)

    def _advance(self, text: str, final: bool) -> list[ToolEvent]:
        self.buffer += text
        events: list[ToolEvent] = []
        if self.state == "start":
            newline = self.buffer.find("\n")
            if newline == -1 and not final:
                return events
            line = self.buffer if newline == -1 else self.buffer[:newline]
            if newline != -1 and line.strip() in self.tool_names:
                self.name_line = self.buffer[: newline + 1]
                self.buffer, self.state = self.buffer[newline + 1 :], "body"
            elif newline == -1 and self.is_cut and any(n.startswith(line.strip()) for n in self.tool_names):
                self.buffer, self.state = "", "after"  # a name cut short
            else:
                self.state = "text"
        if self.state == "body":
            # What the arguments are written as decides when the call starts: JSON streams at once, a python
            # block only once it is whole and known to be a call.
            stripped = self.buffer.lstrip()
            if self.accepts_python_call and stripped.startswith("`"):
                self.buffer, self.state = stripped, "python"
            elif stripped or (final and not self.is_cut):
                events.append(ToolCallStart(0, self.name_line.strip()))
                self.state = "args"
            elif final:
                self.buffer, self.state = "", "after"  # cut before the arguments began
        if self.state == "python":
            self._on_python(events, final)
        if self.state == "args" and not self.scanner.has_started:
            self.buffer = self.buffer.lstrip()
        if self.state == "args" and self.buffer:
            end = self.scanner.scan(self.buffer)
            events.append(ToolCallArguments(0, self.buffer if end is None else self.buffer[:end]))
            self.buffer = "" if end is None else self.buffer[end:]
            if end is not None:
                self.state = "after"
        if self.state == "text" and self.buffer:
            events.append(ContentText(self.buffer))
            self.buffer = ""
        if self.state == "after":
            self.buffer = ""  # nothing may follow the call
        return events

    def _on_python(self, events: list[ToolEvent], final: bool) -> None:
        body_at = self.buffer.find("\n")  # the block's code starts after its ```python line
        fence_at = self.buffer.find("```", body_at + 1) if body_at != -1 else -1
        if fence_at == -1 and not final:
            return
        if fence_at == -1 and self.is_cut:
            self.buffer, self.state = "", "after"  # a block cut short: not a call yet, and not text
            return
        code = "" if body_at == -1 else self.buffer[body_at + 1 : fence_at if fence_at != -1 else None]
        arguments = _python_call_arguments(code)
        if arguments is None:
            self.buffer, self.state = self.name_line + self.buffer, "text"
            return
        events += [ToolCallStart(0, self.name_line.strip()), ToolCallArguments(0, arguments)]
        self.buffer, self.state = "", "after"


def _python_call_arguments(code: str) -> str | None:
    """`tool_call(a=1, b="x")` -> '{"a": 1, "b": "x"}'; None if code is not such a call of literals."""
    try:
        call = ast.parse(code.strip(), mode="eval").body
        if not (
            isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "tool_call"
        ):
            return None
        if call.args or any(k.arg is None for k in call.keywords):
            return None
        return json.dumps({k.arg: ast.literal_eval(k.value) for k in call.keywords}, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


# ---- the formats
