"""LLM: the offline entry point, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`.

It drives the Engine in the caller's thread (no server, no event loop) and turns token ids into text with
the model's tokenizer, through the same incremental detokenizer and stop-string matcher as the server
(serving/stream.py). `n > 1` runs n engine requests; a stop string ends a request at its first match.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tqdm import tqdm

from serval.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from serval.engine.engine import Engine
from serval.engine.outputs import TokenLogprob
from serval.sampling import SamplingParams
from serval.serving.stream import ChoiceStream
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


@dataclass
class _Choice:
    index: int
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    stream: ChoiceStream | None = None  # detokenizer + stop strings, shared with the server's path


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
    ):
        config = EngineConfig(
            model=ModelConfig(
                model=model, dtype=dtype, device=device, max_model_len=max_model_len, seed=seed
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
        )
        self.engine = Engine(config)
        self.tokenizer = Tokenizer.from_source(self.engine.source)
        self._next_id = 0

    def generate(
        self,
        prompts: str | dict | list,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerationOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = (
            sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        results, choices = [], {}
        for prompt, params in zip(prompts, params_list):
            params = params or SamplingParams()
            prompt_text, prompt_ids = self._prompt_ids(prompt)
            result = GenerationOutput(str(self._next_id), prompt_text, prompt_ids, [])
            self._next_id += 1
            for i in range(params.n):
                choice_params = params
                if params.seed is not None and i > 0:
                    # Each choice draws from its own seeded stream, so n choices differ yet reproduce.
                    choice_params = _replace_seed(params, params.seed + i)
                engine_id = f"{result.request_id}-{i}"
                self.engine.add_request(engine_id, prompt_ids, choice_params, self.tokenizer.eos_token_ids)
                stream = ChoiceStream(i, self.tokenizer, choice_params, return_logprobs=False)
                choices[engine_id] = (result, _Choice(i, choice_params, stream=stream))
            results.append(result)
        self._run(choices, use_tqdm)
        for result, choice in choices.values():
            result.outputs.append(_to_completion(choice))
        for result in results:
            result.outputs.sort(key=lambda c: c.index)
        return results

    def _prompt_ids(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return None, list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        return prompt, self.tokenizer.encode(prompt, add_special_tokens=self.tokenizer.add_bos_token)

    def _run(self, choices: dict, use_tqdm: bool) -> None:
        with tqdm(total=len(choices), desc="generating", unit="seq", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    result, choice = choices[output.request_id]
                    if output.new_logprobs is not None:
                        choice.logprobs = (choice.logprobs or []) + output.new_logprobs
                    choice.token_ids.extend(output.new_token_ids)
                    result.num_cached_tokens = output.num_cached_tokens
                    delta = choice.stream.feed(output)
                    if delta is None:
                        continue  # ended earlier by a stop string
                    choice.text += delta.text
                    if choice.stream.is_finished:
                        choice.finish_reason = choice.stream.finish_reason
                        matched = choice.stream.stop_matcher.matched
                        choice.stop_reason = matched if matched is not None else output.stop_token_id
                        if not output.finished:
                            self.engine.abort_request(output.request_id)  # a stop string matched
                        bar.update(1)


def _replace_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed)


def _to_completion(choice: _Choice) -> CompletionOutput:
    cumulative = sum(lp.logprob for lp in choice.logprobs) if choice.logprobs else None
    return CompletionOutput(
        index=choice.index,
        text=choice.text,
        token_ids=choice.token_ids,
        cumulative_logprob=cumulative,
        logprobs=choice.logprobs,
        finish_reason=choice.finish_reason,
        stop_reason=choice.stop_reason,
    )
