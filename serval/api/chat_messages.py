"""From the API's chat messages to what the chat template sees: template messages, and cache_control spans.

Owns the per-message rules of the spec: roles the served template accepts, content required or allowed to
be empty, tool_call_id on tool messages, tool_calls only on assistant ones with JSON-object arguments of a
sane depth, only the final (assistant) message continued as a prefix, MindIE's cap on the characters of
all messages; and where each message's media parts sit in its text (the parts themselves are parsed by
media_parts.py). Every refusal is a 400 naming the message's field.
"""

from __future__ import annotations

import json
from typing import Any

from serval.api.errors import invalid
from serval.api.media_parts import is_media_part
from serval.api.openai import MAX_MESSAGES_CHARS, ChatMessage
from serval.serving.client_text import MEDIA_OFFSETS_KEY, CacheSpan
from serval.serving.template_roles import STANDARD_ROLES

# Tool-call arguments (a JSON string) may nest this deep: far beyond any real call, far below the recursion
# limit that rendering them (tojson) runs into.
MAX_ARGUMENTS_DEPTH = 128


def _content_text(message: ChatMessage, where: str) -> tuple[str | None, tuple[int, ...]]:
    """The message's text, and where each of its media parts sits in it (characters from its start; the
    parts themselves are parsed by api/media_parts.py)."""
    content = message.content
    if content is None or isinstance(content, str):
        return content, ()
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content parts", f"{where}.content")
    if not content:
        raise invalid(f"{where}.content must not be an empty list", f"{where}.content")
    text = ""
    media_offsets: list[int] = []
    follows_text = False
    for j, part in enumerate(content):
        part_where = f"{where}.content[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(f"{part_where} must be an object with a string type", part_where)
        if is_media_part(part):
            media_offsets.append(len(text))
            follows_text = False
            continue
        if part["type"] != "text":
            raise invalid(
                f"{part_where}.type {part['type']!r} is not a known content part type", f"{part_where}.type"
            )
        part_text = part.get("text")
        if not isinstance(part_text, str) or not part_text:
            raise invalid(f"{part_where}.text must be a non-empty string", f"{part_where}.text")
        # NOTE: adjacent text parts join with a newline, vLLM's rendering of list content for string-only
        # templates; a media part sits between the texts around it with nothing added, as Qwen's templates
        # write a list's items one after another.
        text += ("\n" if follows_text else "") + part_text
        follows_text = True
    return text, tuple(media_offsets)


def cache_spans(messages: list[ChatMessage]) -> tuple[CacheSpan, ...]:
    """The stretches of message text (in the template text _content_text makes) marked cache_control.

    Model Studio's explicit cache: `cache_control: {"type": "ephemeral"}` on a content part caches the
    prompt up to and including that part (earlier marks are prefixes of the last one).
    """
    spans = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        end = 0
        follows_text = False
        for j, part in enumerate(message.content):
            if not isinstance(part, dict):
                continue  # _content_text names it
            # The text _content_text makes: adjacent text parts joined with a newline, a media part an empty
            # span where it sits.
            start = span_end = end
            follows_text = follows_text and part.get("type") == "text"
            if part.get("type") == "text":
                start = end + (1 if follows_text else 0)
                end = span_end = start + len(part.get("text") or "")
                follows_text = True
            if "cache_control" not in part:
                continue
            control = part["cache_control"]
            param = f"messages[{i}].content[{j}].cache_control"
            if not isinstance(control, dict) or control.get("type") != "ephemeral":
                raise invalid(f'{param} must be {{"type": "ephemeral"}}', param)
            spans.append(CacheSpan(i, start, span_end, control["type"]))
    return tuple(spans)


def _arguments_problem(value: Any) -> str | None:
    """What makes parsed tool-call arguments unrenderable, or None. Python's json.loads, unlike the body's
    parser, admits any depth up to the recursion limit and lone surrogates (which no tokenizer can encode)."""
    pending = [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, str) and not item.isascii():
            try:
                item.encode()
            except UnicodeEncodeError:
                return "holds a lone surrogate"
        elif isinstance(item, (list, dict)):
            if level > MAX_ARGUMENTS_DEPTH:
                return f"nests lists and objects deeper than {MAX_ARGUMENTS_DEPTH} levels"
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            pending.extend((child, level + 1) for child in children)
    return None


def _tool_call_dict(call: Any, where: str) -> dict[str, Any]:
    # Templates (Qwen2.5, Llama 3.1, ...) expect the arguments as an object; a non-JSON string stays a string.
    # What would fail later (a RecursionError here or in the template's tojson, a surrogate in the tokenizer)
    # and be a 500 is refused by name.
    param = f"{where}.function.arguments"
    try:
        arguments: Any = json.loads(call.function.arguments)
    except RecursionError:
        raise invalid(
            f"{param} nests lists and objects deeper than {MAX_ARGUMENTS_DEPTH} levels", param
        ) from None
    except ValueError:
        arguments = call.function.arguments
    problem = _arguments_problem(arguments)
    if problem is not None:
        raise invalid(f"{param} {problem}", param)
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": call.type, "function": function}


def template_messages(
    messages: list[ChatMessage],
    continue_final_message: bool | None = None,
    roles: frozenset[str] = STANDARD_ROLES,
) -> tuple[list[dict[str, Any]], bool]:
    """The messages as the chat template sees them, and whether the final one is to be continued.
    roles: the roles the served template accepts (serving/template_roles.py); any other is a 400."""
    if not messages:
        raise invalid("messages must not be empty", "messages")
    num_chars = 0
    result = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.role not in roles:
            raise invalid(
                f"{where}.role {message.role[:64]!r} is not a role this model accepts "
                f"(one of {', '.join(sorted(roles))})",
                f"{where}.role",
            )
        text, media_offsets = _content_text(message, where)
        num_chars += len(text or "")
        if num_chars > MAX_MESSAGES_CHARS:
            raise invalid(
                f"messages hold more than {MAX_MESSAGES_CHARS} characters of content (MindIE: at most 4 MB)",
                "messages",
            )
        has_tool_calls = bool(message.tool_calls)
        if message.role == "assistant" and has_tool_calls:
            text = text or ""
        elif text is None:
            raise invalid(f"{where}.content is required for role {message.role!r}", f"{where}.content")
        elif not text and not media_offsets:
            raise invalid(f"{where}.content must not be empty", f"{where}.content")
        if message.role == "tool" and not message.tool_call_id:
            raise invalid(f"{where}.tool_call_id is required on a tool message", f"{where}.tool_call_id")
        if has_tool_calls and message.role != "assistant":
            raise invalid(f"{where}.tool_calls is only allowed on assistant messages", f"{where}.tool_calls")
        item: dict[str, Any] = {"role": message.role, "content": text}
        if media_offsets:
            item[MEDIA_OFFSETS_KEY] = media_offsets  # the template's ClientTexts places them in the text
        for key in ("name", "tool_call_id", "reasoning_content"):
            value = getattr(message, key)
            if value is not None:
                item[key] = value
        if has_tool_calls:
            calls = message.tool_calls or ()
            item["tool_calls"] = [
                _tool_call_dict(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)
            ]
        result.append(item)
    last = messages[-1]
    wants_continue = bool(continue_final_message or last.prefix or last.partial)
    for i, message in enumerate(messages[:-1]):
        if message.prefix or message.partial:
            raise invalid("only the final message can be a prefix to continue", f"messages[{i}].prefix")
    if wants_continue and last.role != "assistant":
        raise invalid("only an assistant message can be continued (prefix/partial)", "messages")
    return result, wants_continue
