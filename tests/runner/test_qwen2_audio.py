"""Qwen2-Audio against transformers on a tiny random-weight checkpoint that transformers wrote: logits within
1e-3 in fp32 and equal greedy tokens for one clip, two clips, and a clip among text turns; an audio request
batched with a text one answers as each alone; chunked prefill over a clip's rows, with the encoder run once
a step over every request's clips; the prefix cache hits for the same clip and not for another of the same
length; bf16 near fp32; bad items are refused.

Clips are real WAV/FLAC/MP3 files (a tone with noise, written by PyAV) decoded by serving's decoder and turned
into features by its processor (serving/media/qwen2_audio.py); the oracle gets the same features (its own
feature extractor agrees: tests/serving/media/test_qwen2_audio_processor.py)."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from serval.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from serval.engine.engine import Engine
from serval.runner.batch import Batch
from serval.runner.media import MediaInput
from serval.sampling import SamplingParams
from serval.serving.media.decode import decode_audio
from serval.serving.media.limits import MediaConfig
from serval.serving.media.parts import MediaKind
from serval.serving.media.processor import content_hash
from serval.serving.media.qwen2_audio import Qwen2AudioProcessor
from tests.fixtures.tiny_audio import AUDIO_BOS, AUDIO_EOS, AUDIO_PAD, clip, encode_audio

TEXT = [list(range(40, 52)), list(range(60, 67)), list(range(90, 110))]  # three stretches of "text" ids


@pytest.fixture(scope="module")
def audio(tiny_audio_factory):
    directory, reference = tiny_audio_factory()
    return directory, reference, Qwen2AudioProcessor.from_model_dir(directory)


def make_engine(directory: str, block_size: int = 16, budget: int = 512, num_blocks: int = 64) -> Engine:
    return Engine(
        EngineConfig(
            model=ModelConfig(model=directory, dtype="float32"),
            cache=CacheConfig(num_blocks=num_blocks, block_size=block_size),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget),
        )
    )


def audio_item(
    processor: Qwen2AudioProcessor, seconds: float, seed: int, fmt: str = "wav", frequency: float = 0.0
) -> MediaInput:
    data = encode_audio(clip(seconds, seed, frequency=frequency or 300.0 + 200 * seed), fmt)
    decoded = decode_audio(io.BytesIO(data), fmt, MediaConfig(), "p")
    return processor.encoder_input(decoded, content_hash(MediaKind.AUDIO, decoded))


def prompt_of(*parts) -> tuple[list[int], tuple[MediaInput, ...]]:
    """Token lists and clips in order -> the prompt ids (each clip's run between the audio markers) and the
    clips at their offsets."""
    ids: list[int] = []
    items = []
    for part in parts:
        if isinstance(part, MediaInput):
            ids.append(AUDIO_BOS)
            items.append(dataclasses.replace(part, offset=len(ids)))
            ids.extend([AUDIO_PAD] * part.num_tokens)
            ids.append(AUDIO_EOS)
        else:
            ids.extend(part)
    return ids, tuple(items)


def oracle_inputs(ids: list[int], items: tuple[MediaInput, ...]) -> dict:
    kwargs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if items:
        kwargs["input_features"] = torch.stack([item.input_features for item in items])
        mask = torch.zeros(len(items), items[0].input_features.shape[1], dtype=torch.long)
        for row, item in zip(mask, items):
            row[: item.num_feature_frames] = 1
        kwargs["feature_attention_mask"] = mask
    return kwargs


def serval_logits(engine: Engine, ids: list[int], items) -> torch.Tensor:
    prompt = engine.runner.prepare_media(ids, items, len(ids) + 8)
    num_blocks = -(-len(ids) // engine.runner.block_size)
    batch = Batch(ids, [len(ids)], [0], [list(range(num_blocks))], [0], [], media=[prompt])
    return engine.runner.compute_logits(batch)[0]


def greedy(engine: Engine, requests: list[tuple[list[int], tuple]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, (ids, items) in enumerate(requests):
        engine.add_request(str(i), ids, params, media=items)
        tokens[str(i)] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [tokens[str(i)] for i in range(len(requests))]


def oracle_greedy(reference, ids: list[int], items, max_tokens: int = 8) -> list[int]:
    with torch.no_grad():
        out = reference.generate(
            **oracle_inputs(ids, items), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def engine(audio):
    return make_engine(audio[0])


@pytest.fixture(scope="module")
def logits_engine(audio):
    """For serval_logits, which writes KV blocks behind the block manager's back: never used to schedule."""
    return make_engine(audio[0])


@pytest.fixture(scope="module")
def cases(audio):
    processor = audio[2]
    # The encoder reads only the frames a clip's rows depend on: an odd count, an even one, a whole chunk.
    first = audio_item(processor, 1.31, seed=1)  # 131 frames: 33 rows
    second = audio_item(processor, 0.7, seed=2, fmt="flac")  # 70 frames: 17 rows
    third = audio_item(processor, 2.6, seed=3, fmt="mp3")  # past the 2 s chunk: cut to it, 50 rows
    return {
        "one clip": prompt_of(TEXT[0], first, TEXT[1]),
        "two clips": prompt_of(TEXT[0], first, TEXT[1], second, TEXT[2]),
        "clip and text turns": prompt_of(TEXT[0], third, TEXT[1], [2, 1], TEXT[2], [2, 1], TEXT[1]),
    }


@pytest.mark.parametrize("case", ["one clip", "two clips", "clip and text turns"])
def test_logits_and_greedy_tokens_match_transformers(audio, engine, logits_engine, cases, case):
    _, reference, _ = audio
    ids, items = cases[case]
    with torch.no_grad():
        out = reference(**oracle_inputs(ids, items))
    ours = serval_logits(logits_engine, ids, items)
    assert (ours - out.logits[0, -1]).abs().max().item() < 1e-3
    assert greedy(engine, [(ids, items)])[0] == oracle_greedy(reference, ids, items)


def test_the_clip_matters(logits_engine, cases):
    # A model that ignored its encoder rows would pass the test above with equal text; not this one.
    ids, items = cases["one clip"]
    other = dataclasses.replace(items[0], input_features=items[0].input_features.flip(1))
    difference = serval_logits(logits_engine, ids, items) - serval_logits(logits_engine, ids, (other,))
    assert difference.abs().max() > 1e-2


def test_an_audio_request_batched_with_a_text_request_matches_each_alone(audio, cases):
    ids, items = cases["two clips"]
    text = (TEXT[2] + TEXT[0], ())
    engine = make_engine(audio[0])
    alone = greedy(engine, [(ids, items)]) + greedy(engine, [text])
    engine = make_engine(audio[0])
    assert greedy(engine, [(ids, items), text]) == alone


def test_chunked_prefill_and_one_encoder_call_a_step(audio, cases, monkeypatch):
    # 7 tokens a step: the clips' rows span several chunks; the first step encodes both requests' clips.
    one, two = cases["one clip"], cases["two clips"]
    whole = greedy(make_engine(audio[0]), [one, two])
    engine = make_engine(audio[0], block_size=4, budget=40)
    calls = []
    encode = engine.runner.model.encode
    monkeypatch.setattr(
        engine.runner.model, "encode", lambda items: calls.append(len(items)) or encode(items)
    )
    assert greedy(engine, [one, two]) == whole
    assert sum(calls) == 3 and len(calls) < 3 + 1


def test_the_same_clip_hits_the_prefix_cache_and_another_does_not(audio):
    processor = audio[2]
    ids, items = prompt_of(TEXT[2], audio_item(processor, 1.3, seed=5), TEXT[1])  # the clip from row 21
    other_item = audio_item(processor, 1.3, seed=6, frequency=6000.0)  # the same length: the same ids
    other = (ids, (dataclasses.replace(items[0], content_hash=other_item.content_hash,
                                       input_features=other_item.input_features),))  # fmt: skip
    engine = make_engine(audio[0])
    first = greedy(engine, [(ids, items)])
    again = greedy(engine, [(ids, items)])
    assert again == first and engine.requests == {}
    hits = engine.block_manager.num_hit_tokens
    assert hits == (len(ids) - 1) // 16 * 16  # every full block of the prompt
    different = greedy(engine, [other])
    assert engine.block_manager.num_hit_tokens - hits == 16  # only the text block before the clip
    assert different == greedy(make_engine(audio[0]), [other]) != first


def test_bf16_follows_fp32(audio, cases):
    ids, items = cases["two clips"]
    fp32 = serval_logits(make_engine(audio[0]), ids, items)
    bf16 = Engine(
        EngineConfig(model=ModelConfig(model=audio[0], dtype="bfloat16"), cache=CacheConfig(num_blocks=16))
    )
    difference = (serval_logits(bf16, ids, items) - fp32).abs().max().item()
    assert difference < 0.05 * fp32.abs().max().item()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda item: dataclasses.replace(item, num_tokens=item.num_tokens - 1), "rows"),
        (lambda item: dataclasses.replace(item, input_features=item.input_features[:, :100]), "features"),
        (lambda item: dataclasses.replace(item, num_feature_frames=0), "frames"),
        (lambda item: dataclasses.replace(item, offset=item.offset - 1), "placeholder"),
    ],
)
def test_bad_items_are_refused_before_anything_is_added(engine, cases, change, message):
    ids, items = cases["one clip"]
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", ids, SamplingParams(max_tokens=1), media=(change(items[0]),))
    assert "bad" not in engine.requests
