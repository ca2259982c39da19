"""Each model family's real chat template (tests/fixtures/templates/) through a real server on loopback and
the real openai client: the template renders the tools (or serval's fallback prompt shows them, for templates
that ignore `tools`), a scripted engine writes the family's reasoning and call markup in the family tokenizer's
ids (its special tokens as such), and a forced call and a streamed one come back as `tool_calls`, the
reasoning as `reasoning_content`. The forced request's grammar is compiled for the family's syntax (the
scripted engine does not apply it: tests/serving/test_family_grammars.py checks what it admits)."""

from __future__ import annotations

import json
from contextlib import contextmanager

import openai
import pytest

from serval.api.app import build_app
from serval.server_config import ServerConfig
from serval.serving.frontend import Frontend
from serval.serving.tokenizer import Tokenizer
from serval.serving.tool_call_families import DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP
from tests.api.chat_stream import stream_parts
from tests.fixtures.family_templates import write_family_tokenizer
from tests.fixtures.inprocess_server import serving
from tests.serving.fakes import FakeEngine

MODEL = "family-model"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather now.",
                                           "parameters": WEATHER}}]  # fmt: skip
FORCED = {"type": "function", "function": {"name": "get_weather"}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
THOUGHT = "I should look it up."
ARGUMENTS = '{"city": "Paris"}'
KIMI_CALL = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    f"{ARGUMENTS}<|tool_call_end|><|tool_calls_section_end|>"
)

# family -> (what the model writes after the prompt, the reasoning expected, request fields that make the
# template think, the call's id when the family writes one)
SCRIPTS = {
    "deepseek_r1": (
        (f"{THOUGHT}\n</think>\n\n{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n"
        f"{ARGUMENTS}\n```{DS_CALL_END}{DS_CALLS_END}"),
        THOUGHT, {}, None,
    ),
    "deepseek_v31": (
        f"{THOUGHT}</think>{DS_CALLS_BEGIN}{DS_CALL_BEGIN}get_weather{DS_SEP}{ARGUMENTS}{DS_CALL_END}{DS_CALLS_END}",
        THOUGHT, {"chat_template_kwargs": {"thinking": True}}, None,
    ),
    "kimi_k2": (KIMI_CALL, None, {}, "functions.get_weather:0"),
    "kimi_k2_thinking": (f"<think>{THOUGHT}</think>{KIMI_CALL}", THOUGHT, {}, "functions.get_weather:0"),
    "glm46": (
        (f"\n<think>{THOUGHT}</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
        "</arg_value>\n</tool_call>"),
        THOUGHT, {"enable_thinking": True}, None,
    ),
    "minimax_m2": (
        (f'{THOUGHT}\n</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
        "Paris</parameter>\n</invoke>\n</minimax:tool_call>"),
        THOUGHT, {}, None,
    ),
    "chatglm3": ('get_weather\n ```python\ntool_call(city="Paris")\n```', None, {}, None),
}  # fmt: skip


class RecordingEngine(FakeEngine):
    """A FakeEngine that keeps the prompt ids it was given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: list[list[int]] = []

    def add_requests(self, requests, shared_queue=None):
        self.prompts += [list(r.prompt_token_ids) for r in requests]
        return super().add_requests(requests, shared_queue)


@contextmanager
def _serve(frontend: Frontend):
    with serving(build_app(ServerConfig(served_model_names=(MODEL,)), frontend)) as port:
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )


@pytest.fixture(scope="module", params=list(SCRIPTS))
def family(request, tmp_path_factory):
    name = request.param
    tokenizer = Tokenizer.from_directory(write_family_tokenizer(str(tmp_path_factory.mktemp(name)), name))
    engine = RecordingEngine([SCRIPTS[name][0]], max_model_len=4096, encode=tokenizer.encode)
    frontend = Frontend(engine, tokenizer)
    try:
        with _serve(frontend) as client:
            yield name, client, engine, tokenizer
    finally:
        frontend.grammars.shutdown()


def _stream(client, **fields) -> tuple[str, str, list[dict], str | None]:
    return stream_parts(client, MODEL, USER, **fields)


def _extra(fields: dict) -> dict:
    return {"extra_body": fields} if fields else {}


def test_a_forced_call_comes_back_as_a_tool_call_with_its_reasoning(family):
    name, client, engine, tokenizer = family
    _, reasoning, fields, call_id = SCRIPTS[name]
    response = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice=FORCED, max_tokens=400, **_extra(fields)
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id == call_id if call_id else call.id.startswith("call_")
    assert not choice.message.content
    assert (choice.message.model_extra or {}).get("reasoning_content") == reasoning
    # the model saw the tool: through its template's `tools`, or serval's prompt in the family's syntax
    assert "get_weather" in tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)


def test_a_streamed_call_comes_back_as_tool_call_deltas_with_their_reasoning(family):
    name, client, _, _ = family
    _, reasoning, fields, call_id = SCRIPTS[name]
    streamed_reasoning, content, calls, finish = _stream(
        client, tools=TOOLS, max_tokens=400, **_extra(fields)
    )
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert not content.strip()
    assert streamed_reasoning == (reasoning or "")
    if call_id:
        assert calls[0]["id"] == call_id
