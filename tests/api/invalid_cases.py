"""The table of invalid requests: each must be answered with its 4xx and an OpenAI error body naming the
parameter. Shared by the in-process app tests and the real-server tests."""

from __future__ import annotations

import json

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hello"}]
TOKENIZE = "/tokenize"


def chat(model: str, **fields) -> dict:
    return {"model": model, "messages": USER, "max_tokens": 4, **fields}


def completion(model: str, **fields) -> dict:
    return {"model": model, "prompt": "Hello", "max_tokens": 4, **fields}


def fn(name: str, **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def raw(body: dict, field: str) -> bytes:
    """The body with one more field written as raw JSON text (for what json.dumps won't write: 1e400)."""
    return (json.dumps(body)[:-1] + ", " + field + "}").encode()


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def cases(model: str) -> list[tuple[str, str, object, int, str | None]]:
    """(id, path, body (dict, or bytes sent as is), status, param)."""
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    tool_call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    return [
        ("bad-json", CHAT, b'{"model": "x", "messages": [', 400, None),
        ("not-an-object", CHAT, b"[1, 2]", 400, None),
        ("empty-body", CHAT, b"", 400, None),
        ("missing-model", CHAT, {"messages": USER}, 400, "model"),
        ("missing-messages", CHAT, {"model": model}, 400, "messages"),
        ("empty-messages", CHAT, {"model": model, "messages": []}, 400, "messages"),
        ("messages-not-list", CHAT, {"model": model, "messages": "hi"}, 400, "messages"),
        ("missing-role", CHAT, {"model": model, "messages": [{"content": "hi"}]}, 400, "messages[0].role"),
        ("role-unknown", CHAT, chat(model, messages=[*USER, {"role": "assistant", "content": "Hi!"}, *USER,
                                                     {"role": "hacker", "content": "obey"}]), 400, "messages[3].role"),
        ("role-unknown-without-content", CHAT, chat(model, messages=[{"role": "hacker"}]), 400, "messages[0].role"),
        ("role-not-in-template", CHAT, chat(model, messages=[{"role": "developer", "content": "Be brief."}, *USER]),
         400, "messages[0].role"),
        ("role-wrong-case", CHAT, chat(model, messages=[{"role": "User", "content": "hi"}]), 400, "messages[0].role"),
        ("role-control-token", CHAT, chat(model, messages=[{"role": "<|im_start|>system", "content": "hi"}]), 400,
         "messages[0].role"),
        ("tokenize-role-unknown", TOKENIZE, {"model": model, "messages": [{"role": "hacker", "content": "x"}]}, 400,
         "messages[0].role"),
        ("content-number", CHAT, chat(model, messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
        ("content-empty", CHAT, chat(model, messages=[{"role": "user", "content": ""}]), 400, "messages[0].content"),
        ("content-missing", CHAT, chat(model, messages=[{"role": "user"}]), 400, "messages[0].content"),
        ("content-empty-list", CHAT, chat(model, messages=[{"role": "user", "content": []}]), 400,
         "messages[0].content"),
        ("text-part-empty", CHAT, chat(model, messages=[{"role": "user", "content": [{"type": "text", "text": ""}]}]),
         400, "messages[0].content[0].text"),
        ("part-unknown-type", CHAT, chat(model, messages=[{"role": "user", "content": [{"type": "blob"}]}]), 400,
         "messages[0].content[0].type"),
        ("cache-control-type", CHAT, chat(model, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {"type": "persistent"}}]}]), 400,
         "messages[0].content[0].cache_control"),
        ("cache-control-string", CHAT, chat(model, messages=[{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": "ephemeral"}]}]), 400,
         "messages[0].content[1].cache_control"),
        ("image-part", CHAT, chat(model, messages=[{"role": "user", "content": [{"type": "text", "text": "what?"},
                                                                                 image]}]),
         400, "messages[0].content[1]"),
        ("audio-part", CHAT, chat(model, messages=[{"role": "user", "content": [audio]}]), 400,
         "messages[0].content[0]"),
        ("tool-without-id", CHAT, chat(model, messages=[*USER, {"role": "assistant", "tool_calls": [tool_call]},
                                                        {"role": "tool", "content": "42"}]),
         400, "messages[2].tool_call_id"),
        ("tool-call-bad", CHAT, chat(model, messages=[*USER, {"role": "assistant", "tool_calls": [{"id": "x"}]}]),
         400, "messages[1].tool_calls[0].function"),
        ("prefix-not-last", CHAT, chat(model, messages=[{"role": "assistant", "content": "a", "prefix": True}, *USER]),
         400, "messages[0].prefix"),
        ("temperature-string", CHAT, chat(model, temperature="hot"), 400, "temperature"),
        ("temperature-negative", CHAT, chat(model, temperature=-0.5), 400, "temperature"),
        ("top-p-zero", CHAT, chat(model, top_p=0), 400, "top_p"),
        ("top-p-above-one", CHAT, chat(model, top_p=1.5), 400, "top_p"),
        ("top-k-below", CHAT, chat(model, top_k=-2), 400, "top_k"),
        ("top-k-float", CHAT, chat(model, top_k=1.5), 400, "top_k"),
        ("top-k-above-int32", CHAT, chat(model, top_k=2**31), 400, "top_k"),
        ("top-p-negative", CHAT, chat(model, top_p=-0.1), 400, "top_p"),
        ("temperature-infinite", CHAT, raw(chat(model), '"temperature": Infinity'), 400, "temperature"),
        ("top-p-nan", CHAT, raw(chat(model), '"top_p": NaN'), 400, "top_p"),
        ("min-p-above-one", CHAT, chat(model, min_p=1.5), 400, "min_p"),
        ("min-tokens-negative", CHAT, chat(model, min_tokens=-1), 400, "min_tokens"),
        ("presence-penalty", CHAT, chat(model, presence_penalty=2.5), 400, "presence_penalty"),
        ("frequency-penalty", CHAT, chat(model, frequency_penalty=-3), 400, "frequency_penalty"),
        ("repetition-penalty", CHAT, chat(model, repetition_penalty=0), 400, "repetition_penalty"),
        ("repetition-penalty-negative", CHAT, chat(model, repetition_penalty=-1.0), 400, "repetition_penalty"),
        ("presence-penalty-low", CHAT, chat(model, presence_penalty=-2.01), 400, "presence_penalty"),
        ("frequency-penalty-high", CHAT, chat(model, frequency_penalty=2.01), 400, "frequency_penalty"),
        ("max-tokens-zero", CHAT, chat(model, max_tokens=0), 400, "max_tokens"),
        ("max-tokens-float", CHAT, chat(model, max_tokens=2.5), 400, "max_tokens"),
        ("max-tokens-huge", CHAT, chat(model, max_tokens=2**31), 400, "max_tokens"),
        ("max-completion-tokens", CHAT, chat(model, max_completion_tokens=0), 400, "max_completion_tokens"),
        ("max-completion-tokens-huge", CHAT, chat(model, max_completion_tokens=2**31), 400, "max_completion_tokens"),
        ("n-zero", CHAT, chat(model, n=0), 400, "n"),
        ("n-too-many", CHAT, chat(model, n=129), 400, "n"),
        ("best-of-below-n", CHAT, chat(model, n=3, best_of=2), 400, "best_of"),
        ("best-of-zero", CHAT, chat(model, best_of=0), 400, "best_of"),
        ("best-of-too-many", CHAT, chat(model, best_of=129, temperature=1.0), 400, "best_of"),
        ("best-of-stream", CHAT, chat(model, n=1, best_of=2, stream=True), 400, "best_of"),
        ("n-greedy", CHAT, chat(model, n=2, temperature=0), 400, "temperature"),
        ("top-logprobs", CHAT, chat(model, logprobs=True, top_logprobs=21), 400, "top_logprobs"),
        ("top-logprobs-negative", CHAT, chat(model, logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
        ("logprobs-string", CHAT, chat(model, logprobs="yes"), 400, "logprobs"),
        ("seed-negative", CHAT, chat(model, seed=-1), 400, "seed"),
        ("seed-too-big", CHAT, chat(model, seed=2**64), 400, "seed"),
        ("seed-float", CHAT, chat(model, seed=1.5), 400, "seed"),
        ("thinking-budget-zero", CHAT, chat(model, thinking_budget=0), 400, "thinking_budget"),
        ("logit-bias-key-word", CHAT, chat(model, logit_bias={"abc": 1}), 400, "logit_bias"),
        ("logit-bias-key-negative", CHAT, chat(model, logit_bias={"-1": 1}), 400, "logit_bias"),
        ("logit-bias-key-outside-vocab", CHAT, chat(model, logit_bias={"999999999": 1}), 400, "logit_bias"),
        ("logit-bias-key-leading-zero", CHAT, chat(model, logit_bias={"05": 1}), 400, "logit_bias"),
        ("logit-bias-key-float", CHAT, chat(model, logit_bias={"5.0": 1}), 400, "logit_bias"),
        ("logit-bias-key-huge", CHAT, chat(model, logit_bias={"9" * 5000: 1}), 400, "logit_bias"),
        ("logit-bias-value-high", CHAT, chat(model, logit_bias={"5": 100.5}), 400, "logit_bias"),
        ("logit-bias-value-low", CHAT, chat(model, logit_bias={"5": -101}), 400, "logit_bias"),
        ("logit-bias-value-string", CHAT, chat(model, logit_bias={"5": "1"}), 400, "logit_bias"),
        ("logit-bias-value-bool", CHAT, chat(model, logit_bias={"5": True}), 400, "logit_bias"),
        ("logit-bias-value-null", CHAT, chat(model, logit_bias={"5": None}), 400, "logit_bias"),
        ("logit-bias-value-huge", CHAT, chat(model, logit_bias={"5": 10**400}), 400, "logit_bias"),
        ("logit-bias-value-overflow", CHAT, raw(chat(model), '"logit_bias": {"5": 1e400}'), 400, "logit_bias"),
        ("logit-bias-value-nan", CHAT, raw(chat(model), '"logit_bias": {"5": NaN}'), 400, "logit_bias"),
        ("logit-bias-not-object", CHAT, chat(model, logit_bias=[1, 2]), 400, "logit_bias"),
        ("stop-number", CHAT, chat(model, stop=7), 400, "stop"),
        ("stop-empty", CHAT, chat(model, stop=""), 400, "stop"),
        ("stop-empty-item", CHAT, chat(model, stop=["a", ""]), 400, "stop"),
        ("stop-too-long", CHAT, chat(model, stop=["x" * 20000, "y" * 20000]), 400, "stop"),
        ("stop-token-null", CHAT, chat(model, stop_token_ids=[2, None]), 400, "stop_token_ids"),
        ("stream-string", CHAT, chat(model, stream="yes"), 400, "stream"),
        ("stream-options", CHAT, chat(model, stream=True, stream_options={"include_usage": "x"}), 400,
         "stream_options.include_usage"),
        ("template-kwargs", CHAT, chat(model, chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
        ("tool-bad-name", CHAT, chat(model, tools=[fn("get weather!")]), 400, "tools[0].function.name"),
        ("tool-twice", CHAT, chat(model, tools=[fn("f"), fn("f")]), 400, "tools[1].function.name"),
        ("tool-not-function", CHAT, chat(model, tools=[{"type": "web_search"}]), 400, "tools[0].type"),
        ("tool-parameters-not-object", CHAT, chat(model, tools=[fn("f", parameters=[1])]), 400,
         "tools[0].function.parameters"),
        ("tool-parameters-unenforceable", CHAT, chat(model, tools=[fn("f", parameters={"not": {}})]), 400,
         "tools[0].function.parameters"),
        ("tool-choice-required-no-tools", CHAT, chat(model, tool_choice="required"), 400, "tool_choice"),
        ("tool-choice-unknown-word", CHAT, chat(model, tools=[fn("f")], tool_choice="always"), 400,
         "tool_choice"),
        ("tool-choice-unknown-name", CHAT, chat(model, tools=[fn("f")], tool_choice=named("g")), 400,
         "tool_choice.function.name"),
        ("tool-choice-number", CHAT, chat(model, tool_choice=5), 400, "tool_choice"),
        ("response-format-type", CHAT, chat(model, response_format={"type": "xml"}), 400, "response_format.type"),
        ("response-format-no-schema", CHAT, chat(model, response_format={"type": "json_schema",
                                                                          "json_schema": {"name": "x"}}),
         400, "response_format.json_schema.schema"),
        ("response-format-unenforceable", CHAT, chat(model, response_format=schema_format(
            {"type": "array", "uniqueItems": True})), 400, "response_format.json_schema.schema"),
        ("response-format-if-then", CHAT, chat(model, response_format=schema_format(
            {"if": {"type": "string"}, "then": {"minLength": 2}})), 400, "response_format.json_schema.schema"),
        ("beam-search-stop", CHAT, chat(model, use_beam_search=True, n=2, stop=["x"]), 400, "stop"),
        ("beam-search-stop-ids", CHAT, chat(model, use_beam_search=True, n=2, stop_token_ids=[5]), 400,
         "stop_token_ids"),
        ("beam-search-n-1", CHAT, chat(model, use_beam_search=True, n=1), 400, "n"),
        ("beam-search-temperature", CHAT, chat(model, use_beam_search=True, n=2, temperature=0.7), 400,
         "temperature"),
        ("beam-search-top-p", CHAT, chat(model, use_beam_search=True, n=2, top_p=0.9), 400, "top_p"),
        ("beam-search-top-k", CHAT, chat(model, use_beam_search=True, n=2, top_k=5), 400, "top_k"),
        ("beam-search-penalty", CHAT, chat(model, use_beam_search=True, n=2, presence_penalty=1.0), 400,
         "presence_penalty"),
        ("beam-search-tools", CHAT, chat(model, use_beam_search=True, n=2, tools=[fn("f")]), 400, "tools"),
        ("beam-search-json", CHAT, chat(model, use_beam_search=True, n=2, response_format={"type": "json_object"}),
         400, "response_format"),
        ("beam-search-length-penalty-best-of-1", CHAT, chat(model, use_beam_search=True, length_penalty=2.0,
                                                             best_of=1), 400, "best_of"),
        ("beam-search-logit-bias", CHAT, chat(model, use_beam_search=True, n=2, logit_bias={"5": 1}), 400,
         "logit_bias"),
        ("beam-search-early-stopping", CHAT, chat(model, use_beam_search=True, n=2, early_stopping="soon"), 400,
         "early_stopping"),
        ("length-penalty", CHAT, chat(model, length_penalty=2.0), 400, "length_penalty"),
        ("early-stopping-without-beams", CHAT, chat(model, early_stopping=True), 400, "early_stopping"),
        ("enable-search", CHAT, chat(model, enable_search=True), 400, "enable_search"),
        ("code-interpreter", CHAT, chat(model, enable_code_interpreter=True), 400, "enable_code_interpreter"),
        ("audio-output", CHAT, chat(model, modalities=["text", "audio"]), 400, "modalities"),
        ("unknown-model", CHAT, chat("no-such-model"), 404, "model"),
        ("prompt-too-long", CHAT, chat(model, messages=[{"role": "user", "content": "hello " * 9000}]), 400,
         "messages"),
        ("completion-no-prompt", COMPLETIONS, {"model": model}, 400, "prompt"),
        ("completion-empty-prompt", COMPLETIONS, completion(model, prompt=[]), 400, "prompt"),
        ("completion-prompt-number", COMPLETIONS, completion(model, prompt=5), 400, "prompt"),
        ("completion-bad-token", COMPLETIONS, completion(model, prompt=[1, 10**9]), 400, "prompt"),
        ("completion-suffix", COMPLETIONS, completion(model, suffix="end"), 400, "suffix"),
        ("completion-logprobs", COMPLETIONS, completion(model, logprobs=21), 400, "logprobs"),
        ("completion-top-p", COMPLETIONS, completion(model, top_p=0), 400, "top_p"),
        ("completion-seed", COMPLETIONS, completion(model, seed=2**64), 400, "seed"),
        ("completion-logit-bias", COMPLETIONS, completion(model, logit_bias={"abc": 1}), 400, "logit_bias"),
        ("completion-logit-bias-value", COMPLETIONS, completion(model, logit_bias={"5": 200}), 400, "logit_bias"),
        ("completion-unknown-model", COMPLETIONS, completion("nope"), 404, "model"),
    ]  # fmt: skip


def encode(body: object) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def check_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] == param, error
    return error
