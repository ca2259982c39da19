"""Qwen2VLProcessor: a real PNG decoded and patchified is what transformers' own Qwen2-VL image processor
makes of the same pixels; video patches are checked one by one against the frames they cut; runs, counts
and keys."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from serval.serving.media.decode import DecodedImage, DecodedVideo, decode_image
from serval.serving.media.limits import MediaConfig
from serval.serving.media.parts import MediaKind
from serval.serving.media.processor import MediaItem, content_hash, media_processor_for
from serval.serving.media.qwen2_vl import Qwen2VLProcessor
from tests.fixtures.tiny_vl import (
    IMAGE_PAD,
    MAX_PIXELS,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    write_preprocessor_config,
)


@pytest.fixture(scope="module")
def processor(tmp_path_factory) -> Qwen2VLProcessor:
    directory = tmp_path_factory.mktemp("qwen2-vl-files")
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "image_token_id": IMAGE_PAD, "video_token_id": VIDEO_PAD,
        "vision_start_token_id": VISION_START, "vision_end_token_id": VISION_END,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    write_preprocessor_config(str(directory))
    found = media_processor_for(str(directory))
    assert isinstance(found, Qwen2VLProcessor)
    return found


def png(width: int, height: int, seed: int = 0) -> io.BytesIO:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    buffer.seek(0)
    return buffer


def test_image_patches_equal_transformers_image_processor(processor):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    decoded = decode_image(png(150, 100), None, processor.resize_bounds, MediaConfig(), "p")
    assert decoded.pixels.shape == (112, 140, 3)  # smart_resize: multiples of 28
    prepared = processor.encoder_input(decoded, b"x" * 16)
    theirs = Qwen2VLImageProcessorPil()(images=[decoded.pixels], do_resize=False, return_tensors="pt")
    assert list(theirs["image_grid_thw"][0]) == list(prepared.grid) == [1, 8, 10]
    assert (theirs["pixel_values"] - prepared.pixel_values).abs().max().item() < 1e-5
    assert prepared.num_tokens == 20 and prepared.offset == 1 and not prepared.is_video


def test_video_patches_cut_the_frames_in_the_encoders_order(processor):
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (3, 56, 84, 3), dtype=np.uint8)  # odd: the last frame is repeated
    video = DecodedVideo(frames, (0.0, 0.5, 1.0), 1.5, "mp4")
    prepared = processor.encoder_input(video, b"y" * 16)
    assert prepared.grid == (2, 4, 6) and prepared.num_tokens == 2 * 4 * 6 // 4 and prepared.is_video
    assert prepared.seconds_per_grid == pytest.approx(1.0)  # 2 frames of 0.5 s each
    c = processor.config
    normalized = (frames / 255.0 - np.asarray(c.image_mean)) / np.asarray(c.image_std)
    normalized = np.concatenate([normalized, normalized[-1:]])  # (4, 56, 84, 3)
    row = 0
    for t in range(2):
        for group_row in range(2):
            for group_col in range(3):
                for dr in range(2):
                    for dc in range(2):
                        r, col = 2 * group_row + dr, 2 * group_col + dc
                        patch = normalized[2 * t : 2 * t + 2, r * 14 : r * 14 + 14, col * 14 : col * 14 + 14]
                        expected = patch.transpose(3, 0, 1, 2).reshape(-1)  # (channel, frame, y, x)
                        assert np.abs(prepared.pixel_values[row].numpy() - expected).max() < 1e-5
                        row += 1
    assert row == len(prepared.pixel_values)


def test_runs_counts_and_keys(processor):
    image = DecodedImage(np.zeros((56, 84, 3), np.uint8), "png", (84, 56))
    assert processor.num_tokens(image) == 2 * 3 + 2  # the merged patches, between the two markers
    item = MediaItem(MediaKind.IMAGE, image, content_hash(MediaKind.IMAGE, image), 8, "p")
    assert processor.placeholder_ids(item) == [VISION_START, *[IMAGE_PAD] * 6, VISION_END]
    video = DecodedVideo(np.zeros((4, 56, 84, 3), np.uint8), (0, 1, 2, 3), 4.0, "mp4")
    video_item = MediaItem(MediaKind.VIDEO, video, b"", processor.num_tokens(video), "p")
    assert processor.placeholder_ids(video_item) == [VISION_START, *[VIDEO_PAD] * 12, VISION_END]
    # The block key names the content and its preparation: the same frames sampled at another rate differ.
    slower = DecodedVideo(video.frames, (0, 2, 4, 6), 8.0, "mp4")
    assert (
        processor.encoder_input(video, b"h").content_hash
        != processor.encoder_input(slower, b"h").content_hash
    )
    assert (
        processor.encoder_input(video, b"h").content_hash == processor.encoder_input(video, b"h").content_hash
    )
    assert processor.resize_bounds.max_pixels == MAX_PIXELS and processor.resize_bounds.factor == 28


def test_a_text_only_model_directory_has_no_processor(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    assert media_processor_for(str(tmp_path)) is None
