"""LLM: the offline entry point, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`.

It drives the Engine in the caller's thread (no server, no event loop) and turns token ids into text with
the model's tokenizer, through the same incremental detokenizer and stop-string matcher as the server
(serving/stream.py), and the same fan-out (serving/choices.py): n / best_of sequences that fork the first
one's prompt blocks, or a beam search. A stop string ends a request at its first match.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

from tqdm import tqdm

from serval.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from serval.engine.engine import Engine
from serval.engine.outputs import RequestOutput, TokenLogprob
from serval.sampling import SamplingParams
from serval.serving.choices import beam_choice_output, plan_sequences
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
        batch_activations: str = "float32",
    ):
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
        )
        self.engine = Engine(config)
        self.tokenizer = Tokenizer.from_source(self.engine.source)
        self._next_id = 0
        gc.freeze()  # the model's long-lived objects leave the collector's passes (as in `serval serve`)

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
            # The server's fan-out: n / best_of sequences forking the first one's prompt, or one beam search.
            max_tokens = params.max_tokens
            for seq in plan_sequences([prompt_ids], params, lambda _, cap=max_tokens: cap):
                engine_id = f"{result.request_id}-{seq.index}"
                leader = None if seq.leader_index is None else f"{result.request_id}-{seq.leader_index}"
                eos = self.tokenizer.eos_token_ids
                self.engine.add_request(engine_id, prompt_ids, seq.params, eos, share_prompt_with=leader)
                choices[engine_id] = (
                    result,
                    [
                        _Choice(
                            seq.index + k,
                            seq.params,
                            stream=ChoiceStream(seq.index + k, self.tokenizer, seq.params, False),
                        )
                        for k in range(seq.num_choices)
                    ],
                )
            results.append((result, params))
        self._run(choices, use_tqdm)
        for result, choice_list in choices.values():
            result.outputs.extend(_to_completion(choice) for choice in choice_list)
        for result, params in results:
            _keep_best(result, params)
        return [result for result, _ in results]

    def _prompt_ids(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return None, list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        return prompt, self.tokenizer.encode(prompt, add_special_tokens=self.tokenizer.add_bos_token)

    def _run(self, choices: dict, use_tqdm: bool) -> None:
        total = sum(len(choice_list) for _, choice_list in choices.values())
        with tqdm(total=total, desc="generating", unit="seq", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    result, choice_list = choices[output.request_id]
                    result.num_cached_tokens = output.num_cached_tokens
                    if output.beams is None:
                        bar.update(self._feed(choice_list[0], output))
                        continue
                    for choice, beam in zip(choice_list, output.beams):  # a beam search ends all at once
                        bar.update(self._feed(choice, beam_choice_output(output, beam)))

    def _feed(self, choice: _Choice, output: RequestOutput) -> int:
        """Fold one engine output into its choice; 1 when that finished the choice (for the progress bar)."""
        if output.new_logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + output.new_logprobs
        choice.token_ids.extend(output.new_token_ids)
        delta = choice.stream.feed(output)
        if delta is None:
            return 0  # ended earlier by a stop string
        choice.text += delta.text
        if not choice.stream.is_finished:
            return 0
        choice.finish_reason = choice.stream.finish_reason
        matched = choice.stream.stop_matcher.matched
        choice.stop_reason = matched if matched is not None else output.stop_token_id
        if not output.finished:
            self.engine.abort_request(output.request_id)  # a stop string matched
        return 1


def _keep_best(result: GenerationOutput, params: SamplingParams) -> None:
    """best_of > n: keep the n outputs of highest cumulative logprob (re-indexed); logprobs only if asked."""
    result.outputs.sort(key=lambda c: c.index)
    if params.use_beam_search or max(params.n, params.best_of or 1) == params.n:
        return
    ranked = sorted(result.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[: params.n]
    for index, output in enumerate(ranked):
        output.index = index
        if params.logprobs is None:
            output.logprobs = None
    result.outputs = ranked


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
