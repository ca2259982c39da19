"""LLM: the offline entry point, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`.

`LLM.chat(messages)` renders conversations (media parts included) as the chat route does, and a prompt's
`multi_modal_data` (images, audio) is placed as vLLM places it (llm_media.py).

A synchronous driver over the server's own serving code: each prompt becomes a serving GenerationRequest
(serving/generation.py: the prompt rules and max_tokens resolution, the n / best_of / beam fan-out, the
incremental detokenizer and stop strings, the best n of best_of), and the Engine runs in the caller's thread
(no server, no event loop) instead of behind EngineClient. So a prompt gets the same tokens, text, finish
reason, usage and refusal message here as through the HTTP API.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tqdm import tqdm

from serval.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from serval.engine.engine import Engine
from serval.engine.outputs import TokenLogprob
from serval.entrypoints.llm_media import chat_prompt, multi_modal_prompt, offline_frontend
from serval.lifetime import freeze_long_lived_objects
from serval.sampling import SamplingParams
from serval.serving.errors import from_engine
from serval.serving.generation import GenerationRequest, PromptRules
from serval.serving.media.limits import MediaConfig
from serval.serving.media.processor import media_processor_for
from serval.serving.stream import ChoiceResult, Fold, LogprobEntry, Usage
from serval.serving.tokenizer import Tokenizer


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
        batch_activations: str = "int8",
        tensor_parallel_size: int = 1,
    ):
        """tensor_parallel_size: split the model over that many processes (docs/deploy/tensor-parallel.md);
        close() stops them (else they stop when this process exits)."""
        config = EngineConfig(
            model=ModelConfig(
                model=model,
                dtype=dtype,
                device=device,
                max_model_len=max_model_len,
                seed=seed,
                batch_activations=batch_activations,
            ),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                num_blocks=num_kv_blocks,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
            ),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
        )
        self.engine = Engine(config)
        self.tokenizer = Tokenizer.from_source(self.engine.source)
        source = self.engine.source
        # A multimodal checkpoint's processor (its preprocessor_config.json); None for a text-only model.
        self.media_processor = None if source.is_gguf else media_processor_for(source.path)
        self.media_config = MediaConfig()
        self._frontend = None  # serving's Frontend, for chat (built on first use)
        self.model_name = os.path.basename(os.path.normpath(source.path))  # as refusals name it
        # The server's rules without a deployment's extra caps (maxInputTokenLen, maxIterTimes, per-request
        # sequence limit): the context alone bounds a prompt and its answer.
        self.rules = PromptRules(self.engine.max_model_len)
        self._next_id = 0
        freeze_long_lived_objects()  # out of the collector's passes until exit (as in `serval serve`)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot run after this)."""
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
        if self._frontend is None:
            self._frontend = offline_frontend(self.engine.max_model_len, self.tokenizer, self.media_processor)
        requests = []
        for conversation, params in zip(conversations, params_list):
            ids, plan, spans = chat_prompt(
                self._frontend, self.model_name, conversation, add_generation_prompt, chat_template_kwargs
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
        self._add(requests)
        try:
            folds = self._run(requests, use_tqdm)
        except BaseException:  # a failed step, Ctrl-C: leave nothing running
            for request in requests:
                for new in request.new_requests:
                    self.engine.abort_request(new.request_id)
            raise
        return [
            _generation_output(request, text, fold) for request, text, fold in zip(requests, texts, folds)
        ]

    def _prompt_ids(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return None, list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)  # as the server's completions

    def _add(self, requests: list[GenerationRequest]) -> None:
        """Add every engine request of every prompt, or (one refused) none: those added are aborted."""
        added: list[str] = []
        try:
            for request in requests:
                for new in request.new_requests:
                    self.engine.add_request(
                        new.request_id, new.prompt_token_ids, new.params, new.eos_token_ids, new.constraint,
                        new.num_pinned_prompt_tokens, new.share_prompt_with, lora_name=new.lora_name,
                        media=new.media,
                    )  # fmt: skip
                    added.append(new.request_id)
        except Exception as e:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise from_engine(e) from e

    def _run(self, requests: list[GenerationRequest], use_tqdm: bool) -> list[Fold]:
        """Step the engine until every request is done; each request's events folded as the server folds them."""
        owner = {new.request_id: i for i, request in enumerate(requests) for new in request.new_requests}
        folds = [Fold() for _ in requests]
        total = sum(len(request.choices) for request in requests)
        with tqdm(total=total, desc="generating", unit="seq", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests() and not all(r.is_finished for r in requests):
                for output in self.engine.step():
                    i = owner[output.request_id]
                    deltas, is_cut_short = requests[i].feed(output)
                    if is_cut_short:
                        self.engine.abort_request(output.request_id)  # a stop string matched
                    for delta in deltas:
                        folds[i].add(delta)
                        bar.update(int(delta.finish_reason is not None))
        for request, fold in zip(requests, folds):
            fold.add(request.usage())
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
