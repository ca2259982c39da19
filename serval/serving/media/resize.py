"""Sizes: what an image or video frame is resized to, and which video frames are kept.

Owns the arithmetic a Qwen2-VL-style preprocessor does before any pixel is touched, so that the model task
reuses it rather than re-deriving it: `smart_resize` (both sides multiples of the patch factor, the area
within [min_pixels, max_pixels], the aspect ratio kept as well as the rounding allows), the bounds a part's
options and vl_high_resolution_images give (`resize_bounds`), a video's per-frame bound under total_pixels,
and the timestamps sampled at a part's fps (`sample_times`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from serval.serving.media.parts import HIGH_RESOLUTION_MAX_PIXELS, MediaOptions

# Qwen2-VL's preprocessor_config.json: 14-pixel patches merged 2 x 2, so sides are multiples of 28.
DEFAULT_FACTOR = 28
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT_RATIO = 200  # Qwen2-VL refuses thinner images: a side would round to zero patches


@dataclass(frozen=True)
class ResizeBounds:
    factor: int = DEFAULT_FACTOR
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS

    def __post_init__(self) -> None:
        if self.factor < 1 or not 1 <= self.min_pixels <= self.max_pixels:
            raise ValueError(f"bad resize bounds: {self}")


def smart_resize(height: int, width: int, bounds: ResizeBounds) -> tuple[int, int]:
    """(height, width) to resize to: each a positive multiple of bounds.factor, the area in
    [min_pixels, max_pixels] when the factor allows it, the aspect ratio as close as the rounding permits.
    ValueError for an empty image or one more than 200 times longer than wide (or the reverse)."""
    if height < 1 or width < 1:
        raise ValueError(f"an image of {width}x{height} pixels is empty")
    if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
        raise ValueError(
            f"an image of {width}x{height} pixels is too thin (aspect ratio above {MAX_ASPECT_RATIO})"
        )
    f = bounds.factor
    new_height = max(f, round(height / f) * f)
    new_width = max(f, round(width / f) * f)
    if new_height * new_width > bounds.max_pixels:
        # Shrink by the area ratio, then round down so the bound holds.
        scale = math.sqrt(height * width / bounds.max_pixels)
        new_height = max(f, math.floor(height / scale / f) * f)
        new_width = max(f, math.floor(width / scale / f) * f)
    elif new_height * new_width < bounds.min_pixels:
        scale = math.sqrt(bounds.min_pixels / (height * width))
        new_height = math.ceil(height * scale / f) * f
        new_width = math.ceil(width * scale / f) * f
    return new_height, new_width


def resize_bounds(model: ResizeBounds, options: MediaOptions) -> ResizeBounds:
    """The bounds one image part gets: the model's, narrowed or widened by the part's min/max_pixels, with
    vl_high_resolution_images raising the ceiling to 16384 tokens' worth (Model Studio)."""
    max_pixels = HIGH_RESOLUTION_MAX_PIXELS if options.high_resolution else model.max_pixels
    if options.max_pixels is not None:
        max_pixels = options.max_pixels
    min_pixels = model.min_pixels if options.min_pixels is None else options.min_pixels
    return ResizeBounds(model.factor, min(min_pixels, max_pixels), max_pixels)


def frame_bounds(bounds: ResizeBounds, num_frames: int, total_pixels: int | None) -> ResizeBounds:
    """A video frame's bounds: total_pixels shared among the frames, but never below min_pixels (Model
    Studio: "the pixel count of a single frame remains within [min_pixels, max_pixels]")."""
    if total_pixels is None or num_frames < 1:
        return bounds
    share = max(bounds.min_pixels, min(bounds.max_pixels, total_pixels // num_frames))
    return ResizeBounds(bounds.factor, bounds.min_pixels, share)


def sample_times(duration: float, fps: float, max_frames: int) -> list[float]:
    """Seconds into the video of the frames to keep: `fps` a second (at least one frame), evenly spread over
    the whole video when that would be more than max_frames."""
    num_frames = max(1, min(max_frames, math.floor(duration * fps + 1e-9)))
    step = duration / num_frames if duration > 0 else 0.0
    return [k * step for k in range(num_frames)]
