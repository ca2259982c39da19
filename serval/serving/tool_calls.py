"""Tool calls: the registry of the tool-call text formats models are trained on (serving/tool_call_format.py
has what a format is).

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

from types import MappingProxyType

from serval.serving import harmony
from serval.serving.tool_call_families import FAMILY_FORMATS
from serval.serving.tool_call_format import Tool, ToolCallFormat, ToolChoice, ToolChoiceMode

__all__ = ["DEFAULT_FORMAT", "FORMATS", "Tool", "ToolCallFormat", "ToolChoice", "ToolChoiceMode",
           "format_for_template"]  # fmt: skip

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

# NOTE: the marker-token families come first: GLM-4.5's template also holds Hermes' <tool_call> and GLM-4's
# <|observation|>, and the first format whose markers the template holds is the one chosen.
FORMATS: MappingProxyType[str, ToolCallFormat] = MappingProxyType({
    **FAMILY_FORMATS,
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
        if template_source and candidate.is_named_by(template_source):
            return candidate
    if harmony.is_harmony_vocabulary(special_token_texts):
        return FORMATS["harmony"]
    return FORMATS[DEFAULT_FORMAT]
