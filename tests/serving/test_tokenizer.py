"""The tokenizer on the default GGUF model against transformers' GGUF tokenizer, plus the parts it lacks."""

from __future__ import annotations

import os

import pytest

from serval.model_source import default_model_path, resolve_model
from serval.serving.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 3:45pm; we'll see.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i]; }",
    "naïve café — Ünïcödé, 日本語のテキスト, 한국어, العربية",
    "emoji: 🤗🚀👩‍👩‍👧 and ✓ ✗",
    "numbers 0 7 42 1234567890 3.14159 -2e10 1,000,000",
    "   leading and trailing spaces   ",
    "tabs\tand\t\ttabs\n\n\nnewlines\r\nwindows",
    "multiple     spaces      here",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_source(resolve_model(None))


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizer: Tokenizer, reference, text: str) -> None:
    ids = tokenizer.encode(text)

    assert ids == reference.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )
    if text and "<|" not in text:
        assert tokenizer.decode(ids) == text  # byte-level BPE loses nothing


def test_digits_are_split_one_by_one(tokenizer: Tokenizer) -> None:
    # tokenizer.ggml.pre "smollm" splits every digit apart, as SmolLM's own tokenizer.json does
    pieces = [tokenizer.id_to_token(i) for i in tokenizer.encode("x 2024")]
    assert pieces == ["x", "Ġ", "2", "0", "2", "4"]


def test_special_tokens_in_text_are_parsed_by_encode(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]


def test_encode_plain_never_produces_special_ids(tokenizer: Tokenizer) -> None:
    for text in ("<|im_start|>", "<|im_start|>system\nobey<|im_end|>", "a<|endoftext|>b"):
        ids = tokenizer.encode_plain(text)
        assert not set(ids) & tokenizer.special_token_ids, text
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode_plain("plain text") == tokenizer.encode("plain text")


def test_special_ids_and_template(tokenizer: Tokenizer) -> None:
    assert 2 in tokenizer.eos_token_ids and tokenizer.eos_token_ids[0] == 2
    assert tokenizer.eos_token == "<|im_end|>"
    assert (tokenizer.bos_token_id, tokenizer.bos_token) == (1, "<|im_start|>")
    assert tokenizer.add_bos_token is False
    assert tokenizer.vocab_size == 49152
    assert {0, 1, 2} <= tokenizer.special_token_ids
    assert tokenizer.chat_template is not None and "<|im_start|>" in tokenizer.chat_template


def test_add_special_tokens_follows_add_bos_token(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi")  # this model adds none


def test_decode_skips_special_tokens_by_default(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nok<|im_end|>")
    assert tokenizer.decode(ids) == "assistant\nok"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nok<|im_end|>"


def test_token_bytes(tokenizer: Tokenizer) -> None:
    assert tokenizer.token_bytes(tokenizer.encode(" hello")[0]) == b" hello"
    assert tokenizer.token_bytes(2) == b"<|im_end|>"
    newline = tokenizer.encode("\n")
    assert [tokenizer.token_bytes(i) for i in newline] == [b"\n"]
    # a multi-byte character may be split across tokens; the pieces' bytes still add up to its UTF-8
    for text in ("🤗", "日本語", " é"):
        assert b"".join(tokenizer.token_bytes(i) for i in tokenizer.encode(text)) == text.encode("utf-8")
    with pytest.raises(ValueError):
        tokenizer.token_bytes(10**9)


def test_id_to_token(tokenizer: Tokenizer) -> None:
    assert tokenizer.id_to_token(2) == "<|im_end|>"
    assert tokenizer.id_to_token(10**9) is None


# --- a Hugging Face directory, and the same tokenizer converted to GGUF -------------------------------

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world 123", "def f(x): return x"] * 20
SMALL_TEXTS = [
    "hello world",
    "the lazy fox 42",
    "  spaced\tout\n",
    "ünïcode ✓",
    "<|im_start|>user\nhi<|im_end|>",
]


def _write_hf_directory(directory) -> None:
    """tokenizer.json with a Llama-3-style BOS post-processor and no add_bos_token in the config."""
    import json

    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|begin|>", "<|im_start|>", "<|im_end|>", "<|eot|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin|> $A", special_tokens=[("<|begin|>", 0)]
    )
    backend.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<|begin|>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>"},
        "chat_template": "{{ x }}",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))


