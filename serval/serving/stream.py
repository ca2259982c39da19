"""Stream assembly: engine token deltas -> text events per choice, and the fold of events into one result.

Owns the per-choice parse state (detokenizer, stop matcher, logprob text, and for chat the reasoning and
tool-call parsers of serving/output.py) and the event types the HTTP layer frames. A non-streaming response is `fold` of the very same events, so streamed and non-streamed text cannot
drift apart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from serval.engine.outputs import RequestOutput, StepTiming
from serval.sampling import SamplingParams
from serval.serving.detokenizer import IncrementalDetokenizer
from serval.serving.errors import EngineError
from serval.serving.output import OutputParser, OutputPlan, ParsedText, ToolCallDelta
from serval.serving.stop import StopMatcher


class TokenText(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    token_bytes: bytes  # the token's raw UTF-8 bytes (may be part of a character)
    logprob: float


@dataclass(frozen=True)
class LogprobEntry:
    token_id: int
    token: str
    token_bytes: bytes
    logprob: float
    top: tuple[TopLogprob, ...]  # most likely first


@dataclass
class ChoiceDelta:
    index: int  # the choice this belongs to
    text: str  # new text, safe to show (no partial stop string, no half character)
    token_ids: list[int]  # tokens the engine produced for it this step
    logprobs: list[LogprobEntry] | None  # one per token in token_ids; None when not requested
    finish_reason: str | None = None  # "stop" | "length" on the choice's last delta
    # Sum of the chosen tokens' logprobs, on the last delta when the engine returned logprobs (best_of).
    cumulative_logprob: float | None = None
    reasoning_text: str = ""  # new reasoning text (a thinking model's <think> part)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # new tool-call pieces
    # On the last delta: the stop string that matched or the stop token id that ended it (the offline LLM's
    # stop_reason); None when a length limit ended it.
    stop_reason: int | str | None = None


@dataclass
class Usage:
    num_prompt_tokens: int
    num_cached_tokens: int
    num_completion_tokens: int  # over all sequences generated, best_of ones included
    num_reasoning_tokens: int = 0  # of those, the tokens of the reasoning (<think> ... </think>)
    # Explicit caching (cache_control): prompt tokens this request newly wrote into the explicit cache, and
    # whether it asked for it at all (the API shows the cache_creation fields only then).
    num_cache_creation_tokens: int = 0
    uses_explicit_cache: bool = False
    # Of the prompt tokens, those of media placeholder runs (Model Studio's prompt_tokens_details); the rest
    # are text.
    num_image_tokens: int = 0
    num_video_tokens: int = 0
    num_audio_tokens: int = 0
    # MindIE's timing arrays, of the longest sequence (they share the steps): per generated token the batch
    # size of its step and its queue wait (µs); the prompt's compute time and each decode step's time (ms).
    batch_sizes: list[int] = field(default_factory=list)
    queue_wait_us: list[int] = field(default_factory=list)
    prefill_time_ms: float = 0.0
    decode_time_ms: list[float] = field(default_factory=list)


Event = ChoiceDelta | Usage


@dataclass
class TimingTotals:
    """One choice's timings, summed on the event loop from the StepTimings of the outputs it took in: each
    token's entries arrive once, with its output. What a choice ended by a stop string reports is complete
    from its own outputs, whatever the engine did before the abort reached it."""

    batch_sizes: list[int] = field(default_factory=list)
    queue_wait_us: list[int] = field(default_factory=list)
    prefill_time_ms: float = 0.0
    decode_time_ms: list[float] = field(default_factory=list)

    def add(self, step: StepTiming) -> None:
        self.batch_sizes.extend(step.batch_sizes)
        self.queue_wait_us.extend(step.queue_wait_us)
        self.prefill_time_ms = step.prefill_time_ms  # a running value, not a delta
        self.decode_time_ms.extend(step.decode_time_ms)


def token_text(tokenizer: TokenText, token_id: int) -> tuple[str, bytes]:
    try:
        raw = tokenizer.token_bytes(token_id)
    except ValueError:  # an id of a padded model vocabulary, past the tokenizer's: it has no text
        raw = b""
    return raw.decode("utf-8", errors="replace"), raw


class ChoiceStream:
    """One engine request's state: its RequestOutputs in, ChoiceDeltas out."""

    def __init__(
        self,
        index: int,
        tokenizer: TokenText,
        params: SamplingParams,
        return_logprobs: bool,
        plan: OutputPlan | None = None,
    ) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self.params = params
        self.return_logprobs = return_logprobs
        # NOTE: a harmony answer is decoded with its special tokens whatever skip_special_tokens says: its
        # channel markers are what the parser splits it by, and none of them reaches the client.
        keeps_special = plan is not None and plan.keeps_special_tokens
        kept_ids = plan.kept_special_token_ids if plan is not None else frozenset()
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, params.skip_special_tokens and not keeps_special, kept_ids
        )
        self.stop_matcher = StopMatcher(params.stop, params.include_stop_str_in_output)
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.num_newly_pinned_tokens = 0
        self.cumulative_logprob: float | None = None
        self.timing = TimingTotals()
        self.finish_reason: str | None = None
        self.parser = OutputParser(plan) if plan is not None and not plan.is_plain else None

    @property
    def num_reasoning_tokens(self) -> int:
        return self.parser.num_reasoning_tokens if self.parser is not None else 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, output: RequestOutput) -> ChoiceDelta | None:
        """Fold one engine delta in. After a stop string matches the choice is finished and the caller must
        abort its engine request; later outputs are ignored."""
        if self.is_finished:
            return None
        if output.finish_reason == "abort":  # refusals and failures are raised by the engine's stream instead
            raise EngineError("the engine aborted the request")
        token_ids = list(output.new_token_ids)
        self.num_output_tokens += len(token_ids)
        self.num_cached_tokens = output.num_cached_tokens
        self.num_newly_pinned_tokens = output.num_newly_pinned_tokens
        if output.timing is not None:
            self.timing.add(output.timing)
        text_ids = token_ids
        # The finishing EOS / stop_token_ids token is generated but not part of the answer's text.
        ends_with_stop_token = output.finished and output.stop_token_id is not None
        keep_stop_token = self.params.include_stop_str_in_output
        if ends_with_stop_token and text_ids and text_ids[-1] == output.stop_token_id and not keep_stop_token:
            text_ids = text_ids[:-1]
        text = self.detokenizer.feed(text_ids)
        if output.finished:
            text += self.detokenizer.flush()
        text = self.stop_matcher.feed(text)
        if self.stop_matcher.matched is not None:
            self.finish_reason = "stop"
        elif output.finished:
            text += self.stop_matcher.flush()
            self.finish_reason = output.finish_reason or "stop"
        logprobs = self._logprobs(output)
        parsed = self._parse(text, len(token_ids))
        stop_reason = None
        if self.is_finished:
            matched = self.stop_matcher.matched
            stop_reason = matched if matched is not None else output.stop_token_id
        return ChoiceDelta(
            index=self.index,
            text=parsed.content,
            token_ids=token_ids,
            logprobs=logprobs if self.return_logprobs else None,
            finish_reason=self.finish_reason,
            cumulative_logprob=self.cumulative_logprob if self.is_finished else None,
            reasoning_text=parsed.reasoning,
            tool_calls=parsed.tool_calls,
            stop_reason=stop_reason,
        )

    def cut_off(self) -> ChoiceDelta:
        """End the choice before the engine did (the request timed out): release held text, reason length."""
        text = self.stop_matcher.feed(self.detokenizer.flush()) + self.stop_matcher.flush()
        self.finish_reason = "length"
        parsed = self._parse(text, 0)
        return ChoiceDelta(
            self.index, parsed.content, [], [] if self.return_logprobs else None, "length",
            self.cumulative_logprob, parsed.reasoning, parsed.tool_calls,
        )  # fmt: skip

    def _parse(self, text: str, num_tokens: int) -> ParsedText:
        """Split the visible text into reasoning, content and tool calls (plain content without a parser)."""
        if self.parser is None:
            return ParsedText(content=text)
        parsed = self.parser.feed(text, num_tokens)
        if self.is_finished:
            # "length": max_tokens, the context or the request timeout cut the text, maybe inside a call.
            rest = self.parser.finish(is_cut=self.finish_reason == "length")
            parsed.content += rest.content
            parsed.reasoning += rest.reasoning
            parsed.tool_calls += rest.tool_calls
            if self.parser.num_tool_calls and self.finish_reason == "stop":
                self.finish_reason = "tool_calls"
        return parsed

    def _logprobs(self, output: RequestOutput) -> list[LogprobEntry]:
        entries: list[LogprobEntry] = []
        for item in output.new_logprobs or ():
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + item.logprob
            if not self.return_logprobs:
                continue
            token, raw = token_text(self.tokenizer, item.token_id)
            top = []
            for token_id, logprob in item.top:
                top_token, top_raw = token_text(self.tokenizer, token_id)
                top.append(TopLogprob(token_id, top_token, top_raw, logprob))
            entries.append(LogprobEntry(item.token_id, token, raw, item.logprob, tuple(top)))
        return entries


