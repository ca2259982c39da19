"""Incremental parsers of tool calls written in marker tokens: DeepSeek's and Kimi-K2's JSON calls inside a
calls section, GLM-4.5's and MiniMax-M2's XML-style calls whose arguments are key/value pairs.

Both parsers share the outer shape: free text, then (after an opening marker) one or more calls, then free text
again. `MarkedJsonCallParser` reads a call header that names the function (a regex over the text up to the
marker that opens the arguments) and then a JSON object. `XmlCallParser` reads a name and key/value pairs and
streams them out as a JSON arguments object: a value is the raw text for a parameter the tool's schema types as
a string, and JSON otherwise (parsed whole, then written out; text that is not JSON becomes a JSON string).

The streaming rule holds: `feed(text) -> events`, `finish(is_cut) -> events`; whatever the split of the text,
the merged events equal the one-shot parse. Markup is never content: whitespace around calls is dropped, and a
call that ended before its name was known (cut by max_tokens, or malformed at the end) is dropped whole.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from serval.serving.tool_call_parsers import (
    MAX_HEADER_CHARS,
    ContentText,
    StateParser,
    ToolCallArguments,
    ToolCallStart,
    ToolEvent,
    _JsonScanner,
)


@dataclass(frozen=True)
class CallMarkers:
    """The texts that frame calls in one format. Empty `section_begin`: calls stand alone in the text."""

    section_begin: str  # opens a run of calls ("<｜tool▁calls▁begin｜>"); "" when calls are not grouped
    section_end: str  # closes the run
    call_open: str  # opens one call
    call_close: tuple[str, ...]  # closes one call: pieces with optional whitespace between and before them
    # JSON calls: the marker after the header, and the header regex (group "name", optional group "id_index")
    arguments_open: str = ""
    header: re.Pattern[str] | None = None
    call_id: str = ""  # JSON calls: an id built from the header ("functions.{name}:{index}"), "" for none
    # XML calls: what ends the name, and the texts around a key and around its value
    name_ends: tuple[str, ...] = ()
    key_open: str = ""
    key_close: str = ""
    value_open: str = ""
    value_close: str = ""


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of text that may still become one of the markers, plus the whitespace
    before it: held back until the next text says what it is."""
    held = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-size:]):
                held = max(held, size)
                break
    rest = text[: len(text) - held]
    return held + len(rest) - len(rest.rstrip())


def _match_pieces(text: str, pieces: tuple[str, ...]) -> tuple[int | None, bool]:
    """(offset past the pieces, None if they are not all there; whether the text may still become them).
    Whitespace is allowed before each piece."""
    position = 0
    for piece in pieces:
        while position < len(text) and text[position].isspace():
            position += 1
        rest = text[position:]
        if rest.startswith(piece):
            position += len(piece)
        else:
            return None, piece.startswith(rest)
    return position, True


