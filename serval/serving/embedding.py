"""Embeddings on the serving side: inputs to prompt ids, the engine's vectors to the vectors asked for.

Owns the text rules: strings are tokenized as sentence-transformers tokenizes them (the tokenizer's special
tokens added: Qwen3-Embedding's trailing <|endoftext|> is what its last-token pooling reads), token-id inputs
are checked against the vocabulary, every prompt must be non-empty and fit the context (no silent
truncation), and `dimensions` keeps a Matryoshka prefix of each vector, renormalized when the model
normalizes (so a shortened vector is still unit length, as OpenAI's are). Every refusal is an
InvalidRequestError naming `input` or `dimensions`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from serval.serving.errors import InvalidRequestError, from_engine

if TYPE_CHECKING:
    from serval.engine.client import RunnerInfo
    from serval.serving.text_threads import TextThreads
    from serval.serving.tokenizer import Tokenizer

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


def check_prompts(prompts: list[list[int]], vocab_size: int, max_model_len: int) -> None:
    for i, prompt in enumerate(prompts):
        where = "input" if len(prompts) == 1 else f"input[{i}]"
        if not prompt:
            raise InvalidRequestError(f"{where} is empty: at least one token is needed", "input")
        if len(prompt) > max_model_len:
            raise InvalidRequestError(
                f"{where} has {len(prompt)} tokens; this model embeds at most {max_model_len}", "input"
            )
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"{where}: token id {bad} is outside the vocabulary [0, {vocab_size})", "input"
            )


def truncated(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    if dimensions is None or dimensions == len(vector):
        return vector
    head = vector[:dimensions]
    if not normalize:
        return head
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


async def embed(
    inputs: list[str | list[int]],
    dimensions: int | None,
    tokenizer: Tokenizer,
    text_threads: TextThreads,
    run: Callable[[list[list[int]]], Awaitable[list[list[float]]]],
    info: RunnerInfo,
    max_model_len: int,
) -> tuple[list[list[float]], int]:
    """(one vector per input, the prompt tokens in all). text_threads: where long texts are tokenized (off the
    event loop); run: the engine's embed; info: the served model's facts (a generative one is refused)."""
    if info.pooling is None:
        raise InvalidRequestError(
            f"{info.architecture or 'this model'} is a generative model, not an embedding model (its "
            "directory has no sentence-transformers modules.json with a Pooling module)",
            "model",
        )
    hidden_size, normalize = info.hidden_size, info.normalizes_embeddings
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequestError(
            f"input holds {len(inputs)} items; at most {MAX_INPUTS} are allowed", "input"
        )
    if dimensions is not None and dimensions > hidden_size:
        raise InvalidRequestError(
            f"dimensions ({dimensions}) is more than this model's {hidden_size}", "dimensions"
        )
    texts = [item for item in inputs if isinstance(item, str)]
    texts = iter(await text_threads.run(sum(map(len, texts)), _encode, tokenizer, texts))
    prompts = [next(texts) if isinstance(item, str) else list(item) for item in inputs]
    check_prompts(prompts, tokenizer.vocab_size, max_model_len)
    try:
        vectors = await run(prompts)
    except Exception as e:  # translated once, for the HTTP layer
        raise from_engine(e) from e
    return [truncated(v, dimensions, normalize) for v in vectors], sum(map(len, prompts))


def _encode(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer.encode_with_post_processor(text) for text in texts]
