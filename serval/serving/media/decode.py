"""Decoding a fetched file into pixels or samples, within budgets; blocking, so the loader runs it in threads.

Owns what a file is allowed to cost. The format is judged by the content (magic bytes), never by a name or
an extension, must be one the part's kind allows, and must agree with what a data URL's MIME type or
`input_audio.format` declared. Containers are opened with that format forced, so FFmpeg never probes its
way into another demuxer (the playlist and concat demuxers open further URLs). Sizes are checked from
headers before decoding: an image's pixel count (a 50000 x 50000 PNG of a few KB is refused without
allocating its 7.5 GB), a video stream's frame size and duration. While decoding, frame and sample counts
are bounded too, since headers can lie. Images come out RGB and resized by `smart_resize`, video as the
frames sampled at the part's fps, audio as mono float32 at 16 kHz (PyAV's resampler).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from serval.serving.media.limits import MediaConfig
from serval.serving.media.parts import FORMATS, MediaError, MediaKind
from serval.serving.media.resize import ResizeBounds, frame_bounds, sample_times, smart_resize

AUDIO_SAMPLE_RATE = 16_000
# Format -> what Pillow and FFmpeg call it.
PIL_FORMATS = {"jpeg": "JPEG", "png": "PNG"}
AV_FORMATS = {"mp4": "mp4", "avi": "avi", "wmv": "asf", "mp3": "mp3", "wav": "wav", "flac": "flac"}
_ASF_GUID = bytes.fromhex("3026b2758e66cf11a6d900aa0062ce6c")


@dataclass(frozen=True)
class DecodedImage:
    pixels: np.ndarray  # (height, width, 3) uint8 RGB, resized
    format: str
    original_size: tuple[int, int]  # (width, height) as the file has it


@dataclass(frozen=True)
class DecodedVideo:
    frames: np.ndarray  # (num_frames, height, width, 3) uint8 RGB, resized
    times: tuple[float, ...]  # seconds into the video of each frame
    duration: float  # seconds
    format: str


@dataclass(frozen=True)
class DecodedAudio:
    samples: np.ndarray  # (num_samples,) float32 mono in [-1, 1]
    sample_rate: int
    format: str

    @property
    def duration(self) -> float:
        return len(self.samples) / self.sample_rate


Decoded = DecodedImage | DecodedVideo | DecodedAudio


def sniff_format(head: bytes) -> str | None:
    """The format the first bytes of a file show, or None."""
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head[4:8] == b"ftyp":
        return "mp4"
    if head.startswith(b"RIFF") and head[8:12] == b"AVI ":
        return "avi"
    if head.startswith(b"RIFF") and head[8:12] == b"WAVE":
        return "wav"
    if head.startswith(_ASF_GUID):
        return "wmv"
    if head.startswith(b"fLaC"):
        return "flac"
    if head.startswith(b"ID3") or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def check_format(file: BinaryIO, kind: MediaKind, declared: str | None, param: str) -> str:
    """The file's format by its content, or MediaError if it is not one `kind` allows or not as declared."""
    head = file.read(16)
    file.seek(0)
    found = sniff_format(head)
    allowed = "/".join(sorted(FORMATS[kind]))
    if found is None:
        raise MediaError(f"{param}: the content is not a {allowed} file", param)
    if found not in FORMATS[kind]:
        raise MediaError(f"{param}: the content is {found}, not {kind.value} ({allowed})", param)
    if declared is not None and declared != found:
        raise MediaError(f"{param}: declared as {declared} but the content is {found}", param)
    return found


def decode_image(
    file: BinaryIO,
    declared: str | None,
    bounds: ResizeBounds | None,
    config: MediaConfig,
    param: str,
    size: tuple[int, int] | None = None,
) -> DecodedImage:
    """size: (height, width) to resize to instead of what `bounds` gives (the frames of an image list)."""
    from PIL import Image

    found = check_format(file, MediaKind.IMAGE, declared, param)
    try:
        image = Image.open(file, formats=[PIL_FORMATS[found]])  # reads the header only
    # Pillow's own ceiling (twice Image.MAX_IMAGE_PIXELS) is above ours, so it only catches the largest.
    except Image.DecompressionBombError:
        raise MediaError(
            f"{param}: the image declares more than {config.max_image_pixels} pixels", param
        ) from None
    except OSError as e:  # a header cut short or garbled
        raise MediaError(f"{param}: the image is truncated or corrupt ({e})", param) from None
    width, height = image.size
    if width * height > config.max_image_pixels:
        raise MediaError(
            f"{param}: the image is {width}x{height} pixels, more than the {config.max_image_pixels} allowed",
            param,
        )
    try:
        image = image.convert("RGB")  # decodes; a truncated file fails here
    except OSError as e:
        raise MediaError(f"{param}: the image is truncated or corrupt ({e})", param) from None
    target = size or (smart_resize(height, width, bounds) if bounds is not None else (height, width))
    if target != (height, width):
        image = image.resize((target[1], target[0]), Image.Resampling.BICUBIC)
    return DecodedImage(np.asarray(image, dtype=np.uint8), found, (width, height))


def decode_video(
    file: BinaryIO,
    declared: str | None,
    fps: float,
    bounds: ResizeBounds | None,
    total_pixels: int | None,
    config: MediaConfig,
    param: str,
) -> DecodedVideo:
    import av

    found = check_format(file, MediaKind.VIDEO, declared, param)
    with av.open(file, format=AV_FORMATS[found]) as container:
        if not container.streams.video:
            raise MediaError(f"{param}: the file has no video stream", param)
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_frame_size(width, height, config, param)
        duration = _duration(container, stream)
        if duration is None:
            raise MediaError(f"{param}: the video does not say how long it is", param)
        if duration > config.max_video_seconds:
            raise MediaError(
                f"{param}: the video is {duration:.1f} s long, more than {config.max_video_seconds:g} s",
                param,
            )
        times = sample_times(duration, fps, config.max_video_frames)
        target = None
        if bounds is not None and width and height:
            target = smart_resize(height, width, frame_bounds(bounds, len(times), total_pixels))
        frames, kept = [], []
        for count, frame in enumerate(container.decode(stream), start=1):
            if count > config.max_video_decoded_frames:
                raise MediaError(
                    f"{param}: the video has more than {config.max_video_decoded_frames} frames", param
                )
            _check_frame_size(frame.width, frame.height, config, param)
            time = frame.time if frame.time is not None else (count - 1) / float(stream.average_rate or 1)
            if time > config.max_video_seconds:
                raise MediaError(f"{param}: the video runs past {config.max_video_seconds:g} s", param)
            # A frame stands for every sample time it is the first frame at or after (within half a frame).
            while len(kept) < len(times) and times[len(kept)] <= time + 0.5 / float(
                stream.average_rate or fps
            ):
                h, w = target or (frame.height, frame.width)
                frames.append(
                    frame.reformat(width=w, height=h, format="rgb24", interpolation="BICUBIC").to_ndarray()
                )
                kept.append(round(time, 6))
            if len(kept) == len(times):
                break
    if not frames:
        raise MediaError(f"{param}: the video has no decodable frames", param)
    return DecodedVideo(np.stack(frames), tuple(kept), duration, found)


def decode_audio(file: BinaryIO, declared: str | None, config: MediaConfig, param: str) -> DecodedAudio:
    import av

    found = check_format(file, MediaKind.AUDIO, declared, param)
    max_samples = int(config.max_audio_seconds * AUDIO_SAMPLE_RATE)
    too_long = f"{param}: the audio is longer than {config.max_audio_seconds:g} s"
    with av.open(file, format=AV_FORMATS[found]) as container:
        if not container.streams.audio:
            raise MediaError(f"{param}: the file has no audio stream", param)
        stream = container.streams.audio[0]
        duration = _duration(container, stream)
        if duration is not None and duration > config.max_audio_seconds:
            raise MediaError(too_long, param)
        resampler = av.AudioResampler(format="flt", layout="mono", rate=AUDIO_SAMPLE_RATE)
        chunks, num_samples = [], 0
        for frame in itertools.chain(container.decode(stream), [None]):  # None flushes the resampler
            for out in resampler.resample(frame):
                chunk = out.to_ndarray().reshape(-1)  # packed mono: (1, n) -> (n,)
                num_samples += len(chunk)
                if num_samples > max_samples:
                    raise MediaError(too_long, param)
                chunks.append(chunk)
    if not num_samples:
        raise MediaError(f"{param}: the audio has no decodable samples", param)
    return DecodedAudio(np.concatenate(chunks).astype(np.float32, copy=False), AUDIO_SAMPLE_RATE, found)


def _check_frame_size(width: int, height: int, config: MediaConfig, param: str) -> None:
    if width * height > config.max_image_pixels:
        raise MediaError(
            f"{param}: video frames are {width}x{height} pixels, more than the {config.max_image_pixels} allowed",
            param,
        )


def _duration(container, stream) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # av.time_base
    return None