class _MarkupCallParser(StateParser):
    """Free text and runs of calls; subclasses read one call's body (`_on_call`), from its opening marker on."""

    def __init__(self, markers: CallMarkers) -> None:
        self.markers = markers
        self.opening = markers.section_begin or markers.call_open
        self.state = "text"
        self.buffer = ""
        self.num_calls = 0
        self.has_text_after_call = False  # content came since the last call (its trailing whitespace counts)
        self.is_cut = False

    def _after_call(self) -> str:
        return "section" if self.markers.section_begin else "text"

    def _on_text(self, events: list[ToolEvent], final: bool) -> bool:
        at = self.buffer.find(self.opening)
        if at != -1:
            piece = self.buffer[:at].rstrip()
        elif final:
            piece = self.buffer
            if self.is_cut:
                piece = piece[: len(piece) - _held(piece, (self.opening,))] if piece.strip() else ""
            if self.num_calls and not self.has_text_after_call and not piece.strip():
                piece = ""  # whitespace after the last call is not content
        else:
            piece = self.buffer[: len(self.buffer) - _held(self.buffer, (self.opening,))]
        if piece:
            events.append(ContentText(piece))
            self.has_text_after_call = True
        if at == -1:
            self.buffer = "" if final else self.buffer[len(piece) :]
            return False
        self.buffer = self.buffer[at:]
        if self.markers.section_begin:
            self.buffer, self.state = self.buffer[len(self.opening) :], "section"
        else:
            self.state = "call"
        return True

    def _on_section(self, events: list[ToolEvent], final: bool) -> bool:
        stripped = self.buffer.lstrip()
        for marker, state in ((self.markers.call_open, "call"), (self.markers.section_end, "text")):
            if stripped.startswith(marker):
                self.buffer, self.state = stripped, state
                if state == "text":
                    self.buffer = stripped[len(marker) :]
                    self.has_text_after_call = False
                return True
        could_be = any(m.startswith(stripped) for m in (self.markers.call_open, self.markers.section_end))
        if could_be and not final:
            return False
        if could_be or not stripped:
            self.buffer = ""  # the section's end, cut short or missing: markup
            return False
        self.state = "text"  # not a call: the section ended without its marker; the rest is text
        self.buffer = stripped
        return True

    def _on_call(self, events: list[ToolEvent], final: bool) -> bool:
        raise NotImplementedError

    def _start_call(self, events: list[ToolEvent], name: str, call_id: str | None = None) -> None:
        events.append(ToolCallStart(self.num_calls, name, call_id))
        self.num_calls += 1
        self.has_text_after_call = False

    def _arguments(self, events: list[ToolEvent], text: str) -> None:
        if text:
            events.append(ToolCallArguments(self.num_calls - 1, text))

    def _on_close(self, events: list[ToolEvent], final: bool) -> bool:
        end, could_be = _match_pieces(self.buffer, self.markers.call_close)
        if end is None and could_be and not final:
            return False
        if end is None and final:
            self.buffer = ""  # the close is all that is missing
            return False
        self.buffer = self.buffer[end:] if end is not None else self.buffer
        self.state = self._after_call()
        return True

    def _drop_unfinished(self, final: bool, size: int) -> bool | None:
        """A call whose name is not known yet: wait (None) or, at the end or past the header bound, drop it
        as markup (False)."""
        if not final and size <= MAX_HEADER_CHARS:
            return None
        self.buffer, self.state = "", self._after_call()
        return False


class MarkedJsonCallParser(_MarkupCallParser):
    """DeepSeek-V3/R1, DeepSeek-V3.1, Kimi-K2: a header naming the function, then a JSON arguments object."""

    def __init__(self, markers: CallMarkers) -> None:
        super().__init__(markers)
        self.scanner = _JsonScanner()

    def _on_call(self, events: list[ToolEvent], final: bool) -> bool:
        at = self.buffer.find(self.markers.arguments_open)
        if at == -1:
            waited = self._drop_unfinished(final, len(self.buffer))
            return False if waited is None else waited
        assert self.markers.header is not None
        match = self.markers.header.fullmatch(self.buffer[:at])
        if match is None:  # not a call after all: its text is content
            events.append(ContentText(self.buffer[: at + len(self.markers.arguments_open)]))
            self.buffer = self.buffer[at + len(self.markers.arguments_open) :]
            self.state = "text"
            return True
        name = match.group("name").strip()
        call_id = None
        if self.markers.call_id and match.group("id_index") is not None:
            call_id = self.markers.call_id.format(name=name, index=match.group("id_index"))
        self._start_call(events, name, call_id)
        self.buffer = self.buffer[at + len(self.markers.arguments_open) :]
        self.scanner = _JsonScanner()
        self.state = "arguments"
        return True

    def _on_arguments(self, events: list[ToolEvent], final: bool) -> bool:
        if not self.scanner.has_started:
            self.buffer = self.buffer.lstrip()
        end = self.scanner.scan(self.buffer)
        self._arguments(events, self.buffer if end is None else self.buffer[:end])
        self.buffer = "" if end is None else self.buffer[end:]
        if end is None:
            return False
        self.state = "close"
        return True


