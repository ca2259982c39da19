"""LLM: the offline entry point, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`.

`LLM.chat(messages)` renders conversations (media parts included) as the chat route does, and a prompt's
`multi_modal_data` (images, audio) is placed as vLLM places it (llm_media.py).

A synchronous client of the server's own pipeline: each prompt becomes a serving GenerationRequest
(serving/generation.py: the prompt rules and max_tokens resolution, the n / best_of / beam fan-out, the
incremental detokenizer and stop strings, the best n of best_of), and all of one call's requests are run
together by serving/run.py over an EngineClient, on an event loop of the LLM's own (offline_loop.py), so a
call works inside a running event loop too (Jupyter). So a prompt gets the same tokens, text, finish reason,
usage and refusal message here as through the HTTP API.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass

from tqdm import tqdm

from serval.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from serval.engine.loading import build_engine
from serval.engine.outputs import TokenLogprob
from serval.entrypoints.llm_media import chat_prompt, multi_modal_prompt
from serval.entrypoints.offline_loop import OfflineLoop
from serval.lifetime import freeze_long_lived_objects
from serval.sampling import SamplingParams
from serval.serving.generation import GenerationRequest, PromptRules
from serval.serving.media.limits import MediaConfig
from serval.serving.media.processor import media_processor_for
from serval.serving.run import run_requests
from serval.serving.stream import ChoiceResult, Event, Fold, LogprobEntry, Usage
from serval.serving.tokenizer import Tokenizer

# Every prompt of a call is admitted at once (all or none), and a batch job may hand over many thousands: the
# offline LLM has no waiting-queue limit to refuse them against.
OFFLINE_MAX_QUEUE_LEN = 2**31 - 1


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class GenerationOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True
    usage: Usage | None = None  # the server's usage of the same request (all sequences counted)


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_memory_bytes: int = CacheConfig.kv_cache_memory_bytes,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        batch_activations: str = "auto",
        deterministic: bool = False,
        tensor_parallel_size: int = 1,
        speculative_config: dict | SpeculativeConfig | None = None,
        attention_backend: str = "auto",
        cuda_graph_max_batch: int = ModelConfig.cuda_graph_max_batch,
        kv_cache_dtype: str = CacheConfig.kv_cache_dtype,
    ):
        """tensor_parallel_size: split the model over that many processes (docs/deploy/tensor-parallel.md);
        close() stops them (else they stop when this process exits). speculative_config: vLLM's keys
        ({"method": "ngram", "num_speculative_tokens": 4, ...}; config.SpeculativeConfig).
        deterministic, attention_backend, cuda_graph_max_batch: ModelConfig's (docs/cuda.md).
        kv_cache_dtype: CacheConfig's ("bfloat16" under fp32 compute; "int8", "fp8_e5m2": 8-bit)."""
        if isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig.from_dict(speculative_config)
        config = EngineConfig(
            model=ModelConfig(
                model=model, dtype=dtype, device=device, max_model_len=max_model_len, seed=seed,
                batch_activations=batch_activations, attention_backend=attention_backend,
                cuda_graph_max_batch=cuda_graph_max_batch, deterministic=deterministic,
            ),
            cache=CacheConfig(
                block_size=block_size, kv_cache_memory_bytes=kv_cache_memory_bytes, num_blocks=num_kv_blocks,
                enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                max_queue_len=OFFLINE_MAX_QUEUE_LEN,
            ),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
            speculative=speculative_config or SpeculativeConfig(),
        )  # fmt: skip
        self.engine = build_engine(config)
        self.tokenizer = Tokenizer.from_source(self.engine.source)
        source = self.engine.source
        # A multimodal checkpoint's processor (its preprocessor_config.json); None for a text-only model.
        self.media_processor = None if source.is_gguf else media_processor_for(source.path)
        self.media_config = MediaConfig()
        self._loop: OfflineLoop | None = None  # the pipeline: started by the first generate or chat
        self._close_loop = None
        self.model_name = os.path.basename(os.path.normpath(source.path))  # as refusals name it
        # The server's rules without a deployment's caps (maxInputTokenLen, ...): the context alone bounds.
        self.rules = PromptRules(self.engine.max_model_len)
        self._next_id = 0
        freeze_long_lived_objects()  # out of the collector's passes until exit (as in `serval serve`)

    @property
    def pipeline(self) -> OfflineLoop:
        """The server's pipeline over this LLM's engine, started on first use: until then `engine` is the
        caller's to drive directly (bench/decode_step.py), from then on its engine thread's."""
        if self._loop is None:
            self._loop = OfflineLoop(self.engine, self.tokenizer, self.media_processor)
            # Its threads hold the engine: they stop when this LLM is collected (or at exit), not later.
            self._close_loop = weakref.finalize(self, self._loop.close)
        return self._loop

    def close(self) -> None:
        """Stop the engine thread and the tensor-parallel workers, if any (the engine cannot run after this)."""
        if self._close_loop is not None:
            self._close_loop()
        else:
            self.engine.runner.close()

    def generate(
        self,
        prompts: str | dict | list,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerationOutput]:
        """One GenerationOutput per prompt. Raises serving's InvalidRequestError (a ValueError, with the
        message the server answers 400 with) for a prompt it refuses; then nothing is left in the engine."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = (
            sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        texts, requests = [], []
        for prompt, params in zip(prompts, params_list):
            text, prompt_ids = self._prompt_ids(prompt)
            spans = ()
            if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
                prompt_ids, spans = multi_modal_prompt(
                    prompt_ids, prompt["multi_modal_data"], self.media_processor, self.media_config
                )
            texts.append(text)
            # Planned before anything is added: a refused prompt leaves the engine untouched.
            requests.append(self._request([prompt_ids], params, "prompt", media_spans=spans))
        return self._generate(requests, texts, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[GenerationOutput]:
        """One GenerationOutput per conversation (a list of OpenAI-style messages, or a list of those), its
        prompt rendered by the model's chat template with its media parts (image_url, input_audio, ...)
        fetched, decoded and placed as `/v1/chat/completions` does. Raises InvalidRequestError as generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        params_list = (
            sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(conversations)
        )
        if len(params_list) != len(conversations):
            raise ValueError("sampling_params must be one SamplingParams or one per conversation")
        pipeline = self.pipeline
        requests = []
        for conversation, params in zip(conversations, params_list):
            ids, plan, spans = pipeline.run(
                chat_prompt(
                    pipeline.frontend,
                    self.model_name,
                    conversation,
                    add_generation_prompt,
                    chat_template_kwargs,
                )
            )
            requests.append(self._request([ids], params, "messages", output_plan=plan, media_spans=spans))
        return self._generate(requests, [None] * len(requests), use_tqdm)

    def _request(self, prompts: list[list[int]], params: SamplingParams | None, param: str, **kwargs):
        request = GenerationRequest(
            str(self._next_id), prompts, params or SamplingParams(), self.rules, self.tokenizer, param=param,
            **kwargs,
        )  # fmt: skip
        self._next_id += 1
        return request

    def _generate(
        self, requests: list[GenerationRequest], texts: list[str | None], use_tqdm: bool
    ) -> list[GenerationOutput]:
        """Run every request together (admitted all or none, as one API request's sequences are)."""
        pipeline = self.pipeline
        total = sum(len(request.choices) for request in requests)
        with tqdm(total=total, desc="generating", unit="seq", disable=not use_tqdm) as bar:

            def observe(event: Event) -> None:
                bar.update(int(getattr(event, "finish_reason", None) is not None))

            folds = pipeline.run(_folds(pipeline, requests, observe))
        return [
            _generation_output(request, text, fold) for request, text, fold in zip(requests, texts, folds)
        ]

    def _prompt_ids(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return None, list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)  # as the server's completions


