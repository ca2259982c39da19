"""Reasoning: splitting `<think>...</think>` out of the output, and the thinking budget that ends it.

Owns two things. `ThinkParser` splits a choice's text into reasoning and content as it streams (`feed(text)
-> events`, `finish()`; any split of the text gives the one-shot result), so `reasoning_content` is the same
streamed or not. `ThinkingBudget` is a TokenConstraint (engine/constraint.py): after `budget` tokens of
reasoning it forces the tokens of the end tag, so the answer follows; it wraps the request's grammar, if any,
and passes every token on to it.

Where reasoning starts: templates of the DeepSeek-R1 kind end the prompt inside `<think>` (the output starts
as reasoning, without the tag); Qwen3-style models write `<think>` themselves as the first thing, or not at
all (`enable_thinking: false` renders an empty think block into the prompt). Both are handled: the parser
starts inside reasoning when the prompt opened it, and otherwise takes a leading `<think>` as its start.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

from serval.engine.constraint import MAX_ROLLBACK_TOKENS, check_rollback

if TYPE_CHECKING:
    import torch

    from serval.engine.constraint import TokenConstraint

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass
class ReasoningText:
    text: str


@dataclass
class AnswerText:
    text: str


ReasoningEvent = ReasoningText | AnswerText


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt ends inside an unclosed <think> block."""
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


def _held_tail(text: str, marker: str) -> int:
    # The longest tail that is a proper prefix of marker, plus whitespace before it (trimmed at the tag).
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size + len(text[: len(text) - size]) - len(text[: len(text) - size].rstrip())
    return len(text) - len(text.rstrip())