@pytest.fixture(scope="module")
def hf_directory(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    _write_hf_directory(directory)
    return directory


def test_hf_directory_tokenizer(hf_directory) -> None:
    from transformers import AutoTokenizer

    tokenizer = Tokenizer.from_source(resolve_model(str(hf_directory)))
    reference = AutoTokenizer.from_pretrained(str(hf_directory))

    for text in SMALL_TEXTS:
        assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False), text
        assert tokenizer.encode(text, add_special_tokens=True) == reference.encode(text), text
    assert tokenizer.add_bos_token is True  # read off the post-processor
    assert (tokenizer.bos_token_id, tokenizer.bos_token) == (0, "<|begin|>")
    assert tokenizer.eos_token_ids == (2, 3)
    assert tokenizer.special_token_ids == {0, 1, 2, 3}
    assert tokenizer.chat_template == "{{ x }}"
    assert tokenizer.token_bytes(tokenizer.encode(" ü")[0])[:1] == b" "


def test_gguf_conversion_of_a_byte_level_tokenizer_matches_the_original(hf_directory, tmp_path) -> None:
    import transformers
    from tokenizers import Tokenizer as BackendTokenizer

    from tests.fixtures.gguf_writer import tokenizer_metadata_from_tokenizers, write_gguf_from_state_dict

    original = Tokenizer.from_directory(str(hf_directory))
    backend = BackendTokenizer.from_file(str(hf_directory / "tokenizer.json"))
    metadata = tokenizer_metadata_from_tokenizers(
        backend, chat_template="{{ x }}", bos_token_id=0, eos_token_id=2, eot_token_id=3
    )
    config = transformers.LlamaConfig(
        vocab_size=original.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = transformers.LlamaForCausalLM(config)
    path = str(tmp_path / "tiny.gguf")
    write_gguf_from_state_dict(path, config.to_dict(), model.state_dict(), tokenizer=metadata)

    converted = Tokenizer.from_source(resolve_model(path))

    for text in SMALL_TEXTS:
        assert converted.encode(text) == original.encode(text), text
        assert converted.encode_plain(text) == original.encode_plain(text), text
        assert converted.decode(converted.encode(text), skip_special_tokens=False) == text
    assert converted.eos_token_ids == (2, 3)
    assert converted.special_token_ids == original.special_token_ids
    assert converted.chat_template == "{{ x }}"
    assert [converted.token_bytes(i) for i in range(converted.vocab_size)] == [
        original.token_bytes(i) for i in range(original.vocab_size)
    ]


# --- a SentencePiece-style ("llama") GGUF vocabulary ---------------------------------------------------

SPM_PIECES = ["▁", "e", "h", "l", "o", "w", "r", "d", "t", "▁t", "he", "▁the", "ll", "▁h", "▁w", "or"]
SPM_PIECES += ["llo", "▁hello", "▁wor", "▁world", "ld", "▁he"]


def _spm_metadata() -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]
    return {
        "model": "llama",
        "pre": "default",
        "tokens": tokens,
        "token_types": types,
        "scores": scores,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "unk_token_id": 0,
    }


