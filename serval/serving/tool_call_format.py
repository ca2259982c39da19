"""ToolCallFormat: how one family of models writes tool calls, as a grammar and as a parser (the registry of
formats is serving/tool_calls.py).

Owns the format's three products: the xgrammar structural tag that admits exactly the calls a tool_choice
allows (arguments that validate against each tool's JSON Schema, in JSON or in an XML key/value style; grouped
in a calls section where the family groups them), the incremental parser of the calls' text, and the text of
earlier calls and of the fallback system prompt for a chat template that ignores `tools`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from serval.serving import harmony
from serval.serving.harmony import HarmonyParser
from serval.serving.structured import MAX_WHITESPACE
from serval.serving.tool_call_markup import CallMarkers, MarkedJsonCallParser, XmlCallParser
from serval.serving.tool_call_parsers import JsonCallParser, NameLineCallParser

CallParser = JsonCallParser | NameLineCallParser | HarmonyParser | MarkedJsonCallParser | XmlCallParser

ToolChoiceMode = Literal["none", "auto", "required", "function"]
_CALL_INDEX = {"type": "regex", "pattern": "[0-9]{1,4}"}  # bounded, as every free part of a grammar


# One argument in an XML style, as the chat templates write it (the key, then the value: a string as it is).
_XML_PAIRS = {
    "glm_xml": "<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n",
    "minimax_xml": '<parameter name="{key}">{value}</parameter>\n',
}


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


# What may follow the last of several forced calls before the end of generation (bounded: a grammar must not
# let a model idle in whitespace until max_tokens).
_TRAILING_WHITESPACE = {"type": "regex", "pattern": "[ \\n]{0,4}"}


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # JSON Schema of the arguments object
    description: str | None = None
    strict: bool = False

    def as_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode
    name: str | None = None  # the function forced when mode is "function"


# ---- parser events


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family of models writes tool calls."""

    name: str
    trigger: str  # the text that opens a call in free text ("" when calls must be the whole message)
    separator: str  # between parallel calls
    call_begin: str  # before the arguments; {name} is the function's name (JSON-escaped)
    call_end: str  # after the arguments
    instructions: str  # the fallback system prompt; {tools} is the tools, one JSON object a line
    markers: tuple[str, ...] = field(default=())  # texts in a chat template that say it uses this format
    is_single_call: bool = False  # the call is the whole message: never parallel calls
    lead: str = ""  # a marker the model may write before bare calls (Llama 3's <|python_tag|>)
    # NOTE: ChatGLM3 writes its arguments as a ```python block of `tool_call(key=value)`; the parser reads
    # that, but the grammar (call_begin/call_end) makes the GLM-4 JSON form: a schema is checkable as JSON.
    accepts_python_call: bool = False
    # gpt-oss's harmony messages (serving/harmony.py): the whole output is channels, so its parser also splits
    # out the reasoning, and its grammars are harmony's own.
    is_harmony: bool = False
    # Calls grouped in one section (DeepSeek's <｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>); "" when not.
    section_begin: str = ""
    section_end: str = ""
    # How the arguments are written: "json", or one of xgrammar's XML styles for key/value arguments
    # ("glm_xml": GLM-4.5's <arg_key>/<arg_value>, "minimax_xml": MiniMax-M2's <parameter name=...>).
    arguments_style: str = "json"
    # Marker-token formats (serving/tool_call_markup.py): what its parser reads; None for the older parsers.
    call_markers: CallMarkers | None = None
    requires: tuple[str, ...] = ()  # texts the template must also contain for a marker to count
    # The control texts of the calls: the tokenizer may have them as special tokens, which the answer then
    # keeps (decoded, and writable by the grammar) so that the parser sees them.
    markup: tuple[str, ...] = ()

    def parser(self, tool_names: frozenset[str], tools: tuple[Tool, ...] = ()) -> CallParser:
        if self.is_harmony:
            return HarmonyParser(parses_tool_calls=True)
        if self.call_markers is not None and self.arguments_style != "json":
            return XmlCallParser(self.call_markers, {t.name: t.parameters for t in tools})
        if self.call_markers is not None:
            return MarkedJsonCallParser(self.call_markers)
        if self.is_single_call:
            return NameLineCallParser(tool_names, self.accepts_python_call)
        return JsonCallParser(self.trigger, self.call_end.replace("}", "", 1).strip(), self.lead)

    def is_named_by(self, template_source: str) -> bool:
        """The chat template says it writes calls in this format."""
        return any(m in template_source for m in self.markers) and all(
            r in template_source for r in self.requires
        )

    def history_text(self, calls: list[tuple[str, str]]) -> str:
        """Earlier calls ((name, arguments JSON) each) written as the model writes them."""
        texts = [self._call_begin(name, str(index)) + self._arguments_text(arguments) + self.call_end
                 for index, (name, arguments) in enumerate(calls)]  # fmt: skip
        return self.section_begin + self.separator.join(texts) + self.section_end

    def _arguments_text(self, arguments: str) -> str:
        pair = _XML_PAIRS.get(self.arguments_style)
        try:
            values = json.loads(arguments) if pair is not None else None
        except ValueError:
            values = None
        if not isinstance(values, dict):
            return arguments
        texts = (v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in values.values())
        return "".join(pair.format(key=k, value=t) for k, t in zip(values, texts))

    def _call_begin(self, name: str, index: str) -> str:
        return self.call_begin.replace("{name}", json.dumps(name)[1:-1]).replace("{index}", index)

    def structural_tag(self, tools: list[Tool], choice: ToolChoice, parallel: bool) -> dict[str, Any]:
        """The xgrammar format that admits exactly the calls `choice` allows (schema-valid arguments).

        A named choice is exactly one call of that function; "required" is one or more calls (exactly one
        without `parallel`), and after each call the model may end. "auto" is free text around calls."""
        if self.is_harmony:
            return harmony.grammar_format(tools, choice, None) or {"type": "any_text"}
        offered = [t for t in tools if choice.mode != "function" or t.name == choice.name]
        parallel = parallel and not self.is_single_call and choice.mode != "function"
        tags = [self._call_tag(t) for t in offered]
        if choice.mode in ("required", "function"):
            calls = {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": self.separator,
                "at_least_one": True,
                "stop_after_first": not parallel,
            }
            if self.section_begin:
                calls = {"type": "sequence", "elements": [_const(self.section_begin), calls,
                                                          _const(self.section_end)]}  # fmt: skip
            if not parallel:
                return calls  # after the one call only the end of generation is allowed
            # NOTE: the separator ("\n" for Hermes) is also what a model writes before it ends; were it only a
            # separator, a model that wrote it would be forced into another call, and a greedy one loops until
            # max_tokens. A little trailing whitespace after the last call lets it end there instead.
            return {"type": "sequence", "elements": [calls, _TRAILING_WHITESPACE]}
        if self.trigger and self.section_begin:
            section = {"type": "tag", "begin": self.section_begin, "end": self.section_end,
                       "content": {"type": "tags_with_separator", "tags": tags, "separator": self.separator,
                                   "at_least_one": True, "stop_after_first": not parallel}}  # fmt: skip
            return {"type": "triggered_tags", "triggers": [self.trigger], "tags": [section],
                    "stop_after_first": True}  # fmt: skip
        if self.trigger:
            return {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags,
                    "stop_after_first": not parallel}  # fmt: skip
        calls = {"type": "tags_with_separator", "tags": tags, "separator": self.separator,
                 "at_least_one": True, "stop_after_first": not parallel}  # fmt: skip
        return {"type": "or", "elements": [calls, {"type": "any_text"}]}

    def _call_tag(self, tool: Tool) -> dict[str, Any]:
        """One call of `tool`: its opening text, schema-valid arguments in this format's style, the close."""
        arguments: dict[str, Any] = {
            "type": "json_schema",
            "json_schema": tool.parameters or {"type": "object"},
            "max_whitespace_cnt": MAX_WHITESPACE,
        }
        if self.arguments_style != "json":
            arguments["style"] = self.arguments_style
        begin = self._call_begin(tool.name, "{index}")
        if "{index}" not in begin:
            return {"type": "tag", "begin": begin, "content": arguments, "end": self.call_end}
        # Kimi-K2 numbers its calls (functions.NAME:IDX): the number is the model's to write
        before, after = begin.split("{index}", 1)
        content = {"type": "sequence", "elements": [_CALL_INDEX, _const(after), arguments]}
        return {"type": "tag", "begin": before, "content": content, "end": self.call_end}

    def system_prompt(self, tools: list[Tool]) -> str:
        return self.instructions.replace("{tools}", "\n".join(json.dumps(t.as_openai()) for t in tools))
