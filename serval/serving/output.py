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

from serval.serving import harmony
from serval.serving.harmony import HarmonyParser, HarmonyReasoningCounter
from serval.serving.reasoning import (
    THINK_END,
    THINK_START,
    AnswerText,
    ReasoningText,
    ReasoningTokenCounter,
    ThinkingBudget,
)
from serval.serving.tool_call_format import Tool, ToolCallFormat
from serval.serving.tool_call_parsers import ContentText, ToolCallArguments, ToolCallStart, ToolEvent

if TYPE_CHECKING:
    from serval.engine.constraint import TokenConstraint
    from serval.serving.chat import ChatOptions
    from serval.serving.reasoning_formats import ReasoningFormat
    from serval.serving.structured import Grammar


@dataclass(frozen=True)
class OutputPlan:
    parses_reasoning: bool = False  # split <think> reasoning out of the text (a thinking chat template)
    starts_in_reasoning: bool = False  # the prompt ended inside <think>
    tool_format: ToolCallFormat | None = (
        None  # parse tool calls in this format (tools offered, choice not none)
    )
    tool_names: frozenset[str] = frozenset()
    tools: tuple[Tool, ...] = ()  # the offered tools: XML-style parsers type argument values by their schema
    # Special tokens the answer is decoded with (kept as text whatever skip_special_tokens says): the tool-call
    # format's and the reasoning's markers, where the tokenizer has them as special tokens.
    kept_special_token_ids: frozenset[int] = frozenset()
    reasoning_in_content: bool = (
        False  # the reasoning stays in content, in its <think> block (minimax_m2_append_think)
    )
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


def chat_plan(
    tokenizer,
    options: ChatOptions,
    tool_format: ToolCallFormat,
    reasoning_format: ReasoningFormat | None,
    starts_in_reasoning: bool,
    grammar: Grammar | None,
    harmony_prefix: str | None,
) -> OutputPlan:
    """A chat answer's plan: its parsers (reasoning_format None: no reasoning split; tools only when offered
    and not refused), its grammar, and the tokens forced when its thinking budget runs out."""
    budget = options.thinking_budget
    if harmony_prefix is not None:
        budget_end_text = harmony.budget_end(grammar is not None)
    else:
        budget_end_text = f"\n{THINK_END}\n\n"
    thinks = reasoning_format is not None
    markup = ((THINK_START, THINK_END) if thinks else ()) + (tool_format.markup if options.uses_tools else ())
    return OutputPlan(
        parses_reasoning=thinks,
        starts_in_reasoning=starts_in_reasoning,
        tool_format=tool_format if options.uses_tools else None,
        tool_names=frozenset(t.name for t in options.tools),
        tools=options.tools,
        kept_special_token_ids=special_markup_ids(tokenizer, markup),
        reasoning_in_content=thinks and reasoning_format.in_content,
        grammar=grammar,
        thinking_budget=budget,
        think_end_token_ids=tuple(tokenizer.encode(budget_end_text)) if budget else (),
        harmony_prefix=harmony_prefix,
        is_json_answer=grammar is not None and options.response_format.type != "text",
    )


def special_markup_ids(tokenizer, texts: tuple[str, ...]) -> frozenset[int]:
    """The ids of those markup texts (a format's markers) that the tokenizer has as single special tokens:
    the answer is decoded with them, or its parsers would never see them."""
    ids = (tokenizer.encode(text) for text in texts)
    return frozenset(i[0] for i in ids if len(i) == 1 and i[0] in tokenizer.special_token_ids)


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
        self.tools = (
            plan.tool_format.parser(plan.tool_names, plan.tools) if parses_tools and is_split else None
        )
        self.reasoning_in_content = plan.reasoning_in_content
        self.think_block = (
            "none"  # reasoning_in_content: the <think> block written into content: open, closed
        )
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
                self._reasoning(event.text, result)
            elif isinstance(event, AnswerText):
                self._close_think_block(result)
                self._answer(event.text, result, final=False)
        return result

    def _reasoning(self, text: str, result: ParsedText) -> None:
        if not self.reasoning_in_content:
            result.reasoning += text
            return
        # Written back as the template writes an earlier turn's reasoning, so a client that sends the content
        # back gives the model its reasoning again (MiniMax-M2 wants it kept between tool calls).
        if self.think_block == "none":
            result.content += f"{THINK_START}\n"
            self.think_block = "open"
        result.content += text

    def _close_think_block(self, result: ParsedText) -> None:
        if self.think_block == "open":
            result.content += f"\n{THINK_END}\n\n"
            self.think_block = "closed"

    def finish(self, is_cut: bool = False) -> ParsedText:
        """The rest of the text. is_cut: it ended before the model did (max_tokens), so an unfinished
        tool call at its end is dropped rather than shown as content (the parsers say what counts)."""
        result = ParsedText()
        if self.harmony is not None:
            self._apply(self.harmony.finish(is_cut), result)
            return result
        for event in self.counter.finish() if self.counter is not None else []:
            if isinstance(event, ReasoningText):
                self._reasoning(event.text, result)
            else:
                self._close_think_block(result)
                self._answer(event.text, result, final=False)
        if not is_cut or self.counter is None or not self.counter.is_reasoning:
            self._close_think_block(result)
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
                call_id = event.call_id or new_tool_call_id()
                result.tool_calls.append(ToolCallDelta(event.index, call_id, event.name))
            elif isinstance(event, ToolCallArguments):
                last = result.tool_calls[-1] if result.tool_calls else None
                if last is not None and last.index == event.index:
                    last.arguments += event.text
                else:
                    result.tool_calls.append(ToolCallDelta(event.index, arguments=event.text))
