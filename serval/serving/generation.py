"""GenerationRequest: one API request (chat or completions) from its prompt ids to its response objects.

Owns what happens between "the prompts are token ids" and "here is the Completion": the prompt-length rules
(PromptRules: context length, MindIE's maxInputTokenLen and maxIterTimes, --max-seqs-per-request), the fan-out
into engine requests (n / best_of sequences or a beam search per prompt, serving/choices.py), their deltas
folded into each choice's text events (serving/stream.py: detokenizer, stop strings, reasoning and tool-call
parsers), which engine request to abort when a stop string ends it early, the usage, and the best n of
best_of. It does no I/O: the server drives it on the event loop (Frontend.stream), the offline LLM drives it
through the same serving/run.py (serval/entrypoints/llm.py), so the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from serval.engine.messages import NewRequest
from serval.engine.outputs import RequestOutput
from serval.sampling import SamplingParams
from serval.serving.choices import (
    SequencePlan,
    beam_choice_output,
    check_num_sequences,
    keep_best,
    plan_sequences,
    usage_of,
)
from serval.serving.errors import InvalidRequestError
from serval.serving.media.parts import MediaKind
from serval.serving.media.processor import MediaSpan, engine_media, num_tokens_by_kind
from serval.serving.output import OutputPlan
from serval.serving.stream import ChoiceDelta, ChoiceStream, Completion, Usage

if TYPE_CHECKING:
    from serval.serving.tokenizer import Tokenizer


@dataclass(frozen=True)
class PromptRules:
    """The limits a prompt and its answer must fit: fixed per deployment."""

    max_model_len: int  # the context: prompt + answer
    max_input_tokens: int | None = None  # MindIE's maxInputTokenLen
    max_iter_times: int | None = None  # MindIE's maxIterTimes: a cap on max_tokens
    max_seqs_per_request: int | None = None  # prompts x max(n, best_of); None: only the queue bounds it

    def resolve_max_tokens(
        self, num_prompt_tokens: int, requested: int | None, param: str = "messages"
    ) -> int:
        """The max_tokens in force: the request's, capped by maxIterTimes and by the room the context leaves
        (the generation then ends with finish_reason "length", as MindIE does)."""
        limit = self.max_model_len
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty", param)
        if self.max_input_tokens is not None and num_prompt_tokens > self.max_input_tokens:
            raise InvalidRequestError(
                f"the prompt has {num_prompt_tokens} tokens, more than the {self.max_input_tokens} this "
                "deployment accepts (maxInputTokenLen)",
                param,
            )
        if num_prompt_tokens >= limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens; at most {limit - 1} leave room for an answer",
                param,
            )
        caps = [limit - num_prompt_tokens, requested, self.max_iter_times]
        return min(cap for cap in caps if cap is not None)

    def check_num_sequences(self, num_prompts: int, params: SamplingParams, param: str) -> None:
        """InvalidRequestError past --max-seqs-per-request (choices.check_num_sequences). Run once per request,
        where the API parses it (Frontend.check_num_sequences), before any costly work: `plan` does not repeat
        it."""
        check_num_sequences(num_prompts, params, self.max_seqs_per_request, param)

    def plan(self, prompts: list[list[int]], params: SamplingParams, param: str) -> list[SequencePlan]:
        """One engine request per (prompt, sequence); raises InvalidRequestError (a prompt the context or the
        deployment refuses) before anything is sent."""
        return plan_sequences(
            prompts, params, lambda prompt: self.resolve_max_tokens(len(prompt), params.max_tokens, param)
        )


class GenerationRequest:
    """One API request's generation: its engine requests (`new_requests`, all admitted together or none),
    their outputs in (`feed`), its choices' events out, then `usage()` and `select(completion)`."""

    def __init__(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        rules: PromptRules,
        tokenizer: Tokenizer,
        *,
        param: str = "messages",
        return_logprobs: bool | None = None,
        output_plan: OutputPlan | None = None,
        num_pinned_prompt_tokens: int = 0,
        lora_name: str | None = None,
        echoes: list[str] | None = None,
        media_spans: tuple[MediaSpan, ...] = (),
    ) -> None:
        """Plans the sequences (InvalidRequestError for a prompt or a count the rules refuse).

        return_logprobs: whether the choices carry logprobs (None: when params.logprobs asks for them).
        num_pinned_prompt_tokens: the leading tokens of every prompt to pin in the explicit cache.
        echoes: completions with echo: per prompt, the prompt text the response starts with.
        media_spans: where a chat prompt's media items sit in its ids (serving/media/processor.py)."""
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.output_plan = output_plan
        self.num_pinned_prompt_tokens = num_pinned_prompt_tokens
        self.lora_name = lora_name
        self.echoes = echoes
        self.media_spans = media_spans
        media = engine_media(media_spans)
        if return_logprobs is None:
            return_logprobs = params.logprobs is not None
        self.sequences = rules.plan(prompts, params, param)
        self.choices = [
            ChoiceStream(s.index + k, tokenizer, s.params, return_logprobs, output_plan)
            for s in self.sequences
            for k in range(s.num_choices)
        ]
        self.new_requests = [
            NewRequest(
                self.engine_request_id(s.index),
                s.prompt_token_ids,
                s.params,
                tokenizer.eos_token_ids,
                # Each engine request gets its own grammar matcher.
                constraint=output_plan.new_constraint(tokenizer.token_bytes, tokenizer.vocab_size)
                if output_plan is not None
                else None,
                num_pinned_prompt_tokens=num_pinned_prompt_tokens,
                share_prompt_with=None if s.leader_index is None else self.engine_request_id(s.leader_index),
                lora_name=lora_name,
                media=media,
            )
            for s in self.sequences
        ]
        self._sequence_of = {r.request_id: s for r, s in zip(self.new_requests, self.sequences)}
        self._open = set(self._sequence_of)  # engine requests still producing outputs

    def engine_request_id(self, sequence_index: int) -> str:
        return f"{self.request_id}-{sequence_index}"

    @property
    def num_choices(self) -> int:
        """How many choices the response holds: n per prompt (best_of's extra sequences are dropped)."""
        return self.params.n * len(self.prompts)

    @property
    def is_finished(self) -> bool:
        """Every engine request has ended (finished, or aborted at a stop string)."""
        return not self._open

    def feed(self, output: RequestOutput) -> tuple[list[ChoiceDelta], bool]:
        """Fold one engine output in: the choices' new deltas, and whether the caller must abort that engine
        request now (a stop string ended its choice before the engine did; it counts as ended)."""
        sequence = self._sequence_of[output.request_id]
        if output.finished:
            self._open.discard(output.request_id)
        if output.beams is None:
            pairs = [(self.choices[sequence.index], output)]
        else:  # beam search answers once, at the end ("pseudo streaming"): one finished output per beam
            pairs = [(self.choices[sequence.index + k], beam_choice_output(output, beam))
                     for k, beam in enumerate(output.beams)]  # fmt: skip
        deltas = []
        for choice, choice_output in pairs:
            delta = choice.feed(choice_output)
            if delta is not None:
                deltas.append(delta)
        is_cut_short = output.request_id in self._open and all(choice.is_finished for choice, _ in pairs)
        if is_cut_short:
            self._open.discard(output.request_id)
        return deltas, is_cut_short

    def cut_off(self) -> list[ChoiceDelta]:
        """End every unfinished choice now (the request timed out, or a shutdown's grace period ended)."""
        self._open.clear()
        return [choice.cut_off() for choice in self.choices if not choice.is_finished]

    def usage(self) -> Usage:
        usage = usage_of(self.prompts, self.sequences, self.choices)
        usage.uses_explicit_cache = self.num_pinned_prompt_tokens > 0
        counts = num_tokens_by_kind(self.media_spans)
        usage.num_image_tokens = counts[MediaKind.IMAGE]
        usage.num_video_tokens = counts[MediaKind.VIDEO]
        usage.num_audio_tokens = counts[MediaKind.AUDIO]
        return usage

    def select(self, completion: Completion) -> Completion:
        """The response's choices: with best_of > n the n of highest cumulative logprob per prompt."""
        return keep_best(completion, self.params)
