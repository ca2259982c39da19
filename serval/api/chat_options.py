"""Tools, tool_choice and response_format of a chat request, parsed into serving's ChatOptions.

Schemas are checked for what the grammar engine can enforce; a named tool_choice must name an offered tool.
Every refusal is an APIError naming the parameter.
"""

from __future__ import annotations

import re
from typing import Any

from serval.api.errors import APIError, invalid, shown, unsupported
from serval.api.openai import ChatCompletionRequest
from serval.serving.chat import ChatOptions, ResponseFormat
from serval.serving.errors import InvalidRequestError
from serval.serving.structured import check_schema
from serval.serving.tool_calls import Tool, ToolChoice

TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # OpenAI's rule, plus '.' and ':' (namespaced tools)
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def chat_options(request: ChatCompletionRequest) -> ChatOptions:
    tools = _tools(request.tools)
    return ChatOptions(
        tools=tools,
        tool_choice=_tool_choice(request.tool_choice, tools),
        parallel_tool_calls=request.parallel_tool_calls is not False,
        response_format=_response_format(request.response_format),
        thinking_budget=request.thinking_budget,
        preserve_thinking=bool(request.preserve_thinking),
    )


def _checked_schema(schema: Any, param: str) -> Any:
    try:
        check_schema(schema, param)
    except InvalidRequestError as e:
        raise invalid(str(e), param) from e
    return schema


def _tools(value: list[dict[str, Any]] | None) -> tuple[Tool, ...]:
    tools: list[Tool] = []
    for i, tool in enumerate(value or ()):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise unsupported(
                f"{where}.type {tool.get('type')!r}: only function tools exist here", f"{where}.type"
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{where}.function must be an object", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise invalid(
                f"{where}.function.name must be 1 to 64 letters, digits, '_', '-', '.' or ':'",
                f"{where}.function.name",
            )
        if any(t.name == name for t in tools):
            raise invalid(f"{where}.function.name {name!r} is offered twice", f"{where}.function.name")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid(f"{where}.function.description must be a string", f"{where}.function.description")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid(f"{where}.function.strict must be a boolean", f"{where}.function.strict")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        elif not isinstance(parameters, dict):
            raise invalid(
                f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters"
            )
        _checked_schema(parameters, f"{where}.function.parameters")
        tools.append(Tool(name, parameters, description, bool(strict)))
    return tuple(tools)


def _tool_choice(value: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise invalid('tool_choice must be "none", "auto", "required" or a function', "tool_choice")
        if value == "required" and not tools:
            raise invalid('tool_choice "required" needs tools', "tool_choice")
        return ToolChoice("none") if value == "auto" and not tools else ToolChoice(value)
    if not isinstance(value, dict):
        raise invalid("tool_choice must be a string or an object", "tool_choice")
    function = value.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if value.get("type") != "function" or not isinstance(name, str):
        raise invalid(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}',
            "tool_choice.function.name",
        )
    if not any(t.name == name for t in tools):
        raise invalid(
            f"tool_choice names {shown(name)}, which is not among the tools", "tool_choice.function.name"
        )
    return ToolChoice("function", name)


def _response_format(value: dict[str, Any] | None) -> ResponseFormat:
    if value is None:
        return ResponseFormat()
    kind = value.get("type", "text")
    if kind in ("text", "json_object"):
        return ResponseFormat(kind)
    if kind != "json_schema":
        raise invalid(
            'response_format.type must be "text", "json_object" or "json_schema"', "response_format.type"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("response_format.json_schema must be an object", "response_format.json_schema")
    schema = spec.get("schema")
    param = "response_format.json_schema.schema"
    if schema is None:
        raise APIError(400, f"{param} is required", param, "missing_required_parameter")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(
            "response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict"
        )
    return ResponseFormat("json_schema", _checked_schema(schema, param), bool(strict))
