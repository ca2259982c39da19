"""OutputPlan: what a chat answer's text holds besides plain content, and how its tokens are constrained.

Owns the per-request decision (made once, before submission, by serving/chat.py) and its two per-choice
products: the TokenConstraint handed to the engine (a grammar's matcher, wrapped in a thinking budget when
one is set) and the `OutputParser` that splits the choice's text into reasoning, content and tool-call
deltas as it streams.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serval.serving.harmony import HarmonyParser, HarmonyReasoningCounter
from serval.serving.reasoning import AnswerText, ReasoningText, ReasoningTokenCounter, ThinkingBudget
from serval.serving.tool_call_parsers import ContentText, ToolCallArguments, ToolCallStart, ToolEvent
from serval.serving.tool_calls import ToolCallFormat

if TYPE_CHECKING:
    from serval.engine.constraint import TokenConstraint
    from serval.serving.structured import Grammar


@dataclass(frozen=True)
class OutputPlan:
    parses_reasoning: bool = False  # split <think> reasoning out of the text (a thinking chat template)
    starts_in_reasoning: bool = False  # the prompt ended inside <think>
    tool_format: ToolCallFormat | None = (
        None  # parse tool calls in this format (tools offered, choice not none)
    )
    tool_names: frozenset[str] = frozenset()
    grammar: Grammar | None = None  # the compiled grammar every choice's tokens must follow
    thinking_budget: int | None = None  # reasoning tokens allowed before the end tag is forced
    think_end_token_ids: tuple[int, ...] = ()  # the tokens forced when the budget runs out
    # The answer is harmony messages (gpt-oss; serving/harmony.py): the message the prompt ends in, which the
    # output continues (harmony.prompt_message). None: not harmony.
    harmony_prefix: str | None = None
    # harmony: the final message is JSON the grammar makes (response_format), so a terminator's spelling in
    # one of its strings is text
    is_json_answer: bool = False

    @property
    def is_plain(self) -> bool:
        return not (
            self.parses_reasoning or self.tool_format or self.grammar or self.thinking_budget
            or self.keeps_special_tokens
        )  # fmt: skip

    @property
    def keeps_special_tokens(self) -> bool:
        """The text is decoded with its special tokens: harmony's channel markers are its structure."""
        return self.harmony_prefix is not None

    def new_constraint(self, token_bytes: Callable[[int], bytes], vocab_size: int) -> TokenConstraint | None:
        """A fresh constraint for one engine request (each choice has its own matcher state)."""
        inner = self.grammar.new_constraint() if self.grammar is not None else None
        if self.thinking_budget is None:
            return inner
        return ThinkingBudget(
            self.thinking_budget,
            list(self.think_end_token_ids),
            token_bytes,
            vocab_size,
            self.starts_in_reasoning,
            inner,
            HarmonyReasoningCounter(self.harmony_prefix) if self.harmony_prefix is not None else None,
        )


@dataclass
class ToolCallDelta:
    index: int  # the call's position in the message
    id: str | None = None  # on the call's first delta only
    name: str | None = None  # on the call's first delta only
    arguments: str = ""  # the next piece of the arguments' JSON text


@dataclass
class ParsedText:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def new_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class OutputParser:
    """One choice's text -> reasoning, content and tool-call deltas; counts the reasoning tokens.

    A harmony plan has one parser for all three (its channels); otherwise the <think> split comes first and
    the tool-call parser reads the answer after it."""

    def __init__(self, plan: OutputPlan) -> None:
        parses_tools = plan.tool_format is not None
        self.harmony = (
            HarmonyParser(parses_tools, plan.harmony_prefix, plan.is_json_answer)
            if plan.harmony_prefix is not None
            else None
        )
        is_split = self.harmony is None
        parses_think = plan.parses_reasoning and is_split
        self.counter = ReasoningTokenCounter(plan.starts_in_reasoning) if parses_think else None
        self.tools = plan.tool_format.parser(plan.tool_names) if parses_tools and is_split else None
        self.num_tool_calls = 0
        # harmony: the tokens fed while inside an analysis message's text (its <|message|> to its <|end|>)
        self.num_harmony_reasoning_tokens = 0

    @property
    def num_reasoning_tokens(self) -> int:
        if self.harmony is not None:
            return self.num_harmony_reasoning_tokens
        return self.counter.num_reasoning_tokens if self.counter is not None else 0

    def feed(self, text: str, num_tokens: int) -> ParsedText:
        result = ParsedText()
        if self.harmony is not None:
            was_reasoning = self.harmony.is_reasoning
            self._apply(self.harmony.feed(text), result)
            if was_reasoning or self.harmony.is_reasoning:
                self.num_harmony_reasoning_tokens += num_tokens
            return result
        if self.counter is None:
            self._answer(text, result, final=False)
            return result
        for event in self.counter.feed(text, num_tokens):
            if isinstance(event, ReasoningText):
                result.reasoning += event.text
            elif isinstance(event, AnswerText):
                self._answer(event.text, result, final=False)
        return result

    def finish(self, is_cut: bool = False) -> ParsedText:
        """The rest of the text. is_cut: it ended before the model did (max_tokens), so an unfinished
        tool call at its end is dropped rather than shown as content (the parsers say what counts)."""
        result = ParsedText()
        if self.harmony is not None:
            self._apply(self.harmony.finish(is_cut), result)
            return result
        for event in self.counter.finish() if self.counter is not None else []:
            if isinstance(event, ReasoningText):
                result.reasoning += event.text
            else:
                self._answer(event.text, result, final=False)
        self._answer("", result, final=True, is_cut=is_cut)
        return result

    def _answer(self, text: str, result: ParsedText, final: bool, is_cut: bool = False) -> None:
        if self.tools is None:
            result.content += text
            return
        events = self.tools.feed(text) if text else []
        if final:
            events += self.tools.finish(is_cut)
        self._apply(events, result)

    def _apply(self, events: list[ToolEvent | ReasoningText], result: ParsedText) -> None:
        for event in events:
            if isinstance(event, ReasoningText):
                result.reasoning += event.text
            elif isinstance(event, ContentText):
                result.content += event.text
            elif isinstance(event, ToolCallStart):
                self.num_tool_calls += 1
                result.tool_calls.append(ToolCallDelta(event.index, new_tool_call_id(), event.name))
            elif isinstance(event, ToolCallArguments):
                last = result.tool_calls[-1] if result.tool_calls else None
                if last is not None and last.index == event.index:
                    last.arguments += event.text
                else:
                    result.tool_calls.append(ToolCallDelta(event.index, arguments=event.text))
