"""A message's media content parts, parsed into serving's MediaPart values (400 naming the part otherwise).

Owns every spelling the specs give. Part types: `image_url`, `video_url`, `audio_url` (MindIE, OpenAI, Model
Studio), `input_audio` ({"data", "format"}), Model Studio's `video` (a list of image URLs), and DashScope's
native `image` / `audio` (a URL). Each URL may be a bare string or {"url": ...} and may say: `http(s)://...`,
`file://PATH`, `data:MIME;base64,...`, or a plain local path (MindIE's "demo.png", under the media root).
Model Studio's per-part `min_pixels`, `max_pixels`, `total_pixels` and `fps` are read beside the URL object
or inside it. What can be checked without I/O is checked here: the form, the scheme, credentials in a URL,
a data URL's MIME type against the kind, its base64 and its decoded size against the kind's cap, option
types and ranges. Whether the served model takes the kind, and the content itself, are serving's business.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from typing import Any
from urllib.parse import urlsplit

from serval.api.errors import APIError, invalid
from serval.api.openai import ChatMessage
from serval.serving.media.limits import MediaConfig
from serval.serving.media.parts import (
    AUDIO_FORMAT_NAMES,
    FORMATS,
    FPS_RANGE,
    HIGH_RESOLUTION_MAX_PIXELS,
    MIME_FORMATS,
    MIN_PIXELS_FLOOR,
    MediaKind,
    MediaOptions,
    MediaPart,
    MediaSource,
)

# Part type -> (its kind, the key its payload is under).
PART_TYPES: dict[str, tuple[MediaKind, str]] = {
    "image_url": (MediaKind.IMAGE, "image_url"),
    "image": (MediaKind.IMAGE, "image"),
    "video_url": (MediaKind.VIDEO, "video_url"),
    "video": (MediaKind.VIDEO, "video"),
    "audio_url": (MediaKind.AUDIO, "audio_url"),
    "audio": (MediaKind.AUDIO, "audio"),
    "input_audio": (MediaKind.AUDIO, "input_audio"),
}
OPTION_NAMES = ("min_pixels", "max_pixels", "total_pixels", "fps")
MAX_TOTAL_PIXELS = 1 << 40  # far past any video's frames x pixels; keeps the number a machine int
_DATA_URL = re.compile(r"data:([^;,]*)((?:;[^;,]*)*),(.*)", re.DOTALL)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


def is_media_part(part: dict[str, Any]) -> bool:
    return part.get("type") in PART_TYPES


def media_part(part: dict[str, Any], where: str, config: MediaConfig, high_resolution: bool) -> MediaPart:
    """One content part (its `type` one of PART_TYPES) as a MediaPart; `where` is "messages[i].content[j]"."""
    kind, key = PART_TYPES[part["type"]]
    if key not in part or part[key] is None:
        raise APIError(400, f"{where}.{key} is required for a {part['type']} part", f"{where}.{key}",
                       "missing_required_parameter")  # fmt: skip
    payload = part[key]
    inner = payload if isinstance(payload, dict) else {}
    options = _options(part, inner, where, key, high_resolution)
    cap = {MediaKind.IMAGE: config.max_image_bytes, MediaKind.VIDEO: config.max_video_bytes,
           MediaKind.AUDIO: config.max_audio_bytes}[kind]  # fmt: skip
    if part["type"] == "input_audio":
        return MediaPart(kind, (_input_audio(payload, f"{where}.{key}", config),), options, where)
    if part["type"] == "video" and isinstance(payload, list):
        if not payload:
            raise invalid(f"{where}.video must be a non-empty list of image URLs", f"{where}.video")
        if len(payload) > config.max_media_items:
            raise invalid(f"{where}.video has more than {config.max_media_items} images", f"{where}.video")
        frames = tuple(
            _source(
                _url(item, f"{where}.video[{k}]"),
                MediaKind.IMAGE,
                f"{where}.video[{k}]",
                config.max_image_bytes,
            )
            for k, item in enumerate(payload)
        )
        return MediaPart(kind, frames, options, where, is_frame_list=True)
    param = f"{where}.{key}"
    return MediaPart(kind, (_source(_url(payload, param), kind, param, cap),), options, where)


def _url(payload: Any, param: str) -> str:
    """A URL part's URL: MindIE's bare string or {"url": ...}."""
    if isinstance(payload, dict):
        payload, param = payload.get("url"), f"{param}.url"
    if not isinstance(payload, str) or not payload:
        raise invalid(f"{param} must be a non-empty string (a URL, a data URL or a local path)", param)
    return payload


def _source(url: str, kind: MediaKind, param: str, cap: int) -> MediaSource:
    head = url[:8].lower()
    if head.startswith("data:"):
        return _data_url(url, kind, param, cap)
    if head.startswith(("http://", "https://")):
        try:
            parts = urlsplit(url)
            _ = parts.port  # ValueError for a port that is not one
        except ValueError:
            raise invalid(f"{param} is not a valid URL", param) from None
        if not parts.hostname:
            raise invalid(f"{param}: the URL has no host", param)
        if parts.username is not None or parts.password is not None:
            raise invalid(f"{param}: media URLs must not carry credentials", param)
        return MediaSource("http", url, cap)
    if head.startswith("file://"):
        path = url[len("file://") :]
        if not path:
            raise invalid(f"{param}: the file:// URL names no file", param)
        return MediaSource("path", path, cap)
    if _SCHEME.match(url) and not re.match(r"[A-Za-z]:[\\/]", url):
        scheme = url.split(":", 1)[0][:16]
        raise invalid(f"{param}: the URL scheme {scheme!r} is not supported (http, https, file, data)", param)
    return MediaSource("path", url, cap)  # MindIE's bare local path, under the media root


def _data_url(url: str, kind: MediaKind, param: str, cap: int) -> MediaSource:
    match = _DATA_URL.fullmatch(url)
    if match is None or ";base64" not in match.group(2).lower():
        raise invalid(f"{param}: a data URL must be data:<MIME type>;base64,<data>", param)
    mime = match.group(1).strip().lower()
    allowed = sorted(m for m, f in MIME_FORMATS.items() if f in FORMATS[kind])
    if MIME_FORMATS.get(mime) not in FORMATS[kind]:
        raise invalid(
            f"{param}: the MIME type {mime[:64]!r} is not an accepted {kind.value} type ({', '.join(allowed)})",
            param,
        )
    data = _base64(match.group(3), param, cap)
    return MediaSource("data", "", cap, data, MIME_FORMATS[mime])


def _base64(text: str, param: str, cap: int) -> bytes:
    if len(text) // 4 * 3 > cap + 3:  # refused before decoding it
        raise invalid(f"{param}: the data is more than {cap} bytes, the limit for this part", param)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{param}: the data is not valid base64", param) from None
    if not data:
        raise invalid(f"{param}: the data is empty", param)
    if len(data) > cap:
        raise invalid(
            f"{param}: the data is {len(data)} bytes, more than the {cap} allowed for this part", param
        )
    return data


def _input_audio(payload: Any, param: str, config: MediaConfig) -> MediaSource:
    """{"data": base64 (MindIE) or a (data) URL (Model Studio), "format": "mp3" | "wav" | "flac"}."""
    if not isinstance(payload, dict):
        raise invalid(f'{param} must be an object {{"data", "format"}}', param)
    fmt = payload.get("format")
    if not isinstance(fmt, str) or fmt.lower() not in AUDIO_FORMAT_NAMES:
        raise invalid(f"{param}.format must be one of mp3, wav, flac", f"{param}.format")
    data = payload.get("data")
    if not isinstance(data, str) or not data:
        raise invalid(f"{param}.data must be a non-empty base64 string", f"{param}.data")
    fmt = fmt.lower()
    head = data[:8].lower()
    if head.startswith(("data:", "http://", "https://")):
        source = _source(data, MediaKind.AUDIO, f"{param}.data", config.max_audio_bytes)
        if source.declared_format not in (None, fmt):
            raise invalid(
                f"{param}: format says {fmt} but the data URL says {source.declared_format}",
                f"{param}.format",
            )
        return MediaSource(source.scheme, source.location, source.max_bytes, source.data, fmt)
    cap = config.max_input_audio_bytes
    return MediaSource("data", "", cap, _base64(data, f"{param}.data", cap), fmt)


def _options(
    part: dict[str, Any], inner: dict[str, Any], where: str, key: str, high_res: bool
) -> MediaOptions:
    values: dict[str, Any] = {}
    params: dict[str, str] = {}
    for name in OPTION_NAMES:
        for container, param in ((part, f"{where}.{name}"), (inner, f"{where}.{key}.{name}")):
            if container.get(name) is not None:
                values[name], params[name] = container[name], param
    for name in ("min_pixels", "max_pixels", "total_pixels"):
        if name in values:
            value, ceiling = (
                values[name],
                MAX_TOTAL_PIXELS if name == "total_pixels" else HIGH_RESOLUTION_MAX_PIXELS,
            )
            if isinstance(value, bool) or not isinstance(value, int):
                raise APIError(400, f"{params[name]} must be an integer", params[name], "invalid_type")
            if not MIN_PIXELS_FLOOR <= value <= ceiling:
                raise invalid(
                    f"{params[name]} must be in [{MIN_PIXELS_FLOOR}, {ceiling}], got {value}", params[name]
                )
    if "min_pixels" in values and "max_pixels" in values and values["min_pixels"] > values["max_pixels"]:
        raise invalid(f"{params['min_pixels']} must not exceed max_pixels", params["min_pixels"])
    if "fps" in values:
        fps = values["fps"]
        if isinstance(fps, bool) or not isinstance(fps, (int, float)):
            raise APIError(400, f"{params['fps']} must be a number", params["fps"], "invalid_type")
        if not (math.isfinite(fps) and FPS_RANGE[0] <= fps <= FPS_RANGE[1]):
            raise invalid(
                f"{params['fps']} must be in [{FPS_RANGE[0]}, {FPS_RANGE[1]}], got {fps}", params["fps"]
            )
        values["fps"] = float(fps)
    return MediaOptions(**values, high_resolution=high_res)


def chat_media_parts(
    messages: list[ChatMessage], config: MediaConfig, high_resolution: bool = False
) -> tuple[MediaPart, ...]:
    """Every media part of the messages, in order (`template_messages` has checked the rest of each list).
    high_resolution: the request's vl_high_resolution_images."""
    parts: list[MediaPart] = []
    num_files = 0
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if not (isinstance(part, dict) and is_media_part(part)):
                continue
            where = f"messages[{i}].content[{j}]"
            if message.role != "user":
                raise invalid(f"{where}: media parts are accepted in user messages only", where)
            parts.append(media_part(part, where, config, high_resolution))
            num_files += len(parts[-1].sources)
            if num_files > config.max_media_items:
                raise invalid(
                    f"the messages hold more than {config.max_media_items} media files, the most accepted",
                    "messages",
                )
    return tuple(parts)
