"""IncrementalDetokenizer: deltas sum to the one-shot decode and never carry half a character."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from serval.serving.detokenizer import IncrementalDetokenizer
from tests.serving.fakes import ByteTokenizer

TEXTS = [
    "plain ascii text",
    "héllo wörld — ünïcödé",
    "中文字符和 emoji 🎉🚀 mixed",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 four-byte letters",
]


class HFTokenizer:
    """A byte-level BPE trained here, wrapped in the decode() signature the detokenizer uses."""

    def __init__(self) -> None:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        tokenizer.train_from_iterator(TEXTS * 3, trainer)
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def hf_tokenizer() -> HFTokenizer:
    return HFTokenizer()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_byte_tokens_sum_to_the_text(text, step):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode_plain(text)
    detokenizer = IncrementalDetokenizer(tokenizer)
    out = ""
    for start in range(0, len(ids), step):
        delta = detokenizer.feed(ids[start : start + step])
        assert "\ufffd" not in delta
        out += delta
    out += detokenizer.flush()
    assert out == text


@pytest.mark.parametrize("text", TEXTS + ["unseen: Ωμέγα ☃ 🦙"])
def test_trained_bpe_matches_one_shot_decode(hf_tokenizer, text):
    ids = hf_tokenizer.encode(text) + hf_tokenizer.encode("<|end|>")
    for skip in (True, False):
        detokenizer = IncrementalDetokenizer(hf_tokenizer, skip_special_tokens=skip)
        out = ""
        for token_id in ids:
            delta = detokenizer.feed([token_id])
            assert "\ufffd" not in delta
            out += delta
        out += detokenizer.flush()
        assert out == hf_tokenizer.decode(ids, skip_special_tokens=skip)


def test_special_tokens_are_skipped_or_kept():
    tokenizer = ByteTokenizer()
    ids = [*b"hi", 257, *b"!"]
    skipped = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    assert "".join(skipped.feed([i]) for i in ids) + skipped.flush() == "hi!"
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(kept.feed([i]) for i in ids) + kept.flush() == "hi<|im_end|>!"


def test_an_unfinished_character_is_flushed_at_the_end():
    detokenizer = IncrementalDetokenizer(ByteTokenizer())
    first_byte_of_euro = "€".encode()[:1]
    assert detokenizer.feed(list(b"a" + first_byte_of_euro)) == "a"
    assert detokenizer.flush() == "\ufffd"
