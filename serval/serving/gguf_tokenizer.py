"""A GGUF file's tokenizer, rebuilt from llama.cpp's tokenizer.ggml.* metadata (a GGUF carries no
tokenizer.json) the way llama.cpp itself tokenizes: byte-level BPE ("gpt2") with the pre-tokenizer split named
by tokenizer.ggml.pre, or SentencePiece-style BPE ("llama") with merges ranked by the pieces' scores.

Owns the splits, the vocabulary and merges, the added tokens and which control tokens end a generation; the
Tokenizer around it is tokenizer.py's.
"""

from __future__ import annotations

import re
import warnings
from types import MappingProxyType
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# llama.cpp's token types (tokenizer.ggml.token_type)
TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_BYTE = 3, 4, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o's split (MiniMax-M2's tokenizer.json): a word is an optional lead, capitals then lower-case letters
# (so "CamelCase" is two pieces), with its English contraction attached; digits in threes.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT_SPLIT = r"\p{N}"  # every digit its own piece, before the GPT-2 split (StarCoder-family vocabularies)
# tokenizer.ggml.pre -> the regex splits applied in order, as llama.cpp's llama-vocab.cpp does
_PRE_SPLITS: MappingProxyType[str, tuple[str, ...]] = MappingProxyType(
    {
        "default": (_GPT2_SPLIT,),
        "gpt2": (_GPT2_SPLIT,),
        "smollm": (_DIGIT_SPLIT, _GPT2_SPLIT),
        "starcoder": (_DIGIT_SPLIT, _GPT2_SPLIT),
        "refact": (_DIGIT_SPLIT, _GPT2_SPLIT),
        "llama-bpe": (_LLAMA3_SPLIT,),
        "llama3": (_LLAMA3_SPLIT,),
        "llama-v3": (_LLAMA3_SPLIT,),
        "smaug-bpe": (_LLAMA3_SPLIT,),
        "dbrx": (_LLAMA3_SPLIT,),
        "qwen2": (_QWEN2_SPLIT,),
        "deepseek-r1-qwen": (_QWEN2_SPLIT,),
        # llama.cpp's CHATGLM4 type (GLM-4, GLM-4.5, ChatGLM): Llama 3's split, but merges ranked as usual
        # and no BOS
        "glm4": (_LLAMA3_SPLIT,),
        "chatglm-bpe": (_LLAMA3_SPLIT,),
        "minimax-m2": (_GPT4O_SPLIT,),
        "gpt-4o": (_GPT4O_SPLIT,),
    }
)
# Vocabularies whose merges were learned with "a whole-word token beats merging" (HF: ignore_merges).
_IGNORE_MERGES_PRE = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"})
# NOTE: a GGUF names one eos id, but chat models end turns with other control tokens too; llama.cpp treats
# control tokens with these texts as end-of-generation as well, and so do we.
_END_OF_GENERATION_TEXTS = frozenset(
    {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>"}
)
GGUF_TOKENIZER_KEYS = (  # the tokenizer.ggml.* keys read
    *("model", "pre", "tokens", "token_type", "merges", "scores", "add_bos_token", "add_space_prefix"),
    *("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id", "unknown_token_id"),
)
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
METASPACE = "\u2581"


def byte_level_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte (index = byte value), the alphabet of byte-level BPE."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(byte) if byte in printable else chr(next(extra)) for byte in range(256)]


def gguf_backend(meta: dict[str, Any]) -> tuple[BackendTokenizer, bool, list[int]]:
    """The tokenizer the tokenizer.ggml.* values describe (`meta`: GGUF_TOKENIZER_KEYS without the prefix),
    whether its kind adds BOS by default, and the ids of its end-of-generation control tokens."""
    kind = meta["model"]
    if kind == "gpt2":
        backend = _byte_level_bpe(meta)
        default_add_bos = meta["pre"] in _IGNORE_MERGES_PRE  # llama.cpp adds BOS for Llama 3 vocabularies
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta)
        default_add_bos = True
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2, llama")
    _add_gguf_added_tokens(backend, meta["tokens"], meta["token_type"] or [])
    types = meta["token_type"] or []
    end_of_generation = [
        i
        for i, text in enumerate(meta["tokens"])
        if text in _END_OF_GENERATION_TEXTS and types[i : i + 1] == [TOKEN_CONTROL]
    ]
    return backend, default_add_bos, end_of_generation


def _add_gguf_added_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int]) -> None:
    """CONTROL tokens become special added tokens and USER_DEFINED ones plain added tokens, so both are
    matched whole in text (llama.cpp does the same) rather than split into pieces."""
    control = [
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types)
        if k == TOKEN_USER_DEFINED
    ]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(
            token, index
        )  # NOTE: a duplicated text keeps its first id, as llama.cpp's lookup does
    return vocab


def _byte_level_bpe(meta: dict) -> BackendTokenizer:
    pre = meta["pre"] or "default"
    splits = _PRE_SPLITS.get(pre)
    if splits is None:
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; splitting text the GPT-2 way", stacklevel=4)
        splits = _PRE_SPLITS["default"]
    merges = [tuple(merge.split(" ", 1)) for merge in meta["merges"] or []]
    backend = BackendTokenizer(
        models.BPE(vocab=_vocab(meta["tokens"]), merges=merges, ignore_merges=pre in _IGNORE_MERGES_PRE)
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-ranked merging: a piece made of two pieces can be
    merged from them, and a higher-scoring result merges first."""
    vocab = _vocab(tokens)
    candidates = []
    for index, token in enumerate(tokens):
        if types and types[index] != 1:  # only normal pieces are merge results
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                candidates.append((-scores[index], vocab[left], vocab[right], left, right))
    candidates.sort()
    return [(left, right) for _, _, _, left, right in candidates]


def _sentencepiece_bpe(meta: dict) -> BackendTokenizer:
    tokens, types = meta["tokens"], meta["token_type"] or []
    if not meta["scores"]:
        raise ValueError("a GGUF SentencePiece ('llama') tokenizer needs tokenizer.ggml.scores")
    unk_id = meta["unknown_token_id"]
    backend = BackendTokenizer(
        models.BPE(
            vocab=_vocab(tokens),
            merges=_sentencepiece_merges(tokens, meta["scores"], types),
            unk_token=tokens[unk_id] if unk_id is not None else None,
            byte_fallback=True,  # unknown characters become their <0xNN> byte tokens
            fuse_unk=True,
        )
    )
    add_prefix = meta["add_space_prefix"] is not False  # SentencePiece's default is a leading space
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=METASPACE, prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace(METASPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    return backend
