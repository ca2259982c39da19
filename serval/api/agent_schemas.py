"""Request schemas of the agent APIs (pydantic, strict, unknown fields ignored), as openai.py's are for chat:
OpenAI's Responses (`POST /v1/responses`), Anthropic's Messages (`POST /v1/messages`, `/count_tokens`) and
OpenAI's embeddings (`POST /v1/embeddings`).

Owns the top-level fields' types and single-field ranges; item lists and content blocks stay `Any` here and are
checked item by item in responses_request.py and anthropic_request.py, so that an error names the item that
is wrong (`input[2].type`, `messages[0].content[1].source`). docs/api.md says what each field does.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from serval.api.openai import INT32_MAX, UINT64_MAX, PositiveInt32, Schema

MAX_METADATA_KEYS = 16  # both vendors' limit on metadata


class ResponsesRequest(Schema):
    model: str
    input: Any  # a string or a list of items: checked in responses_request.py
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name"}
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict[str, Any] | None = None  # {"effort": ..., "summary": ...}
    max_output_tokens: PositiveInt32 | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: Annotated[dict[str, str], Field(max_length=MAX_METADATA_KEYS)] | None = None
    user: str | None = None
    # Not OpenAI's: serval's extensions, as on chat requests (seeded sampling; reasoning tokens before the
    # end of thinking is forced).
    seed: Annotated[int, Field(ge=0, le=UINT64_MAX)] | None = None
    thinking_budget: Annotated[int, Field(ge=1)] | None = None
    # Accepted and refused by name when set (responses_request.py): what serval cannot provide.
    background: bool | None = None
    include: list[str] | None = None
    truncation: str | None = None
    conversation: Any = None
    prompt: Any = None


class MessagesRequest(Schema):
    model: str
    # Required by Anthropic; None here so that its absence gets Anthropic's own message (anthropic_request.py).
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    messages: list[Any]
    system: Any = None  # a string or a list of text blocks
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    thinking: dict[str, Any] | None = None  # {"type": "enabled", "budget_tokens": N} | {"type": "disabled"}
    metadata: dict[str, Any] | None = None  # {"user_id": ...}
    stream: bool | None = None
    service_tier: str | None = None


class CountTokensRequest(Schema):
    model: str
    messages: list[Any]
    system: Any = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class EmbeddingRequest(Schema):
    model: str | None = None
    input: Any  # a string, strings, token ids, or lists of token ids: checked in embeddings_routes.py
    encoding_format: str | None = None  # "float" (default) | "base64"
    dimensions: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    user: str | None = None
