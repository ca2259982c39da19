"""Media parts as typed values: what a message's image, video or audio part asks for, once parsed.

Owns the vocabulary every media module shares: the three kinds, the formats each kind may have and the MIME
types that name them (the spec's tables, plus the aliases clients commonly send), where a part's bytes come
from (an http(s) URL, a local path, inline data), the pixel and frame options of Model Studio, the error every
media problem becomes (a 400 naming the part), and the refusal of a kind the served model cannot read. The API
layer builds these (api/media_parts.py); nothing here does I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from serval.serving.errors import InvalidRequestError


class MediaKind(str, enum.Enum):
    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


# The container/file formats accepted per kind (MindIE's tables: JPG/JPEG/PNG, MP4/AVI/WMV, MP3/WAV/FLAC).
FORMATS: dict[MediaKind, frozenset[str]] = {
    MediaKind.IMAGE: frozenset({"jpeg", "png"}),
    MediaKind.VIDEO: frozenset({"mp4", "avi", "wmv"}),
    MediaKind.AUDIO: frozenset({"mp3", "wav", "flac"}),
}
# MIME type -> format: the spec's Tables 1-3, then aliases in wide use (audio/wav is what browsers send).
MIME_FORMATS: dict[str, str] = {
    "image/jpeg": "jpeg", "image/png": "png",
    "video/mp4": "mp4", "video/x-msvideo": "avi", "video/x-ms-wmv": "wmv",
    "audio/mpeg": "mp3", "audio/x-wav": "wav", "audio/flac": "flac",
    "image/jpg": "jpeg", "audio/mp3": "mp3", "audio/wav": "wav", "audio/wave": "wav", "audio/x-flac": "flac",
}  # fmt: skip
# `input_audio.format` spellings (MindIE: "MP3, WAV, and FLAC"; Model Studio: "mp3 or wav").
AUDIO_FORMAT_NAMES = frozenset({"mp3", "wav", "flac"})

# Model Studio's ranges. fps: [0.1, 10], default 2.0. Pixels: at least one 28 x 28 patch; at most what
# vl_high_resolution_images allows (16384 tokens of 28 x 28 pixels).
FPS_RANGE = (0.1, 10.0)
DEFAULT_FPS = 2.0
MIN_PIXELS_FLOOR = 28 * 28
HIGH_RESOLUTION_MAX_PIXELS = 16384 * 28 * 28


class MediaError(InvalidRequestError):
    """A media part that cannot be used: malformed, too large, the wrong type, refused by the fetch rules, or
    undecodable. A 400 whose `param` is the part (`messages[i].content[j]`) and whose message says why."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_media") -> None:
        super().__init__(message, param)
        self.code = code


@dataclass(frozen=True)
class MediaSource:
    """Where one file's bytes come from."""

    scheme: Literal["http", "path", "data"]
    location: str  # the URL (http, https) or the path as the client wrote it; "" for inline data
    max_bytes: int  # the cap of this file: its kind's, or input_audio's for base64 audio
    data: bytes | None = field(default=None, repr=False)  # inline data, base64-decoded
    declared_format: str | None = None  # what a data URL's MIME type or input_audio.format says it is

    def describe(self) -> str:
        """The source as an error message names it (cut short: a client may send long URLs)."""
        if self.scheme == "data":
            return "the inline data"
        shown = self.location if len(self.location) <= 96 else self.location[:96] + "..."
        return repr(shown)


@dataclass(frozen=True)
class MediaOptions:
    """Model Studio's per-part controls, validated; None: the model's own default."""

    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None  # a video's frames together
    fps: float = DEFAULT_FPS  # frames sampled per second of video
    high_resolution: bool = False  # vl_high_resolution_images: max_pixels up to 16384 tokens' worth


@dataclass(frozen=True)
class MediaPart:
    """One media part of one message, in request order."""

    kind: MediaKind
    sources: tuple[MediaSource, ...]  # one file; or, for Model Studio's `video` list, one image per frame
    options: MediaOptions
    param: str  # "messages[i].content[j]": what every error about this part names
    is_frame_list: bool = False  # a `video` given as a list of images


def check_accepted(parts: Iterable[MediaPart], accepts: frozenset[MediaKind], model: str) -> None:
    """MediaError (code unsupported_media) for the first part whose kind the served model cannot read."""
    for part in parts:
        if part.kind not in accepts:
            raise MediaError(
                f"model {model!r} does not accept {part.kind.value} inputs", part.param, "unsupported_media"
            )