@dataclass
class ChoiceResult:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobEntry] | None
    finish_reason: str | None
    cumulative_logprob: float | None
    reasoning_text: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # one per call, arguments complete
    stop_reason: int | str | None = None


@dataclass
class Completion:
    choices: list[ChoiceResult]  # by index
    usage: Usage


async def fold(events: AsyncIterator[Event]) -> Completion:
    """The non-streaming response: every event of the stream, concatenated per choice."""
    folded = Fold()
    async for event in events:
        folded.add(event)
    return folded.result()


class Fold:
    """Events added one by one, concatenated per choice: `fold` on the event loop, the offline LLM in its
    own thread."""

    def __init__(self) -> None:
        self.choices: dict[int, ChoiceResult] = {}
        self.usage = Usage(0, 0, 0)

    def result(self) -> Completion:
        return Completion([self.choices[i] for i in sorted(self.choices)], self.usage)

    def add(self, event: Event) -> None:
        if isinstance(event, Usage):
            self.usage = event
            return
        choice = self.choices.get(event.index)
        if choice is None:
            choice = ChoiceResult(event.index, "", [], None, None, None)
            self.choices[event.index] = choice
        choice.text += event.text
        choice.reasoning_text += event.reasoning_text
        for piece in event.tool_calls:
            if piece.id is not None:
                choice.tool_calls.append(ToolCallDelta(piece.index, piece.id, piece.name, piece.arguments))
            else:
                call = next(c for c in reversed(choice.tool_calls) if c.index == piece.index)
                call.arguments += piece.arguments
        choice.token_ids.extend(event.token_ids)
        if event.logprobs is not None:
            choice.logprobs = choice.logprobs if choice.logprobs is not None else []
            choice.logprobs.extend(event.logprobs)
        if event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
            choice.cumulative_logprob = event.cumulative_logprob
            choice.stop_reason = event.stop_reason
