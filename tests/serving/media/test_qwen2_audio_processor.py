"""Qwen2AudioProcessor: real WAV/FLAC/MP3 files decoded and turned into log-mel features are what
transformers' WhisperFeatureExtractor makes of the same samples (features, mel filters, frame count), and
each clip's run of placeholder ids is the one transformers' Qwen2AudioProcessor writes into the prompt."""

from __future__ import annotations

import asyncio
import io
import json

import numpy as np
import pytest
import torch

from serval.serving.media.decode import DecodedAudio, decode_audio
from serval.serving.media.limits import MediaConfig
from serval.serving.media.parts import MediaKind, MediaOptions, MediaPart, MediaSource
from serval.serving.media.processor import MediaItem, content_hash, media_processor_for
from serval.serving.media.qwen2_audio import Qwen2AudioProcessor
from tests.fixtures.tiny_audio import (
    AUDIO_BOS,
    AUDIO_EOS,
    AUDIO_PAD,
    SAMPLE_RATE,
    SPECIALS,
    clip,
    encode_audio,
    write_preprocessor_config,
)
from tests.fixtures.tiny_vl import write_vl_tokenizer


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("qwen2-audio-files")
    config = {"architectures": ["Qwen2AudioForConditionalGeneration"], "audio_token_index": AUDIO_PAD}
    (directory / "config.json").write_text(json.dumps(config))
    write_preprocessor_config(str(directory))
    write_vl_tokenizer(str(directory), SPECIALS)
    return str(directory)


@pytest.fixture(scope="module")
def processor(directory) -> Qwen2AudioProcessor:
    found = media_processor_for(directory)
    assert isinstance(found, Qwen2AudioProcessor)
    return found


@pytest.mark.parametrize("seconds, fmt", [(1.3, "wav"), (0.05, "flac"), (2.0, "mp3"), (3.1, "wav")])
def test_features_equal_whisper_feature_extractor(directory, processor, seconds, fmt):
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor.from_pretrained(directory)
    assert np.abs(extractor.mel_filters - processor.filters.numpy()).max() < 1e-7
    decoded = decode_audio(io.BytesIO(encode_audio(clip(seconds, 0), fmt)), fmt, MediaConfig(), "p")
    theirs = extractor(
        decoded.samples, sampling_rate=SAMPLE_RATE, return_attention_mask=True, padding="max_length",
        return_tensors="pt",
    )  # fmt: skip
    prepared = processor.encoder_input(decoded, content_hash(MediaKind.AUDIO, decoded))
    assert prepared.input_features.shape == theirs["input_features"][0].shape == (32, 200)
    assert (prepared.input_features - theirs["input_features"][0]).abs().max() < 1e-5
    assert prepared.num_feature_frames == int(theirs["attention_mask"].sum())


@pytest.mark.parametrize("seconds", [0.03, 0.7, 1.3, 2.5])
def test_the_run_is_the_one_transformers_processor_writes(directory, processor, seconds):
    from transformers import AutoProcessor

    samples = clip(seconds, 1)
    decoded = DecodedAudio(samples, SAMPLE_RATE, "wav")
    theirs = AutoProcessor.from_pretrained(directory)(
        text="hi <|audio_bos|><|AUDIO|><|audio_eos|>what is this", audio=[samples], sampling_rate=SAMPLE_RATE,
        return_tensors="pt",
    )  # fmt: skip
    ids = theirs["input_ids"][0].tolist()
    run = ids[ids.index(AUDIO_BOS) : ids.index(AUDIO_EOS) + 1]
    num_tokens = processor.num_tokens(decoded)
    item = MediaItem(MediaKind.AUDIO, decoded, b"h", num_tokens, "p", processor.encoder_input(decoded, b"h"))
    assert processor.placeholder_ids(item) == run
    assert item.encoder_input.offset == 1 and item.encoder_input.num_tokens == num_tokens - 2
    assert torch.equal(item.encoder_input.input_features, theirs["input_features"][0])


def test_equal_clips_share_a_key_and_other_clips_do_not(processor):
    def key(samples):
        decoded = DecodedAudio(samples, SAMPLE_RATE, "wav")
        return processor.encoder_input(decoded, content_hash(MediaKind.AUDIO, decoded)).content_hash

    assert key(clip(1.0, 0)) == key(clip(1.0, 0)) != key(clip(1.0, 1))


def test_a_clip_too_short_for_one_row_is_a_400_naming_the_part(processor):
    from serval.serving.media.loader import MediaLoader
    from serval.serving.media.parts import MediaError

    data = encode_audio(clip(0.01, 0), "wav")
    source = MediaSource("data", "", 1 << 20, data, "wav")
    part = MediaPart(MediaKind.AUDIO, (source,), MediaOptions(), "messages[0].content[1]")
    loader = MediaLoader(MediaConfig())
    try:
        with pytest.raises(MediaError, match="too short") as raised:
            asyncio.run(loader.load([part], processor))
        assert raised.value.param == "messages[0].content[1]"
    finally:
        loader.shutdown()
