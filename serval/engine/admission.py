"""The engine's admission rules that need no engine state: a function of fixed numbers, run once per request by
whatever hands requests to the engine, before anything is queued: EngineClient.add_requests on the event loop
(and cluster/client.py's client of the replicas, which has the same interface). So a refusal is raised to the
caller at once and leaves nothing queued. Engine.add_request checks only what needs the engine's state (a
request id in use, an adapter unloaded meanwhile, token ids outside the runner's vocabulary, media).

Serving resolves max_tokens so that its requests always fit (serving/generation.py's PromptRules, whose
messages are what HTTP clients see); these rules are the engine's own contract with every other caller.
"""

from __future__ import annotations

from collections.abc import Mapping

from serval.engine.lora import UnknownLoraError
from serval.engine.messages import NewRequest
from serval.sampling import SamplingParams


class PromptTooLongError(ValueError):
    """The prompt (plus the tokens asked for) can't fit the context or the KV cache."""


def check_prompt(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> None:
    """PromptTooLongError unless the prompt and the tokens asked for fit the context."""
    if num_prompt_tokens == 0:
        raise PromptTooLongError("the prompt is empty: at least one token is needed")
    needed = num_prompt_tokens + (params.max_tokens or 1)
    if num_prompt_tokens >= max_model_len or needed > max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} tokens and {params.max_tokens or 1} more were requested ({needed} in all)"
        )


def check_admissible(
    requests: list[NewRequest], max_model_len: int, loras: Mapping[str, object], max_queue_len: int
) -> list[str]:
    """ValueError (a prompt the context can't hold, with the numbers; ids not distinct; more requests than the
    queue could ever hold) or UnknownLoraError. Returns the request ids."""
    for request in requests:
        check_prompt(len(request.prompt_token_ids), request.params, max_model_len)
        if request.lora_name is not None and request.lora_name not in loras:
            raise UnknownLoraError(f"the LoRA adapter {request.lora_name!r} is not loaded")
    ids = [request.request_id for request in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be distinct")
    if len(requests) > max_queue_len:
        raise ValueError(
            f"{len(requests)} sequences at once can never be admitted: at most {max_queue_len} may wait"
        )
    return ids