class ThinkParser:
    """Reasoning text (tags removed, trimmed) and answer text (leading whitespace after the tag removed)."""

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self.state = "reasoning" if starts_in_reasoning else "start"
        self.buffer = ""
        self.has_reasoning_text = False  # leading whitespace of the reasoning is dropped until text comes
        self.has_answer_text = False
        self.has_opened = starts_in_reasoning  # reasoning started (the prompt or a leading <think> opened it)

    def feed(self, text: str) -> list[ReasoningEvent]:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> list[ReasoningEvent]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[ReasoningEvent]:
        events: list[ReasoningEvent] = []
        if self.state == "start":
            stripped = self.buffer.lstrip()
            if stripped.startswith(THINK_START):
                self.buffer, self.state = stripped[len(THINK_START) :], "reasoning"
                self.has_opened = True
            elif THINK_START.startswith(stripped) and not final:
                return events  # whitespace, or the tag's first characters: wait
            else:
                self.state = "answer"
        if self.state == "reasoning":
            end = self.buffer.find(THINK_END)
            if end != -1:
                self._reasoning(events, self.buffer[:end].rstrip())
                self.buffer, self.state = self.buffer[end + len(THINK_END) :], "answer"
            else:
                keep = 0 if final else _held_tail(self.buffer, THINK_END)
                self._reasoning(events, self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
        if self.state == "answer" and self.buffer:
            text = self.buffer if self.has_answer_text else self.buffer.lstrip()
            self.buffer = ""
            if text:
                self.has_answer_text = True
                events.append(AnswerText(text))
        return events

    def _reasoning(self, events: list[ReasoningEvent], text: str) -> None:
        if not self.has_reasoning_text:
            text = text.lstrip()
        if text:
            self.has_reasoning_text = True
            events.append(ReasoningText(text))


class ReasoningTokenCounter:
    """Counts the output tokens that belong to the reasoning: from the first token up to the one that
    completes `</think>`. Whitespace tokens before a `<think>` count once the tag comes; if the answer starts
    without one, nothing counts. Fed one token's text (or one delta's) at a time."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.parser = ThinkParser(starts_in_reasoning)
        self.num_reasoning_tokens = 0
        self.num_pending_tokens = 0  # tokens seen while the start was undecided

    @property
    def is_reasoning(self) -> bool:
        return self.parser.state == "reasoning"

    def feed(self, text: str, num_tokens: int = 1) -> list[ReasoningEvent]:
        was_answer = self.parser.state == "answer"
        events = self.parser.feed(text)
        if was_answer:
            return events
        if self.parser.state == "start":
            self.num_pending_tokens += num_tokens
            return events
        if self.parser.has_opened:
            self.num_reasoning_tokens += self.num_pending_tokens + num_tokens
        self.num_pending_tokens = 0
        return events

    def finish(self) -> list[ReasoningEvent]:
        return self.parser.finish()


class ThinkingBudget:
    """A TokenConstraint: at most `budget` tokens of reasoning, then the end tag is forced.

    It tracks the reasoning from the sampled tokens' bytes (the tags are ASCII, so a character split across
    tokens cannot fake one), and forces `end_token_ids` one token at a time. The inner constraint, if any,
    sees every token too and decides the rest.

    Rollback (engine/constraint.py) replays: it keeps a copy of its counting state (the counter, the tags
    still to force) from some tokens back and the tokens accepted since, and rebuilds the state before the
    rolled-back ones from them. NOTE: a replay, not a snapshot per token: the counter may be a whole parser
    (harmony's), and copying it at every token would cost every request, speculative or not. The copy moves
    forward max_rollback_tokens at a time, so at most twice that many tokens are kept and replayed."""

    def __init__(
        self,
        budget: int,
        end_token_ids: list[int],
        token_bytes,  # token_id -> bytes
        vocab_size: int,
        starts_in_reasoning: bool,
        inner: TokenConstraint | None = None,
        counter=None,  # what tells the reasoning (feed(text), is_reasoning, num_reasoning_tokens); <think>'s
        max_rollback_tokens: int = MAX_ROLLBACK_TOKENS,
    ) -> None:
        self.budget = budget
        self.end_token_ids = end_token_ids
        self.token_bytes = token_bytes
        self.vocab_size = vocab_size
        self.inner = inner
        self.counter = counter if counter is not None else ReasoningTokenCounter(starts_in_reasoning)
        self.forced: list[int] = []  # end-tag tokens still to force
        self._bitmask: torch.Tensor | None = None
        self.max_rollback_tokens = max_rollback_tokens
        # (counter, forced) as they were before the oldest of recent_token_ids, which rollback replays.
        self._checkpoint = (copy.deepcopy(self.counter), list(self.forced))
        self.recent_token_ids: list[int] = []

    def allowed_token_bitmask(self) -> torch.Tensor | None:
        if not self.forced:
            return self.inner.allowed_token_bitmask() if self.inner is not None else None
        import torch

        if self._bitmask is None:
            self._bitmask = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
        self._bitmask.zero_()
        token_id = self.forced[0]
        bit = 1 << (token_id % 32)
        self._bitmask[token_id // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 two's complement
        return self._bitmask

    def accept_token(self, token_id: int) -> None:
        if self.inner is not None:
            self.inner.accept_token(token_id)
        self.forced = self._count(self.counter, self.forced, token_id)
        self.recent_token_ids.append(token_id)
        if len(self.recent_token_ids) > 2 * self.max_rollback_tokens:
            # Bring the checkpoint up to max_rollback_tokens behind: rollback never reaches further.
            num_old = len(self.recent_token_ids) - self.max_rollback_tokens
            counter, forced = self._checkpoint
            for old_token_id in self.recent_token_ids[:num_old]:
                forced = self._count(counter, forced, old_token_id)
            self._checkpoint = (counter, forced)
            del self.recent_token_ids[:num_old]

    def _count(self, counter, forced: list[int], token_id: int) -> list[int]:
        """Feed a token to `counter`; returns the end-tag tokens still to force after it."""
        forced = forced[1:]
        try:
            text = self.token_bytes(token_id).decode("utf-8", errors="replace")
        except ValueError:  # an id past the tokenizer's vocabulary (the model's may be wider): no text
            text = ""
        counter.feed(text)
        if not forced and counter.is_reasoning and counter.num_reasoning_tokens >= self.budget:
            return list(self.end_token_ids)
        return forced

    def rollback(self, num_tokens: int) -> None:
        num_kept = min(len(self.recent_token_ids), self.max_rollback_tokens)
        check_rollback(num_tokens, num_kept, self.max_rollback_tokens)
        if self.inner is not None:
            self.inner.rollback(num_tokens)  # first: should it refuse, nothing here has changed
        kept = self.recent_token_ids[: len(self.recent_token_ids) - num_tokens]
        counter, forced = copy.deepcopy(self._checkpoint[0]), list(self._checkpoint[1])
        for token_id in kept:
            forced = self._count(counter, forced, token_id)
        self.counter, self.forced, self.recent_token_ids = counter, forced, kept

    @property
    def is_finished(self) -> bool:
        return self.inner is not None and self.inner.is_finished
