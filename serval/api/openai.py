"""Request schemas of the OpenAI-compatible API (pydantic, strict), with the spec's ranges and defaults.

Owns parsing a body into native types: types are strict (a string is not a number, 0 is not false), ranges are
checked here so the client learns which parameter was wrong, and unknown fields are ignored (clients send
fields of newer API versions). Turning a request into SamplingParams and template messages lives in
`api/requests.py`; what a field does here is written down in docs/api.md.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
MAX_STOP_CHARS = 32 * 1024
MAX_MESSAGES_CHARS = 4 * 1024 * 1024  # MindIE: the messages' text is at most 4 MB, whatever the body limit
MAX_CHOICES = 128
MAX_TOP_LOGPROBS = 20

PositiveInt32 = Annotated[int, Field(ge=1, le=INT32_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class Schema(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(Schema):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage on every chunk


class FunctionCall(Schema):
    name: str
    arguments: str


class ToolCall(Schema):
    id: str
    type: str = "function"
    function: FunctionCall
    index: int | None = None  # Alibaba's spelling carries the position; ignored


class ChatMessage(Schema):
    role: Annotated[str, Field(min_length=1)]
    # str, a list of content parts, or null (assistant with tool_calls); checked in chat_messages.py so the
    # error names the part that is wrong.
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    prefix: bool | None = None  # ModelArts: continue this final assistant message
    partial: bool | None = None  # Alibaba: the same


class SamplingFields(Schema):
    """Fields shared by chat and completions requests (MindIE's ranges, widened where a vendor allows more)."""

    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=0, le=UINT64_MAX)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    stop: Any = None  # str or list[str]: checked in requests.py
    stop_token_ids: list[Any] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    ignore_eos: bool | None = None
    max_tokens: PositiveInt32 | None = None
    # OpenAI's {"token id": bias in [-100, 100]}: keys and values checked in requests.py, so that the error
    # names the key; ids are checked against the served model's vocabulary there.
    logit_bias: dict[str, Any] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    early_stopping: Any = (
        None  # beam search: true, false or "never" (transformers'); checked in beam_rules.py
    )
    user: str | None = None
    # serval's: false opts this request out of the server's speculative decoding (--speculative-config).
    speculative_decoding: bool | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt32 | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None  # vLLM's; default true
    continue_final_message: bool | None = None  # vLLM's spelling of prefix/partial
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | an object: checked in requests.py
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # Alibaba's thinking controls: passed to the chat template (a model without a thinking mode ignores them).
    enable_thinking: bool | None = None
    thinking_budget: Annotated[int, Field(ge=1)] | None = None
    reasoning_effort: str | None = None
    preserve_thinking: bool | None = None
    # Features this deployment cannot provide; set to anything but "off" they are refused by name.
    enable_search: bool | None = None
    search_options: dict[str, Any] | None = None
    enable_code_interpreter: bool | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    vl_high_resolution_images: bool | None = None


class CompletionRequest(SamplingFields):
    # str, list[str], list[int] or list[list[int]]: checked in requests.py.
    prompt: Any
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = None
    suffix: str | None = None


class TokenizeRequest(Schema):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Schema):
    model: str | None = None
    tokens: list[int]
