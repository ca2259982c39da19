"""Decoding real files made on the fly (Pillow, PyAV), with budgets: sizes after smart_resize, frames at fps,
16 kHz mono audio, and the refusals (bomb, truncated, wrong kind, MIME mismatch, too long, not media)."""

from __future__ import annotations

import io
import math

import pytest

from serval.serving.media.decode import decode_audio, decode_image, decode_video, sniff_format
from serval.serving.media.limits import MediaConfig
from serval.serving.media.parts import MediaError, MediaOptions
from serval.serving.media.resize import ResizeBounds, frame_bounds, resize_bounds, sample_times, smart_resize
from tests.serving.media.files import audio_bytes, image_bytes, png_bomb, video_bytes

CONFIG = MediaConfig()
BOUNDS = ResizeBounds()  # Qwen2-VL's: factor 28, [56*56, 28*28*1280] pixels
PARAM = "messages[0].content[0]"


def image(data: bytes, declared=None, bounds=BOUNDS, config=CONFIG):
    return decode_image(io.BytesIO(data), declared, bounds, config, PARAM)


def refused(call, *args, **kwargs) -> str:
    with pytest.raises(MediaError) as error:
        call(*args, **kwargs)
    assert error.value.param == PARAM
    return str(error.value)


@pytest.mark.parametrize(
    "height, width, expected",
    [
        (28, 28, (56, 56)),  # below min_pixels: scaled up
        (100, 200, (112, 196)),  # rounded to multiples of 28
        (1080, 1920, (728, 1316)),  # above max_pixels: scaled down within it
        (10, 1000, (28, 1008)),  # a side never rounds to zero
    ],
)
def test_smart_resize(height, width, expected):
    assert smart_resize(height, width, BOUNDS) == expected
    h, w = expected
    assert h % 28 == 0 and w % 28 == 0


def test_smart_resize_keeps_within_bounds_and_refuses_slivers():
    for height in (29, 57, 333, 1000, 4000):
        for width in (31, 64, 777, 3000):
            h, w = smart_resize(height, width, BOUNDS)
            assert h % 28 == 0 and w % 28 == 0 and h * w <= BOUNDS.max_pixels
            if height * width >= BOUNDS.min_pixels and max(height, width) < 200 * min(height, width):
                assert h * w >= BOUNDS.min_pixels
    with pytest.raises(ValueError, match="too thin"):
        smart_resize(1, 500, BOUNDS)


def test_part_options_set_the_bounds():
    assert resize_bounds(BOUNDS, MediaOptions(max_pixels=3136)).max_pixels == 3136
    assert resize_bounds(BOUNDS, MediaOptions(high_resolution=True)).max_pixels == 16384 * 28 * 28
    assert resize_bounds(BOUNDS, MediaOptions(min_pixels=10000)).min_pixels == 10000
    # total_pixels shares out among the frames, never below min_pixels.
    assert frame_bounds(BOUNDS, 10, 100_000).max_pixels == 10_000
    assert frame_bounds(BOUNDS, 1000, 100_000).max_pixels == BOUNDS.min_pixels
    assert sample_times(2.0, 2.0, 768) == [0.0, 0.5, 1.0, 1.5]
    assert len(sample_times(600.0, 2.0, 768)) == 768 and sample_times(0.2, 2.0, 768) == [0.0]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_images_decode_and_resize(fmt):
    decoded = image(image_bytes(300, 100, fmt))
    assert decoded.pixels.shape == (112, 308, 3) and decoded.pixels.dtype.name == "uint8"
    assert decoded.original_size == (300, 100) and decoded.format == fmt.lower()
    assert image(image_bytes(300, 100, fmt), bounds=None).pixels.shape == (100, 300, 3)


def test_a_decompression_bomb_is_refused_from_its_header():
    bomb = png_bomb()
    assert len(bomb) < 2000
    assert "more than" in refused(image, bomb)
    # Under Pillow's own ceiling, ours still holds: 9000 x 9000 is above the default 64 Mi pixels.
    assert "9000x9000 pixels" in refused(image, png_bomb(9000, 9000))


