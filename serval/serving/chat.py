"""Chat planning: a request's tools, tool_choice, response_format and thinking options -> the messages the
template sees and the OutputPlan (grammar, parsers, thinking budget) its answer follows.

Owns three decisions. How tools reach the model: through the chat template's `tools` variable when the
template uses it, otherwise a system prompt in the model's tool-call format (documented in docs/tools.md),
with earlier calls and tool results written into the history the same way. Which grammar the answer
follows: tool calls (required, named, or triggered by the format's opening tag under `auto`), a JSON schema,
or both, behind an optional `<think>` block when the template is a thinking one. And how reasoning is read:
where it starts, and the tokens forced when a thinking budget runs out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from serval.serving import harmony
from serval.serving.client_text import CacheSpan
from serval.serving.media.parts import MediaPart
from serval.serving.reasoning import THINK_END, THINK_START
from serval.serving.structured import MAX_WHITESPACE
from serval.serving.tool_calls import Tool, ToolCallFormat, ToolChoice

# Whitespace allowed between the end of the reasoning and the answer's grammar (bounded: a grammar must not
# let a model idle in whitespace forever).
_GAP = {"type": "regex", "pattern": "[ \\n]{0,4}"}
TOOL_RESPONSE = "<tool_response>\n{content}\n</tool_response>"


@dataclass(frozen=True)
class ResponseFormat:
    type: Literal["text", "json_object", "json_schema"] = "text"
    schema: dict[str, Any] | bool | None = None  # json_schema only
    strict: bool = False


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's prompt side, validated by the API layer: what the chat template renders."""

    messages: list[dict[str, Any]]  # {"role", "content": str, ...}, in the template's terms
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not answered
    template_kwargs: dict[str, Any] | None = None
    cache_spans: tuple[CacheSpan, ...] = ()  # cache_control stretches of message text (explicit caching)
    # The media parts, in order; each sits in its message's text where its content list puts it
    # (serval_media_offsets).
    media: tuple[MediaPart, ...] = ()


@dataclass(frozen=True)
class ChatOptions:
    """The output-shaping parts of a chat request, validated by the API layer."""

    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel_tool_calls: bool = True
    response_format: ResponseFormat = field(default_factory=ResponseFormat)
    thinking_budget: int | None = None
    preserve_thinking: bool = False

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice.mode != "none"


def template_uses_tools(template_source: str | None) -> bool:
    return bool(template_source) and "tools" in template_source


def prepare_messages(
    messages: list[dict[str, Any]],
    options: ChatOptions,
    tool_format: ToolCallFormat,
    template_source: str | None,
    cache_spans: tuple[CacheSpan, ...] = (),
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, tuple[CacheSpan, ...]]:
    """(messages for the template, the `tools` variable, the cache spans moved with their text). Without
    template support for tools, the tools go into a system prompt and past calls and results into plain text
    the model can read."""
    # Each rewrite only puts text before a message's own (or after it): a span moves by that many characters.
    shifts = [0] * len(messages)
    # NOTE: harmony templates decide themselves which earlier analysis to show (gpt-oss's: a tool-call turn's).
    if options.preserve_thinking and not tool_format.is_harmony:
        rewritten = [_with_reasoning(m) for m in messages]
        shifts = [s + len(new.get("content") or "") - len(old.get("content") or "")
                  for s, old, new in zip(shifts, messages, rewritten)]  # fmt: skip
        messages = rewritten
    if tool_format.is_harmony:
        messages = [_with_thinking(m) for m in messages]
    if template_uses_tools(template_source):
        tools = [t.as_openai() for t in options.tools] if options.uses_tools else None
        return messages, tools, _moved(cache_spans, shifts, 0)
    result = []
    for i, message in enumerate(messages):
        plain, num_before = _plain_history(message, tool_format)
        shifts[i] += num_before
        result.append(plain)
    first = 0
    if options.uses_tools:
        prompt = tool_format.system_prompt(list(options.tools))
        if result and result[0]["role"] == "system":
            result[0] = {**result[0], "content": f"{result[0]['content']}\n\n{prompt}"}
        else:
            result.insert(0, {"role": "system", "content": prompt})
            first = 1
    return result, None, _moved(cache_spans, shifts, first)


def _moved(spans: tuple[CacheSpan, ...], shifts: list[int], first: int) -> tuple[CacheSpan, ...]:
    return tuple(span.shifted(span.message_index + first, shifts[span.message_index]) for span in spans)


