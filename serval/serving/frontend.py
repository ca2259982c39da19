"""Frontend: the text side of the server: a parsed API request -> GenerationRequest -> events and a Completion.

Owns what the engine does not, for the server: the chat template and tokenization (off the event loop for long
text), the answer's shape for chat (serving/chat.py: tools in the prompt, the grammar compiled before
submission, the reasoning and tool-call parsers), building each API request's GenerationRequest
(serving/generation.py: prompt rules, fan-out, stop strings, best_of), and running it on the event loop:
admitting its engine requests together, reading their outputs from one queue, the request deadline and a
shutdown's grace period (serving/drain.py; the running itself is serving/run.py's). The HTTP layer above
only parses, authenticates and frames.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from serval.engine.client import EngineClient, EngineStats, RunnerInfo
from serval.sampling import SamplingParams
from serval.serving import embedding
from serval.serving.chat import ChatOptions, ChatPrompt, grammar_spec, prepare_messages
from serval.serving.chat_template import ChatTemplate, ChatTemplateError
from serval.serving.client_text import CacheSpan, Segment
from serval.serving.drain import Drain
from serval.serving.errors import InvalidRequestError
from serval.serving.generation import GenerationRequest, PromptRules
from serval.serving.grammar_pool import GrammarLimits
from serval.serving.harmony import STRUCTURE_TOKENS, prompt_message
from serval.serving.lora import LoraAdapters
from serval.serving.media.limits import MediaConfig
from serval.serving.media.loader import MediaLoader
from serval.serving.media.parts import MediaKind, MediaPart, check_accepted
from serval.serving.media.processor import MediaItem, MediaProcessor, MediaSpan
from serval.serving.output import OutputPlan, chat_plan
from serval.serving.reasoning import THINK_END, THINK_START, prompt_opens_reasoning
from serval.serving.reasoning_formats import reasoning_format_for_template
from serval.serving.run import run_requests
from serval.serving.segment_encoding import answer_start, encode_segments
from serval.serving.stream import Completion, Event, fold
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
        media_config: MediaConfig | None = None,
        media_processor: MediaProcessor | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        """media_processor: the served model's (serving/media/processor.py); None for a text-only model.
        tool_call_format, reasoning_parser: a registry name, or None: chosen from the chat template."""
        self.engine = engine
        self.rules = PromptRules(engine.max_model_len, max_input_tokens, max_iter_times, max_seqs_per_request)
        self.tokenizer = tokenizer
        source = chat_template or tokenizer.chat_template
        self.template_source = source
        self.chat_template = (
            ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token, tokenizer.special_token_texts)
            if source is not None
            else None
        )
        self.tool_format = format_for_template(source, tool_call_format, tokenizer.special_token_texts)
        self.reasoning_format = reasoning_format_for_template(source, reasoning_parser)
        # xgrammar is imported, and its worker processes started, on the first structured request. An answer
        # keeps its markup's special tokens as text (harmony's, Kimi-K2's <|tool_call_begin|>...): grammars
        # may write them.
        self.think_markup = (THINK_START, THINK_END) if self.reasoning_format is not None else ()
        markup = frozenset(self.tool_format.markup + self.think_markup)
        text_tokens = frozenset(STRUCTURE_TOKENS) if self.tool_format.is_harmony else markup
        self.grammars = GrammarCompiler(tokenizer, grammar_limits, text_tokens)
        self.loras = LoraAdapters(engine)
        self.drain = Drain()  # graceful shutdown: begun by the HTTP server on SIGTERM
        self.text_threads = TextThreads()
        self.media = MediaLoader(media_config or MediaConfig())
        self.media_processor = media_processor
        if media_processor is not None:
            self.media.warn_if_short_of_spool_space()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def runner_info(self) -> RunnerInfo:
        return self.engine.runner_info

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def health(self) -> dict[str, Any]:
        """/health's body: {"status": "ok"} for one engine; replicas add their own (serval/cluster/)."""
        return self.engine.health()

    @property
    def media_kinds(self) -> frozenset[MediaKind]:
        """The media kinds the served model reads: none for a text-only model."""
        return self.media_processor.accepts if self.media_processor is not None else frozenset()

    def check_media(self, parts: tuple[MediaPart, ...], model: str) -> None:
        """A 400 naming the first part the served model cannot read, before anything is fetched."""
        check_accepted(parts, self.media_kinds, model)

    # ---- requests

    async def chat_request(
        self,
        request_id: str,
        prompt: ChatPrompt,
        options: ChatOptions,
        params: SamplingParams,
        lora_name: str | None = None,
    ) -> GenerationRequest:
        """A chat request, rendered, tokenized, its grammar compiled and its sequences planned; raises a
        ServingError (a 4xx) before anything reaches the engine. The caller has checked the number of
        sequences (check_num_sequences)."""
        items: list[MediaItem] = []
        if prompt.media:
            assert self.media_processor is not None, "check_media refuses media without a processor"
            items = await self.media.load(prompt.media, self.media_processor)
        token_ids, plan, num_pinned, spans = await self.prepare_chat(prompt, options, items)
        return self.new_request(
            request_id, [token_ids], params, output_plan=plan, num_pinned_prompt_tokens=num_pinned,
            lora_name=lora_name, media_spans=spans,
        )  # fmt: skip

    async def completion_request(
        self,
        request_id: str,
        prompts: list[str | list[int]],
        params: SamplingParams,
        lora_name: str | None = None,
        echo: bool = False,
    ) -> GenerationRequest:
        """A completions request: text prompts tokenized, token prompts checked, sequences planned (their
        number checked by the caller: check_num_sequences)."""
        for prompt in prompts:
            if not isinstance(prompt, str):
                self.check_token_ids(prompt, "prompt")
        encoded = iter(await self.encode_prompts([p for p in prompts if isinstance(p, str)]))
        token_ids = [next(encoded) if isinstance(p, str) else list(p) for p in prompts]
        echoes = [p if isinstance(p, str) else self.decode(p) for p in prompts] if echo else None
        return self.new_request(request_id, token_ids, params, "prompt", lora_name=lora_name, echoes=echoes)

    def new_request(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        param: str = "messages",
        *,
        return_logprobs: bool | None = None,
        output_plan: OutputPlan | None = None,
        num_pinned_prompt_tokens: int = 0,
        lora_name: str | None = None,
        echoes: list[str] | None = None,
        media_spans: tuple[MediaSpan, ...] = (),
    ) -> GenerationRequest:
        return GenerationRequest(
            request_id, prompts, params, self.rules, self.tokenizer, param=param,
            return_logprobs=return_logprobs, output_plan=output_plan,
            num_pinned_prompt_tokens=num_pinned_prompt_tokens, lora_name=lora_name, echoes=echoes,
            media_spans=media_spans,
        )  # fmt: skip

    # ---- prompts

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        media: list[MediaItem] | None = None,
    ) -> list[int]:
        """The prompt ids of the messages, each loaded media item's run placed where its part sits."""
        segments = self._render(
            messages, add_generation_prompt, continue_final_message, tools, template_kwargs
        )
        return self._encode(segments, media or [])[0]

    async def prepare_chat(
        self, prompt: ChatPrompt, options: ChatOptions, media: list[MediaItem] | None = None
    ) -> tuple[list[int], OutputPlan, int, tuple[MediaSpan, ...]]:
        """The prompt ids, the answer's OutputPlan (its grammar compiled here: a 400 if it can't be), how
        many leading prompt tokens to pin in the explicit cache (the end of the last cache span), and where
        the loaded media's runs sit in the ids."""
        messages, tools, spans = prepare_messages(
            prompt.messages, options, self.tool_format, self.template_source, prompt.cache_spans
        )
        continue_final_message = prompt.continue_final_message
        # Rendered and tokenized together, off the event loop when the text is long (serving/text_threads.py).
        segments, (token_ids, num_pinned_tokens, media_spans) = await self.text_threads.run(
            num_message_chars(messages),
            self._render_and_encode,
            messages, media or [], prompt.add_generation_prompt, continue_final_message, tools,
            prompt.template_kwargs, spans,
        )  # fmt: skip
        thinks = self.reasoning_format is not None
        starts_in_reasoning = thinks and prompt_opens_reasoning(
            answer_start(segments, continue_final_message)
        )
        reasoning = "open" if starts_in_reasoning else ("optional" if thinks else "none")
        spec = grammar_spec(options, self.tool_format, reasoning)
        param = "tools" if options.uses_tools else "response_format"
        grammar = await self.grammars.compile(spec, param) if spec is not None else None
        is_harmony = self.tool_format.is_harmony
        plan = chat_plan(
            self.tokenizer, options, self.tool_format, self.reasoning_format, starts_in_reasoning, grammar,
            prompt_message(segments) if is_harmony else None,
        )  # fmt: skip
        return token_ids, plan, num_pinned_tokens, media_spans

    async def count_chat_tokens(self, prompt: ChatPrompt, options: ChatOptions) -> int:
        """How many tokens the chat prompt is, its tools shown as a chat request would show them (no grammar
        is compiled); media parts (checked by check_media) are loaded to count their runs."""
        items: list[MediaItem] = []
        if prompt.media:
            assert self.media_processor is not None, "check_media refuses media without a processor"
            items = await self.media.load(prompt.media, self.media_processor)
        messages, tools, spans = prepare_messages(
            prompt.messages, options, self.tool_format, self.template_source, prompt.cache_spans
        )
        _, (token_ids, _, _) = await self.text_threads.run(
            num_message_chars(messages),
            self._render_and_encode,
            messages, items, prompt.add_generation_prompt, prompt.continue_final_message, tools,
            prompt.template_kwargs, spans,
        )  # fmt: skip
        return len(token_ids)

    async def tokenize_chat(
        self, messages: list[dict[str, Any]], media: tuple[MediaPart, ...] = (), **kwargs: Any
    ) -> list[int]:
        """render_chat, off the event loop when the text is long; the media parts (checked by check_media)
        loaded as a chat request's are, so that their runs count as the prompt's tokens (vLLM's /tokenize)."""
        items: list[MediaItem] = []
        if media:
            assert self.media_processor is not None, "check_media refuses media without a processor"
            items = await self.media.load(media, self.media_processor)
        return await self.text_threads.run(
            num_message_chars(messages), self.render_chat, messages, media=items, **kwargs
        )

    async def encode_prompts(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Raw completion prompts' ids (a raw prompt is the client's own template: special tokens in it are
        meant as such), off the event loop when the text is long. add_special_tokens: BOS as the model wants."""
        return await self.text_threads.run(
            sum(map(len, texts)), lambda: [self.tokenizer.encode(t, add_special_tokens) for t in texts]
        )

    def _render_and_encode(
        self, messages: list[dict[str, Any]], media: list[MediaItem], *render_args: Any
    ) -> tuple[list[Segment], tuple[list[int], int, tuple[MediaSpan, ...]]]:
        segments = self._render(messages, *render_args)
        return segments, self._encode(segments, media)

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None,
        cache_spans: tuple[CacheSpan, ...] = (),
    ) -> list[Segment]:
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template: use /v1/completions or start the server with --chat-template",
                "messages",
            )
        if self.reasoning_format is not None:  # the request's thinking switch, by this template's name
            template_kwargs = self.reasoning_format.template_kwargs(template_kwargs)
        try:
            segments = self.chat_template.render(
                messages, add_generation_prompt, continue_final_message, tools, template_kwargs, cache_spans
            )
        except ChatTemplateError as e:
            raise InvalidRequestError(str(e), "messages") from e
        return segments

    def _encode(
        self, segments: list[Segment], media: list[MediaItem] | None = None
    ) -> tuple[list[int], int, tuple[MediaSpan, ...]]:
        return encode_segments(segments, self.tokenizer, media or [], self.media_processor)

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
        return self.rules.resolve_max_tokens(num_prompt_tokens, requested, param)

    def check_num_sequences(self, num_prompts: int, params: SamplingParams, param: str) -> None:
        """--max-seqs-per-request: checked once, where the API parses a request (before its messages' checks,
        a template render, a grammar compile or tokenizing thousands of prompts), not again when planning."""
        self.rules.check_num_sequences(num_prompts, params, param)

    async def embed(
        self, inputs: list[str | list[int]], dimensions: int | None
    ) -> tuple[list[list[float]], int]:
        """An embedding model's vectors of the inputs, and their prompt tokens (serving/embedding.py)."""
        return await embedding.embed(
            inputs, dimensions, self.tokenizer, self.text_threads, self.engine.embed, self.runner_info,
            self.max_model_len,
        )  # fmt: skip

    # ---- running a request

    async def events(
        self,
        request: GenerationRequest,
        timeout: float | None = None,
        observe: Callable[[Event], None] | None = None,
    ) -> AsyncIterator[Event]:
        """ChoiceDeltas of all of the request's choices as they come (interleaved), then one Usage; each is
        passed to `observe` first (the API's metrics). Closing the iterator aborts every engine request
        still running.

        Every sequence is admitted or none: a refusal (ServerBusyError for a full queue, ModelNotFoundError
        for an adapter unloaded meanwhile, ...) is raised at the first event, before anything reaches the
        engine. The request timeout and the end of a shutdown's grace period (serving/drain.py) cut every
        choice off with what it has."""
        async with contextlib.aclosing(
            run_requests(self.engine, self.drain, [request], timeout, observe)
        ) as run:
            async for _, event in run:
                yield event

    async def result(
        self,
        request: GenerationRequest,
        timeout: float | None = None,
        observe: Callable[[Event], None] | None = None,
    ) -> Completion:
        """The non-streaming result: the fold of `events`, keeping the best n of best_of per prompt."""
        async with contextlib.aclosing(self.events(request, timeout, observe)) as events:
            return request.select(await fold(events))

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
        """`events` of a request of token-id prompts, planned at the first event (tests and tools)."""
        request = self.new_request(
            request_id, prompts, params, param, return_logprobs=return_logprobs, output_plan=output_plan,
            num_pinned_prompt_tokens=num_pinned_prompt_tokens, lora_name=lora_name,
        )  # fmt: skip
        async with contextlib.aclosing(self.events(request, timeout)) as events:
            async for event in events:
                yield event

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
        """`result` of a request of token-id prompts (tests and tools)."""
        request = self.new_request(
            request_id, prompts, params, param, return_logprobs=return_logprobs, output_plan=output_plan
        )
        return await self.result(request, timeout)