def test_broken_and_wrong_images_are_refused():
    data = image_bytes(64, 64, "PNG")
    assert "truncated or corrupt" in refused(image, data[: len(data) // 2])
    assert "not a jpeg/png file" in refused(image, b"GIF89a" + b"\0" * 64)
    assert "not image" in refused(image, audio_bytes(0.1))
    assert "declared as png but the content is jpeg" in refused(image, image_bytes(8, 8, "JPEG"), "png")


def test_video_frames_are_sampled_at_fps():
    data = video_bytes(seconds=2.0, fps=10)
    for fps, num_frames in ((2.0, 4), (0.5, 1), (10.0, 20)):
        decoded = decode_video(io.BytesIO(data), None, fps, BOUNDS, None, CONFIG, PARAM)
        assert decoded.frames.shape == (num_frames, 56, 56, 3)
        assert decoded.times == pytest.approx([k / fps for k in range(num_frames)])
    # The frames are the ones at those times: frame k of the file has grey level 8k.
    decoded = decode_video(io.BytesIO(data), None, 2.0, None, None, CONFIG, PARAM)
    assert [round(float(f.mean()) / 8) for f in decoded.frames] == [0, 5, 10, 15]
    assert decoded.frames.shape[1:] == (48, 64, 3)


@pytest.mark.parametrize("fmt, name", [("avi", "avi"), ("asf", "wmv")])
def test_avi_and_wmv_decode(fmt, name):
    decoded = decode_video(io.BytesIO(video_bytes(1.0, fmt=fmt)), name, 2.0, BOUNDS, None, CONFIG, PARAM)
    assert decoded.format == name and decoded.frames.shape == (2, 56, 56, 3)


def test_video_budgets():
    data = video_bytes(seconds=2.0, fps=10)
    short = MediaConfig(max_video_seconds=1.0)
    assert "more than 1 s" in refused(decode_video, io.BytesIO(data), None, 2.0, BOUNDS, None, short, PARAM)
    few = MediaConfig(max_video_decoded_frames=5)
    assert "more than 5 frames" in refused(
        decode_video, io.BytesIO(data), None, 2.0, BOUNDS, None, few, PARAM
    )
    small = MediaConfig(max_image_pixels=1000)
    assert "64x48" in refused(decode_video, io.BytesIO(data), None, 2.0, BOUNDS, None, small, PARAM)
    truncated = io.BytesIO(data[: len(data) // 3])
    with pytest.raises(Exception):  # noqa: B017 - FFmpeg's error; the loader makes any of them a MediaError
        decode_video(truncated, None, 2.0, BOUNDS, None, CONFIG, PARAM)


@pytest.mark.parametrize("fmt", ["wav", "mp3", "flac"])
def test_audio_becomes_16khz_mono(fmt):
    decoded = decode_audio(io.BytesIO(audio_bytes(1.0, 44_100, fmt)), fmt, CONFIG, PARAM)
    assert (
        decoded.sample_rate == 16_000
        and decoded.samples.dtype.name == "float32"
        and decoded.samples.ndim == 1
    )
    assert decoded.duration == pytest.approx(1.0, abs=0.08)  # MP3 pads a frame or so
    # Still a 440 Hz tone: count the zero crossings of the middle half second.
    middle = decoded.samples[4000:12000]
    crossings = int(((middle[:-1] < 0) & (middle[1:] >= 0)).sum())
    assert abs(crossings - 220) <= 2
    assert math.isclose(float(abs(middle).max()), 0.707, abs_tol=0.05)


def test_audio_budgets_and_mismatches():
    data = audio_bytes(2.0, 16_000, "wav")
    short = MediaConfig(max_audio_seconds=1.0)
    assert "longer than 1 s" in refused(decode_audio, io.BytesIO(data), "wav", short, PARAM)
    assert "declared as mp3 but the content is wav" in refused(
        decode_audio, io.BytesIO(data), "mp3", CONFIG, PARAM
    )
    assert "not audio" in refused(decode_audio, io.BytesIO(image_bytes(8, 8)), None, CONFIG, PARAM)


def test_sniffing_is_by_content():
    assert [sniff_format(x[:16]) for x in (image_bytes(4, 4, "PNG"), image_bytes(4, 4, "JPEG"))] == [
        "png",
        "jpeg",
    ]
    assert (
        sniff_format(video_bytes(0.2)[:16]) == "mp4"
        and sniff_format(video_bytes(0.2, fmt="asf")[:16]) == "wmv"
    )
    assert sniff_format(audio_bytes(0.1, fmt="flac")[:16]) == "flac" and sniff_format(b"hello world") is None