def _with_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    # preserve_thinking: earlier reasoning stays in the prompt, written back where the model wrote it.
    reasoning = message.get("reasoning_content")
    if message.get("role") != "assistant" or not reasoning:
        return message
    rest = {k: v for k, v in message.items() if k != "reasoning_content"}
    return {**rest, "content": f"{THINK_START}\n{reasoning}\n{THINK_END}\n\n{message.get('content') or ''}"}


def _with_thinking(message: dict[str, Any]) -> dict[str, Any]:
    # Harmony templates (gpt-oss's) read an assistant turn's analysis from `thinking`; the API says
    # `reasoning_content`. NOTE: gpt-oss's template refuses a tool-call turn with both content and thinking,
    # so such a turn keeps its content only.
    reasoning = message.get("reasoning_content")
    if message.get("role") != "assistant" or not reasoning or "thinking" in message:
        return message
    if message.get("tool_calls") and message.get("content"):
        return message
    return {**message, "thinking": reasoning}


def _plain_history(message: dict[str, Any], tool_format: ToolCallFormat) -> tuple[dict[str, Any], int]:
    """The message in plain text, and how many characters now come before its own text."""
    if message.get("role") == "tool":
        before = TOOL_RESPONSE.index("{content}")
        return {
            "role": "user",
            "content": TOOL_RESPONSE.replace("{content}", message.get("content") or ""),
        }, before
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message, 0
    written = []
    for call in calls:
        function = call["function"]
        arguments = function["arguments"]
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        written.append((function["name"], arguments))
    if tool_format.section_begin:  # one section holds every call
        texts = [message.get("content") or "", tool_format.history_text(written)]
    else:
        texts = [message.get("content") or ""] + [tool_format.history_text([call]) for call in written]
    content = tool_format.separator.join(t for t in texts if t)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}, 0


def strict_schema(schema: Any) -> Any:
    """OpenAI's strict mode: objects admit only their listed properties unless they say otherwise."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: strict_schema(value) if key != "properties" and key != "required" else value
              for key, value in schema.items()}  # fmt: skip
    if isinstance(schema.get("properties"), dict):
        result["properties"] = {name: strict_schema(s) for name, s in schema["properties"].items()}
        result.setdefault("additionalProperties", False)
    return result


def grammar_spec(
    options: ChatOptions, tool_format: ToolCallFormat, reasoning: Literal["none", "open", "optional"]
) -> dict[str, Any] | None:
    """The grammar the answer must follow (GrammarCompiler's spec), or None for free text.

    reasoning: "open" when the prompt ended inside <think> (the answer's grammar starts after </think>),
    "optional" when the model may open a <think> block first, "none" otherwise. A harmony format has its own
    (serving/harmony.py: the analysis message is its reasoning)."""
    answer = None
    response_format = options.response_format
    schema = None
    if response_format.type != "text":
        schema = response_format.schema if response_format.type == "json_schema" else {"type": "object"}
        if response_format.strict:
            schema = strict_schema(schema)
    if tool_format.is_harmony:
        tools = _enforced_tools(options) if options.uses_tools else []
        main = harmony.grammar_format(tools, options.tool_choice, schema)
        return None if main is None else {"type": "structural_tag", "format": main}
    if schema is not None:
        if not options.uses_tools and reasoning == "none":
            return {"type": "json_schema", "schema": schema, "strict": response_format.strict}
        answer = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}
    main = answer
    if options.uses_tools:
        tools = _enforced_tools(options)
        calls = tool_format.structural_tag(tools, options.tool_choice, options.parallel_tool_calls)
        if answer is not None and options.tool_choice.mode == "auto":
            forced = tool_format.structural_tag(tools, ToolChoice("required"), options.parallel_tool_calls)
            main = {"type": "or", "elements": [forced, answer]}
        else:
            main = calls
    if main is None:
        return None
    if reasoning == "open":
        think = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": THINK_END}
        main = {"type": "sequence", "elements": [think, _GAP, main]}
    elif reasoning == "optional":
        think = {"type": "tag", "begin": THINK_START, "content": {"type": "any_text"}, "end": THINK_END}
        main = {"type": "sequence", "elements": [{"type": "optional", "content": think}, _GAP, main]}
    return {"type": "structural_tag", "format": main}


def _enforced_tools(options: ChatOptions) -> list[Tool]:
    """The offered tools with the schemas the grammar enforces (strict ones closed)."""
    return [Tool(t.name, strict_schema(t.parameters) if t.strict else t.parameters) for t in options.tools]