class XmlCallParser(_MarkupCallParser):
    """GLM-4.5 (`<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`) and MiniMax-M2
    (`<invoke name="NAME"><parameter name="k">v</parameter></invoke>` inside `<minimax:tool_call>`).

    tools: each tool's name -> its parameters' JSON Schema, which says which values are raw strings."""

    def __init__(self, markers: CallMarkers, tools: dict[str, dict[str, Any]]) -> None:
        super().__init__(markers)
        self.tools = tools
        self.name = ""
        self.num_arguments = 0  # key/value pairs written into the current call's JSON object
        self.is_string_value = False
        self.value_kind = "json"  # the current value's: "string" (raw text), "choice" (a string enum), "json"

    def _on_call(self, events: list[ToolEvent], final: bool) -> bool:
        body = self.buffer[len(self.markers.call_open) :]
        ends = [(body.find(end), end) for end in self.markers.name_ends if end in body]
        if not ends:
            waited = self._drop_unfinished(final, len(body))
            return False if waited is None else waited
        at, end = min(ends)
        self.name = body[:at].strip()
        self._start_call(events, self.name)
        self.num_arguments = 0
        consumed = at if end.startswith("<") else at + len(end)  # "<" begins the next marker: keep it
        self.buffer = body[consumed:]
        self.state = "parameters"
        return True

    def _on_parameters(self, events: list[ToolEvent], final: bool) -> bool:
        stripped = self.buffer.lstrip()
        key_open, closing = self.markers.key_open, self.markers.call_close
        if stripped.startswith(key_open):
            return self._on_key(events, stripped, final)
        end, could_be = _match_pieces(stripped, closing)
        if end is None and (could_be or key_open.startswith(stripped)) and not final:
            return False
        self._arguments(events, "}" if self.num_arguments else "{}")
        self.buffer = stripped[end:] if end is not None else ("" if final else stripped)
        self.state = self._after_call()
        return True

    def _on_key(self, events: list[ToolEvent], text: str, final: bool) -> bool:
        markers = self.markers
        key_end = text.find(markers.key_close, len(markers.key_open))
        value_at = -1
        if key_end != -1:
            after_key = key_end + len(markers.key_close)
            value_end, _ = _match_pieces(
                text[after_key:], (markers.value_open,) if markers.value_open else ()
            )
            value_at = -1 if value_end is None else after_key + value_end
        if value_at == -1:
            if final:
                self._arguments(events, "}" if self.num_arguments else "")
                self.buffer = ""
            return False
        key = text[len(markers.key_open) : key_end].strip()
        self.value_kind = _value_kind(self.tools.get(self.name), key)
        self.is_string_value = self.value_kind == "string"
        opening = "{" if self.num_arguments == 0 else ", "
        self._arguments(events, f"{opening}{json.dumps(key, ensure_ascii=False)}: ")
        if self.is_string_value:
            self._arguments(events, '"')
        self.num_arguments += 1
        self.buffer = text[value_at:]
        self.state = "value"
        return True

    def _on_value(self, events: list[ToolEvent], final: bool) -> bool:
        close = self.markers.value_close
        at = self.buffer.find(close)
        if self.is_string_value:
            if at != -1:
                end = at
            else:  # a string value keeps its whitespace: only what may become the close is held back
                end = len(self.buffer) - (0 if final else _held_marker_only(self.buffer, close))
            self._arguments(events, json.dumps(self.buffer[:end], ensure_ascii=False)[1:-1])
            if at == -1:
                self.buffer = "" if final else self.buffer[end:]
                return False
            self._arguments(events, '"')
        else:
            if at == -1:
                if final:
                    self.buffer = ""  # a value cut short: it cannot be written as JSON yet
                return False
            value = self.buffer[:at]
            choice = json.dumps(
                value.strip(), ensure_ascii=False
            )  # a choice never begins or ends in whitespace
            self._arguments(events, choice if self.value_kind == "choice" else _json_value(value))
        self.buffer = self.buffer[at + len(close) :]
        self.state = "parameters"
        return True


def _held_marker_only(text: str, marker: str) -> int:
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _json_value(text: str) -> str:
    """A non-string parameter's value as JSON: the text if it is JSON, else the text as a JSON string."""
    try:
        return json.dumps(json.loads(text.strip()), ensure_ascii=False)
    except (ValueError, RecursionError):
        return json.dumps(text, ensure_ascii=False)


def _value_kind(parameters: dict[str, Any] | None, key: str) -> str:
    """How a parameter's value is written: "string" when the schema types it a string (the raw text is the
    value), "choice" for a string enum or const (the grammars let whitespace surround it), else "json" (JSON if
    its text parses, a string otherwise: _json_value)."""
    properties = (parameters or {}).get("properties")
    schema = properties.get(key) if isinstance(properties, dict) else None
    if not isinstance(schema, dict):
        return "json"
    values = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
    if values and all(isinstance(v, str) for v in values):
        return "choice"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    return "string" if "string" in kinds and all(k in ("string", "null") for k in kinds) else "json"