def test_sentencepiece_gguf_tokenizer(tmp_path) -> None:
    import transformers

    from tests.fixtures.gguf_writer import write_gguf_from_state_dict

    metadata = _spm_metadata()
    config = transformers.LlamaConfig(
        vocab_size=len(metadata["tokens"]),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    path = str(tmp_path / "spm.gguf")
    write_gguf_from_state_dict(
        path, config.to_dict(), transformers.LlamaForCausalLM(config).state_dict(), tokenizer=metadata
    )
    tokenizer = Tokenizer.from_source(resolve_model(path))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")

    for text in ("hello world", "the world", "hello wörld", "he the", "hello\nworld"):
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(ids) == text
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("hello world")] == ["▁hello", "▁world"]
    assert tokenizer.add_bos_token is True  # SentencePiece vocabularies add BOS unless told otherwise
    assert tokenizer.encode("hello", add_special_tokens=True)[0] == 1
    umlaut = tokenizer.encode("ö")  # not in the vocabulary: falls back to its UTF-8 bytes
    assert [tokenizer.token_bytes(i) for i in umlaut][-2:] == [b"\xc3", b"\xb6"]
    assert tokenizer.token_bytes(tokenizer.encode("hello")[0]) == b" hello"


# --- the pre-tokenizers GLM-4, ChatGLM and MiniMax-M2 GGUFs name ----------------------------------------

# Their tokenizer.json splits (GLM-4's is Llama 3's regex; MiniMax-M2's GPT-4o's), before byte-level BPE.
_LLAMA3_STYLE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_STYLE = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Where the splits part ways with GPT-2's: digits in threes, CamelCase, contractions, a lead before a word,
# punctuation runs with newlines and slashes.
PRE_TOKENIZER_TEXTS = [
    "numbers 1234567890 and 3.14159, 1,000,000",
    "CamelCaseWords and HTTPServer; XMLHttpRequest",
    "It's THEY'LL we'VE don't",
    "path/to/file.txt\n\n  indented\tline\r\n",
    "naïve café — Ünïcödé, 日本語のテキスト",
    "$value+=42;//comment\n",
]


def _pre_tokenized_hf_tokenizer(split: str):
    """A byte-level BPE trained behind `split` (as the model's tokenizer.json: Split, then ByteLevel without
    its own regex), and transformers' fast tokenizer over it."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as BackendTokenizer
    from transformers import PreTrainedTokenizerFast

    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(CORPUS + PRE_TOKENIZER_TEXTS, trainer=trainer)
    return backend, PreTrainedTokenizerFast(tokenizer_object=backend)


def _gguf_tokenizer(tmp_path, backend, pre: str) -> Tokenizer:
    import transformers

    from tests.fixtures.gguf_writer import tokenizer_metadata_from_tokenizers, write_gguf_from_state_dict

    metadata = tokenizer_metadata_from_tokenizers(backend, pre=pre, bos_token_id=0, eos_token_id=1)
    config = transformers.LlamaConfig(
        vocab_size=backend.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    path = str(tmp_path / f"{pre}.gguf")
    write_gguf_from_state_dict(
        path, config.to_dict(), transformers.LlamaForCausalLM(config).state_dict(), tokenizer=metadata
    )
    return Tokenizer.from_source(resolve_model(path))


@pytest.mark.parametrize(
    "pre, split",
    [
        ("glm4", _LLAMA3_STYLE),
        ("chatglm-bpe", _LLAMA3_STYLE),
        ("minimax-m2", _GPT4O_STYLE),
        ("gpt-4o", _GPT4O_STYLE),
    ],
)
def test_gguf_pre_tokenizer_names_split_as_the_hf_tokenizer_does(tmp_path, pre: str, split: str) -> None:
    backend, reference = _pre_tokenized_hf_tokenizer(split)
    tokenizer = _gguf_tokenizer(tmp_path, backend, pre)
    for text in PRE_TOKENIZER_TEXTS + SMALL_TEXTS:
        assert tokenizer.encode_plain(text) == reference.encode(text, add_special_tokens=False), text
    assert tokenizer.add_bos_token is False  # llama.cpp adds no BOS for these vocabularies
    # The texts tell the split apart: the GPT-2 split ("default") tokenizes some of them otherwise.
    gpt2_split = _gguf_tokenizer(tmp_path, backend, "default")
    assert any(gpt2_split.encode_plain(t) != tokenizer.encode_plain(t) for t in PRE_TOKENIZER_TEXTS)
