"""The terminal tools' pure parts: how a streamed answer is drawn (reasoning dim on a terminal, marked in a
pipe; tool calls by name and arguments), how a message is read (continuation lines, blocks), and how SSE
chunks fold into an answer."""

from __future__ import annotations

import io

import pytest

from serval.entrypoints.chat_client import Answer, _pieces, base_url
from serval.entrypoints.terminal_chat import DIM, RESET, Screen, read_message, timing_line


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


PIECES = [("reasoning", "Think"), ("reasoning", "ing."), ("content", "Paris"), ("content", ".")]


def test_reasoning_is_dim_on_a_terminal(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    out, err = FakeTerminal(), FakeTerminal()
    screen = Screen(out, err)
    for kind, text in PIECES:
        screen.piece(kind, text)
    screen.end(Answer(usage={"completion_tokens": 5}, ttft_s=0.25))
    assert out.getvalue() == f"{DIM}Thinking.{RESET}\nParis.\n"
    assert err.getvalue() == f"{DIM}[TTFT 0.25 s, 5 tokens]{RESET}\n"


def test_reasoning_is_marked_in_a_pipe():
    out, err = io.StringIO(), io.StringIO()
    screen = Screen(out, err)
    for kind, text in PIECES:
        screen.piece(kind, text)
    screen.end(Answer(usage={"completion_tokens": 5}))
    assert out.getvalue() == "[reasoning]\nThinking.\n[answer]\nParis.\n"
    assert "\x1b" not in out.getvalue() + err.getvalue()


def test_tool_calls_by_name_and_arguments():
    out = io.StringIO()
    screen = Screen(out, io.StringIO())
    for kind, text in [("tool_call", "get_weather"), ("tool_arguments", '{"city": '), ("tool_arguments", '"Paris"}'),
                       ("tool_call", "get_time"), ("tool_arguments", "{}")]:  # fmt: skip
        screen.piece(kind, text)
    screen.end(None)
    assert out.getvalue() == '[tool call] get_weather {"city": "Paris"}\n[tool call] get_time {}\n'


def test_timing_line():
    answer = Answer(usage={"completion_tokens": 11, "prompt_tokens_details": {"cached_tokens": 16}},
                    ttft_s=0.5, last_piece_s=1.5)  # fmt: skip
    assert timing_line(answer) == "[TTFT 0.50 s, 11 tokens, 10.0 tokens/s, 16 cached prompt tokens]"


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["one line"], "one line"),
        (["first \\", "second\\", "third"], "first \nsecond\nthird"),
        (['"""', "a", "", "  b \\", '"""'], "a\n\n  b \\"),
    ],
)
def test_read_message(lines, message):
    typed = iter(lines)
    assert read_message(lambda prompt: next(typed), is_terminal=False) == message
    assert next(typed, None) is None  # read exactly the message's lines


def test_chunks_fold_into_an_answer():
    answer = Answer()
    deltas = [
        {"delta": {"role": "assistant", "reasoning_content": "hm"}},
        {"delta": {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": ""}}]}},
        {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}},
        {"text": " and text"},  # a /v1/completions choice
    ]
    pieces = [piece for delta in deltas for piece in _pieces(delta, answer)]
    assert pieces == [
        ("reasoning", "hm"),
        ("tool_call", "f"),
        ("tool_arguments", '{"a": 1}'),
        ("content", " and text"),
    ]
    assert answer.tool_calls == [{"name": "f", "arguments": '{"a": 1}'}]
    assert answer.reasoning == "hm" and answer.content == " and text"


def test_base_url_takes_the_sdk_spelling_too():
    assert base_url("http://h:1/v1/") == base_url("http://h:1") == "http://h:1"
