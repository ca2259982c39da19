"""A Responses API request (`POST /v1/responses`) translated into the chat request the chat route serves.

Owns the translation and the per-item rules: `input` as a string or a list of items (`message` with
`input_text` / `output_text` / `input_image` parts, `function_call`, `function_call_output`, `reasoning`),
`instructions` as the first system message, Responses' flat function tools, `tool_choice`, `text.format`
(response_format), `reasoning.effort` and `max_output_tokens`. Consecutive assistant turns (a message, the
reasoning before it, its function calls) become one assistant message with `tool_calls`, as the chat
templates expect them. Every refusal is a 400 naming the item (`input[2].type`); refusals raised later by the
chat checks have their parameter renamed into this API's spelling (`renamed`).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from serval.api.agent_schemas import ResponsesRequest
from serval.api.errors import APIError, from_validation, invalid, unsupported
from serval.api.openai import ChatCompletionRequest

# Responses' spellings of the chat request's parameters, for errors the chat checks raise.
_PARAMS = (
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"^tool_choice\.function\.name"), "tool_choice.name"),
    (re.compile(r"^response_format\.json_schema\."), "text.format."),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^max_tokens"), "max_output_tokens"),
    (re.compile(r"^messages(\[\d+\])?"), "input"),
)
_REFUSED = ("background", "conversation", "prompt")  # features serval has no counterpart of


def renamed(error: APIError) -> APIError:
    """The chat check's error with its parameter in Responses' terms."""
    if error.param is None:
        return error
    for pattern, replacement in _PARAMS:
        param = pattern.sub(replacement, error.param)
        if param != error.param:
            message = error.message.replace(error.param, param)
            return APIError(error.status_code, message, param, error.code, error.headers)
    return error


def _text_of(value: Any, where: str, kinds: tuple[str, ...]) -> str:
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise invalid(f"{where} must be a part of type {' or '.join(map(repr, kinds))}", f"{where}.type")
    text = value.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}.text must be a string", f"{where}.text")
    return text


def _content(content: Any, where: str, role: str) -> str | list[dict[str, Any]]:
    """A message item's content as chat content: a string, or chat parts (text and image_url)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise invalid(f"{where} must be a string or a non-empty list of content parts", where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        part_where = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": _text_of(part, part_where, (kind,))})
        elif kind == "refusal" and role == "assistant":
            refusal = part.get("refusal")
            if not isinstance(refusal, str):
                raise invalid(f"{part_where}.refusal must be a string", f"{part_where}.refusal")
            parts.append({"type": "text", "text": refusal})
        elif kind == "input_image":
            url = part.get("image_url")
            if part.get("file_id") is not None:
                raise unsupported(
                    f"{part_where}.file_id: there is no Files API here; send image_url", part_where
                )
            if not isinstance(url, str) or not url:
                raise invalid(
                    f"{part_where}.image_url must be a URL or a data: URL", f"{part_where}.image_url"
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind in ("input_file", "input_audio"):
            raise unsupported(f"{part_where}.type {kind!r} is not supported here", f"{part_where}.type")
        else:
            raise invalid(
                f"{part_where} must be an object with a known content part type", f"{part_where}.type"
            )
    return parts


def _string_field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise invalid(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    return value


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and output:
        return "\n".join(
            _text_of(p, f"{where}[{j}]", ("input_text", "output_text")) for j, p in enumerate(output)
        )
    raise invalid(f"{where} must be a string or a list of input_text parts", where)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    texts = []
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise invalid(f"{where}.{key} must be a list", f"{where}.{key}")
        texts += [_text_of(p, f"{where}.{key}[{j}]", (kind,)) for j, p in enumerate(parts)]
        if texts:  # the full text when given, else the summary
            break
    return "\n".join(texts)


class _Turns:
    """Chat messages built item by item; assistant pieces in a row join one assistant message."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.pending_reasoning = ""

    def assistant(self) -> dict[str, Any]:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": None}
            self.messages.append(last)
        if self.pending_reasoning:
            last["reasoning_content"] = self.pending_reasoning
            self.pending_reasoning = ""
        return last

    def add(self, item: Any, where: str, roles: frozenset[str]) -> None:
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid(f"{where}.role must be user, assistant, system or developer", f"{where}.role")
            if role == "developer" and "developer" not in roles:
                role = "system"  # the template's name for the instructions it is given
            content = _content(item.get("content"), f"{where}.content", role)
            if role == "assistant":
                message = self.assistant()
                if message.get("tool_calls"):  # text after calls starts a turn of its own
                    message = {"role": "assistant", "content": None}
                    self.messages.append(message)
                message["content"] = (
                    content if message["content"] is None else _joined(message["content"], content)
                )
            else:
                self.messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call_id = _string_field(item, "call_id", where)
            name = _string_field(item, "name", where)
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise invalid(f"{where}.arguments must be a string of JSON", f"{where}.arguments")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            self.assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = _string_field(item, "call_id", where)
            output = _output_text(item.get("output"), f"{where}.output")
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            self.pending_reasoning += _reasoning_text(item, where)
        elif kind == "item_reference":
            raise unsupported(f"{where}: item references need stored items; send the item itself", where)
        elif isinstance(kind, str):
            raise invalid(f"{where}.type {kind[:64]!r} is not a known input item type", f"{where}.type")
        else:
            raise invalid(f"{where} must have a string type (or a role)", f"{where}.type")


def _joined(first: str | list, second: str | list) -> str | list:
    if isinstance(first, str) and isinstance(second, str):
        return first + second
    as_parts = [{"type": "text", "text": t} if isinstance(t, str) else t for t in (first, second)]
    return [p for part in as_parts for p in (part if isinstance(part, list) else [part])]


def input_messages(value: Any, roles: frozenset[str]) -> list[dict[str, Any]]:
    """`input` as chat messages (the wire shape of ChatMessage)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise invalid("input must be a string or a list of input items", "input")
    turns = _Turns()
    for i, item in enumerate(value):
        turns.add(item, f"input[{i}]", roles)
    return turns.messages


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise invalid(f"{where} must be an object", where)
    if tool.get("type") != "function":
        kind = tool.get("type")
        shown_kind = repr(kind[:64]) if isinstance(kind, str) else "missing"
        raise unsupported(f"{where}.type {shown_kind}: only function tools exist here", f"{where}.type")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _tool_choice(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        raise unsupported(
            f"tool_choice.type {value['type'][:64]!r} is not supported here", "tool_choice.type"
        )
    raise invalid(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name"}', "tool_choice"
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    spec = (text or {}).get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise invalid("text.format must be an object", "text.format")
    if spec.get("type") != "json_schema":
        return spec  # text, json_object, or a wrong type the chat check names
    schema = {key: spec[key] for key in ("name", "schema", "strict", "description") if key in spec}
    return {"type": "json_schema", "json_schema": schema}


def _template_fields(reasoning: dict[str, Any] | None) -> dict[str, Any]:
    effort = (reasoning or {}).get("effort")
    if effort is None:
        return {}
    if not isinstance(effort, str):
        raise invalid("reasoning.effort must be a string", "reasoning.effort")
    # "none": no thinking at all (Qwen3's switch); any other effort is the template's to read (gpt-oss's).
    return {"enable_thinking": False} if effort == "none" else {"reasoning_effort": effort}


def check_features(request: ResponsesRequest) -> None:
    for name in _REFUSED:
        if getattr(request, name):
            raise unsupported(f"{name}: not supported by this server", name)
    if request.truncation not in (None, "disabled"):
        raise unsupported('truncation: only "disabled" (a prompt too long is a 400)', "truncation")


def chat_request(
    request: ResponsesRequest, history: list[dict[str, Any]], roles: frozenset[str]
) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """(the chat request to serve, the conversation it holds without instructions: what a stored response
    keeps for previous_response_id). history: the previous response's conversation."""
    check_features(request)
    conversation = [*history, *input_messages(request.input, roles)]
    if not conversation:
        raise invalid("input must not be empty", "input")
    messages = list(conversation)
    if request.instructions:
        first = messages[0] if messages else None
        if first is not None and first["role"] == "system" and isinstance(first["content"], str):
            messages[0] = {**first, "content": f"{request.instructions}\n\n{first['content']}"}
        else:
            messages.insert(0, {"role": "system", "content": request.instructions})
    tools = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(request.tools or ())]
    fields: dict[str, Any] = {
        "model": request.model, "messages": messages, "stream": request.stream,
        "max_tokens": request.max_output_tokens, "temperature": request.temperature, "top_p": request.top_p,
        "tools": tools or None, "tool_choice": _tool_choice(request.tool_choice),
        "parallel_tool_calls": request.parallel_tool_calls, "response_format": _response_format(request.text),
        "user": request.user, "seed": request.seed,
        "thinking_budget": request.thinking_budget, **_template_fields(request.reasoning),
    }  # fmt: skip
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        raise renamed(from_validation(list(e.errors()))) from e
    return chat, conversation