async def _folds(pipeline: OfflineLoop, requests: list[GenerationRequest], observe) -> list[Fold]:
    """Each request's events folded as the server folds them (its deltas, then its usage)."""
    folds = [Fold() for _ in requests]
    run = run_requests(pipeline.client, pipeline.frontend.drain, requests, observe=observe)
    async with contextlib.aclosing(run) as events:
        async for i, event in events:
            folds[i].add(event)
    return folds


def _generation_output(request: GenerationRequest, prompt: str | None, fold: Fold) -> GenerationOutput:
    completion = request.select(fold.result())
    usage = completion.usage
    return GenerationOutput(
        request.request_id,
        prompt,
        request.prompts[0],
        [_completion_output(choice) for choice in completion.choices],
        num_cached_tokens=usage.num_cached_tokens,
        usage=usage,
    )


def _completion_output(choice: ChoiceResult) -> CompletionOutput:
    return CompletionOutput(
        index=choice.index,
        text=choice.text,
        token_ids=choice.token_ids,
        cumulative_logprob=choice.cumulative_logprob,
        logprobs=None if choice.logprobs is None else [_token_logprob(entry) for entry in choice.logprobs],
        finish_reason=choice.finish_reason,
        stop_reason=choice.stop_reason,
    )


def _token_logprob(entry: LogprobEntry) -> TokenLogprob:
    return TokenLogprob(entry.token_id, entry.logprob, [(top.token_id, top.logprob) for top in entry.top])
