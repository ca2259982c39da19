"""A streamed chat completion read back through the openai client, as the API tests compare it."""

from __future__ import annotations


def stream_parts(
    client, model: str, messages: list[dict], **fields
) -> tuple[str, str, list[dict], str | None]:
    """(reasoning_content, content, tool calls as {id, name, arguments} by index, finish_reason) of a stream."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, **fields):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(
                piece.index, {"id": piece.id, "name": piece.function.name, "arguments": ""}
            )
            call["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish
