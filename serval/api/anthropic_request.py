"""An Anthropic Messages request (`POST /v1/messages`, `/v1/messages/count_tokens`) translated into the chat
request the chat route serves.

Owns the translation and the per-block rules: `system` (a string or text blocks) as the first system message;
user content blocks (`text`, `image` from base64 or url sources, `tool_result`: each a tool message, before
the turn's own text), assistant blocks (`text`, `thinking` as the turn's reasoning, `tool_use` as its
tool_calls); tools with `input_schema`; tool_choice auto/any/tool/none (and disable_parallel_tool_use);
stop_sequences; temperature/top_p/top_k; thinking enabled (with its budget) or disabled (the default, as
Anthropic's models do not think unless asked); `cache_control` on text blocks as the chat route's explicit
cache. Every refusal is a 400 naming the block (`messages[0].content[1].source`); the route answers it in
Anthropic's error shape.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from serval.api.agent_schemas import CountTokensRequest, MessagesRequest
from serval.api.errors import APIError, from_validation, invalid, unsupported
from serval.api.openai import ChatCompletionRequest

IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})


def _text(block: dict[str, Any], where: str) -> dict[str, Any]:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}.text must be a string", f"{where}.text")
    part: dict[str, Any] = {"type": "text", "text": text}
    if block.get("cache_control") is not None:
        part["cache_control"] = {"type": (block["cache_control"] or {}).get("type")}
    return part


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in IMAGE_TYPES:
            raise invalid(
                f"{where}.source.media_type must be one of {sorted(IMAGE_TYPES)}", f"{where}.source"
            )
        if not isinstance(data, str) or not data:
            raise invalid(f"{where}.source.data must be base64 text", f"{where}.source.data")
        url = f"data:{media_type};base64,{data}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise invalid(
            f'{where}.source must be {{"type": "base64", ...}} or {{"type": "url", ...}}', f"{where}.source"
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where}.tool_use_id must be a non-empty string", f"{where}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise unsupported(
                    f"{where}.content[{j}]: tool results hold text blocks here", f"{where}.content[{j}]"
                )
        content = "\n".join(_text(part, f"{where}.content[{j}]")["text"] for j, part in enumerate(content))
    elif not isinstance(content, str):
        raise invalid(f"{where}.content must be a string or a list of text blocks", f"{where}.content")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where}.id must be a non-empty string", f"{where}.id")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.name must be a non-empty string", f"{where}.name")
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.input must be an object", f"{where}.input")
    function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": call_id, "type": "function", "function": function}


def _turn(message: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user turn's tool results come first, as tool messages."""
    if not isinstance(message, dict):
        raise invalid(f"{where} must be an object", where)
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise invalid(f'{where}.role must be "user" or "assistant"', f"{where}.role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list) or not content:
        raise invalid(
            f"{where}.content must be a string or a non-empty list of content blocks", f"{where}.content"
        )
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning = ""
    for j, block in enumerate(content):
        block_where = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        allowed = {"text", "image", "tool_result"} if role == "user" else {"text", "thinking", "redacted_thinking",
                                                                              "tool_use"}  # fmt: skip
        if kind not in allowed:
            shown_kind = repr(kind[:64]) if isinstance(kind, str) else "missing"
            raise invalid(
                f"{block_where}.type {shown_kind} is not a {role} content block", f"{block_where}.type"
            )
        if kind == "text":
            parts.append(_text(block, block_where))
        elif kind == "image":
            parts.append(_image(block, block_where))
        elif kind == "tool_result":
            tools.append(_tool_result(block, block_where))
        elif kind == "tool_use":
            calls.append(_tool_use(block, block_where))
        elif kind == "thinking":
            thinking = block.get("thinking")
            if not isinstance(thinking, str):
                raise invalid(f"{block_where}.thinking must be a string", f"{block_where}.thinking")
            reasoning += thinking  # NOTE: its signature is not checked: serval's own are not secrets
    turn: list[dict[str, Any]] = list(tools)
    if parts or calls or not tools:
        chat: dict[str, Any] = {"role": role, "content": parts or None}
        if calls:
            chat["tool_calls"] = calls
        if reasoning:
            chat["reasoning_content"] = reasoning
        turn.append(chat)
    return turn


def _system(value: Any) -> str | list[dict[str, Any]] | None:
    if value is None or isinstance(value, str):
        return value or None
    if not isinstance(value, list):
        raise invalid("system must be a string or a list of text blocks", "system")
    parts = []
    for j, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise invalid(f"system[{j}] must be a text block", f"system[{j}]")
        parts.append(_text(block, f"system[{j}]"))
    return parts or None


def _tools(value: list[Any] | None) -> list[dict[str, Any]] | None:
    tools = []
    for i, tool in enumerate(value or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(f"{where} must be an object", where)
        if tool.get("type") not in (None, "custom"):
            kind = tool["type"]
            shown_kind = repr(kind[:64]) if isinstance(kind, str) else "not a string"
            raise unsupported(
                f"{where}.type {shown_kind}: only custom (client) tools exist here", f"{where}.type"
            )
        if "input_schema" not in tool:
            raise APIError(
                400,
                f"{where}.input_schema: Field required",
                f"{where}.input_schema",
                "missing_required_parameter",
            )
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if "description" in tool:
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools or None


def _tool_choice(value: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(the chat tool_choice, parallel_tool_calls)."""
    if value is None:
        return None, None
    kind = value.get("type")
    parallel = False if value.get("disable_parallel_tool_use") is True else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": value.get("name")}}, parallel
    raise invalid('tool_choice.type must be "auto", "any", "tool" or "none"', "tool_choice.type")


def _thinking(value: dict[str, Any] | None, max_tokens: int | None) -> dict[str, Any]:
    kind = (value or {}).get("type", "disabled")
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind not in ("enabled", "adaptive"):
        raise invalid('thinking.type must be "enabled", "adaptive" or "disabled"', "thinking.type")
    budget = (value or {}).get("budget_tokens")
    if kind == "adaptive" and budget is None:
        return {"enable_thinking": True}
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise invalid("thinking.budget_tokens must be a positive integer", "thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise invalid("thinking.budget_tokens must be less than max_tokens", "thinking.budget_tokens")
    return {"enable_thinking": True, "thinking_budget": budget}


def chat_request(request: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that serves `request` (a count_tokens request: the same prompt, nothing generated)."""
    max_tokens = getattr(request, "max_tokens", None)
    if isinstance(request, MessagesRequest) and max_tokens is None:
        raise APIError(400, "max_tokens: Field required", "max_tokens", "missing_required_parameter")
    if not request.messages:
        raise invalid("messages: at least one message is required", "messages")
    messages = [
        chat for i, message in enumerate(request.messages) for chat in _turn(message, f"messages[{i}]")
    ]
    system = _system(request.system)
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    tool_choice, parallel = _tool_choice(request.tool_choice)
    fields: dict[str, Any] = {
        "model": request.model, "messages": messages, "max_tokens": max_tokens, "tools": _tools(request.tools),
        "tool_choice": tool_choice, "parallel_tool_calls": parallel, **_thinking(request.thinking, max_tokens),
    }  # fmt: skip
    if isinstance(request, MessagesRequest):
        user = (request.metadata or {}).get("user_id")
        fields.update(
            stream=request.stream, stop=request.stop_sequences, temperature=request.temperature,
            top_p=request.top_p, top_k=request.top_k, user=user if isinstance(user, str) else None,
        )  # fmt: skip
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        raise from_validation(list(e.errors())) from e
