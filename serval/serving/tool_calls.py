"""Tool calls: the tool-call text formats models are trained on, as grammars and as incremental parsers.

Owns a small registry of formats (`FORMATS`, chosen per model by `format_for_template`: from the chat template,
else from the vocabulary, default Hermes). A
format knows three things: the grammar (an xgrammar structural tag) that makes the model write well-formed
calls whose arguments validate against each tool's JSON Schema; the incremental parser that turns the text
back into calls; and the system prompt that shows the tools to a model whose chat template ignores `tools`.

Peers parse tool calls out of free text with regexes and hope; here the sampler is constrained, so a call that
reaches the parser is well formed by construction. The parsers stay lenient anyway (whitespace, key order):
a generation cut off by max_tokens, or one continued from a client's prefix, is not grammar-made.

Parsers follow the streaming rule: `feed(text) -> events`, `finish() -> events`; whatever the split of the
text, the events merge to the one-shot parse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from serval.serving import harmony
from serval.serving.harmony import HarmonyParser
from serval.serving.structured import MAX_WHITESPACE
from serval.serving.tool_call_parsers import JsonCallParser, NameLineCallParser

ToolChoiceMode = Literal["none", "auto", "required", "function"]
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

    def parser(self, tool_names: frozenset[str]) -> JsonCallParser | NameLineCallParser | HarmonyParser:
        if self.is_harmony:
            return HarmonyParser(parses_tool_calls=True)
        if self.is_single_call:
            return NameLineCallParser(tool_names, self.accepts_python_call)
        return JsonCallParser(self.trigger, self.call_end.replace("}", "", 1).strip(), self.lead)

    def structural_tag(self, tools: list[Tool], choice: ToolChoice, parallel: bool) -> dict[str, Any]:
        """The xgrammar format that admits exactly the calls `choice` allows (schema-valid arguments).

        A named choice is exactly one call of that function; "required" is one or more calls (exactly one
        without `parallel`), and after each call the model may end. "auto" is free text around calls."""
        if self.is_harmony:
            return harmony.grammar_format(tools, choice, None) or {"type": "any_text"}
        offered = [t for t in tools if choice.mode != "function" or t.name == choice.name]
        parallel = parallel and not self.is_single_call and choice.mode != "function"
        tags = [
            {
                "type": "tag",
                "begin": self.call_begin.replace("{name}", json.dumps(t.name)[1:-1]),
                "content": {
                    "type": "json_schema",
                    "json_schema": t.parameters or {"type": "object"},
                    "max_whitespace_cnt": MAX_WHITESPACE,
                },
                "end": self.call_end,
            }
            for t in offered
        ]
        if choice.mode in ("required", "function"):
            calls = {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": self.separator,
                "at_least_one": True,
                "stop_after_first": not parallel,
            }
            if not parallel:
                return calls  # after the one call only the end of generation is allowed
            # NOTE: the separator ("\n" for Hermes) is also what a model writes before it ends; were it only a
            # separator, a model that wrote it would be forced into another call, and a greedy one loops until
            # max_tokens. A little trailing whitespace after the last call lets it end there instead.
            return {"type": "sequence", "elements": [calls, _TRAILING_WHITESPACE]}
        if self.trigger:
            return {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags,
                    "stop_after_first": not parallel}  # fmt: skip
        calls = {"type": "tags_with_separator", "tags": tags, "separator": self.separator,
                 "at_least_one": True, "stop_after_first": not parallel}  # fmt: skip
        return {"type": "or", "elements": [calls, {"type": "any_text"}]}

    def system_prompt(self, tools: list[Tool]) -> str:
        return self.instructions.replace("{tools}", "\n".join(json.dumps(t.as_openai()) for t in tools))


_HERMES_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions are listed in "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, reply with a JSON object with the "
    "function name and its arguments inside <tool_call></tool_call> tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_LLAMA3_PROMPT = (
    "You have access to the following functions:\n{tools}\n\nTo call a function, reply with only a JSON "
    'object of the form {"name": <function-name>, "parameters": <args-json-object>}. Separate several '
    "calls with '; '."
)
_HARMONY_PROMPT = (
    "You may call these functions:\n{tools}\n\nTo call one, write <|channel|>commentary to=functions.NAME "
    "<|constrain|>json<|message|> and then its arguments as a JSON object."
)
_GLM_PROMPT = (
    "You have access to the following tools:\n{tools}\n\nTo call a tool, reply with its name on the first "
    "line and its arguments as a JSON object on the next."
)

FORMATS: MappingProxyType[str, ToolCallFormat] = MappingProxyType({
    "hermes": ToolCallFormat(
        "hermes", "<tool_call>", "\n", '<tool_call>\n{"name": "{name}", "arguments": ', "}\n</tool_call>",
        _HERMES_PROMPT, ("<tool_call>",),
    ),
    "llama3_json": ToolCallFormat(
        "llama3_json", "", "; ", '{"name": "{name}", "parameters": ', "}", _LLAMA3_PROMPT,
        ("<|python_tag|>", "ipython"), lead="<|python_tag|>",
    ),
    # Before "glm": ChatGLM3's template also has <|observation|>; its "[gMASK]sop" (GLM-4: "[gMASK]<sop>")
    # tells them apart.
    "chatglm3": ToolCallFormat(
        "chatglm3", "", "\n", "{name}\n", "", _GLM_PROMPT, ("[gMASK]sop",), is_single_call=True,
        accepts_python_call=True,
    ),
    "glm": ToolCallFormat(
        "glm", "", "\n", "{name}\n", "", _GLM_PROMPT, ("<|observation|>",), is_single_call=True
    ),
    # gpt-oss. NOTE: one call at most: <|call|> ends the generation (the model waits for the result).
    "harmony": ToolCallFormat(
        "harmony", f"{harmony.CHANNEL}commentary to=", "", harmony.call_begin("{name}"), harmony.CALL,
        _HARMONY_PROMPT, (harmony.CHANNEL,), is_single_call=True, is_harmony=True,
    ),
})  # fmt: skip
DEFAULT_FORMAT = "hermes"


def format_for_template(
    template_source: str | None, name: str | None = None, special_token_texts: frozenset[str] = frozenset()
) -> ToolCallFormat:
    """The format named, else the one whose markers the chat template contains, else harmony for a harmony
    vocabulary (special_token_texts: the tokenizer's), else Hermes."""
    if name is not None:
        if name not in FORMATS:
            raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(sorted(FORMATS))}")
        return FORMATS[name]
    for candidate in FORMATS.values():
        if template_source and any(marker in template_source for marker in candidate.markers):
            return candidate
    if harmony.is_harmony_vocabulary(special_token_texts):
        return FORMATS["harmony"]
    return FORMATS[DEFAULT_FORMAT]
