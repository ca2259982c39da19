"""Frontend: the text side of a request: messages -> prompt ids -> engine requests -> text events.

Owns what the engine does not: the chat template and tokenization, the prompt-length rules (context length,
MindIE's maxInputTokenLen and maxIterTimes), fanning one request out into n (or best_of) engine requests per
prompt (at most --max-seqs-per-request in all, admitted together or not at all) and merging their deltas,
stop strings (an engine request is aborted at its stop string), the request deadline and a shutdown's grace
period (serving/drain.py), and choosing the best n of best_of. For chat it also plans the answer's shape
(serving/chat.py): tools in the prompt, the grammar compiled before submission, one constraint per engine
request, and the reasoning and tool-call parsers of each choice. The HTTP layer above only validates and
frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from serval.engine.client import EngineClient, EngineStats, NewRequest, RequestStream, RunnerInfo
from serval.sampling import SamplingParams
from serval.serving.chat import ChatOptions, grammar_spec, prepare_messages, template_thinks
from serval.serving.chat_template import ChatTemplate, ChatTemplateError, Segment
from serval.serving.choices import (
    SequencePlan,
    beam_choice_output,
    check_num_sequences,
    keep_best,
    plan_sequences,
    usage_of,
)
from serval.serving.drain import CUT_OFF, Drain
from serval.serving.errors import InvalidRequestError, from_engine
from serval.serving.grammar_pool import GrammarLimits
from serval.serving.lora import LoraAdapters
from serval.serving.output import OutputPlan
from serval.serving.reasoning import THINK_END, prompt_opens_reasoning
from serval.serving.stream import ChoiceStream, Completion, Event, fold
from serval.serving.structured import GrammarCompiler
from serval.serving.text_threads import TextThreads, num_message_chars
from serval.serving.tool_calls import format_for_template

if TYPE_CHECKING:
    from serval.serving.tokenizer import Tokenizer


class Frontend:
    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Tokenizer,
        chat_template: str | None = None,
        max_input_tokens: int | None = None,
        max_iter_times: int | None = None,
        tool_call_format: str | None = None,
        max_seqs_per_request: int | None = None,
        grammar_limits: GrammarLimits | None = None,
    ) -> None:
        self.engine = engine
        # Most sequences (prompts x max(n, best_of)) one request may ask for; None: only the queue bounds it.
        self.max_seqs_per_request = max_seqs_per_request
        self.tokenizer = tokenizer
        source = chat_template or tokenizer.chat_template
        self.template_source = source
        self.chat_template = (
            ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token, tokenizer.special_token_texts)
            if source is not None
            else None
        )
        self.max_input_tokens = max_input_tokens
        self.max_iter_times = max_iter_times
        self.tool_format = format_for_template(source, tool_call_format)
        # xgrammar is imported, and its worker processes started, on the first structured request.
        self.grammars = GrammarCompiler(tokenizer, grammar_limits)
        self.loras = LoraAdapters(engine)
        self.drain = Drain()  # graceful shutdown: begun by the HTTP server on SIGTERM
        self.text_threads = TextThreads()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def runner_info(self) -> RunnerInfo:
        return self.engine.runner_info

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # ---- prompts

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        segments = self._render(
            messages, add_generation_prompt, continue_final_message, tools, template_kwargs
        )
        return self._encode(segments)[0]

    async def prepare_chat(
        self,
        messages: list[dict[str, Any]],
        options: ChatOptions,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        cache_point: tuple[int, int] | None = None,
    ) -> tuple[list[int], OutputPlan, int]:
        """The prompt ids, the answer's OutputPlan (its grammar compiled here: a 400 if it can't be) and how
        many leading prompt tokens to pin in the explicit cache.

        cache_point: (message index, characters of its text) where the cache_control prefix ends, or None.
        """
        marker = None
        if cache_point is not None:
            # A marker no client text can contain rides in the text through the tool and reasoning rewrites
            # (which prepend and wrap) to the renderer, which splits the segments there.
            index, offset = cache_point
            marker = f"SERVALCACHE{secrets.token_hex(8)}E"
            text = messages[index]["content"]
            messages = list(messages)
            messages[index] = {**messages[index], "content": text[:offset] + marker + text[offset:]}
        messages, tools = prepare_messages(messages, options, self.tool_format, self.template_source)
        # Rendered and tokenized together, off the event loop when the text is long (serving/text_threads.py).
        segments, (token_ids, num_pinned_tokens) = await self.text_threads.run(
            num_message_chars(messages),
            self._render_and_encode,
            messages, add_generation_prompt, continue_final_message, tools, template_kwargs, marker,
        )  # fmt: skip
        thinks = template_thinks(self.template_source)
        starts_in_reasoning = thinks and prompt_opens_reasoning(_tail(segments, continue_final_message))
        reasoning = "open" if starts_in_reasoning else ("optional" if thinks else "none")
        spec = grammar_spec(options, self.tool_format, reasoning)
        param = "tools" if options.uses_tools else "response_format"
        grammar = await self.grammars.compile(spec, param) if spec is not None else None
        budget = options.thinking_budget
        plan = OutputPlan(
            parses_reasoning=thinks,
            starts_in_reasoning=starts_in_reasoning,
            tool_format=self.tool_format if options.uses_tools else None,
            tool_names=frozenset(t.name for t in options.tools),
            grammar=grammar,
            thinking_budget=budget,
            think_end_token_ids=tuple(self.tokenizer.encode(f"\n{THINK_END}\n\n")) if budget else (),
        )
        return token_ids, plan, num_pinned_tokens

    async def tokenize_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """render_chat, off the event loop when the text is long."""
        return await self.text_threads.run(num_message_chars(messages), self.render_chat, messages, **kwargs)

    async def encode_prompts(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Raw completion prompts' ids (a raw prompt is the client's own template: special tokens in it are
        meant as such), off the event loop when the text is long. add_special_tokens: BOS as the model wants."""
        return await self.text_threads.run(
            sum(map(len, texts)), lambda: [self.tokenizer.encode(t, add_special_tokens) for t in texts]
        )

    def _render_and_encode(
        self, messages: list[dict[str, Any]], *render_args: Any
    ) -> tuple[list[Segment], tuple[list[int], int]]:
        segments = self._render(messages, *render_args)
        return segments, self._encode(segments)

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None,
        cache_marker: str | None = None,
    ) -> list[Segment]:
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template: use /v1/completions or start the server with --chat-template",
                "messages",
            )
        try:
            segments = self.chat_template.render(
                messages, add_generation_prompt, continue_final_message, tools, template_kwargs, cache_marker
            )
        except ChatTemplateError as e:
            raise InvalidRequestError(str(e), "messages") from e
        return segments

    def _encode(self, segments: list[Segment]) -> tuple[list[int], int]:
        """The prompt ids, and how many of them the explicit-cache prefix covers (0 without one)."""
        token_ids: list[int] = []
        num_prefix_tokens = 0
        for segment in segments:
            if segment.is_client_text:
                token_ids.extend(self.tokenizer.encode_plain(segment.text))
            else:
                token_ids.extend(self.tokenizer.encode(segment.text))
            if segment.ends_cache_prefix:
                num_prefix_tokens = len(token_ids)
        return token_ids, num_prefix_tokens

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.tokenizer.vocab_size
        for token_id in token_ids:
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(
                    f"token id {token_id} is outside the vocabulary [0, {vocab_size})", param
                )

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        self.check_token_ids(token_ids, "tokens")
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

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

    # ---- generation

    def plan(self, prompts: list[list[int]], params: SamplingParams, param: str) -> list[SequencePlan]:
        """One engine request per (prompt, sequence); raises InvalidRequestError before anything is sent."""
        self.check_num_sequences(len(prompts), params, param)
        return plan_sequences(
            prompts, params, lambda prompt: self.resolve_max_tokens(len(prompt), params.max_tokens, param)
        )

    def check_num_sequences(self, num_prompts: int, params: SamplingParams, param: str) -> None:
        """InvalidRequestError past --max-seqs-per-request (choices.check_num_sequences)."""
        check_num_sequences(num_prompts, params, self.max_seqs_per_request, param)

    async def generate(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        return_logprobs: bool = False,
        timeout: float | None = None,
        param: str = "messages",
        output_plan: OutputPlan | None = None,
        num_pinned_prompt_tokens: int = 0,
        lora_name: str | None = None,
    ) -> AsyncIterator[Event]:
        """ChoiceDeltas of all sequences as they come (interleaved), then one Usage. Closing the iterator
        aborts every engine request still running. num_pinned_prompt_tokens: the leading tokens of every
        prompt to pin in the explicit cache (cache_control). lora_name: the LoRA adapter to generate with
        (ModelNotFoundError if it is not loaded); None: the base model.

        Every sequence is admitted or none: a refusal (ServerBusyError for a full queue, ...) is raised at the
        first event, before anything reaches the engine. The request timeout and the end of a shutdown's grace
        period (serving/drain.py) cut every choice off with what it has."""
        sequences = self.plan(prompts, params, param)
        streams = [
            ChoiceStream(s.index + k, self.tokenizer, s.params, return_logprobs, output_plan)
            for s in sequences
            for k in range(s.num_choices)
        ]
        new_requests = [
            self._new_request(request_id, s, output_plan, num_pinned_prompt_tokens, lora_name)
            for s in sequences
        ]
        queue: asyncio.Queue = asyncio.Queue()
        self.drain.register(queue)  # ShuttingDownError once the grace period is over
        try:
            outputs = self.engine.add_requests(new_requests)
        except Exception as e:  # translated for the HTTP layer
            self.drain.unregister(queue)
            raise from_engine(e) from e
        tasks = [asyncio.create_task(self._pump(s, o, queue)) for s, o in zip(sequences, outputs)]
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        num_open = len(tasks)
        try:
            while num_open:
                try:
                    remaining = None if deadline is None else max(0.0, deadline - loop.time())
                    entry = await asyncio.wait_for(queue.get(), remaining)
                except TimeoutError:
                    entry = CUT_OFF
                if entry is CUT_OFF:
                    for stream in streams:
                        if not stream.is_finished:
                            yield stream.cut_off()
                    break
                index, item = entry
                if item is None:
                    num_open -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                stream = streams[index]
                delta = stream.feed(item)
                if delta is None:
                    continue
                if stream.is_finished and not item.finished:
                    tasks[index].cancel()  # a stop string matched: abort the engine request
                yield delta
            usage = usage_of(prompts, sequences, streams)
            usage.uses_explicit_cache = num_pinned_prompt_tokens > 0
            yield usage
        finally:
            # NOTE: no awaiting here: under a cancelled scope (a client that went away) every await would be
            # cancelled again. Closing a stream aborts its engine request unless it finished; a pump that never
            # ran would not close its own.
            self.drain.unregister(queue)
            for task in tasks:
                task.cancel()
            for output in outputs:
                output.close()

    async def complete(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        return_logprobs: bool = False,
        timeout: float | None = None,
        param: str = "messages",
        output_plan: OutputPlan | None = None,
    ) -> Completion:
        """The non-streaming result: the fold of `generate`, keeping the best n of best_of per prompt."""
        events = self.generate(request_id, prompts, params, return_logprobs, timeout, param, output_plan)
        async with contextlib.aclosing(events):
            return keep_best(await fold(events), params)

    def _new_request(
        self,
        request_id: str,
        sequence: SequencePlan,
        plan: OutputPlan | None,
        num_pinned_prompt_tokens: int,
        lora_name: str | None,
    ) -> NewRequest:
        tokenizer = self.tokenizer
        leader = sequence.leader_index
        return NewRequest(
            f"{request_id}-{sequence.index}",
            sequence.prompt_token_ids,
            sequence.params,
            tokenizer.eos_token_ids,
            constraint=plan.new_constraint(tokenizer.token_bytes, tokenizer.vocab_size) if plan else None,
            num_pinned_prompt_tokens=num_pinned_prompt_tokens,
            share_prompt_with=None if leader is None else f"{request_id}-{leader}",
            lora_name=lora_name,
        )

    async def _pump(self, sequence: SequencePlan, outputs: RequestStream, queue: asyncio.Queue) -> None:
        # Moves one engine request's outputs onto the shared queue, errors translated; None marks its end.
        try:  # NOTE: everything inside, so that whatever fails still ends with the None the caller waits for
            async for output in outputs:
                if output.beams is None:
                    queue.put_nowait((sequence.index, output))
                    continue
                # Beam search answers once, at the end ("pseudo streaming"): one finished output per beam.
                for k, beam in enumerate(output.beams):
                    queue.put_nowait((sequence.index + k, beam_choice_output(output, beam)))
        except Exception as e:  # noqa: BLE001 - reported to the client, never a hang
            queue.put_nowait((sequence.index, from_engine(e)))
        finally:
            outputs.close()
            queue.put_nowait((sequence.index, None))


def _tail(segments: list[Segment], continue_final_message: bool) -> str:
    """The prompt text where the answer begins: after the last client text (from it, when continuing it)."""
    client = [i for i, segment in enumerate(segments) if segment.is_client_text]
    start = (client[-1] if continue_final_message else client[-1] + 1) if client else 0
    return "".join(segment.text for segment in segments[start:])
